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

The rows behind line 6's estimate and line 9's gradient come from the run's estimate source
(:mod:`~hf_constrained.method.strategies`): the paper's one split (:class:`~.strategies.OneSplit`), or
two-split estimation (:class:`~.strategies.TwoSplit`, a deviation from the paper, off by default): each
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
constraint in Cooper's sense. The engine holds the two sides as :class:`RowPart` values (one and the
same object under one split) and never asks which flag was set; margins likewise are each
constraint's :class:`~hf_constrained.margin.Margin` rule, decided once by :func:`~.strategies.margin_rules`.

The engine's state (:meth:`ConstraintEngine.state_dict`) is assembled from its parts' states:
the estimators, the data streams, the running row spread behind margins, the drawn next step.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..batches import BatchMaker
from ..constraint import Constraint, ConstraintValueError
from ..margin import Margin, as_margin, margin_settings
from ..row_sums import stats_dtype
from .draw_values import DrawValues
from .estimators import MSVREstimator, resolve_gamma_prime
from .margins import RowSpread
from .penalties import Penalty
from .sampling import ConstraintBatchStream, ConstraintSampler
from .shared_forward import SharedObjectiveForward
from .strategies import EstimateSource, OneSplit, has_statistic, margin_rules

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
    # the run's margin rule as its flags spell it (at most one set), and the rule itself
    constraint_confidence: Optional[float]
    constraint_margin: Optional[float]
    constraint_certificate_delta: Optional[float]
    margin_rule: str  # e.g. "calibrated(confidence=0.9)"; "none"
    margin_rules: dict[str, int]  # the rule in force -> how many constraints follow it (Constraint.margin included)
    # the estimate source as its flags spell it, and the source itself
    constraint_indicator_fraction: Optional[float]
    constraint_indicator_batch_size: Optional[int]  # resolved: |B_k| when not set, with two-split estimation
    constraint_proxy_indicator: bool
    estimate_source: str  # e.g. "one_split"; "two_split(fraction=0.25, indicator_batch_size=None, ...)"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class StepConfig:
    """The constraint part of Algorithm 1's step as configured (the engine resolves it; what it runs with is
    :class:`EngineSettings`).

    Args:
        gamma, gamma_prime: the MSVR weights of line 6; ``gamma_prime`` may be ``"theory"``.
        num_sampled: |B_c|, the constraints sampled per step (line 3).
        batch_size: |B_k| per process, the rows of each sampled constraint (line 5).
        seed: the sampling seed (B_c^t and the streams are functions of it and the step).
        share_constraint_batches: row-wise constraints of one group on the same dataset object
            draw one batch per step from one stream (a sampling choice: their batches are no
            longer independent).
        check_finite: stop with an error naming the constraint when a value is NaN/inf (one
            host sync per step).
    """

    gamma: float
    gamma_prime: Any
    num_sampled: int
    batch_size: int
    seed: int
    share_constraint_batches: bool = False
    check_finite: bool = True


@dataclass(frozen=True)
class Placement:
    """Where the engine's values live and which processes share a step: ``device`` and ``dtype`` (the
    estimators' precision, the run's), the number of processes ``world``, this one's ``rank`` and their
    all-reduce of a sum ``reduce_sum`` (``None`` on one process)."""

    device: torch.device
    dtype: torch.dtype = torch.float32
    world: int = 1
    rank: int = 0
    reduce_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None


class RowPart:
    """One side of a step's rows: the constraints' views over them, a batch stream per constraint (``None``
    for a data-free one) and the one way their values are computed (:class:`DrawValues`; with
    ``statistic_views`` the estimate's values are a proxy statistic scored on the same rows)."""

    def __init__(self, views: Sequence[Constraint], batches: BatchMaker, *, seed: int, first_stream: int,
                 batch_size: int, placement: Placement,
                 statistic_views: Optional[Sequence[Constraint]] = None) -> None:
        self.views = list(views)
        self.streams: list[Optional[ConstraintBatchStream]] = [
            None if c.data_free else ConstraintBatchStream(len(c.dataset), seed, first_stream + k)
            for k, c in enumerate(self.views)]
        self.values = DrawValues(self.views, batches, batch_size=batch_size, device=placement.device,
                                 world=placement.world, rank=placement.rank, reduce_sum=placement.reduce_sum,
                                 statistic_views=statistic_views)

    def rows(self, ids: torch.Tensor) -> list[Optional[list[int]]]:
        """The global rows of each sampled constraint's batch (line 5); constraints sharing a stream share them."""
        global_b = self.values.batch_size * self.values.world
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
        return rows


