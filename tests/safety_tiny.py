"""A tiny, exactly predictable run for the safety tests (report, selection, card, gate, CLI).

The model has one scalar parameter theta (a ``PreTrainedModel``, so it saves and reloads
like a Hub model). The objective is (theta - 5)^2: plain SGD with lr 0.1 from theta = 0
moves theta up monotonically, theta_t = 5 (1 - 0.8^t) = 1.0, 1.8, 2.44, 2.95, ...,
so the held-out loss falls at every step. Two constraints grow with theta:

- ``theta_cap``: data-free, h = theta;
- ``scaled_theta``: a per-sample mean over its data, h = mean_i(x_i) * theta with
  mean(x) = 1 on both its training and held-out data (different rows), so h = theta.

With tolerance 2.0 steps 1-2 are feasible and steps >= 3 are not: the objective-best
checkpoint is infeasible, the feasible best is step 2 (theta = 1.8). With penalty
``none`` the constraints are evaluated but not trained on, so the trajectory is exact.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from datasets import Dataset
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from hf_constrained import ConstrainedTrainer, ConstrainedTrainingArguments, Constraint


class ThetaConfig(PretrainedConfig):
    model_type = "hf_constrained_theta"

    def __init__(self, target: float = 5.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target = target


class ThetaModel(PreTrainedModel):
    config_class = ThetaConfig
    base_model_prefix = "theta_model"

    def __init__(self, config: ThetaConfig) -> None:
        super().__init__(config)
        self.theta = nn.Parameter(torch.zeros(()))
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        pass

    def forward(self, x: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None, **_: Any) -> dict:
        n = 1 if x is None else x.shape[0]
        loss = (self.theta - self.config.target) ** 2
        return {"loss": loss, "logits": self.theta.expand(n).unsqueeze(-1)}


def theta_value(model: nn.Module, batch: Any) -> torch.Tensor:
    return model.theta * 1.0


def scaled_theta(model: nn.Module, batch: Any) -> torch.Tensor:
    return (batch["x"].float() * model.theta).mean()


def objective_data(n: int = 16) -> Dataset:
    return Dataset.from_dict({"x": [1.0] * n, "labels": [0.0] * n})


def constraints(tolerance: float = 2.0) -> list[Constraint]:
    train = Dataset.from_dict({"x": [0.5, 1.5] * 6})
    held_out = Dataset.from_dict({"x": [0.25, 1.75, 1.0] * 3})
    return [
        Constraint("theta_cap", theta_value, tolerance=tolerance),
        Constraint("scaled_theta", scaled_theta, dataset=train, eval_dataset=held_out, tolerance=tolerance),
    ]


def theta_at(step: int, lr: float = 0.1, target: float = 5.0) -> float:
    """theta after ``step`` SGD steps on (theta - target)^2 from 0."""
    return target * (1.0 - (1.0 - 2.0 * lr) ** step)


def make_trainer(output_dir: str, *, tolerance: float = 2.0, max_steps: int = 6, penalty: str = "none",
                 callbacks: Optional[list] = None, trainer_cls: type = ConstrainedTrainer,
                 safety_rule: str = "point", **args_kw: Any) -> ConstrainedTrainer:
    kw: dict[str, Any] = dict(
        output_dir=output_dir, per_device_train_batch_size=4, per_device_eval_batch_size=4, learning_rate=0.1,
        optim="sgd", weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant", report_to=[],
        disable_tqdm=True, use_cpu=True, seed=0, max_steps=max_steps, logging_steps=1, eval_strategy="steps",
        eval_steps=1, save_strategy="steps", save_steps=1, load_best_model_at_end=True,
        metric_for_best_model="loss", constraint_penalty=penalty, constraint_batch_size=4,
        constraint_eval_batch_size=4, save_only_model=True,
    )
    kw.update(args_kw)
    args = ConstrainedTrainingArguments(**kw)
    torch.manual_seed(0)
    model = ThetaModel(ThetaConfig())
    trainer = trainer_cls(model=model, args=args, constraints=constraints(tolerance),
                          train_dataset=objective_data(), eval_dataset=objective_data(8), callbacks=callbacks)
    # these runs have no certification split: the gate's mechanics are exercised under the explicit, uncertified
    # point rule (the certificate, the default rule, is tested in test_certificate_gate.py)
    trainer.safety.configure(safety_rule=safety_rule)
    return trainer
