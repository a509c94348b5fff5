"""Margins and estimate sources: the variants of Algorithm 1's line 9 indicator, as strategy objects.

Algorithm 1 (section 4 of the paper) weighs each sampled constraint by the penalty's derivative at its
MSVR estimate u_k, whose indicator is ``1[u_k > tol_k]``, and u_k follows the same batches B_k^t as the
constraint's gradient. Two families of deviations change that line, each one variant behind one
dispatch point (PEFT's ``LoraVariant`` style), so that the engine calls a variant and never asks which
flag was set:

* **margins** (:class:`Margin`): the indicator acts on ``u_k + margin_k > tol_k``, training each
  constraint ``margin_k`` below its tolerance. :class:`FixedMargin` (a number), :class:`CalibratedMargin`
  (the one-sided CLT width ``z_c s_k / sqrt(n_k)``), :class:`CertificateMargin` (the empirical-Bernstein
  width the certificate's bound will need). :func:`margin_rules` decides, once per run, each
  constraint's rule from its own ``Constraint.margin`` and the run's flags (:func:`run_margin`).
* **estimate sources** (:class:`EstimateSource`): which rows drive u_k (and so the indicator) and
  which drive the gradient. :class:`OneSplit` is the paper's line 6 (the same B_k^t for both);
  :class:`TwoSplit` estimates on a held-apart indicator part of each constraint's rows, optionally
  tracking the certificate's statistic there (a proxy constraint). :func:`estimate_source` builds it
  from the run's flags.

Both are deviations from Algorithm 1 (off by default): its convergence analysis covers neither.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import numpy as np
import torch

from ..statistics import group_difference_share, z_value

if TYPE_CHECKING:  # pragma: no cover
    from ..constraint import Constraint

logger = logging.getLogger(__name__)


def _describe(obj: Any) -> str:
    """``name(field=value, ...)``: how reports and logs name a strategy and its parameters."""
    params = ", ".join(f"{f.name}={getattr(obj, f.name)!r}" for f in dataclasses.fields(obj))
    return f"{obj.name}({params})" if params else obj.name


# ---------------------------------------------------------------------------------------------- margins
@dataclass(frozen=True)
class SpreadAt:
    """The running row spread of some constraints as a margin reads it (one row per constraint; the two
    columns are the two groups of a ``group_key`` constraint, the second empty otherwise).

    Attributes:
        var: running per-row variance s^2 per group.
        rows: running rows per batch per group (0: the group has no rows).
        share: each group's running share of the batch rows.
        data_rows: n_k, the independent rows of D_k (``Constraint.independent_rows`` or ``len(dataset)``).
        certify_rows: rows of the certification split (0: none).
        certify_range: width of ``certify.value_range`` (0: none).
    """

    var: torch.Tensor
    rows: torch.Tensor
    share: torch.Tensor
    data_rows: torch.Tensor
    certify_rows: torch.Tensor
    certify_range: torch.Tensor


class Margin(ABC):
    """How far below its tolerance a constraint is trained: line 9's indicator acts on ``u_k + margin_k > tol_k``.

    A rule has one number per constraint, its :meth:`coefficient` (packed with the other constraints' into one
    vector when the run starts), and one vectorised :meth:`margins` that turns coefficients and the running
    spread into margins, for every constraint that follows a rule of its class at once.
    """

    name: ClassVar[str]
    requirement: ClassVar[str]  # what the parameter must be, for error messages
    skip_reason: ClassVar[str] = ""  # why a run's rule may size no margin for some constraints (its warning)

    def describe(self) -> str:
        return _describe(self)

    def flag_value(self) -> Optional[float]:
        """The value of the run flag that spells this rule (:data:`MARGIN_FLAGS`), as reports record it; ``None``
        for a rule no flag spells (a user's own subclass need not define it)."""
        return None

    @abstractmethod
    def coefficient(self, constraint: "Constraint") -> float:
        """This rule's number for ``constraint`` (0: no margin)."""

    @classmethod
    @abstractmethod
    def margins(cls, coefficient: torch.Tensor, at: SpreadAt) -> torch.Tensor:
        """The margin of each constraint that follows a rule of this class, from its coefficient and spread."""

    def unusable_for(self, constraint: "Constraint") -> Optional[str]:
        """Why this rule cannot size ``constraint``'s margin (``None``: it can)."""
        return None

    def _checked(self, value: Any, field: str, ok: Any) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if isinstance(value, bool) or not ok(number):
            raise ValueError(f"{field} must be {self.requirement}, got {value!r}")
        return number


@dataclass(frozen=True)
class FixedMargin(Margin):
    """An explicit margin >= 0 (``constraint_margin``, or a plain number as ``Constraint.margin``): the hinge
    acts once the estimate exceeds ``tol_k - value`` (on the inner value of a compositional constraint)."""

    value: float
    name: ClassVar[str] = "fixed"
    requirement: ClassVar[str] = "a finite number >= 0"

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", self._checked(self.value, "margin", lambda v: math.isfinite(v) and v >= 0))

    def flag_value(self) -> float:
        return self.value

    def coefficient(self, constraint: "Constraint") -> float:
        return self.value

    @classmethod
    def margins(cls, coefficient: torch.Tensor, at: SpreadAt) -> torch.Tensor:
        return coefficient


@dataclass(frozen=True)
class CalibratedMargin(Margin):
    """A calibrated constraint (``constraint_confidence``): the margin ``z_c * s_k / sqrt(n_k)``, so that the
    constraint also holds on unseen data of the same population with about this one-sided confidence (the CLT
    bound of :mod:`hf_constrained.statistics`); for a group difference ``z_c * sqrt(s_0^2/n_0 + s_1^2/n_1)``
    with n_g = n_k times group g's running share of the batch rows. Row-wise constraints only."""

    confidence: float
    name: ClassVar[str] = "calibrated"
    requirement: ClassVar[str] = "in [0.5, 1)"
    skip_reason: ClassVar[str] = "Declare them with row_fn (per-row values)"

    def __post_init__(self) -> None:
        object.__setattr__(self, "confidence", self._checked(self.confidence, "confidence", lambda v: 0.5 <= v < 1))

    def flag_value(self) -> float:
        return self.confidence

    def coefficient(self, constraint: "Constraint") -> float:
        return z_value(self.confidence)

    @classmethod
    def margins(cls, coefficient: torch.Tensor, at: SpreadAt) -> torch.Tensor:
        n_data = (at.data_rows.unsqueeze(1) * at.share).clamp(min=1.0)
        se = torch.where(at.rows > 0, at.var / n_data, torch.zeros_like(at.var)).sum(dim=1).sqrt()
        return coefficient * se

    def unusable_for(self, constraint: "Constraint") -> Optional[str]:
        if not constraint.rowwise:
            return ("confidence needs per-row values (declare it with row_fn), or give an explicit margin "
                    "(FixedMargin)")
        return None


@dataclass(frozen=True)
class CertificateMargin(Margin):
    """A margin sized to the certificate (``constraint_certificate_delta``): for a constraint certifying its own
    per-row values (``certify`` with a dataset and a value_range, no statistic), the width the certificate's bound
    will need at its n and delta, by the empirical-Bernstein rule (Maurer & Pontil 2009):
    ``sqrt(2 s_k^2 log(2/delta) / n) + 7 R log(2/delta) / (3 (n - 1))`` with R the range's width and
    n = |certify.dataset|; a difference of two group means takes each group's width at ``delta/2``
    (``delta/4`` with ``outer``) over its share of the rows, as the certificate does."""

    delta: float
    name: ClassVar[str] = "certificate"
    requirement: ClassVar[str] = "in (0, 1)"
    skip_reason: ClassVar[str] = ("They do not certify their own per-row values (no certify.dataset or "
                                  "certify.value_range, or a certify.statistic)")

    def __post_init__(self) -> None:
        object.__setattr__(self, "delta", self._checked(self.delta, "certificate_delta", lambda v: 0 < v < 1))

    def flag_value(self) -> float:
        return self.delta

    def coefficient(self, constraint: "Constraint") -> float:
        """``log(2 / delta')``, delta' the constraint's share of delta (the union bound of a group difference)."""
        share = group_difference_share(grouped=constraint.group_key is not None, absolute=constraint.outer is not None)
        return math.log(2.0 / (self.delta * share))

    @classmethod
    def margins(cls, coefficient: torch.Tensor, at: SpreadAt) -> torch.Tensor:
        log_term, width = coefficient.unsqueeze(1), at.certify_range.unsqueeze(1)
        n = (at.certify_rows.unsqueeze(1) * at.share).clamp(min=2.0)
        eb = (2.0 * at.var * log_term / n).sqrt() + 7.0 * width * log_term / (3.0 * (n - 1.0))
        eb = torch.where((at.share > 0) & (log_term > 0), eb, torch.zeros_like(eb))
        return eb.sum(dim=1)

    def unusable_for(self, constraint: "Constraint") -> Optional[str]:
        if (not constraint.certifiable or constraint.certify.statistic is not None
                or constraint.certify.value_range is None):
            return ("a margin sized to the certificate needs a constraint that certifies its own per-row values "
                    "(certify=Certification(dataset=..., value_range=...), no statistic)")
        return None


MARGIN_FLAGS: dict[str, type[Margin]] = {"constraint_margin": FixedMargin, "constraint_confidence": CalibratedMargin,
                                         "constraint_certificate_delta": CertificateMargin}
"""The run's margin flags of :class:`~hf_constrained.ConstrainedTrainingArguments` and the rule each one means."""


def margin_flag(rule: Optional[Margin]) -> Optional[str]:
    """The run flag of :data:`MARGIN_FLAGS` that spells ``rule``'s class (``None``: no rule, or no flag spells it)."""
    return next((flag for flag, cls in MARGIN_FLAGS.items() if type(rule) is cls), None)


def margin_settings(rule: Optional[Margin]) -> dict[str, Optional[float]]:
    """The run's margin flags as ``rule`` sets them: the flag that spells it (:func:`margin_flag`) with the rule's
    :meth:`~Margin.flag_value`, every other flag ``None`` (all ``None``: no rule, or one no flag spells)."""
    flags: dict[str, Optional[float]] = dict.fromkeys(MARGIN_FLAGS)
    flag = margin_flag(rule)
    if flag is not None:
        flags[flag] = rule.flag_value()
    return flags


def as_margin(value: Any) -> Optional[Margin]:
    """``Constraint.margin`` as a rule: a :class:`Margin` as it is, a plain number as a :class:`FixedMargin`."""
    if value is None or isinstance(value, Margin):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise TypeError(f"margin must be a number or a Margin (FixedMargin, CalibratedMargin, CertificateMargin), "
                        f"got {type(value).__name__} {value!r}")
    return FixedMargin(float(value))


def run_margin(margin: Optional[float] = None, confidence: Optional[float] = None,
               certificate_delta: Optional[float] = None) -> Optional[Margin]:
    """The run's margin rule from its flags (``constraint_margin``, ``constraint_confidence``,
    ``constraint_certificate_delta``): the one place the flags are read. At most one may be given."""
    given = {flag: value for flag, value in zip(MARGIN_FLAGS, (margin, confidence, certificate_delta))
             if value is not None}
    if len(given) > 1:
        raise ValueError(f"give at most one of {', '.join(MARGIN_FLAGS)} (one margin rule per run; "
                         "Constraint.margin sets a constraint's own), got "
                         + " and ".join(f"{flag}={value!r}" for flag, value in given.items()))
    if not given:
        return None
    ((flag, value),) = given.items()
    rule = MARGIN_FLAGS[flag]
    try:
        return rule(value)
    except ValueError:
        raise ValueError(f"{flag} must be {rule.requirement}, got {value!r}") from None


def margin_rules(constraints: Sequence["Constraint"], run: Optional[Margin]) -> list[Optional[Margin]]:
    """Each constraint's margin rule: its own ``Constraint.margin`` when set (an error naming the constraint
    when that rule cannot apply to it), else the run's rule where it applies (a warning lists the constraints
    it cannot size: no margin for them), else none. The one dispatch point of margins."""
    rules: list[Optional[Margin]] = []
    skipped: list[str] = []
    for c in constraints:
        own = c.margin
        if own is not None:
            reason = own.unusable_for(c)
            if reason is not None:
                raise ValueError(f"constraint {c.name!r}: Constraint.margin={own.describe()}: {reason}")
            rules.append(own)
        elif run is not None and run.unusable_for(c) is None:
            rules.append(run)
        else:
            rules.append(None)
            if run is not None:
                skipped.append(c.name)
    if skipped:
        flag = margin_flag(run) or "the run's margin rule"
        logger.warning("%s (%s) sizes no margin for %d constraint(s): %s. %s; or give them Constraint(margin=...).",
                       flag, run.describe(), len(skipped), skipped[:10], run.skip_reason)
    return rules


# ---------------------------------------------------------------------------------------------- estimate sources
class EstimateSource(ABC):
    """Which rows drive the estimate u_k (so line 9's indicator) and which drive the gradient."""

    name: ClassVar[str]

    def describe(self) -> str:
        return _describe(self)

    @abstractmethod
    def views(self, constraints: Sequence["Constraint"], seed: int
              ) -> tuple[list["Constraint"], Optional[list["Constraint"]]]:
        """(the constraints over the gradient's rows, the constraints over the estimate's rows; ``None`` when the
        gradient's batches drive the estimate too)."""

    def estimate_batch_size(self, batch_size: int) -> Optional[int]:
        """Rows per process of the estimate's own batches (``None``: it follows the gradient's)."""
        return None

    def estimated(self, constraints: Sequence["Constraint"], estimate_views: Optional[Sequence["Constraint"]]
                  ) -> list["Constraint"]:
        """What each estimate u_k tracks (its tolerance and ``outer``): the constraints themselves."""
        return list(constraints)

    @property
    def batch_setting(self) -> str:
        """The flag that sizes the batches the estimate follows (named by the noise warning)."""
        return "constraint_batch_size"

    def settings(self, batch_size: int) -> dict[str, Any]:
        """The run flags this source stands for, resolved (``constraint_indicator_batch_size`` is |B_k| when unset)."""
        return {"constraint_indicator_fraction": None, "constraint_indicator_batch_size": None,
                "constraint_proxy_indicator": False}


@dataclass(frozen=True)
class OneSplit(EstimateSource):
    """The paper's Algorithm 1, line 6: u_k follows h_k on the same batch B_k^t as the gradient."""

    name: ClassVar[str] = "one_split"

    def views(self, constraints: Sequence["Constraint"], seed: int
              ) -> tuple[list["Constraint"], Optional[list["Constraint"]]]:
        return list(constraints), None


@dataclass(frozen=True)
class TwoSplit(EstimateSource):
    """Two-split estimation (a deviation from Algorithm 1): each constraint's rows are split once, by a seeded
    permutation, into an indicator part (``fraction`` of them) and a gradient part. u_k follows batches of the
    indicator part, evaluated without grad (``indicator_batch_size`` rows per process, default |B_k|); the
    gradient follows batches of the gradient part. No indicator row reaches a gradient, so u_k estimates the
    constraint on rows the model is not fitted to (Cotter et al., ICML 2019). With ``proxy_statistic`` the
    estimate of a constraint that declares ``certify.statistic`` tracks that statistic on the indicator rows,
    against its tolerance, while the gradient follows the surrogate (a proxy constraint in Cooper's sense)."""

    fraction: float
    indicator_batch_size: Optional[int] = None
    proxy_statistic: bool = False
    name: ClassVar[str] = "two_split"

    def __post_init__(self) -> None:
        check_indicator_fraction(self.fraction)
        if self.indicator_batch_size is not None and (isinstance(self.indicator_batch_size, bool)
                                                      or int(self.indicator_batch_size) != self.indicator_batch_size
                                                      or self.indicator_batch_size < 1):
            raise ValueError(f"constraint_indicator_batch_size must be >= 1, got {self.indicator_batch_size!r}")

    def views(self, constraints: Sequence["Constraint"], seed: int
              ) -> tuple[list["Constraint"], Optional[list["Constraint"]]]:
        return split_for_indicator(constraints, self.fraction, seed, proxy=self.proxy_statistic)

    def estimate_batch_size(self, batch_size: int) -> Optional[int]:
        return self.indicator_batch_size or batch_size

    def estimated(self, constraints: Sequence["Constraint"], estimate_views: Optional[Sequence["Constraint"]]
                  ) -> list["Constraint"]:
        """With ``proxy_statistic`` the indicator views (a certification statistic's row_fn and tolerance)."""
        return list(estimate_views) if self.proxy_statistic and estimate_views is not None else list(constraints)

    @property
    def batch_setting(self) -> str:
        return "constraint_indicator_batch_size"

    def settings(self, batch_size: int) -> dict[str, Any]:
        return {"constraint_indicator_fraction": self.fraction,
                "constraint_indicator_batch_size": self.estimate_batch_size(batch_size),
                "constraint_proxy_indicator": self.proxy_statistic}


def check_indicator_fraction(fraction: Any) -> float:
    """``constraint_indicator_fraction`` as a number in (0, 1), the share of each constraint's rows that drives the
    estimate under two-split estimation; else a ``ValueError`` naming the flag. The one check of the flag (the
    arguments' ``__post_init__``, :class:`TwoSplit` and :func:`split_for_indicator` call it)."""
    try:
        number = float(fraction)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(fraction, bool) or not 0.0 < number < 1.0:
        raise ValueError(f"constraint_indicator_fraction must be in (0, 1), got {fraction}")
    return number


def estimate_source(indicator_fraction: Optional[float] = None, indicator_batch_size: Optional[int] = None,
                    proxy_indicator: bool = False) -> EstimateSource:
    """The run's estimate source from its flags (``constraint_indicator_fraction``,
    ``constraint_indicator_batch_size``, ``constraint_proxy_indicator``): the one place they are read."""
    if not indicator_fraction:
        if proxy_indicator:
            raise ValueError("constraint_proxy_indicator needs two-split estimation (constraint_indicator_fraction)")
        if indicator_batch_size is not None:
            raise ValueError("constraint_indicator_batch_size sizes the indicator part's batches of two-split "
                             "estimation: give constraint_indicator_fraction too")
        return OneSplit()
    return TwoSplit(float(indicator_fraction), indicator_batch_size, bool(proxy_indicator))


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
    check_indicator_fraction(fraction)
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
                        independent_rows=None, margin=None)
            stat = None if c.certify is None else c.certify.statistic
            if proxy and views is ind_views and stat is not None:
                if c.outer is not None:
                    raise ValueError(f"constraint {c.name!r}: a proxy indicator needs a constraint without outer (its "
                                     "gradient weight is the indicator of the statistic alone)")
                view.update(fn=None, row_fn=stat.row_fn, row_transform=None, group_key=None, exact_fn=None,
                            tolerance=float(stat.tolerance), certify=None)
            views.append(dataclasses.replace(c, **view))
    return grad_views, ind_views


__all__ = ["CalibratedMargin", "CertificateMargin", "EstimateSource", "FixedMargin", "MARGIN_FLAGS", "Margin",
           "OneSplit", "SpreadAt", "TwoSplit", "as_margin", "check_indicator_fraction", "estimate_source",
           "margin_flag", "margin_rules", "margin_settings", "run_margin", "split_for_indicator"]
