"""Certification: which candidate models satisfy every constraint, with a finite-sample guarantee.

Learn-Then-Test (Angelopoulos, Bates, Candes, Jordan & Lei 2021) read for trained weights:
each candidate ``j`` (a checkpoint, a beta, the final model) is a null hypothesis
``H_j: some constraint k has population value h_jk > tolerance_k``. From the per-row values of
each constraint's certification statistic on a split that nothing else touched (no gradient,
no look-ahead, no checkpoint selection, no default), :mod:`~hf_constrained.safety.bounds`
gives an upper confidence bound ``U_jk``; ``H_j`` is rejected, i.e. candidate ``j`` is
*certified*, when ``U_jk <= tolerance_k`` for every ``k``.

- **Several constraints at once (intersection-union).** ``H_j`` is a union of the
  per-constraint nulls, so each bound is taken at the candidate's full level: no correction
  across constraints (MAPIE's multi-risk LTT takes the largest p-value likewise).
- **Several candidates (family-wise).** ``procedure="fixed_sequence"`` tests the candidates in
  the order given, which must be fixed before the certification data is read (training order,
  or a ranking made on other data), each at level ``delta``, and stops at the first one not
  certified; ``procedure="bonferroni"`` tests each at ``delta / J``. Either way, with
  probability at least ``1 - delta`` over the certification sample, every certified candidate
  satisfies every constraint on the population the split was drawn from.

:func:`certify` works from per-row values alone, so the statistics can be checked without
training; the trainer (``finish_run``) calls the same function. Plain numpy/scipy: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

from .bounds import bound_is_asymptotic, check_bound, check_delta, difference_upper_bound, upper_bound

PROCEDURES = ("fixed_sequence", "bonferroni")
DEFAULT_DELTA = 0.05
DEFAULT_BOUND = "betting"


@dataclass(frozen=True)
class GroupRows:
    """Per-row values of a constraint that is a difference of two group means (``groups`` 0/1
    per row: ``mean over group 0 - mean over group 1``, or its absolute value with ``absolute``)."""

    values: np.ndarray
    groups: np.ndarray
    absolute: bool = False


RowValues = Union[Sequence[float], np.ndarray, GroupRows]
"""A constraint's per-row values on the certification split: a 1-D array (its mean is the
value) or :class:`GroupRows`."""


def _rows(value: RowValues) -> tuple[np.ndarray, Optional[GroupRows]]:
    if isinstance(value, GroupRows):
        return np.asarray(value.values, dtype=np.float64).reshape(-1), value
    return np.asarray(value, dtype=np.float64).reshape(-1), None


def point_value(value: RowValues) -> float:
    """The sample value of a constraint's certification statistic: the mean of the rows, or
    the group-0 minus group-1 mean (its absolute value for ``absolute`` groups)."""
    v, grouped = _rows(value)
    if grouped is None:
        return float(v.mean()) if v.size else math.nan
    g = np.asarray(grouped.groups).reshape(-1)
    if not (np.any(g == 0) and np.any(g == 1)):
        return math.nan
    d = float(v[g == 0].mean() - v[g == 1].mean())
    return abs(d) if grouped.absolute else d


def statistic_upper_bound(value: RowValues, value_range: tuple[float, float], delta: float,
                          bound: str = DEFAULT_BOUND, *, name: str = "constraint") -> float:
    """Upper confidence bound at ``1 - delta`` of one constraint's certification statistic."""
    v, grouped = _rows(value)
    what = f"constraint {name!r}"
    if grouped is None:
        return upper_bound(v, value_range, delta, bound, what=what)
    return difference_upper_bound(v, grouped.groups, value_range, delta, bound, absolute=grouped.absolute, what=what)


