"""Exact evaluation: every constraint on all of its data (a full pass, not the estimator).

:func:`row_values` is the ONE pass over the data: the per-row values of every row-wise
constraint on a split, one ``row_fn`` call per batch for the constraints that share
``row_fn``, collate and data. :func:`constraint_statistics` turns them into values with
one-sided CLT upper bounds (:func:`~hf_constrained.statistics.constraint_statistic`) and
adds the constraints without per-row values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from .batches import BatchMaker
from .certification.certify import GroupRows
from .constraint import Constraint
from .method.rows import plan_row_groups
from .statistics import ConstraintStatistic, constraint_statistic

SPLITS = ("eval", "train")

Progress = Callable[[range, str], Any]
"""``progress(batch_starts, description)``: wraps a pass's batch starts (e.g. in a progress bar)."""

RowValues = dict[str, tuple[np.ndarray, Optional[np.ndarray]]]
"""Constraint name -> (per-row values, per-row group 0/1 or ``None``), float64 on the host."""


def progress_bars(disable: bool) -> Progress:
    """A :data:`Progress` with a tqdm bar over long passes (20 batches or more), unless ``disable``."""
    def progress(items: Any, description: str) -> Any:
        return tqdm(items, desc=description, leave=False, disable=disable or len(items) < 20)
    return progress


def in_eval_mode(run: Callable[..., Any], model: nn.Module, constraints: Sequence[Constraint], batches: BatchMaker,
                 **kwargs: Any) -> Any:
    """``run(model, constraints, batches, **kwargs)`` (a pass of this module) with the model in eval mode,
    restored after; a ``split`` other than :data:`SPLITS` is refused before any pass."""
    if kwargs.get("split", "eval") not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {kwargs['split']!r}")
    was_training = model.training
    model.eval()
    try:
        return run(model, constraints, batches, **kwargs)
    finally:
        model.train(was_training)


