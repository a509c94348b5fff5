"""Algorithm 1 of the paper (section 4), without the Trainer: the constraint part of a step.

:meth:`ConstraintEngine.penalty_loss` is lines 3-9 in the paper's order:

* line 3: B_c^t, the sampled constraints (:class:`~hf_constrained.method.sampling.ConstraintSampler`);
* line 5: B_k^t per sampled constraint (:class:`~hf_constrained.method.sampling.ConstraintBatchStream`);
* line 6: h_k(w_t; B_k^t) with grad and the MSVR update of u_k with the previous-iterate
  value h_k(w_{t-1}; B_k^t), which :meth:`ConstraintEngine.look_ahead` computed at the end of
  step t-1, when the parameters were still w_{t-1} (no copy of the parameters is kept);
* line 8: the other estimators keep their value;
* line 9: the loss ``(1/|B_c|) sum_k weight(u_k^t) h_k(w_t; B_k^t)``, the weight detached,
  whose gradient is G_2. The trainer's optimizer then steps along G_1 + G_2 (line 10).

The engine's state (:meth:`ConstraintEngine.state_dict`) is assembled from its parts' states:
the estimators, the data streams, the running row spread behind margins, the drawn next step.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..batches import BatchMaker
from ..constraint import Constraint, ConstraintValueError
from .draw_values import DrawValues
from .estimators import MSVREstimator, resolve_gamma_prime
from .margins import RowSpread
from .penalties import Penalty
from .rows import stats_dtype
from .sampling import ConstraintBatchStream, ConstraintSampler

logger = logging.getLogger(__name__)


@dataclass
class ConstraintDraw:
    """The constraint part of one step: B_c^t, the global sample indices of each B_k^t, and
    h_k(w_{t-1}; B_k^t) where it was computed (the look-ahead; ``None`` where not)."""

    step: int
    constraint_ids: torch.Tensor
    sample_indices: list[Optional[list[int]]]
    previous: Optional[torch.Tensor] = None
    # the look-ahead's collated device batches, reused by the step (same rows, new parameters);
    # not state: a resumed run collates them again
    kept_batches: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "constraint_ids": self.constraint_ids.cpu(), "sample_indices": self.sample_indices,
                "previous": None if self.previous is None else self.previous.cpu()}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "ConstraintDraw":
        return cls(state["step"], state["constraint_ids"], state["sample_indices"], state["previous"])


class ConstraintEngine:
    """The constraint side of Algorithm 1 for m constraints.

    Args:
        constraints: the m constraints.
        penalty: maps estimates to gradient weights (line 9).
        batches: the one way rows become a device batch.
        gamma, gamma_prime: MSVR weights (line 6); ``gamma_prime`` may be ``"theory"``.
        num_sampled: |B_c|.
        batch_size: |B_k| per process.
        seed: the sampling seed (B_c^t and the streams are functions of it and the step).
        device: where estimators and values live; ``dtype`` their precision (the run's).
        world, rank, reduce_sum: the processes and their all-reduce (a sum).
        share_constraint_batches: row-wise constraints of one group on the same dataset object
            draw one batch per step from one stream (a sampling choice: their batches are no
            longer independent).
        check_finite: stop with an error naming the constraint when a value is NaN/inf (one
            host sync per step).
        confidence, margin: the run's calibrated-constraint settings (see
            :class:`~hf_constrained.method.margins.RowSpread`).
    """

    def __init__(self, constraints: Sequence[Constraint], penalty: Penalty, batches: BatchMaker, *, gamma: float,
                 gamma_prime: Any, num_sampled: int, batch_size: int, seed: int, device: torch.device,
                 dtype: torch.dtype = torch.float32, world: int = 1, rank: int = 0,
                 reduce_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 share_constraint_batches: bool = False, check_finite: bool = True,
                 confidence: Optional[float] = None, margin: Optional[float] = None) -> None:
        self.constraints = list(constraints)
        m = len(self.constraints)
        self.penalty, self.batches, self.check_finite = penalty, batches, check_finite
        self.batch_size, self.world, self.device = batch_size, world, device
        self.sampler = ConstraintSampler(m, num_sampled, seed)
        self.estimator = MSVREstimator(m, gamma, resolve_gamma_prime(gamma_prime, m, num_sampled, gamma),
                                       device=device, dtype=dtype)
        self.streams: list[Optional[ConstraintBatchStream]] = [
            None if c.data_free else ConstraintBatchStream(len(c.dataset), seed, k) for k, c in enumerate(self.constraints)]
        self.values = DrawValues(self.constraints, batches, batch_size=batch_size, device=device, world=world,
                                 rank=rank, reduce_sum=reduce_sum)
        if share_constraint_batches:
            self.values.stream_owner = self._shared_stream_owners()
        self.spread = RowSpread(self.constraints, confidence=confidence, margin=margin, device=device,
                                dtype=stats_dtype(device))
        self.tolerances = torch.tensor([c.tolerance for c in self.constraints], dtype=stats_dtype(device), device=device)
        self.next_draw: Optional[ConstraintDraw] = None
        self.step_metrics: dict[str, list[torch.Tensor]] = defaultdict(list)

    def _shared_stream_owners(self) -> list[int]:
        """The first member of each row group on the same dataset object draws for all of them."""
        owners = list(range(len(self.constraints)))
        for group in self.values.row_groups:
            first: dict[int, int] = {}
            for k in group.members:  # identity: the objects live as long as the engine
                owners[k] = first.setdefault(id(self.constraints[k].dataset), k)
        logger.info("share_constraint_batches: %d of %d constraints draw their batch from another constraint's "
                    "stream (same row_fn, collate and dataset)", sum(o != k for k, o in enumerate(owners)), len(owners))
        return owners

    # ------------------------------------------------------------------ Algorithm 1
    def draw(self, step: int) -> ConstraintDraw:
        """B_c^t (line 3) and the global rows of each B_k^t (line 5)."""
        ids = self.sampler.sample(step)
        global_b = self.batch_size * self.world
        drawn: dict[int, list[int]] = {}
        rows: list[Optional[list[int]]] = []
        for k in ids.tolist():
            if self.streams[k] is None:
                rows.append(None)
                continue
            owner = self.values.stream_owner[k]
            if owner not in drawn:
                drawn[owner] = self.streams[owner].next_indices(global_b)
            rows.append(drawn[owner])
        return ConstraintDraw(step, ids, rows)

    def penalty_loss(self, model: nn.Module, step: int) -> torch.Tensor:
        """Lines 3-9 of step ``step``: the loss whose gradient is G_2.

        Host synchronisations (on a GPU): one for the finite check (``check_finite``), one for the
        group counts of ``group_key`` constraints, the collective of a multi-process run.
        """
        draw = self.next_draw if self.next_draw is not None and self.next_draw.step == step else self.draw(step)
        self.next_draw = None
        ids_cpu = draw.constraint_ids.cpu()                                          # line 3 (and 5: draw)
        ids = ids_cpu.to(self.device, non_blocking=True)
        values, current, stats = self.values.evaluate(model, draw, need_grad=True)  # h_k(w_t; B_k^t)
        if self.check_finite:
            self._check_finite(ids_cpu, current, draw.previous, step)
        u_t = self.estimator.get(ids, fallback=current)                            # u_k^t, before the update
        self.estimator.update(ids, current, draw.previous, check_unique=False)     # line 6 (B_c has no repeats)
        if stats is not None:
            self.spread.observe(ids, stats)
        margin = self.spread.margin_values(ids) if self.spread.has_margins else None
        violation, slope = self.violations(ids_cpu, u_t, margin)
        weights = self.penalty.weight(violation) * slope                            # line 9
        loss = (weights.detach().to(values.dtype) * values).sum() / ids.numel()
        self.step_metrics["constraint/sampled_active_fraction"].append((weights != 0).float().mean())
        self.step_metrics["constraint/penalty_loss"].append(loss.detach())
        return loss

    @torch.no_grad()
    def look_ahead(self, model: nn.Module, step: int) -> None:
        """Draw step ``step``'s batches now and evaluate them at the current parameters, which are
        w_{step-1} from that step's point of view (line 6's previous-iterate term). Nothing to do
        with gamma' = 0."""
        if self.estimator.gamma_prime <= 0:
            return
        draw = self.draw(step)
        _, previous, _ = self.values.evaluate(model, draw, need_grad=False)
        draw.previous = previous.to(self.estimator.values)
        self.next_draw = draw

    def violations(self, ids: torch.Tensor, inner: torch.Tensor, margin: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """``outer(inner) - tolerance`` and ``d outer / d inner`` per constraint (``ids`` on the host).

        With ``margin`` (a calibrated constraint) the violation is the upper end of ``outer`` over
        ``[inner - margin, inner + margin]``: ``inner + margin - tol`` without ``outer``,
        ``max(outer(inner - margin), outer(inner + margin)) - tol`` with a convex ``outer``; the
        slope stays d outer / d inner at ``inner``.
        """
        id_list = ids.tolist()
        tol = self.tolerances.to(inner.device)[ids.to(inner.device, non_blocking=True)].to(inner.dtype)
        if not any(self.constraints[k].outer is not None for k in id_list):
            h = inner if margin is None else inner + margin.to(inner)
            return h - tol, torch.ones_like(inner)
        with torch.enable_grad():
            x = inner.detach().clone().requires_grad_(True)
            h = torch.stack([self.constraints[k].apply_outer(x[i]) for i, k in enumerate(id_list)])
            (slope,) = torch.autograd.grad(h.sum(), x, allow_unused=True)
        slope = torch.zeros_like(x) if slope is None else slope
        h = h.detach()
        if margin is not None:
            margin = margin.to(inner)
            lo = torch.stack([self.constraints[k].apply_outer(x[i] - margin[i]) for i, k in enumerate(id_list)])
            hi = torch.stack([self.constraints[k].apply_outer(x[i] + margin[i]) for i, k in enumerate(id_list)])
            h = torch.maximum(lo, hi).detach()
        return h - tol, slope.detach()

    def current_weights(self) -> torch.Tensor:
        """``weight(u_k) * outer'(u_k)`` of every constraint at the current estimates, margins
        included (0 for constraints not visited yet): line 9's weights with B_c = all m."""
        ids = torch.arange(len(self.constraints))
        margin = self.spread.margin_values(ids.to(self.device)) if self.spread.has_margins else None
        violation, slope = self.violations(ids, self.estimator.values.detach(), margin)
        return (self.penalty.weight(violation) * slope * self.estimator.visited).cpu()

    def _check_finite(self, ids: torch.Tensor, current: torch.Tensor, previous: Optional[torch.Tensor],
                      step: int) -> None:
        """Every value that feeds the estimator is finite: this step's h_k(w_t; B_k^t) and the
        look-ahead h_k(w_{t-1}; B_k^t) computed at the previous step (one host sync for both)."""
        check = current if previous is None else torch.cat([current, previous.to(current)])
        if bool(torch.isfinite(check).all()):
            return
        n = ids.numel()
        if not bool(torch.isfinite(current).all()):
            values, what = current, "h_k(w_t; B_k) at this step's parameters"
        else:
            values, what = check[n:], f"the look-ahead h_k(w_(t-1); B_k^t) computed at step {step - 1}"
        bad = [(self.constraints[int(k)].name, float(v)) for k, v in zip(ids.tolist(), values.cpu().tolist())
               if not math.isfinite(v)]
        raise ConstraintValueError(
            f"constraint {bad[0][0]!r} is {bad[0][1]} ({what}) at step {step}; all non-finite: {bad}. "
            "Training stopped; checkpoints already written are untouched.")

    # ------------------------------------------------------------------ reading
    def estimates(self) -> dict[str, float]:
        """The current estimate of each visited constraint, h_k ~ outer(u_k) (no tolerance subtracted)."""
        if not self.constraints:
            return {}
        ids = torch.arange(len(self.constraints))
        h, _ = self.violations(ids, self.estimator.values.detach().cpu())
        h = h + self.tolerances.cpu().to(h)
        visited = self.estimator.visited.cpu().tolist()
        return {c.name: float(v) for c, v, seen in zip(self.constraints, h.tolist(), visited) if seen}

    def log_metrics(self, per_constraint: bool) -> dict[str, float]:
        """The training log's constraint entries: the step metrics since the last log, the
        estimates (each with ``per_constraint``), the largest one, the active fraction and the
        penalty term of Phi, ``(1/m) sum_k penalty(h_k)`` over the visited constraints; then
        the noise and margins of :class:`~hf_constrained.method.margins.RowSpread`."""
        logs = {key: torch.stack(vals).float().mean().item() for key, vals in self.step_metrics.items()}
        self.step_metrics.clear()
        estimates = self.estimates()
        if estimates:
            tol = torch.tensor([c.tolerance for c in self.constraints if c.name in estimates], dtype=torch.float64)
            h = torch.tensor([estimates[n] for n in estimates], dtype=torch.float64) - tol
            if per_constraint:
                logs.update({f"constraint/{n}": v for n, v in estimates.items()})
            logs["constraint/max_estimate"] = h.max().item()
            logs["constraint/active_fraction"] = (h > 0).float().mean().item()
            logs["constraint/penalty"] = self.penalty.value(h).sum().item() / len(self.constraints)
        logs.update(self.spread.log_metrics(per_constraint, self.estimator.gamma))
        return logs

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly, assembled from the parts' states."""
        return {
            "names": [c.name for c in self.constraints],
            "estimator": self.estimator.state_dict() if self.constraints else None,
            "streams": [None if s is None else s.state_dict() for s in self.streams],
            "spread": self.spread.state_dict(),
            "next_draw": None if self.next_draw is None else self.next_draw.state_dict(),
            # B_c^t and the streams' permutations are functions of (seed, step): the seed is their RNG state
            "sampling_seed": self.sampler.seed,
            # the drawn next step holds global batches of this size, split by rank
            "num_processes": self.world,
            "global_constraint_batch_size": self.batch_size * self.world,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = [c.name for c in self.constraints]
        if state["names"] != names:
            raise ValueError(f"checkpoint constraints {state['names']} do not match this trainer's {names}")
        if self.constraints:
            self.estimator.load_state_dict(state["estimator"])
        for stream, s in zip(self.streams, state["streams"]):
            if stream is not None:
                stream.load_state_dict(s)
        if state.get("spread") is not None:
            self.spread.load_state_dict(state["spread"])
        nd = state["next_draw"]
        self.next_draw = None if nd is None else ConstraintDraw.from_state_dict(nd)
        self._drop_draw_of_other_batch_size(state)
        if self.next_draw is not None and self.next_draw.previous is not None:
            self.next_draw.previous = self.next_draw.previous.to(self.estimator.values)
        self._continue_sampling_seed(state.get("sampling_seed"))

    def _drop_draw_of_other_batch_size(self, state: dict[str, Any]) -> None:
        """Resuming on another number of processes (or another ``constraint_batch_size``).

        The estimators, streams and sampler are global (every rank holds the same values), so
        they carry over. The drawn next step does not: its global batches B_k^t were drawn for the
        checkpoint's global size and each rank takes a slice of its own size, so it is dropped
        and that step uses a fresh draw without the previous-iterate term (line 6) once.
        """
        global_b = self.batch_size * self.world
        draw = self.next_draw
        sizes = set() if draw is None else {len(r) for r in draw.sample_indices if r is not None}
        if state.get("global_constraint_batch_size", global_b) == global_b and sizes <= {global_b}:
            return
        self.next_draw = None
        saved = state.get("num_processes")
        logger.warning(
            "resuming a checkpoint written by %s process(es) with global constraint batches of %s rows on %d "
            "process(es) with %d rows: the estimators, streams and sampler continue, the prefetched draw of step %s "
            "is dropped (that step uses no previous-iterate correction), and the run is not identical to an "
            "uninterrupted run", saved if saved is not None else "?",
            state.get("global_constraint_batch_size", sorted(sizes)), self.world, global_b,
            None if draw is None else draw.step)

    def _continue_sampling_seed(self, seed: Optional[int]) -> None:
        """Continue the checkpoint's sampling sequence (B_c^t and each stream's shuffles) even
        when this run was configured with another seed."""
        if seed is None or seed == self.sampler.seed:
            return
        logger.warning("resuming with the checkpoint's constraint sampling seed %s (this run's arguments say %s)",
                       seed, self.sampler.seed)
        self.sampler.seed = int(seed)
        for stream in self.streams:
            if stream is not None:
                stream.reseed(int(seed))


__all__ = ["ConstraintDraw", "ConstraintEngine"]
