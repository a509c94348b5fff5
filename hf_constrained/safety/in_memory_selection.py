"""Feasible-checkpoint selection kept in memory: the best weights of a run without writing checkpoints.

The Trainer's ``load_best_model_at_end`` (with :class:`~hf_constrained.safety.loop.SafetyLoop`'s
``is_new_best``) saves a checkpoint at every evaluation and loads the best one at the end. For a small
model evaluated often, :class:`InMemoryFeasibleSelection` does the same selection without a disk: every
``every`` optimizer steps (and at the last step) it evaluates the weights in the model, an objective and a
largest violation of the requirement, and keeps a copy of the weights of the best evaluation in the
lexicographic order of :func:`~hf_constrained.certification.selection.is_better` (
feasible, ``max_violation <= 0``, before infeasible; then the better objective; with none feasible, the
smallest largest violation). :meth:`InMemoryFeasibleSelection.restore` loads them after training.

Feasibility is whatever the requirement is, measured on data that training does not read (a selection
split):

- :func:`largest_constraint_violation`: every constraint's exact value on its ``eval_dataset``
  (``trainer.evaluate_constraints``) against its tolerance, or against one ``requirement`` for all (the
  requirement itself rather than a training tolerance tightened by a margin);
- :func:`hf_constrained.non_forgetting.largest_share_forgotten`: every protected task's share of selection
  rows forgotten (right under the old model, wrong now; the certificate's statistic) against a largest share;
  :func:`forgetting_violation` takes the old model's correctness on the selection rows for it, before training.

The rows that chose the kept weights cannot certify them: the certificate reads its own split
(:mod:`hf_constrained.certification.certify`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any, Callable, Optional, Protocol

import torch
from torch import nn
from transformers import TrainerCallback

from ..certification.selection import EvaluationRecord, FeasibleSelection, is_better, summarize_records
from ..non_forgetting import largest_share_forgotten, with_old_correctness

ModelValue = Callable[[nn.Module], float]
"""``value(model) -> float``, evaluated on the weights now in the model (no gradient needed)."""


class InMemoryFeasibleSelection(TrainerCallback):
    """Every ``every`` optimizer steps and at the last step: ``objective(model)`` and ``violation(model)`` (the
    largest violation of the requirement, feasible when ``<= 0``) of the weights in the model, recorded as an
    :class:`~hf_constrained.certification.selection.EvaluationRecord`; the weights of the best record are copied (CPU
    memory: one ``state_dict``) and put back by :meth:`restore`.

    Args:
        every: optimizer steps between evaluations (>= 1).
        objective: the objective of the selection, e.g. the target task's loss on its selection rows.
        violation: the largest violation (:func:`largest_constraint_violation`,
            :func:`hf_constrained.non_forgetting.largest_share_forgotten`);
            ``None`` ranks by the objective alone (every record feasible, violation 0: unconstrained training).
        greater_is_better: whether a larger objective is better (a loss: ``False``).
        metric: the objective's name in :meth:`summary`.

    Ties keep the earlier record, as the Trainer's best-checkpoint rule does. The model the Trainer hands its
    callbacks is the one evaluated and copied (one process; under FSDP use ``load_best_model_at_end``).
    """

    def __init__(self, every: int, objective: ModelValue, violation: Optional[ModelValue] = None, *,
                 greater_is_better: bool = False, metric: str = "objective") -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1 (optimizer steps between evaluations), got {every}")
        self.every, self.objective, self.violation = every, objective, violation
        self.greater_is_better, self.metric = greater_is_better, metric
        self.records: list[EvaluationRecord] = []
        self.best: Optional[EvaluationRecord] = None
        self.best_state: Optional[dict[str, torch.Tensor]] = None

    def on_step_end(self, args: Any, state: Any, control: Any, model: Optional[nn.Module] = None,
                    **kwargs: Any) -> None:
        if state.global_step % self.every and state.global_step != state.max_steps:
            return
        if model is None:
            raise ValueError("InMemoryFeasibleSelection needs the model the Trainer passes to its callbacks")
        self.evaluate(model, state.global_step)

    def evaluate(self, model: nn.Module, step: int) -> EvaluationRecord:
        """Evaluate the weights in ``model`` as the record of ``step``, and keep them when they are the best."""
        largest = 0.0 if self.violation is None else float(self.violation(model))
        record = EvaluationRecord(step, float(self.objective(model)), largest <= 0, largest)
        self.records.append(record)
        if is_better(record, self.best, self.greater_is_better):
            self.best = record
            self.best_state = copy.deepcopy(model.state_dict())
        return record

    def restore(self, model: nn.Module) -> Optional[EvaluationRecord]:
        """Load the best record's weights into ``model`` and return the record (``None``, the model unchanged,
        when nothing was evaluated)."""
        if self.best_state is None:
            return None
        model.load_state_dict(self.best_state)
        return self.best

    def record_dicts(self) -> list[dict[str, Any]]:
        """The records as plain dicts (step, metric, feasible, max_violation), in step order."""
        return [asdict(r) for r in self.records]

    def summary(self) -> FeasibleSelection:
        """What the selection found, in the form of the Trainer-driven selection's
        (:class:`~hf_constrained.certification.selection.FeasibleSelection`, with its :meth:`message`)."""
        return summarize_records(self.records, self.metric, self.greater_is_better)


class ConstraintEvaluator(Protocol):
    """What the violation reads of a trainer (:class:`~hf_constrained.ConstrainedTrainer` has it): its
    constraints and their exact values on a split."""

    constraints: Any

    def evaluate_constraints(self, model: Any = None, split: str = "eval") -> dict[str, float]: ...


def largest_constraint_violation(trainer: ConstraintEvaluator, requirement: Optional[float] = None,
                                 split: str = "eval") -> ModelValue:
    """``model -> max_k (h_k - tol_k)``: every constraint's exact value on its ``split`` data (``"eval"``: its
    ``eval_dataset``) through ``trainer.evaluate_constraints`` (the trainer's model: the one being trained),
    against each constraint's tolerance, or against ``requirement`` for all (``max_k h_k - requirement``)."""

    def largest(model: nn.Module) -> float:
        values = trainer.evaluate_constraints(split=split)
        if requirement is not None:
            return max(values.values()) - requirement
        return max(values[c.name] - c.tolerance for c in trainer.constraints)

    return largest


def forgetting_violation(old_model: nn.Module, datasets: Mapping[str, Any], correct: Callable[..., torch.Tensor],
                         rate: float, collate_fn: Optional[Callable] = None, batch_size: int = 512) -> ModelValue:
    """``model -> max_k share_k - rate``: the largest share of a protected task's selection rows forgotten (right
    under the old model, wrong under ``model``; the certificate's statistic) above ``rate``
    (:func:`hf_constrained.non_forgetting.largest_share_forgotten`). The old model's correctness on the rows of
    ``datasets`` (task -> selection rows) is taken now, once: call it before training, with ``old_model`` still
    the old model. ``correct``: ``(model, batch) -> (rows,)`` of 0/1, e.g. CLIP's zero-shot correctness."""
    rows = {name: with_old_correctness(old_model, pool, correct, collate_fn, batch_size=batch_size)
            for name, pool in datasets.items()}
    return largest_share_forgotten(rows, correct, rate, collate_fn, batch_size=batch_size)


__all__ = ["InMemoryFeasibleSelection", "ModelValue", "forgetting_violation", "largest_constraint_violation"]
