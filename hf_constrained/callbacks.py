"""Callbacks that add metrics to the Trainer's logs without replacing them.

A callback that calls ``trainer.log(...)`` from ``on_step_end`` makes the Trainer skip its
own log entry of that step: ``on_log`` resets ``control.should_log``, so the loss, learning
rate, gradient norm and constraint estimates of that step are lost. The pattern here
instead queues the metrics with
:meth:`~hf_constrained.ConstrainedTrainer.add_metrics_to_next_log` and asks for a log at
this step (``control.should_log = True``): the Trainer's entry then carries both, and
every logger (TensorBoard, W&B, ``log_history``) sees them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

import torch
from transformers import TrainerCallback

from .clipping import PENALTY_GRAD_NORM_KEY

if TYPE_CHECKING:
    from .trainer import ConstrainedTrainer


class PeriodicMetricsCallback(TrainerCallback):
    """Every ``every`` optimizer steps, ``compute(trainer)`` -> metrics, logged with the
    Trainer's own entry of that step.

    Example (per-class accuracy every 50 steps)::

        trainer.add_callback(PeriodicMetricsCallback(
            trainer, every=50, compute=lambda t: {"eval_accuracy/foggy": accuracy(t.model)}))
    """

    def __init__(self, trainer: "ConstrainedTrainer", every: int,
                 compute: Callable[["ConstrainedTrainer"], Mapping[str, float]]) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.trainer, self.every, self.compute = trainer, every, compute

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step % self.every == 0:
            metrics = {k: float(v) for k, v in self.compute(self.trainer).items()}
            self.trainer.add_metrics_to_next_log(metrics)
            control.should_log = True
        return control


def penalty_gradient_norm(trainer: "ConstrainedTrainer") -> float:
    """||G_2|| at the current weights: the gradient norm of the penalty term of Algorithm 1,
    line 9, with every constraint in B_c, ``(1/m) sum_k weight(u_k) * grad h_k(w; B_k)``, the
    weights from the current estimates and B_k the first ``constraint_batch_size`` rows of
    each constraint (no data stream advances). An extra forward and backward through the
    constraints with a nonzero weight; 0 when none is active. It calls the unwrapped model:
    under DDP the norm is this process's, under FSDP it is not supported."""
    m = len(trainer.constraints)
    if not m or not trainer.penalty.active:
        return 0.0
    weights = trainer.engine.current_weights()  # line 9's weights at the current estimates, margins included
    model = trainer.model
    params = [p for p in model.parameters() if p.requires_grad]
    loss = None
    for k in torch.nonzero(weights).flatten().tolist():
        c = trainer.constraints[k]
        batch = None
        if not c.data_free:
            rows = list(range(min(len(c.dataset), trainer.args.constraint_batch_size)))
            batch = trainer.batches.constraint_rows(c, rows)  # the trainer's one batch path
        with trainer.compute_loss_context_manager():
            term = float(weights[k]) * c.fn(model, batch).float() / m
        loss = term if loss is None else loss + term
    if loss is None:
        return 0.0
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return float(torch.sqrt(sum((g.float() ** 2).sum() for g in grads if g is not None)))


class PenaltyGradientNormCallback(PeriodicMetricsCallback):
    """Opt-in clipping diagnostic: every ``every`` steps, log ``clip/penalty_grad_norm``
    (:func:`penalty_gradient_norm`) and, with the Trainer's pre-clip ``grad_norm`` of that
    entry, ``clip/penalty_share`` (see :mod:`hf_constrained.clipping`). Costs one extra
    forward and backward through the active constraints per measurement."""

    def __init__(self, trainer: "ConstrainedTrainer", every: int = 10) -> None:
        super().__init__(trainer, every, lambda t: {PENALTY_GRAD_NORM_KEY: penalty_gradient_norm(t)})


__all__ = ["PenaltyGradientNormCallback", "PeriodicMetricsCallback", "penalty_gradient_norm"]