@dataclass
class Certificate:
    """The outcome of :func:`certify`.

    Attributes:
        certified: indices (into the candidates, in testing order) of the certified candidates.
        upper_bounds: one mapping (constraint name -> upper bound) per TESTED candidate, in
            testing order (fixed-sequence testing stops at the first candidate not certified).
        values: the sample values (means, or group differences) beside them.
        tolerance, value_range, bound: per constraint, as given.
        num_rows: per constraint, the certification rows behind each bound.
        delta, procedure: the family-wise error level and how candidates were tested.
        num_candidates: how many candidates were in the family (all count, tested or not).
        level: the level each candidate was tested at (``delta``, or ``delta / J`` for Bonferroni).
    """

    certified: list[int]
    upper_bounds: list[dict[str, float]]
    values: list[dict[str, float]]
    tolerance: dict[str, float]
    value_range: dict[str, tuple[float, float]]
    bound: dict[str, str]
    num_rows: dict[str, int]
    delta: float
    procedure: str
    num_candidates: int
    level: float
    split_fingerprints: dict[str, str] = field(default_factory=dict)

    @property
    def tested(self) -> int:
        """How many candidates were tested (the rest were never looked at)."""
        return len(self.upper_bounds)

    @property
    def asymptotic(self) -> list[str]:
        """Constraints certified with an asymptotic (CLT) bound: no finite-sample guarantee."""
        return [k for k, b in self.bound.items() if bound_is_asymptotic(b)]

    @property
    def any_certified(self) -> bool:
        return bool(self.certified)

    def is_certified(self, candidate: int) -> bool:
        return candidate in self.certified

    def failing(self, candidate: int) -> list[str]:
        """Constraints whose bound exceeds its tolerance for a tested candidate."""
        if candidate >= self.tested:
            return list(self.tolerance)
        ub = self.upper_bounds[candidate]
        return [k for k in self.tolerance if not ub[k] <= self.tolerance[k]]

    def statement(self, statistics: Optional[Mapping[str, str]] = None) -> str:
        """The guarantee in words (:func:`~hf_constrained.safety.report.guarantee_sentence`, the one
        copy), with ``statistics`` (constraint name -> what its rows measure) when known."""
        from .report import CONSTRAINT_ITSELF, guarantee_sentence

        described = {k: (statistics or {}).get(k, CONSTRAINT_ITSELF) for k in self.tolerance}
        return (f"Certified at delta = {self.delta:g}: "
                + guarantee_sentence(self.delta, described, self.bound, self.num_rows, self.num_candidates,
                                     self.procedure) + ".")

    def to_dict(self) -> dict[str, Any]:
        return {
            "certified": list(self.certified),
            "upper_bounds": [dict(u) for u in self.upper_bounds],
            "values": [dict(v) for v in self.values],
            "tolerance": dict(self.tolerance),
            "value_range": {k: [float(a), float(b)] for k, (a, b) in self.value_range.items()},
            "bound": dict(self.bound),
            "num_rows": dict(self.num_rows),
            "delta": self.delta,
            "procedure": self.procedure,
            "num_candidates": self.num_candidates,
            "level": self.level,
            "split_fingerprints": dict(self.split_fingerprints),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Certificate":
        return cls(
            certified=[int(i) for i in data["certified"]],
            upper_bounds=[{k: float(x) for k, x in u.items()} for u in data["upper_bounds"]],
            values=[{k: float(x) for k, x in v.items()} for v in data.get("values", [])],
            tolerance={k: float(x) for k, x in data["tolerance"].items()},
            value_range={k: (float(a), float(b)) for k, (a, b) in data["value_range"].items()},
            bound=dict(data["bound"]),
            num_rows={k: int(x) for k, x in data["num_rows"].items()},
            delta=float(data["delta"]),
            procedure=str(data["procedure"]),
            num_candidates=int(data["num_candidates"]),
            level=float(data["level"]),
            split_fingerprints=dict(data.get("split_fingerprints") or {}),
        )

    def recomputed_certified(self) -> list[int]:
        """The certified set implied by the stored bounds, tolerances and procedure (what a
        checker compares with :attr:`certified`)."""
        out = []
        for j, ub in enumerate(self.upper_bounds):
            if all(ub[k] <= self.tolerance[k] for k in self.tolerance):
                out.append(j)
            elif self.procedure == "fixed_sequence":
                break
        return out


def _per_constraint(option: Union[Any, Mapping[str, Any]], names: Sequence[str], what: str) -> dict[str, Any]:
    if isinstance(option, Mapping):
        missing = [n for n in names if n not in option]
        if missing:
            raise ValueError(f"{what} has no entry for constraint(s) {missing}")
        return {n: option[n] for n in names}
    return {n: option for n in names}


def certify(candidates: Sequence[Mapping[str, RowValues]], tolerance: Mapping[str, float],
            value_range: Union[tuple[float, float], Mapping[str, tuple[float, float]]],
            delta: float = DEFAULT_DELTA, *, bound: Union[str, Mapping[str, str]] = DEFAULT_BOUND,
            procedure: str = "fixed_sequence",
            split_fingerprints: Optional[Mapping[str, str]] = None) -> Certificate:
    """Certify candidates from per-row values on a certification split.

    Args:
        candidates: in testing order (fixed before the certification data was read), one
            mapping per candidate: constraint name -> its per-row values on the certification
            split (a 1-D array whose mean is the constraint's value, or :class:`GroupRows`).
            The requirement is ``value <= tolerance[name]`` on the population.
        tolerance: constraint name -> tolerance.
        value_range: (low, high) that every per-row value lies in, for all constraints or per
            name; a value outside it is an error naming the constraint (never clipped).
        delta: the family-wise error level: with probability >= 1 - delta every certified
            candidate satisfies every constraint.
        bound: one of :data:`~hf_constrained.safety.bounds.BOUNDS` (``"betting"`` by default;
            ``"clopper_pearson"`` for 0/1 rates; ``"clt"`` is asymptotic), or one per name.
        procedure: ``"fixed_sequence"`` (each candidate at ``delta``, stopping at the first
            not certified) or ``"bonferroni"`` (each at ``delta / len(candidates)``).
        split_fingerprints: recorded in the certificate (constraint name -> fingerprint of its
            certification rows).

    Returns:
        a :class:`Certificate` (``certified``: the certified candidate indices;
        ``upper_bounds``: one mapping per tested candidate).
    """
    delta = check_delta(delta)
    if procedure not in PROCEDURES:
        raise ValueError(f"procedure must be one of {', '.join(PROCEDURES)}, got {procedure!r}")
    if not candidates:
        raise ValueError("certify needs at least one candidate")
    names = list(tolerance)
    if not names:
        raise ValueError("certify needs at least one constraint (tolerance is empty)")
    for j, cand in enumerate(candidates):
        missing = [n for n in names if n not in cand]
        extra = [n for n in cand if n not in tolerance]
        if missing or extra:
            raise ValueError(f"candidate {j}: per-row values are needed for exactly the constraints {names}; "
                             f"missing {missing}, unknown {extra}")
    ranges = {n: (float(r[0]), float(r[1])) for n, r in _per_constraint(value_range, names, "value_range").items()}
    bounds = {n: check_bound(b) for n, b in _per_constraint(bound, names, "bound").items()}
    tol = {n: float(tolerance[n]) for n in names}
    level = delta if procedure == "fixed_sequence" else delta / len(candidates)
    certified: list[int] = []
    upper_bounds: list[dict[str, float]] = []
    values: list[dict[str, float]] = []
    num_rows: dict[str, int] = {}
    for j, cand in enumerate(candidates):
        ub = {n: statistic_upper_bound(cand[n], ranges[n], level, bounds[n], name=n) for n in names}
        upper_bounds.append(ub)
        values.append({n: point_value(cand[n]) for n in names})
        for n in names:
            num_rows.setdefault(n, int(_rows(cand[n])[0].size))
        if all(ub[n] <= tol[n] for n in names):
            certified.append(j)
        elif procedure == "fixed_sequence":
            break  # the candidates after the first failure are never tested
    return Certificate(certified=certified, upper_bounds=upper_bounds, values=values, tolerance=tol,
                       value_range=ranges, bound=bounds, num_rows=num_rows, delta=delta, procedure=procedure,
                       num_candidates=len(candidates), level=level,
                       split_fingerprints=dict(split_fingerprints or {}))


def best_certified(certificate: Certificate, objective: Sequence[Optional[float]],
                   greater_is_better: bool = False) -> Optional[int]:
    """The certified candidate with the best objective (``objective[j]`` per candidate, measured
    on data other than the certification split); ``None`` when none is certified. Ties go to
    the earlier candidate."""
    best: Optional[int] = None
    for j in certificate.certified:
        value = objective[j] if j < len(objective) else None
        if value is None or not math.isfinite(value):
            continue
        if best is None or (value > objective[best] if greater_is_better else value < objective[best]):
            best = j
    if best is None and certificate.certified:
        best = certificate.certified[0]
    return best


__all__ = [
    "DEFAULT_BOUND",
    "DEFAULT_DELTA",
    "PROCEDURES",
    "Certificate",
    "GroupRows",
    "RowValues",
    "best_certified",
    "certify",
    "point_value",
    "statistic_upper_bound",
]
