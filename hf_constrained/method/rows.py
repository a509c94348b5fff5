"""Row-wise constraints: one planner of model calls, one reduction of per-row values.

Algorithm 1 needs, for each sampled constraint k in B_c^t (line 3), the mini-batch value
h_k(w_t; B_k^t) with grad (lines 5-6, 9) and, when gamma' > 0, the previous-iterate value
h_k(w_{t-1}; B_k^t) on the same batch (line 6). Constraints declared in the row-wise form
(:class:`~hf_constrained.Constraint` with ``row_fn``) that share one ``row_fn`` object and
one collate function form a :class:`RowGroup`. For a group, one step:

1. fetches the rows B_k^t of every sampled member, collates them in ONE call of the shared
   collate and runs ``row_fn`` ONCE on the concatenation (:func:`~hf_constrained.batches.collate_units`);
2. maps each member's slice of the outputs to its per-row values (``row_transform``) and
   reads each row's group (``group_key``: 0/1, else 0);
3. accumulates per-(constraint, group) sums of the values (with grad) and, detached in
   float64, sums, sums of squares and row counts, by ``index_add`` over an owner index
   ``2 * position + group`` (:func:`~hf_constrained.row_sums.segment_sums`): no per-constraint loop over
   model calls and no host synchronisation (counts stay on the device).

Across processes the detached sums and counts are all-reduced (summed), never means of
means, so ``h_k(w; B_k) = S_k0 / N_k0`` (or ``S_k0 / N_k0 - S_k1 / N_k1`` for a difference
of two group means, e.g. a TPR gap) is the value on the GLOBAL batch whatever the split of
rows between processes (:func:`~hf_constrained.row_sums.inner_values`). The gradient flows through each
process's local sums divided by the global counts (:func:`~hf_constrained.row_sums.local_contribution`), so
the data-parallel gradient average yields exactly the gradient of the global value.

With ``share_constraint_batches`` the members of a group whose ``dataset`` is the same
object draw ONE batch per step from one stream (a :class:`~hf_constrained.batches.RowUnit`
with several members):
its rows are collated and scored once and every member's ``row_transform`` is applied to
the same outputs. That is a different sampling (the members' batches are no longer
independent), hence opt-in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
import torch

if TYPE_CHECKING:  # pragma: no cover
    from ..batches import Collate, RowUnit
    from ..constraint import Constraint, RowFn


@dataclass
class RowGroup:
    """Row-wise constraints evaluated together: one ``row_fn`` object, one collate function."""

    members: list[int]
    row_fn: "RowFn"
    collate: "Collate"


def same_callable(a: Any, b: Any) -> bool:
    # bound methods are re-created on each attribute access: compare them by ==; callables that
    # define __eq__ without __hash__ (dataclass collators) too
    try:
        return a is b or bool(a == b)
    except Exception:  # an __eq__ that raises on a foreign type
        return False


def plan_row_groups(constraints: Sequence["Constraint"], collate_of: Callable[["Constraint"], "Collate"],
                    data_of: Optional[Callable[[int], Any]] = None) -> list[RowGroup]:
    """Group the row-wise constraints by their shared ``row_fn`` object and collate function
    (and, with ``data_of``, the same data object: the exact evaluation's passes).

    Constraints with one ``row_fn`` but different collate functions cannot be collated in
    one call; they form separate groups (each still one call for its own members).
    """
    groups: list[RowGroup] = []
    data: list[Any] = []
    for k, c in enumerate(constraints):
        if not c.rowwise:
            continue
        collate = collate_of(c)
        own = None if data_of is None else data_of(k)
        for g, d in zip(groups, data):
            if g.row_fn is c.row_fn and same_callable(g.collate, collate) and d is own:
                g.members.append(k)
                break
        else:
            groups.append(RowGroup([k], c.row_fn, collate))
            data.append(own)
    return groups


def _group_labels(c: "Constraint", batch: Any, num_rows: int, device: torch.device,
                  cache: dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
    """Each row's group (0/1) from the fused batch, read once per ``group_key``."""
    if c.group_key is None:
        return None
    if c.group_key not in cache:
        cache[c.group_key] = c.row_groups(batch, num_rows, device)
    return cache[c.group_key]


def row_values_and_owners(constraints: Sequence["Constraint"], units: Sequence["RowUnit"],
                          slices: Sequence[tuple[int, int]], outputs: torch.Tensor,
                          batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row values of every (unit, constraint) pair, concatenated, and each value's owner
    ``2 * position + group`` (``position`` in B_c^t, ``group`` 0 or 1).

    The owners are laid out on the host and copied once; when every unit holds one constraint
    without ``row_transform`` (e.g. many constraints of one formula) the outputs ARE the values
    (no per-constraint slicing). ``slices`` index ``outputs`` and ``batch``, which may hold more
    rows than ``units`` (a call shared with the look-ahead's rows): the units' slices must be
    consecutive."""
    num_rows = outputs.shape[0]
    device = outputs.device
    labels_cache: dict[str, torch.Tensor] = {}
    plain = all(len(u.constraints) == 1 and constraints[u.constraints[0]].row_transform is None for u in units)
    values: list[torch.Tensor] = []
    owner_base: list[np.ndarray] = []
    grouped: list[tuple[int, int, torch.Tensor]] = []  # (start, end, labels) of group_key constraints
    offset = 0
    for unit, (start, end) in zip(units, slices):
        piece = None if plain else outputs[start:end]
        for pos, k in zip(unit.positions, unit.constraints):
            c = constraints[k]
            if plain:
                n = end - start
            else:
                v = c.row_values(piece)
                n = v.shape[0]
                if n != end - start:
                    raise ValueError(f"constraint {c.name!r}: row_transform returned {n} values for "
                                     f"{end - start} rows")
                values.append(v)
            owner_base.append(np.full(n, 2 * pos, dtype=np.int64))
            labels = _group_labels(c, batch, num_rows, device, labels_cache)
            if labels is not None:
                grouped.append((offset, offset + n, labels[start:end]))
            offset += n
    if plain:
        if outputs.dim() != 1:
            raise ValueError(f"constraints {[constraints[u.constraints[0]].name for u in units][:5]}: per-row values "
                             f"must be a 1-d tensor (one value per row), got shape {tuple(outputs.shape)}")
        # the units' rows may be part of a longer call (look-ahead rows or the objective's alongside)
        first, last = slices[0][0], slices[-1][1]
        all_values = outputs if (first, last) == (0, num_rows) else outputs[first:last]
    else:
        all_values = torch.cat(values)
    owners = torch.from_numpy(np.concatenate(owner_base))
    owners = owners.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else owners.to(device)
    if grouped:
        extra = torch.zeros_like(owners)
        for start, end, labels in grouped:
            extra[start:end] = labels
        owners = owners + extra
    return all_values, owners