class ConstraintEngine:
    """The constraint side of Algorithm 1 for m constraints.

    Args:
        constraints: the m constraints.
        penalty: maps estimates to gradient weights (line 9).
        batches: the one way rows become a device batch.
        config: the step's settings (:class:`StepConfig`: MSVR's gamma and gamma', |B_c|, |B_k|, the seed).
        placement: the device, precision and processes (:class:`Placement`).
        margin: the run's margin rule (:class:`~hf_constrained.margin.Margin`; a number is a
            :class:`~hf_constrained.margin.FixedMargin`), for every constraint without its own
            ``Constraint.margin`` that it applies to (:func:`~hf_constrained.method.strategies.margin_rules`).
        source: which rows drive the estimates and which the gradient
            (:class:`~hf_constrained.method.strategies.EstimateSource`; default the paper's one split).
    """

    def __init__(self, constraints: Sequence[Constraint], penalty: Penalty, batches: BatchMaker, config: StepConfig,
                 placement: Placement, *, margin: Optional[Margin | float] = None,
                 source: Optional[EstimateSource] = None) -> None:
        self.constraints = list(constraints)
        m = len(self.constraints)
        self.margin_rule, self.source = as_margin(margin), source if source is not None else OneSplit()
        self._configured = dict(gamma_prime_rule=str(config.gamma_prime),
                                share_constraint_batches=bool(config.share_constraint_batches))
        self.penalty, self.batches, self.check_finite = penalty, batches, config.check_finite
        batch_size, device = config.batch_size, placement.device
        self.batch_size, self.world, self.device = batch_size, placement.world, device
        self.sampler = ConstraintSampler(m, config.num_sampled, config.seed)
        self.estimator = MSVREstimator(
            m, config.gamma, resolve_gamma_prime(config.gamma_prime, m, config.num_sampled, config.gamma),
            device=device, dtype=placement.dtype)
        # the source decides which rows drive the gradient and which the estimate (the same part under one split);
        # the estimate part's streams have their own ids (m + k)
        grad_views, estimate_views = self.source.views(self.constraints, config.seed)
        # what each estimate u_k tracks: the estimate part's views (a proxy statistic's, with one); margins aside
        self.estimated = self.source.estimated(self.constraints, estimate_views)
        # whether the estimates are a proxy statistic's (a checkpoint records it)
        self.proxy_statistic = bool(self.source.settings(batch_size)["constraint_proxy_indicator"])
        if self.proxy_statistic:
            plain = [c.name for c in self.constraints if not has_statistic(c)]
            if plain:
                logger.warning("constraint_proxy_indicator: %d of %d constraints declare no certification statistic "
                               "(Certification.statistic), so their estimates follow their own values: %s",
                               len(plain), m, plain[:10])
        part = dict(seed=config.seed, placement=placement)
        self.gradient_rows = RowPart(grad_views, batches, first_stream=0, batch_size=batch_size, **part,
                                     statistic_views=self.estimated if self.source.statistic_on_gradient_rows else None)
        self.estimate_rows = self.gradient_rows if estimate_views is None else RowPart(
            estimate_views, batches, first_stream=m, batch_size=self.source.estimate_batch_size(batch_size), **part)
        if config.share_constraint_batches:
            self.values.stream_owner = self._shared_stream_owners()
        self.margins = margin_rules(self.constraints, self.margin_rule)
        self.spread = RowSpread(self.constraints, self.margins, device=device, dtype=stats_dtype(device),
                                sampled=self.estimate_rows.views, batch_setting=self.source.batch_setting)
        self.tolerances = torch.tensor([c.tolerance for c in self.estimated], dtype=stats_dtype(device), device=device)
        self.next_draw: Optional[ConstraintDraw] = None
        self.step_metrics: dict[str, list[torch.Tensor]] = defaultdict(list)

    @property
    def values(self) -> DrawValues:
        """The values of the gradient's rows (line 9)."""
        return self.gradient_rows.values

    @property
    def streams(self) -> list[Optional[ConstraintBatchStream]]:
        """The batch streams of the gradient's rows (line 5)."""
        return self.gradient_rows.streams

    @property
    def separate_estimate(self) -> bool:
        """Whether the estimates follow rows of their own (two-split estimation)."""
        return self.estimate_rows is not self.gradient_rows

    def settings(self) -> EngineSettings:
        """The settings this engine runs with (:class:`EngineSettings`), read from its parts."""
        c = self._configured
        in_force = dict(Counter("none" if rule is None else rule.describe() for rule in self.margins))
        return EngineSettings(
            constraint_penalty=self.penalty.name, penalty_beta=self.penalty.beta, num_constraints=len(self.constraints),
            constraints_per_step=self.sampler.num_per_step, constraint_batch_size=self.batch_size,
            msvr_gamma=self.estimator.gamma, msvr_gamma_prime=self.estimator.gamma_prime,
            msvr_gamma_prime_rule=c["gamma_prime_rule"], constraint_seed=self.sampler.seed,
            share_constraint_batches=c["share_constraint_batches"], check_constraint_finite=bool(self.check_finite),
            **margin_settings(self.margin_rule),
            margin_rule="none" if self.margin_rule is None else self.margin_rule.describe(), margin_rules=in_force,
            **self.source.settings(self.batch_size), estimate_source=self.source.describe())

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
        draw = ConstraintDraw(step, ids, self.gradient_rows.rows(ids))
        if self.separate_estimate:
            draw.indicator = ConstraintDraw(step, ids, self.estimate_rows.rows(ids))
        return draw

    def penalty_loss(self, model: nn.Module, step: int, shared: Optional[SharedObjectiveForward] = None,
                     row_weight: float = 0.0) -> torch.Tensor:
        """Lines 3-9 of step ``step``: the loss whose gradient is G_2. With ``shared`` (the objective's
        micro-batch) a row group's rows may join the objective's forward (:mod:`.shared_forward`).
        ``row_weight``: a weight every sampled constraint's value carries besides the penalty's (the old rows'
        share of the loss when replay reads these rows: :class:`~.regularisers.ConstraintRowReplay`), so the
        rows are drawn and forwarded once and one backward applies both.

        Host synchronisations (on a GPU): one for the finite check (``check_finite``), one for the
        group counts of ``group_key`` constraints, the collective of a multi-process run.
        """
        draw = self.next_draw if self.next_draw is not None and self.next_draw.step == step else self.draw(step)
        self.next_draw = None
        ids_cpu = draw.constraint_ids.cpu()                                          # line 3 (and 5: draw)
        ids = ids_cpu.to(self.device, non_blocking=True)
        values, current, stats = self.values.evaluate(model, draw, need_grad=True, shared=shared)  # h_k(w_t; B_k^t)
        estimate = draw.estimate_draw
        if self.separate_estimate and self.penalty.active:  # two-split: the estimate follows rows no gradient uses
            with torch.no_grad():
                _, current, stats = self.estimate_rows.values.evaluate(model, estimate, need_grad=False)
        if self.check_finite:
            self._check_finite(ids_cpu, current, estimate.previous, step)
        u_t = self.estimator.get(ids, fallback=current)                            # u_k^t, before the update
        self.estimator.update(ids, current, estimate.previous, check_unique=False)  # line 6 (B_c has no repeats)
        if stats is not None:
            self.spread.observe(ids, stats)
        margin = self.spread.margin_values(ids) if self.spread.has_margins else None
        violation, slope = self.violations(ids_cpu, u_t, margin)
        weights = self.penalty.weight(violation) * slope                            # line 9
        loss = ((weights.detach() + row_weight).to(values.dtype) * values).sum() / ids.numel()
        self.step_metrics["constraint/sampled_active_fraction"].append((weights != 0).float().mean())
        self.step_metrics["constraint/penalty_loss"].append(
            loss.detach() if not row_weight else (weights.detach().to(values.dtype) * values.detach()).mean())
        return loss

    @torch.no_grad()
    def look_ahead(self, model: nn.Module, step: int) -> None:
        """Draw step ``step``'s batches now and evaluate them at the current parameters, which are
        w_{step-1} from that step's point of view (line 6's previous-iterate term). Nothing to do
        with gamma' = 0."""
        if self.estimator.gamma_prime <= 0:
            return
        draw = self.draw(step)
        _, previous, _ = self.estimate_rows.values.evaluate(model, draw.estimate_draw, need_grad=False)
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
            # what the estimates are in (a proxy statistic's units or the constraints'): a resume must keep it
            "proxy_statistic": self.proxy_statistic,
            "indicator_streams": None if not self.separate_estimate else
            [None if s is None else s.state_dict() for s in self.estimate_rows.streams],
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
        if (state.get("indicator_streams") is None) == self.separate_estimate:
            raise ValueError("the checkpoint was written with" + (" " if state.get("indicator_streams") else "out ")
                             + "two-split estimation (constraint_indicator_fraction) and this run is "
                             + ("not" if state.get("indicator_streams") else "") + ": resume with the same setting")
        proxy = self.proxy_statistic
        if state.get("proxy_statistic", proxy) != proxy:  # checkpoints before the key: not checked
            raise ValueError(f"the checkpoint's estimates {'are' if state['proxy_statistic'] else 'are not'} a proxy "
                             "statistic's (constraint_proxy_indicator) and this run's "
                             f"{'are' if proxy else 'are not'}: resume with the same setting")
        if self.constraints:
            self.estimator.load_state_dict(state["estimator"])
        for stream, s in zip(self.streams, state["streams"]):
            if stream is not None:
                stream.load_state_dict(s)
        for stream, s in zip(self.estimate_rows.streams if self.separate_estimate else [],
                             state.get("indicator_streams") or []):
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
        for stream in [*self.streams, *(self.estimate_rows.streams if self.separate_estimate else [])]:
            if stream is not None:
                stream.reseed(int(seed))


__all__ = ["ConstraintDraw", "ConstraintEngine", "EngineSettings", "Placement", "RowPart", "StepConfig"]
