"""Margins: how far below its tolerance a constraint is trained (``Constraint.margin``, the run's margin flags).

Algorithm 1 (section 4 of the paper) weighs each sampled constraint by the penalty's derivative at its MSVR
estimate u_k, whose indicator is ``1[u_k > tol_k]``. A margin moves that indicator to ``u_k + margin_k >
tol_k``, training each constraint ``margin_k`` below its tolerance (a deviation from Algorithm 1, off by
default: its convergence analysis does not cover it). The rules a user declares live here, below both the
problem's declaration (:mod:`hf_constrained.constraint`) and the method (:mod:`hf_constrained.method`):
:class:`FixedMargin` (a number), :class:`CalibratedMargin` (the one-sided CLT width ``z_c s_k / sqrt(n_k)``),
:class:`CertificateMargin` (the empirical-Bernstein width the certificate's bound will need). The method
decides each constraint's rule once per run (:func:`hf_constrained.method.strategies.margin_rules`) and keeps
the running spread they read (:mod:`hf_constrained.method.margins`).
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Protocol

import torch

from .statistics import group_difference_share, z_value


class MarginTarget(Protocol):
    """What a margin rule reads of a constraint (:class:`~hf_constrained.Constraint` has it all)."""

    group_key: Optional[str]
    outer: Any
    certify: Any  # its Certification, or None

    @property
    def rowwise(self) -> bool: ...

    @property
    def certifiable(self) -> bool: ...


def describe(obj: Any) -> str:
    """``name(field=value, ...)``: how reports and logs name a strategy and its parameters."""
    params = ", ".join(f"{f.name}={getattr(obj, f.name)!r}" for f in dataclasses.fields(obj))
    return f"{obj.name}({params})" if params else obj.name


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
        return describe(self)

    def flag_value(self) -> Optional[float]:
        """The value of the run flag that spells this rule (:data:`MARGIN_FLAGS`), as reports record it; ``None``
        for a rule no flag spells (a user's own subclass need not define it)."""
        return None

    @abstractmethod
    def coefficient(self, constraint: MarginTarget) -> float:
        """This rule's number for ``constraint`` (0: no margin)."""

    @classmethod
    @abstractmethod
    def margins(cls, coefficient: torch.Tensor, at: SpreadAt) -> torch.Tensor:
        """The margin of each constraint that follows a rule of this class, from its coefficient and spread."""

    def unusable_for(self, constraint: MarginTarget) -> Optional[str]:
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

    def coefficient(self, constraint: MarginTarget) -> float:
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

    def coefficient(self, constraint: MarginTarget) -> float:
        return z_value(self.confidence)

    @classmethod
    def margins(cls, coefficient: torch.Tensor, at: SpreadAt) -> torch.Tensor:
        n_data = (at.data_rows.unsqueeze(1) * at.share).clamp(min=1.0)
        se = torch.where(at.rows > 0, at.var / n_data, torch.zeros_like(at.var)).sum(dim=1).sqrt()
        return coefficient * se

    def unusable_for(self, constraint: MarginTarget) -> Optional[str]:
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

    def coefficient(self, constraint: MarginTarget) -> float:
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

    def unusable_for(self, constraint: MarginTarget) -> Optional[str]:
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


__all__ = ["MARGIN_FLAGS", "CalibratedMargin", "CertificateMargin", "FixedMargin", "Margin", "MarginTarget", "SpreadAt",
           "as_margin", "describe", "margin_flag", "margin_settings", "run_margin"]
