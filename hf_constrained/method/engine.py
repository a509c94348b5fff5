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

Two-split estimation (``indicator_fraction``, a deviation from the paper, off by default): each
constraint's rows are split once, by a seeded permutation, into an *indicator* part and a
*gradient* part. Line 6's estimate u_k (so line 9's indicator 1[u_k > 0]) follows batches of the
indicator part, evaluated without grad; line 9's gradient follows batches of the gradient part.
No indicator row ever reaches a gradient, so u_k estimates the constraint on rows the model is
not fitted to (Cotter et al., ICML 2019: the constraint side on an independent split). Each step
then evaluates both parts' batches: one extra forward without grad, over ``indicator_batch_size``
rows (default |B_k|; the larger, the less noise u_k keeps). With ``proxy_indicator`` the
estimate of a constraint that declares a certification statistic (``Constraint.certify.statistic``)
tracks that statistic on the indicator rows (e.g. the share of a class's examples forgotten), against
the statistic's tolerance, while the gradient still follows the differentiable surrogate: a proxy
constraint in Cooper's sense.

The engine's state (:meth:`ConstraintEngine.state_dict`) is assembled from its parts' states:
the estimators, the data streams, the running row spread behind margins, the drawn next step.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
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
from .shared_forward import SharedObjectiveForward

logger = logging.getLogger(__name__)


@dataclass
class ConstraintDraw:
    """The constraint part of one step: B_c^t, the global sample indices of each B_k^t, and
    h_k(w_{t-1}; B_k^t) where it was computed (the look-ahead; ``None`` where not)."""

    step: int
    constraint_ids: torch.Tensor
    sample_indices: list[Optional[list[int]]]
    previous: Optional[torch.Tensor] = None
    # two-split estimation: the same constraints' batches of their indicator parts (they carry the
    # previous-iterate values then)
    indicator: Optional["ConstraintDraw"] = None
    # the look-ahead's collated device batches, reused by the step (same rows, new parameters);
    # not state: a resumed run collates them again
    kept_batches: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "constraint_ids": self.constraint_ids.cpu(), "sample_indices": self.sample_indices,
                "previous": None if self.previous is None else self.previous.cpu(),
                "indicator": None if self.indicator is None else self.indicator.state_dict()}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "ConstraintDraw":
        indicator = state.get("indicator")
        return cls(state["step"], state["constraint_ids"], state["sample_indices"], state["previous"],
                   None if indicator is None else cls.from_state_dict(indicator))

    @property
    def estimate_draw(self) -> "ConstraintDraw":
        """The draw whose values update the estimators: the indicator part's under two-split estimation."""
        return self.indicator if self.indicator is not None else self