def split_data(c: Constraint, split: str) -> Any:
    """A constraint's data for ``split``: ``"eval"`` its ``eval_dataset`` (falling back to its
    training data), ``"train"`` its training data."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    return c.dataset if split == "train" or c.eval_dataset is None else c.eval_dataset


@torch.no_grad()
def row_values(model: nn.Module, constraints: Sequence[Constraint], batches: BatchMaker, *, split: str = "eval",
               batch_size: int, context: Callable[[], Any] = contextlib.nullcontext,
               which: Optional[Sequence[int]] = None, progress: Optional[Progress] = None) -> RowValues:
    """The per-row values (and groups) of the row-wise constraints (without ``exact_fn``) on ``split``.

    Args:
        model: evaluated as given (the caller sets eval mode).
        batches: the one way rows become a device batch.
        batch_size: rows per ``row_fn`` call.
        context: entered around each model call (the trainer's autocast).
        which: the constraint positions to evaluate (default: every row-wise one without ``exact_fn``).
        progress: ``progress(batch_starts, description)`` may wrap each pass (a progress bar).
    """
    chosen = [k for k, c in enumerate(constraints) if c.rowwise and c.exact_fn is None
              and (which is None or k in which)]
    subset = [constraints[k] for k in chosen]
    out: RowValues = {}
    for group in plan_row_groups(subset, batches.collate_of, data_of=lambda i: split_data(subset[i], split)):
        members = [subset[i] for i in group.members]
        values: dict[str, list[torch.Tensor]] = {c.name: [] for c in members}
        groups: dict[str, list[torch.Tensor]] = {c.name: [] for c in members}
        bar = None if progress is None else (
            lambda starts, name=members[0].name: progress(starts, f"constraint {name}"))
        for _, batch in batches.in_order(split_data(members[0], split), group.collate, batch_size, bar):
            with context():
                outputs = group.row_fn(model, batch)
            for c in members:
                v = c.row_values(outputs)
                values[c.name].append(v.detach().double().cpu())
                if c.group_key is not None:
                    groups[c.name].append(c.row_groups(batch, v.shape[0], v.device).cpu())
        for c in members:
            labels = torch.cat(groups[c.name]).numpy() if groups[c.name] else None
            if labels is not None:
                c.check_group_counts(int((labels == 0).sum()), int((labels == 1).sum()))
            out[c.name] = (torch.cat(values[c.name]).numpy(), labels)
    return out


def _float_outer(c: Constraint) -> Any:
    """A constraint's ``outer`` as a float -> float map (for :mod:`hf_constrained.statistics`)."""
    return lambda x: float(c.apply_outer(torch.tensor(x, dtype=torch.float64)))


@torch.no_grad()
def constraint_statistics(model: nn.Module, constraints: Sequence[Constraint], batches: BatchMaker, *,
                          split: str = "eval", confidence: float = 0.95, batch_size: int,
                          context: Callable[[], Any] = contextlib.nullcontext,
                          progress: Optional[Progress] = None) -> dict[str, ConstraintStatistic]:
    """Exact value of every constraint on its ``split`` data, with its upper confidence bound
    where the constraint gives per-row values.

    Row-wise constraints: :func:`row_values`, then
    :func:`~hf_constrained.statistics.constraint_statistic` (value, CLT upper bound, standard
    error). A constraint's ``exact_fn`` wins when given; scalar ``fn`` constraints give their
    batch values averaged with batch-size weights (exact for per-sample means) and data-free
    ones their value: value only (``upper_bound`` None).
    """
    out: dict[str, ConstraintStatistic] = {}
    for name, (values, groups) in row_values(model, constraints, batches, split=split, batch_size=batch_size,
                                             context=context, progress=progress).items():
        c = next(c for c in constraints if c.name == name)
        out[name] = constraint_statistic(values, groups=groups, outer=None if c.outer is None else _float_outer(c),
                                         confidence=confidence)
    for c in constraints:
        if c.name in out:
            continue
        data = split_data(c, split)
        if c.exact_fn is not None:
            value = float(c.exact_fn(model, data))
        elif data is None:
            with context():
                value = float(c.apply_outer(c.fn(model, None).float()))
        else:
            total, count = 0.0, 0
            bar = None if progress is None else (lambda starts, name=c.name: progress(starts, f"constraint {name}"))
            for rows, batch in batches.in_order(data, batches.collate_of(c), batch_size, bar):
                with context():
                    total += float(c.fn(model, batch)) * len(rows)
                count += len(rows)
            value = float(c.apply_outer(torch.tensor(total / count)))
        out[c.name] = ConstraintStatistic(value=value, confidence=confidence)
    return {c.name: out[c.name] for c in constraints}


__all__ = ["RowValues", "SPLITS", "constraint_metrics", "constraint_statistics", "row_values", "split_data"]


def constraint_metrics(values: dict[str, float], constraints: Sequence[Constraint], prefix: str = "eval"
                       ) -> dict[str, float]:
    """``{prefix}_constraint/<name>``, the largest violation ``max_k h_k - tol_k`` and whether all hold."""
    metrics = {f"{prefix}_constraint/{n}": v for n, v in values.items()}
    if values:
        violations = [values[c.name] - c.tolerance for c in constraints]
        metrics[f"{prefix}_constraint_max_violation"] = max(violations)
        metrics[f"{prefix}_constraints_satisfied"] = float(all(v <= 0 for v in violations))
    return metrics


def loggable(metrics: dict[str, float], num_constraints: int, max_logged: int) -> dict[str, float]:
    """Per-constraint values only up to ``max_logged`` constraints (``log_constraint_estimates_max``: the logs and
    ``log_history``, which every checkpoint copies); the summaries always."""
    if num_constraints <= max_logged:
        return dict(metrics)
    return {k: v for k, v in metrics.items() if "_constraint/" not in k}


def is_absolute_value(outer: Any) -> bool:
    """Whether a constraint's ``outer`` is the identity (``None``: False) or ``|x|`` (True), checked
    on test points; the certificate bounds a group difference or its absolute value, nothing else."""
    if outer is None:
        return False
    x = torch.tensor([-2.0, -0.5, 0.0, 0.75, 3.0], dtype=torch.float64)
    try:
        y = outer(x)
    except Exception:  # noqa: BLE001 - any failure means "not |x|"
        y = None
    if isinstance(y, torch.Tensor) and torch.allclose(y.double(), x.abs()):
        return True
    raise ValueError("certification supports constraints whose outer is the identity or the absolute value")


@torch.no_grad()
def certification_values(model: nn.Module, constraints: Sequence[Constraint], batches: BatchMaker, *,
                         batch_size: int, context: Callable[[], Any] = contextlib.nullcontext,
                         progress: Optional[Progress] = None) -> dict[str, Any]:
    """Per-row values of each certifiable constraint's certification statistic on its
    ``certify.dataset``: name -> a 1-D float64 array (its ``certify.statistic.row_fn``, else the
    constraint's own per-row values), or :class:`~hf_constrained.certification.certify.GroupRows` for a
    difference of group means (``outer=abs``: its absolute value). See
    :mod:`hf_constrained.certification.certify`."""
    out: dict[str, Any] = {}
    for c in constraints:
        if not c.certifiable:
            continue
        stat = c.certify.statistic
        values, groups = [], []
        bar = None if progress is None else (lambda starts, name=c.name: progress(starts, f"certify {name}"))
        for _, batch in batches.in_order(c.certify.dataset, batches.collate_of(c), batch_size, bar):
            with context():
                v = stat.row_fn(model, batch) if stat is not None else c.row_values(c.row_fn(model, batch))
            v = v.detach().double().reshape(-1)
            values.append(v.cpu())
            if stat is not None and stat.group_key is not None:
                groups.append(torch.as_tensor(batch[stat.group_key]).reshape(-1).long().cpu())
            elif stat is None and c.group_key is not None:
                groups.append(c.row_groups(batch, v.shape[0], v.device).cpu())
        v = torch.cat(values).numpy()
        absolute = stat.absolute if stat is not None else is_absolute_value(c.outer)
        out[c.name] = v if not groups else GroupRows(v, torch.cat(groups).numpy(), absolute=absolute)
    return out
