"""Feasible-checkpoint selection: the best objective among checkpoints that satisfy all constraints.

The Trainer's ``load_best_model_at_end`` keeps the checkpoint with the best
``metric_for_best_model``. Under constraints h_k(w) <= tol_k (problem (1) of Yang et al.,
TMLR 2026) the best checkpoint must first be *feasible* on the validation data, so
evaluations are ordered lexicographically:

1. a feasible evaluation (``eval_constraints_satisfied == 1``: every exact held-out
   constraint value within tolerance) beats any infeasible one;
2. among feasible ones, the better objective metric wins (ties: the earlier one, as
   in the Trainer);
3. among infeasible ones (only when none is feasible), the smaller largest violation
   ``eval_constraint_max_violation`` wins: the fallback is the least-violating
   checkpoint, and the run says loudly that no checkpoint is feasible.

Everything here is a pure function of the Trainer's ``log_history``, so the selection
survives a resume and can be recomputed from ``trainer_state.json`` alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Optional

SATISFIED_SUFFIX = "constraints_satisfied"
VIOLATION_SUFFIX = "constraint_max_violation"


@dataclass(frozen=True)
class EvaluationRecord:
    """One evaluation: its step, objective metric, feasibility and largest violation."""

    step: int
    metric: Optional[float]
    feasible: bool
    max_violation: float


def metric_key(metric_for_best_model: str) -> str:
    """The Trainer's naming: ``loss`` -> ``eval_loss``."""
    return metric_for_best_model if metric_for_best_model.startswith("eval_") else f"eval_{metric_for_best_model}"


def constraint_feasibility(metrics: Mapping[str, Any]) -> Optional[tuple[bool, float]]:
    """(all constraints satisfied, largest violation) from evaluation metrics, or ``None``
    when they hold no constraint evaluation. With several eval datasets
    (``eval_<name>_constraints_satisfied``) all must be satisfied."""
    satisfied = [float(v) for k, v in metrics.items() if k.startswith("eval") and k.endswith(SATISFIED_SUFFIX)]
    if not satisfied:
        return None
    violations = [float(v) for k, v in metrics.items() if k.startswith("eval") and k.endswith(VIOLATION_SUFFIX)]
    max_violation = max(violations) if violations else (0.0 if all(s == 1.0 for s in satisfied) else math.inf)
    return all(s == 1.0 for s in satisfied), max_violation


def after_training_flags(log_history: Iterable[Mapping[str, Any]]) -> list[bool]:
    """For each entry: was it logged after a ``train()`` call ended, at that call's last step?

    Such entries (e.g. the safety report's evaluation) evaluate the weights selected at
    the end, not the weights of their logged step; a later ``train()`` call logs at
    larger steps again and is not affected.
    """
    flags, ended_at = [], None
    for entry in log_history:
        if "train_runtime" in entry:
            ended_at = entry.get("step")
            flags.append(True)
            continue
        flags.append(ended_at is not None and entry.get("step") == ended_at)
    return flags


def evaluation_records(log_history: Iterable[Mapping[str, Any]], metric_for_best_model: str) -> list[EvaluationRecord]:
    """The constraint evaluations in a Trainer ``log_history``, one per step (entries of
    the same step are merged, as the Trainer logs one entry per eval dataset); entries
    logged after training (see :func:`after_training_flags`) are not candidates."""
    key = metric_key(metric_for_best_model)
    log_history = list(log_history)
    by_step: dict[int, dict[str, Any]] = {}
    for entry, after in zip(log_history, after_training_flags(log_history)):
        if after or "step" not in entry or not any(k.startswith("eval") for k in entry):
            continue
        by_step.setdefault(int(entry["step"]), {}).update(entry)
    records = []
    for step in sorted(by_step):
        merged = by_step[step]
        feas = constraint_feasibility(merged)
        if feas is None:
            continue
        metric = merged.get(key)
        records.append(EvaluationRecord(step, None if metric is None else float(metric), feas[0], feas[1]))
    return records


def is_better(candidate: EvaluationRecord, incumbent: Optional[EvaluationRecord], greater_is_better: bool) -> bool:
    """The lexicographic order above: strictly better, so ties keep the incumbent."""
    if incumbent is None:
        return True
    if candidate.feasible != incumbent.feasible:
        return candidate.feasible
    if candidate.feasible:
        if candidate.metric is None:
            return False
        if incumbent.metric is None:
            return True
        return candidate.metric > incumbent.metric if greater_is_better else candidate.metric < incumbent.metric
    return candidate.max_violation < incumbent.max_violation


def select_best(records: Iterable[EvaluationRecord], greater_is_better: bool) -> Optional[EvaluationRecord]:
    """The best evaluation in the lexicographic order (``None`` when there are none)."""
    best = None
    for record in records:
        if is_better(record, best, greater_is_better):
            best = record
    return best


@dataclass
class FeasibleSelection:
    """What feasible-checkpoint selection found over a run's evaluations."""

    metric: str
    greater_is_better: bool
    num_evaluations: int
    num_feasible: int
    best_step: Optional[int]
    best_metric: Optional[float]
    best_feasible: bool
    best_max_violation: Optional[float]
    best_checkpoint: Optional[str] = None

    @property
    def any_feasible(self) -> bool:
        return self.num_feasible > 0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "any_feasible": self.any_feasible}

    def message(self) -> str:
        if self.num_evaluations == 0:
            return "no constraint evaluation during training: feasible-checkpoint selection had nothing to choose from"
        where = self.best_checkpoint or f"step {self.best_step}"
        if self.any_feasible:
            return (f"feasible best: {where} ({self.metric} = {self.best_metric:.6g}); {self.num_feasible} of "
                    f"{self.num_evaluations} evaluations satisfied all constraints on the validation data")
        # a diagnostic of training (the surrogate on validation data): the verdict is the report's, not this
        return (f"no feasible checkpoint: none of the {self.num_evaluations} evaluations satisfied all constraints "
                f"on the validation data; the least-violating one is {where} "
                f"(largest violation {self.best_max_violation:.6g})")


def summarize_selection(log_history: Iterable[Mapping[str, Any]], metric_for_best_model: str,
                        greater_is_better: bool, best_checkpoint: Optional[str] = None) -> FeasibleSelection:
    """Feasible-checkpoint selection over a whole ``log_history``."""
    return summarize_records(evaluation_records(log_history, metric_for_best_model), metric_key(metric_for_best_model),
                             greater_is_better, best_checkpoint)


def summarize_records(records: Iterable[EvaluationRecord], metric: str, greater_is_better: bool,
                      best_checkpoint: Optional[str] = None) -> FeasibleSelection:
    """Feasible-checkpoint selection over evaluation records (of a ``log_history``, or kept in memory by
    :class:`~hf_constrained.safety.in_memory_selection.InMemoryFeasibleSelection`); ``metric``: the objective's
    name."""
    records = list(records)
    best = select_best(records, greater_is_better)
    return FeasibleSelection(
        metric=metric,
        greater_is_better=greater_is_better,
        num_evaluations=len(records),
        num_feasible=sum(r.feasible for r in records),
        best_step=None if best is None else best.step,
        best_metric=None if best is None else best.metric,
        best_feasible=False if best is None else best.feasible,
        best_max_violation=None if best is None else best.max_violation,
        best_checkpoint=best_checkpoint,
    )


__all__ = [
    "EvaluationRecord",
    "FeasibleSelection",
    "after_training_flags",
    "constraint_feasibility",
    "evaluation_records",
    "is_better",
    "metric_key",
    "select_best",
    "summarize_records",
    "summarize_selection",
]
