"""h_k(w; B_k) of every constraint of a draw, at the current parameters (Algorithm 1, line 6).

Row-wise constraints go through one ``row_fn`` call per :class:`~hf_constrained.method.rows.RowGroup`
(the rows of all its sampled members collated once) and per-(constraint, group) segment
sums; scalar ``fn`` constraints are called one by one. Everything that crosses processes
travels in ONE all-reduce (a sum): the row sums and counts, and the scalar values (then
divided by the number of processes).

**Measured the way the certificate measures them.** Every constraint value here (the estimate
u_k's inputs, the look-ahead, the gradient's h_k(w_t; B_k)) is computed with the model in eval
mode (:func:`measured_as_certified`): dropout off, normalisation layers on their running
statistics, as the old model's reference values (:func:`~hf_constrained.reference_pass.reference_losses`),
the held-out evaluation and the certificate are. In training mode a dropout model's own
unchanged weights would show a violation (its loss with dropout exceeds its loss without: about
+0.12 nats per token on a small LM) and the hinge would push on a violation that does not exist.
The objective's forward pass keeps training mode. The gradient of a constraint is then the
gradient of the deterministic model's value; under Hugging Face gradient checkpointing (active
only in training mode) the constraint forward keeps its activations.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import torch
from torch import nn

from ..batches import BatchMaker, RowUnit, shallow_copy
from ..constraint import Constraint, ConstraintValueError
from ..row_sums import inner_values, local_contribution, segment_sums, stats_dtype
from .rows import RowGroup, plan_row_groups, row_values_and_owners

if TYPE_CHECKING:  # pragma: no cover
    from .shared_forward import SharedObjectiveForward


class DrawRows(Protocol):
    """The rows of one step's draw that :meth:`DrawValues.evaluate` reads (a
    :class:`~hf_constrained.method.engine.ConstraintDraw`): B_c^t, each B_k^t's sample indices, and the
    collated batches a look-ahead keeps for the step."""

    constraint_ids: torch.Tensor
    sample_indices: list[Optional[list[int]]]
    kept_batches: dict[Any, Any]


@contextlib.contextmanager
def measured_as_certified(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode inside the block (dropout off), each submodule's own mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    if not any(training for _, training in modes):
        yield
        return
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


class DrawValues:
    """Evaluates the constraints of a :class:`~hf_constrained.method.engine.ConstraintDraw`.

    Args:
        constraints: all m constraints.
        batches: the one way rows become a device batch.
        batch_size: |B_k| per process; a draw holds global batches of ``batch_size * world``
            rows, of which this process takes the contiguous slice of its ``rank``.
        device: where the values live.
        world, rank, reduce_sum: the processes and their all-reduce (a sum).
        stream_owner: which constraint's stream draws each constraint's rows (its own, or a
            shared batch's first member).
        statistic_views: the constraints as the estimate tracks them when a proxy indicator scores the
            certificate's statistic on these same rows (a row function :class:`~.statistic_rows.RowsWithStatistic`
            keeps it); ``None``: the estimate follows the constraints' own values.
    """

    def __init__(self, constraints: Sequence[Constraint], batches: BatchMaker, *, batch_size: int,
                 device: torch.device, world: int = 1, rank: int = 0,
                 reduce_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 stream_owner: Optional[list[int]] = None,
                 statistic_views: Optional[Sequence[Constraint]] = None) -> None:
        self.constraints = list(constraints)
        self.statistic_views = None if statistic_views is None else list(statistic_views)
        self.batches = batches
        self.batch_size, self.device, self.world, self.rank = batch_size, device, world, rank
        self.reduce_sum = reduce_sum
        self.row_groups: list[RowGroup] = plan_row_groups(self.constraints, batches.collate_of)
        self.group_of = {k: gi for gi, g in enumerate(self.row_groups) for k in g.members}
        self.stream_owner = list(range(len(self.constraints))) if stream_owner is None else stream_owner

    # ------------------------------------------------------------------ checks
    def check_value(self, k: int, value: Any, *, need_grad: bool) -> torch.Tensor:
        """A scalar ``fn`` returned a 0-dim tensor (with grad where the step needs it)."""
        name = self.constraints[k].name
        if not isinstance(value, torch.Tensor):
            raise ConstraintValueError(f"constraint {name!r} returned {type(value).__name__}, expected a scalar tensor")
        if value.dim() != 0:
            raise ConstraintValueError(
                f"constraint {name!r} returned a tensor of shape {tuple(value.shape)}, expected a scalar "
                "(the mini-batch estimate of h_k: reduce it, e.g. with .mean())"
            )
        if need_grad and not value.requires_grad:
            raise ConstraintValueError(
                f"constraint {name!r} returned a tensor without grad: compute it from the model passed to fn "
                "without .detach()/.item()/torch.no_grad()"
            )
        return value

    def check_row_outputs(self, units: Sequence[RowUnit], slices: list[tuple[int, int]], outputs: Any, *,
                          need_grad: bool) -> list[tuple[int, int]]:
        """``row_fn``'s outputs have one row (or the same number of rows) per example; returns the
        units' slices of the output rows."""
        names = [self.constraints[k].name for u in units for k in u.constraints]
        num_examples = slices[-1][1]
        if not isinstance(outputs, torch.Tensor):
            raise ConstraintValueError(f"row_fn of constraints {names} returned {type(outputs).__name__}, expected a "
                                       "tensor with one entry per row")
        if outputs.dim() > 0 and num_examples and outputs.shape[0] != num_examples \
                and outputs.shape[0] % num_examples == 0:
            # a collate that turns every example into the same number of consecutive rows (e.g. a pair of
            # rows of two groups into 2 rows): each unit's slice of the rows scales with it
            per_example = outputs.shape[0] // num_examples
            slices = [(start * per_example, end * per_example) for start, end in slices]
        if outputs.dim() == 0 or outputs.shape[0] != slices[-1][1]:
            raise ConstraintValueError(f"row_fn of constraints {names} returned shape {tuple(outputs.shape)} for a "
                                       f"batch of {num_examples} examples: dim 0 must be the rows (one per example, "
                                       "or the same number per example in example order)")
        if need_grad and not outputs.requires_grad:
            raise ConstraintValueError(f"row_fn of constraints {names} returned a tensor without grad: compute it from "
                                       "the model passed to row_fn without .detach()/.item()/torch.no_grad()")
        return slices

    def check_group_counts(self, ids: list[int], stats: Optional[torch.Tensor]) -> None:
        """Every ``group_key`` constraint has rows of both groups in its global batch (one host
        sync, only for draws holding such constraints)."""
        grouped = [p for p, k in enumerate(ids) if self.constraints[k].group_key is not None]
        if stats is None or not grouped:
            return
        counts = stats[2].view(-1, 2)[grouped].cpu().tolist()
        for p, (n0, n1) in zip(grouped, counts):
            self.constraints[ids[p]].check_group_counts(int(n0), int(n1))

    # ------------------------------------------------------------------ planning
    def local_rows(self, rows: list[int]) -> list[int]:
        """This process's share of a global constraint batch (contiguous slice by rank)."""
        b = self.batch_size
        return rows[self.rank * b : (self.rank + 1) * b]

    def plan(self, ids: list[int], sample_indices: list[Optional[list[int]]]
             ) -> tuple[dict[int, list[RowUnit]], list[int]]:
        """The row units of each row group (one per stream owner, in B_c order) and the positions
        of the scalar constraints."""
        buckets: dict[int, dict[int, RowUnit]] = defaultdict(dict)
        scalar_pos: list[int] = []
        for p, k in enumerate(ids):
            gi = self.group_of.get(k)
            if gi is None:
                scalar_pos.append(p)
                continue
            owner = self.stream_owner[k]
            units = buckets[gi]
            if owner not in units:
                units[owner] = RowUnit(self.constraints[k].dataset, self.local_rows(sample_indices[p]))
            units[owner].positions.append(p)
            units[owner].constraints.append(k)
        return {gi: list(units.values()) for gi, units in buckets.items()}, scalar_pos

    def row_outputs(self, model: nn.Module, group: RowGroup, units: list[RowUnit], *, need_grad: bool,
                    batch: Any = None, shared: Optional["SharedObjectiveForward"] = None
                    ) -> tuple[Any, list[tuple[int, int]], torch.Tensor]:
        """ONE collate call (unless ``batch``, a kept ``(batch, slices)``, is given) and ONE ``row_fn``
        call for ``units``; or, where ``shared`` takes the group, the rows in the objective's forward."""
        batch, slices = self.batches.units(units, group.collate) if batch is None else batch
        if shared is not None and shared.take(group.row_fn):
            outputs = shared(model, group.row_fn, batch)  # training mode: shared only where it equals eval mode
        else:
            with measured_as_certified(model):
                outputs = group.row_fn(model, batch)
        return batch, self.check_row_outputs(units, slices, outputs, need_grad=need_grad), outputs

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, model: nn.Module, draw: DrawRows, *, need_grad: bool,
                 shared: Optional["SharedObjectiveForward"] = None
                 ) -> tuple[Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]:
        """h_k(w; B_k) of every constraint of ``draw`` at the current parameters.

        Returns ``(local, current, stats)``: ``local`` (with ``need_grad``) this process's part
        of each value, carrying the gradient, scaled so that the data-parallel gradient average
        gives the gradient of the global value; ``current`` the global values, detached (float64
        where the device has it, else at least float32); ``stats`` the global ``(3, 2 |B_c|)``
        row sums, sums of squares and counts (``None`` without row-wise constraints). With
        ``statistic_views`` (a proxy indicator on the gradient's rows) ``current`` and ``stats`` are the
        statistic's, scored on the same rows in the same forward (:mod:`.statistic_rows`).

        A no-grad evaluation (the look-ahead) keeps its collated batches in ``draw``: the step
        evaluates the same rows next, with grad. ``shared``: the objective's micro-batch, whose forward
        the first row group that can joins (:mod:`~hf_constrained.method.shared_forward`).
        """
        ids = draw.constraint_ids.tolist()
        n = len(ids)
        buckets, scalar_pos = self.plan(ids, draw.sample_indices)
        sums, stats, estimated = self._row_group_sums(model, draw, buckets, n, need_grad=need_grad, shared=shared)
        scalar_local = self._scalar_values(model, draw, ids, scalar_pos, need_grad=need_grad)

        acc = stats_dtype(self.device)
        pos_t = torch.tensor(scalar_pos, dtype=torch.long).to(self.device, non_blocking=True) if scalar_pos else None
        scalar_vec = torch.zeros(n, dtype=acc, device=self.device)
        if scalar_local:
            scalar_vec = scalar_vec.index_copy(0, pos_t, torch.stack(scalar_local).detach().to(acc))
        if self.world > 1:  # one collective per evaluation: sums and counts, never means of means
            row_parts = [] if stats is None else [stats] if estimated is stats else [stats, estimated]
            packed = self.reduce_sum(torch.cat([*(t.reshape(-1) for t in row_parts), scalar_vec]))
            scalar_vec = packed[-n:] / self.world
            reduced = [packed[i * 6 * n: (i + 1) * 6 * n].view(3, 2 * n) for i in range(len(row_parts))]
            stats, estimated = (None, None) if not reduced else (reduced[0], reduced[-1])
        if estimated is None:
            current = scalar_vec
        elif not scalar_pos:
            current = inner_values(estimated)
        else:
            is_row = torch.ones(n, dtype=torch.bool).index_fill_(0, torch.tensor(scalar_pos), False)
            current = torch.where(is_row.to(self.device, non_blocking=True), inner_values(estimated), scalar_vec)
        self.check_group_counts(ids, stats)

        local = None
        if need_grad:
            dtype = torch.float32 if sums is None else sums.dtype
            if scalar_local:
                dtype = torch.promote_types(dtype, scalar_local[0].dtype)
            local = torch.zeros(n, dtype=dtype, device=self.device)
            if sums is not None:
                local = local + local_contribution(sums, stats[2], self.world)
            if scalar_local:
                local = local.index_add(0, pos_t, torch.stack(scalar_local).to(dtype))
        return local, current, estimated

    def _row_group_sums(self, model: nn.Module, draw: DrawRows, buckets: dict[int, list[RowUnit]], n: int, *,
                        need_grad: bool, shared: Optional["SharedObjectiveForward"]
                        ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
        """ONE model call per row group: the per-(constraint, group) sums with grad, this process's row
        statistics, and those the estimate follows (the same object, or the statistic's on the same rows)."""
        sums: Optional[torch.Tensor] = None
        stats: Optional[torch.Tensor] = None
        estimated: Optional[torch.Tensor] = None
        for gi, units in buckets.items():
            group = self.row_groups[gi]
            kept = draw.kept_batches.pop(("group", gi), None)
            batch, slices, outputs = self.row_outputs(model, group, units, need_grad=need_grad, batch=kept,
                                                      shared=shared)
            if not need_grad:
                draw.kept_batches[("group", gi)] = (shallow_copy(batch), _unit_spans(units))
            values, owners = row_values_and_owners(self.constraints, units, slices, outputs, batch)
            g_sums, g_stats = segment_sums(values, owners, n, need_grad=need_grad)
            # each group's owners are its own positions of B_c: adding the groups' sums merges them
            if g_sums is not None:
                sums = g_sums if sums is None else sums + g_sums
            stats = g_stats if stats is None else stats + g_stats
            e_stats = g_stats
            if self.statistic_views is not None and hasattr(group.row_fn, "take_statistic"):
                statistic = group.row_fn.take_statistic()
                s_slices = self.check_row_outputs(units, _unit_spans(units), statistic, need_grad=False)
                s_values, s_owners = row_values_and_owners(self.statistic_views, units, s_slices, statistic, batch)
                _, e_stats = segment_sums(s_values, s_owners, n, need_grad=False)
            estimated = e_stats if estimated is None else estimated + e_stats
        return sums, stats, stats if self.statistic_views is None else estimated

    def _scalar_values(self, model: nn.Module, draw: DrawRows, ids: list[int], scalar_pos: list[int], *,
                       need_grad: bool) -> list[torch.Tensor]:
        """The scalar ``fn`` constraints' values, one call each (with grad where the step needs it)."""
        scalar_local: list[torch.Tensor] = []
        for p in scalar_pos:
            k = ids[p]
            rows = draw.sample_indices[p]
            batch = draw.kept_batches.pop(("scalar", p), None)
            if batch is None and rows is not None:
                batch = self.batches.constraint_rows(self.constraints[k], self.local_rows(rows))
            if not need_grad and batch is not None:
                draw.kept_batches[("scalar", p)] = shallow_copy(batch)
            with measured_as_certified(model):
                value = self.check_value(k, self.constraints[k].fn(model, batch), need_grad=need_grad)
            scalar_local.append(value.to(torch.promote_types(value.dtype, torch.float32)))
        return scalar_local


def _unit_spans(units: Sequence[RowUnit]) -> list[tuple[int, int]]:
    """Each unit's (start, end) example slice of a batch collated from ``units``."""
    spans, start = [], 0
    for unit in units:
        spans.append((start, start + len(unit.rows)))
        start += len(unit.rows)
    return spans


__all__ = ["DrawValues", "measured_as_certified"]
