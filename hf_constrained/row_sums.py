"""Sums of per-row values: the one reduction of a constraint's rows to its value h(w; B).

A row-wise constraint's value on a batch is the mean of its per-row values, or for a difference of two
group means (a TPR gap) the group-0 mean minus the group-1 mean. The fused step of Algorithm 1 (section 4
of the paper; :mod:`hf_constrained.method.rows`) accumulates per-(constraint, group) sums by ``index_add``
over an owner index ``2 * position + group`` (:func:`segment_sums`), all-reduces the detached sums and
counts across processes, and reads the value on the GLOBAL batch (:func:`inner_values`); the gradient flows
through each process's local sums divided by the global counts (:func:`local_contribution`). The scalar form
of one constraint (:meth:`hf_constrained.Constraint.reduce_rows`, :func:`reduce_rows`) runs the same sums,
so both forms agree to the last bit.

This module sits below both the problem's declaration (:mod:`hf_constrained.constraint`) and the method.
"""

from __future__ import annotations

from typing import Optional

import torch


def stats_dtype(device: torch.device) -> torch.dtype:
    """Detached sums are accumulated in float64 (MPS has none: float32 there)."""
    return torch.float32 if device.type == "mps" else torch.float64


def segment_sums(values: torch.Tensor, owners: torch.Tensor, num_constraints: int,
                 *, need_grad: bool) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """Per-owner sums by ``index_add``.

    Returns ``(sums, stats)``: ``sums`` (``2 n`` entries, in the values' dtype promoted to at
    least float32, with grad; ``None`` without ``need_grad``) and ``stats``, a detached
    ``(3, 2 n)`` tensor of sums, sums of squares and row counts in float64.
    """
    n2 = 2 * num_constraints
    sums = None
    if need_grad:
        dtype = torch.promote_types(values.dtype, torch.float32)
        sums = torch.zeros(n2, dtype=dtype, device=values.device).index_add(0, owners, values.to(dtype))
    v = values.detach().to(stats_dtype(values.device))
    stacked = torch.stack([v, v * v, torch.ones_like(v)], dim=1)
    stats = torch.zeros(n2, 3, dtype=v.dtype, device=v.device).index_add_(0, owners, stacked).t().contiguous()
    return sums, stats


def inner_values(stats: torch.Tensor) -> torch.Tensor:
    """h(w; B) per constraint from (global) sums and counts: ``S_0/N_0 - S_1/N_1`` with the
    group-1 term taken as 0 where a constraint has no group-1 rows (a plain mean).

    A ``group_key`` constraint whose batch lacks one of its groups is an
    :class:`~hf_constrained.constraint.EmptyGroupError` (checked by the caller on the counts).
    """
    s, n = stats[0].view(-1, 2), stats[2].view(-1, 2)
    mean0 = s[:, 0] / n[:, 0]
    mean1 = torch.where(n[:, 1] > 0, s[:, 1] / n[:, 1].clamp(min=1), torch.zeros_like(s[:, 1]))
    return mean0 - mean1


def local_contribution(sums: torch.Tensor, counts: torch.Tensor, world_size: int) -> torch.Tensor:
    """This process's share of h(w; B) per constraint, carrying the gradient.

    ``world * (S_local_0 / N_0 - S_local_1 / N_1)`` with the GLOBAL counts N: the
    data-parallel gradient average (divide by ``world``) then gives the gradient of the
    global value exactly, whatever the split of rows and groups between processes.
    """
    n = counts.to(sums.dtype)
    per_group = (torch.where(n > 0, sums / n.clamp(min=1), torch.zeros_like(sums)) * world_size).view(-1, 2)
    return per_group[:, 0] - per_group[:, 1]


def batch_variances(stats: torch.Tensor) -> torch.Tensor:
    """Per-(constraint, group) sample variance of the per-row values (``n - 1`` degrees of
    freedom; 0 where fewer than two rows)."""
    s, ss, n = stats
    var = (ss - s * s / n.clamp(min=1)) / (n - 1).clamp(min=1)
    return torch.where(n > 1, var.clamp(min=0), torch.zeros_like(var))


def reduce_rows(values: torch.Tensor, groups: Optional[torch.Tensor] = None) -> torch.Tensor:
    """h(w; B) of ONE constraint from its per-row values, with grad: their mean, or with
    ``groups`` (0/1 per row) the group-0 mean minus the group-1 mean. The same segment sums
    and group means as the fused step (:func:`segment_sums`, :func:`local_contribution`);
    the caller checks that both groups have rows
    (:meth:`~hf_constrained.Constraint.check_group_counts`)."""
    owners = torch.zeros(values.shape[0], dtype=torch.long, device=values.device) if groups is None else groups.long()
    sums, stats = segment_sums(values, owners, 1, need_grad=True)
    return local_contribution(sums, stats[2], 1)[0]


__all__ = ["batch_variances", "inner_values", "local_contribution", "reduce_rows", "segment_sums", "stats_dtype"]