def split_for_indicator(constraints: Sequence[Constraint], fraction: float, seed: int, *, proxy: bool = False
                        ) -> tuple[list[Constraint], list[Constraint]]:
    """Each dataset's rows split once into (gradient part, indicator part) by a permutation seeded by
    (``seed``, the position of the first constraint on it): views of the constraints over each part,
    for two-split estimation. Constraints on the same dataset object share its split (e.g. the TPR
    constraints of every threshold on one set of positives), so no row is an indicator row of one
    and a gradient row of another; datasets that merely hold copies of the same rows are split
    independently. The indicator part holds ``round(fraction * n)`` rows; both parts need one.
    With ``proxy``, the indicator view of a constraint with a ``certify.statistic`` evaluates that
    statistic (its ``row_fn``, tolerance, no ``outer``)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"constraint_indicator_fraction must be in (0, 1), got {fraction}")
    grad_views, ind_views = [], []
    parts_of: dict[int, tuple[Any, Any]] = {}  # id(dataset) -> (gradient part, indicator part)
    for k, c in enumerate(constraints):
        if c.data_free:
            grad_views.append(c)
            ind_views.append(c)
            continue
        if id(c.dataset) not in parts_of:
            n = len(c.dataset)
            n_ind = int(round(fraction * n))
            if not 1 <= n_ind <= n - 1:
                raise ValueError(f"constraint {c.name!r}: {n} rows cannot be split into an indicator part of "
                                 f"{fraction:g} and a gradient part, both non-empty (constraint_indicator_fraction)")
            order = np.random.default_rng([int(seed), k, 0x5B17]).permutation(n)
            parts_of[id(c.dataset)] = tuple(
                c.dataset.select(rows.tolist()) if hasattr(c.dataset, "select")
                else torch.utils.data.Subset(c.dataset, rows.tolist())
                for rows in (np.sort(order[n_ind:]), np.sort(order[:n_ind])))
        for views, data in zip((grad_views, ind_views), parts_of[id(c.dataset)]):
            # a view for drawing batches only (no held-out, certification or calibration data of its own)
            view = dict(dataset=data, fn=None if c.rowwise else c.fn, eval_dataset=None,
                        certify=None if c.certify is None else dataclasses.replace(c.certify, dataset=None),
                        independent_rows=None, confidence=None, margin=None)
            stat = None if c.certify is None else c.certify.statistic
            if proxy and views is ind_views and stat is not None:
                if c.outer is not None:
                    raise ValueError(f"constraint {c.name!r}: a proxy indicator needs a constraint without outer (its "
                                     "gradient weight is the indicator of the statistic alone)")
                view.update(fn=None, row_fn=stat.row_fn, row_transform=None, group_key=None, exact_fn=None,
                            tolerance=float(stat.tolerance), certify=None)
            views.append(dataclasses.replace(c, **view))
    return grad_views, ind_views


@dataclass(frozen=True)
class EngineSettings:
    """The constraint side's settings as this engine runs them, resolved (``constraints_per_step``
    is |B_c| even when configured as "all", ``msvr_gamma_prime`` the number line 6 uses even when
    configured as ``"theory"``); field names are those of
    :class:`~hf_constrained.ConstrainedTrainingArguments`. Reports record this value, never
    attributes read by name."""

    constraint_penalty: str
    penalty_beta: float
    num_constraints: int
    constraints_per_step: int  # |B_c|, Algorithm 1 line 3
    constraint_batch_size: int  # |B_k| per process, line 5
    msvr_gamma: float  # line 6
    msvr_gamma_prime: float  # line 6, resolved
    msvr_gamma_prime_rule: str  # as configured: a number or "theory"
    constraint_seed: int  # the sampling seed in force (a resumed run continues its checkpoint's)
    share_constraint_batches: bool
    check_constraint_finite: bool
    constraint_confidence: Optional[float]
    constraint_margin: Optional[float]
    constraint_certificate_delta: Optional[float]
    constraint_indicator_fraction: Optional[float]
    constraint_indicator_batch_size: Optional[int]  # resolved: |B_k| when not set, with two-split estimation
    constraint_proxy_indicator: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
        indicator_fraction, proxy_indicator: two-split estimation (module docstring).
        indicator_batch_size: rows per process of each indicator-part batch (default
            ``batch_size``); no grad flows through them, so a larger one buys a less noisy u_k
            for a forward pass.
        certificate_delta: size margins to the certificate's bound (``RowSpread``).
    """

    def __init__(self, constraints: Sequence[Constraint], penalty: Penalty, batches: BatchMaker, *, gamma: float,
                 gamma_prime: Any, num_sampled: int, batch_size: int, seed: int, device: torch.device,
                 dtype: torch.dtype = torch.float32, world: int = 1, rank: int = 0,
                 reduce_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 share_constraint_batches: bool = False, check_finite: bool = True,
                 confidence: Optional[float] = None, margin: Optional[float] = None,
                 indicator_fraction: Optional[float] = None, certificate_delta: Optional[float] = None,
                 proxy_indicator: bool = False, indicator_batch_size: Optional[int] = None) -> None:
        self.constraints = list(constraints)
        m = len(self.constraints)
        self._configured = dict(
            gamma_prime_rule=str(gamma_prime), share_constraint_batches=bool(share_constraint_batches),
            confidence=confidence, margin=margin, certificate_delta=certificate_delta,
            indicator_fraction=indicator_fraction, proxy_indicator=bool(proxy_indicator),
            indicator_batch_size=(indicator_batch_size or batch_size) if indicator_fraction else None)
        self.penalty, self.batches, self.check_finite = penalty, batches, check_finite
        self.batch_size, self.world, self.device = batch_size, world, device
        self.sampler = ConstraintSampler(m, num_sampled, seed)
        self.estimator = MSVREstimator(m, gamma, resolve_gamma_prime(gamma_prime, m, num_sampled, gamma),
                                       device=device, dtype=dtype)
        if proxy_indicator and not indicator_fraction:
            raise ValueError("constraint_proxy_indicator needs two-split estimation (constraint_indicator_fraction)")
        if indicator_batch_size is not None and not indicator_fraction:
            raise ValueError(
                "constraint_indicator_batch_size needs two-split estimation (constraint_indicator_fraction)")
        grad_views, ind_views = (self.constraints, None) if not indicator_fraction else \
            split_for_indicator(self.constraints, indicator_fraction, seed, proxy=proxy_indicator)
        # what each estimate u_k tracks: the constraint, or with proxy indicators its certification statistic
        self.estimated = list(ind_views) if proxy_indicator else self.constraints
        self.streams: list[Optional[ConstraintBatchStream]] = [
            None if c.data_free else ConstraintBatchStream(len(c.dataset), seed, k) for k, c in enumerate(grad_views)]
        self.values = DrawValues(grad_views, batches, batch_size=batch_size, device=device, world=world,
                                 rank=rank, reduce_sum=reduce_sum)
        # two-split estimation: the indicator parts' own streams (other stream ids) and values
        self.indicator_streams: Optional[list[Optional[ConstraintBatchStream]]] = None
        self.indicator_values: Optional[DrawValues] = None
        if ind_views is not None:
            self.indicator_streams = [None if c.data_free else ConstraintBatchStream(len(c.dataset), seed, m + k)
                                      for k, c in enumerate(ind_views)]
            self.indicator_values = DrawValues(ind_views, batches, batch_size=indicator_batch_size or batch_size,
                                               device=device, world=world, rank=rank, reduce_sum=reduce_sum)
        if share_constraint_batches:
            self.values.stream_owner = self._shared_stream_owners()
        self.spread = RowSpread(self.constraints, confidence=confidence, margin=margin, device=device,
                                dtype=stats_dtype(device), certificate_delta=certificate_delta,
                                indicator_views=ind_views)
        self.tolerances = torch.tensor([c.tolerance for c in self.estimated], dtype=stats_dtype(device), device=device)
        self.next_draw: Optional[ConstraintDraw] = None
        self.step_metrics: dict[str, list[torch.Tensor]] = defaultdict(list)

    def settings(self) -> EngineSettings:
        """The settings this engine runs with (:class:`EngineSettings`), read from its parts."""
        c = self._configured
        return EngineSettings(
            constraint_penalty=self.penalty.name, penalty_beta=self.penalty.beta, num_constraints=len(self.constraints),
            constraints_per_step=self.sampler.num_per_step, constraint_batch_size=self.batch_size,
            msvr_gamma=self.estimator.gamma, msvr_gamma_prime=self.estimator.gamma_prime,
            msvr_gamma_prime_rule=c["gamma_prime_rule"], constraint_seed=self.sampler.seed,
            share_constraint_batches=c["share_constraint_batches"], check_constraint_finite=bool(self.check_finite),
            constraint_confidence=c["confidence"], constraint_margin=c["margin"],
            constraint_certificate_delta=c["certificate_delta"], constraint_indicator_fraction=c["indicator_fraction"],
            constraint_indicator_batch_size=c["indicator_batch_size"], constraint_proxy_indicator=c["proxy_indicator"])

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
        """B_c^t (line 3) and the global rows of each B_k^t (line 5); under two-split estimation
        also a batch of each sampled constraint's indicator part."""
        ids = self.sampler.sample(step)
        draw = ConstraintDraw(step, ids, self._rows(ids, self.streams, self.values))
        if self.indicator_streams is not None:
            draw.indicator = ConstraintDraw(step, ids, self._rows(ids, self.indicator_streams, self.indicator_values))
        return draw

    def _rows(self, ids: torch.Tensor, streams: list[Optional[ConstraintBatchStream]], values: DrawValues
              ) -> list[Optional[list[int]]]:
        global_b = values.batch_size * self.world
        drawn: dict[int, list[int]] = {}
        rows: list[Optional[list[int]]] = []
        for k in ids.tolist():
            if streams[k] is None:
                rows.append(None)
                continue
            owner = values.stream_owner[k]
            if owner not in drawn:
                drawn[owner] = streams[owner].next_indices(global_b)
            rows.append(drawn[owner])
        return rows

    def penalty_loss(self, model: nn.Module, step: int, shared: Optional[SharedObjectiveForward] = None
                     ) -> torch.Tensor:
        """Lines 3-9 of step ``step``: the loss whose gradient is G_2. With ``shared`` (the objective's
        micro-batch) a row group's rows may join the objective's forward (:mod:`.shared_forward`).

        Host synchronisations (on a GPU): one for the finite check (``check_finite``), one for the
        group counts of ``group_key`` constraints, the collective of a multi-process run.
        """
        draw = self.next_draw if self.next_draw is not None and self.next_draw.step == step else self.draw(step)
        self.next_draw = None
        ids_cpu = draw.constraint_ids.cpu()                                          # line 3 (and 5: draw)
        ids = ids_cpu.to(self.device, non_blocking=True)
        values, current, stats = self.values.evaluate(model, draw, need_grad=True, shared=shared)  # h_k(w_t; B_k^t)
        estimate = draw.estimate_draw
        if self.indicator_values is not None:  # two-split: the estimate follows rows no gradient uses
            with torch.no_grad():
                _, current, stats = self.indicator_values.evaluate(model, estimate, need_grad=False)
        if self.check_finite:
            self._check_finite(ids_cpu, current, estimate.previous, step)
        u_t = self.estimator.get(ids, fallback=current)                            # u_k^t, before the update
        self.estimator.update(ids, current, estimate.previous, check_unique=False)  # line 6 (B_c has no repeats)
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
        values = self.indicator_values if self.indicator_values is not None else self.values
        _, previous, _ = values.evaluate(model, draw.estimate_draw, need_grad=False)
        draw.estimate_draw.previous = previous.to(self.estimator.values)
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
        if not any(self.estimated[k].outer is not None for k in id_list):
            h = inner if margin is None else inner + margin.to(inner)
            return h - tol, torch.ones_like(inner)
        with torch.enable_grad():
            x = inner.detach().clone().requires_grad_(True)
            h = torch.stack([self.estimated[k].apply_outer(x[i]) for i, k in enumerate(id_list)])
            (slope,) = torch.autograd.grad(h.sum(), x, allow_unused=True)
        slope = torch.zeros_like(x) if slope is None else slope
        h = h.detach()
        if margin is not None:
            margin = margin.to(inner)
            lo = torch.stack([self.estimated[k].apply_outer(x[i] - margin[i]) for i, k in enumerate(id_list)])
            hi = torch.stack([self.estimated[k].apply_outer(x[i] + margin[i]) for i, k in enumerate(id_list)])
            h = torch.maximum(lo, hi).detach()
        return h - tol, slope.detach()

    def current_weights(self) -> torch.Tensor:
        """``weight(u_k) * outer'(u_k)`` of every constraint at the current estimates, margins
        included (0 for constraints not visited yet): line 9's weights with B_c = all m."""
        violation, slope = self._violations_at_estimates()
        return (self.penalty.weight(violation) * slope * self.estimator.visited).cpu()

    def _violations_at_estimates(self) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`violations` of all m constraints at their current estimates, margins included."""
        ids = torch.arange(len(self.constraints))
        margin = self.spread.margin_values(ids.to(self.device)) if self.spread.has_margins else None
        return self.violations(ids, self.estimator.values.detach(), margin)

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
            tol = torch.tensor([c.tolerance for c in self.estimated if c.name in estimates], dtype=torch.float64)
            h = torch.tensor([estimates[n] for n in estimates], dtype=torch.float64) - tol
            if per_constraint:
                logs.update({f"constraint/{n}": v for n, v in estimates.items()})
            logs["constraint/max_estimate"] = h.max().item()
            logs["constraint/active_fraction"] = (h > 0).float().mean().item()
            logs["constraint/penalty"] = self.penalty.value(h).sum().item() / len(self.constraints)
        logs.update(self.spread.log_metrics(per_constraint, self.estimator.gamma, self.threshold_distances))
        return logs

    def threshold_distances(self) -> dict[str, float]:
        """``|outer(u_k) + margin - tol_k|`` of each visited constraint: how far its estimate is from
        where line 9's indicator switches (the noise warning asks whether noise can flip it)."""
        if not self.constraints:
            return {}
        violation, _ = self._violations_at_estimates()
        visited = self.estimator.visited.cpu().tolist()
        return {c.name: abs(float(v))
                for c, v, seen in zip(self.constraints, violation.cpu().tolist(), visited) if seen}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly, assembled from the parts' states."""
        return {
            "names": [c.name for c in self.constraints],
            "estimator": self.estimator.state_dict() if self.constraints else None,
            "streams": [None if s is None else s.state_dict() for s in self.streams],
            "indicator_streams": None if self.indicator_streams is None else
            [None if s is None else s.state_dict() for s in self.indicator_streams],
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
        if (state.get("indicator_streams") is None) != (self.indicator_streams is None):
            raise ValueError("the checkpoint was written with" + (" " if state.get("indicator_streams") else "out ")
                             + "two-split estimation (constraint_indicator_fraction) and this run is "
                             + ("not" if state.get("indicator_streams") else "") + ": resume with the same setting")
        if self.constraints:
            self.estimator.load_state_dict(state["estimator"])
        for stream, s in zip(self.streams, state["streams"]):
            if stream is not None:
                stream.load_state_dict(s)
        for stream, s in zip(self.indicator_streams or [], state.get("indicator_streams") or []):
            if stream is not None:
                stream.load_state_dict(s)
        if state.get("spread") is not None:
            self.spread.load_state_dict(state["spread"])
        nd = state["next_draw"]
        self.next_draw = None if nd is None else ConstraintDraw.from_state_dict(nd)
        self._drop_draw_of_other_batch_size(state)
        if self.next_draw is not None and self.next_draw.estimate_draw.previous is not None:
            estimate = self.next_draw.estimate_draw
            estimate.previous = estimate.previous.to(self.estimator.values)
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
        for stream in [*self.streams, *(self.indicator_streams or [])]:
            if stream is not None:
                stream.reseed(int(seed))


__all__ = ["ConstraintDraw", "ConstraintEngine", "EngineSettings"]
