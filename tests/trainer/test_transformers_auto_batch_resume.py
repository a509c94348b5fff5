"""transformers' own ``test_auto_batch_size_with_resume_from_checkpoint`` (tests/trainer/test_trainer.py,
transformers 5.x) with ``Trainer`` swapped for ``ConstrainedTrainer`` (and its arguments class; issue 32, item 7).

The run ends at ``max_steps`` with a checkpoint at that step, so the resume is one at ``max_steps``:
``ConstrainedTrainer`` trains nothing then (the Trainer would take one more step) and must still
restore what ``Trainer.train`` restores, here the batch size ``auto_find_batch_size`` found.
The helpers are transformers' test helpers (``RegressionDataset``, ``RegressionModelConfig``,
``RegressionRandomPreTrainedModel``, ``MockCudaOOMCallback``), reproduced here as small as they
need to be since transformers' test suite is not installed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, TrainerCallback

from hf_constrained import ConstrainedTrainer, ConstrainedTrainingArguments, Constraint


class MockCudaOOMCallback(TrainerCallback):
    """Simulate a CUDA OOM error while the batch size is >= ``batch_size_limit``."""

    def __init__(self, batch_size_limit: int = 16):
        self.batch_size_limit = batch_size_limit

    def on_step_end(self, args, state, control, **kwargs):
        if state.train_batch_size >= self.batch_size_limit:
            raise RuntimeError("CUDA out of memory.")


class RegressionDataset:
    def __init__(self, a=2, b=3, length=64, seed=42):
        np.random.seed(seed)
        self.length = length
        self.x = np.random.normal(size=(length,)).astype(np.float32)
        self.ys = a * self.x + b + np.random.normal(scale=0.1, size=(length,)).astype(np.float32)

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return {"input_x": self.x[i], "labels": self.ys[i]}


class RegressionModelConfig(PretrainedConfig):
    def __init__(self, a=0, b=0, double_output=False, random_torch=True, **kwargs):
        super().__init__(**kwargs)
        self.a, self.b, self.double_output, self.random_torch = a, b, double_output, random_torch
        self.hidden_size = 1


class RegressionRandomPreTrainedModel(PreTrainedModel):
    config_class = RegressionModelConfig
    base_model_prefix = "regression"

    def __init__(self, config):
        super().__init__(config)
        self.a = nn.Parameter(torch.tensor(config.a).float())
        self.b = nn.Parameter(torch.tensor(config.b).float())
        self.random_torch = config.random_torch
        self.post_init()

    def forward(self, input_x, labels=None, **kwargs):
        y = input_x * self.a + self.b
        if self.random_torch:
            torch_rand = torch.randn(1).squeeze()
        np.random.seed(0)
        if self.random_torch:
            y += 0.05 * torch_rand
        y = y + 0.05 * torch.tensor(np.random.rand() + 1.0)
        if labels is None:
            return (y,)
        return (nn.functional.mse_loss(y, labels), y)


class RowList(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _mse(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(input_x=batch["input_x"], labels=batch["labels"])[0]


def _trainer_class(constrained: bool):
    """``ConstrainedTrainer`` without constraints (penalty ``none``), or with one (hinge), as a class."""
    data = RegressionDataset(length=48, seed=7)
    rows = RowList([{"input_x": torch.tensor(data.x[i]), "labels": torch.tensor(data.ys[i])} for i in range(48)])

    def make(model, args, **kwargs):
        if not constrained:
            args.constraint_penalty = "none"
            return ConstrainedTrainer(model, args, **kwargs)
        return ConstrainedTrainer(model, args, constraints=[Constraint(name="mse", fn=_mse, dataset=rows,
                                                                       tolerance=100.0)], **kwargs)
    return make


@pytest.mark.parametrize("constrained", [False, True], ids=["no_constraint", "one_constraint"])
def test_auto_batch_size_with_resume_from_checkpoint(tmp_path, constrained):
    trainer_class = _trainer_class(constrained)
    train_dataset = RegressionDataset(length=128)
    config = RegressionModelConfig(a=0, b=2)
    model = RegressionRandomPreTrainedModel(config)
    args = ConstrainedTrainingArguments(str(tmp_path), do_train=True, max_steps=2, save_steps=1,
                                        per_device_train_batch_size=16, auto_find_batch_size=True, use_cpu=True,
                                        report_to=[], disable_tqdm=True, constraint_batch_size=8)
    trainer = trainer_class(model, args, train_dataset=train_dataset, callbacks=[MockCudaOOMCallback()])
    trainer.train()
    previous_batch_size = trainer._train_batch_size
    assert previous_batch_size < 16

    trainer = trainer_class(model, args, train_dataset=train_dataset)
    assert trainer._train_batch_size == 16 * max(trainer.args.n_gpu, 1)
    trainer.train(resume_from_checkpoint=True)
    assert trainer._train_batch_size == previous_batch_size
    assert trainer.state.global_step == 2  # nothing trained past max_steps
