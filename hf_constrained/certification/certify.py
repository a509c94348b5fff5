"""Certification: which candidate models satisfy every constraint, with a finite-sample guarantee.

Learn-Then-Test (Angelopoulos, Bates, Candes, Jordan & Lei 2021) read for trained weights:
each candidate ``j`` (a checkpoint, a beta, the final model) is a null hypothesis
``H_j: some constraint k has population value h_jk > tolerance_k``. From the per-row values of
each constraint's certification statistic on a split that nothing else touched (no gradient,
no look-ahead, no checkpoint selection, no default), :mod:`~hf_constrained.certification.bounds`
gives an upper confidence bound ``U_jk``; ``H_j`` is rejected, i.e. candidate ``j`` is
*certified*, when ``U_jk <= tolerance_k`` for every ``k``.

- **Several constraints at once (intersection-union).** ``H_j`` is a union of the
  per-constraint nulls, so each bound is taken at the candidate's full level: no correction
  across constraints (MAPIE's multi-risk LTT takes the largest p-value likewise).
- **Several looks at one split (a ledger).** With a
  :class:`~hf_constrained.certification.ledger.CertificationLedger`, each call is one look at each
  certification split it reads (known by its fingerprint), and each constraint is tested at
  the ``delta_j`` its split's spending schedule gives that look (``delta * 0.9 * 0.1^(j-1)`` by default;
  a schedule may refuse a look instead): summed over every look ever taken at a split, the
  error stays at most ``delta``. The certificate records each constraint's look and the delta
  it spent. Without a ledger the call is taken to be the split's only look. Only the same
  certificate again (the same candidates, values, tolerances and split) is the same look: two
  different models whose per-row values happen to coincide (a 0/1 rate with nothing forgotten
  often does) make two claims, so each candidate is known by its identity too
  (``candidate_ids``: the trainer passes its weights' fingerprint).
- **Row order.** An order-dependent bound (``"betting"``) reads the rows in a random order
  drawn from a seed that is independent of the data (``row_order_seed``, recorded).
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

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

from .bounds import (
    DEFAULT_BOUND,
    ORDER_DEPENDENT_BOUNDS,
    bound_is_asymptotic,
    check_bound,
    check_delta,
    difference_upper_bound,
    new_order_seed,
    smallest_certifiable,
    unit_values,
    upper_bound,
)
from .ledger import CertificationLedger, GeometricSpending, Spending, look_key

logger = logging.getLogger(__name__)

PROCEDURES = ("fixed_sequence", "bonferroni")
DEFAULT_DELTA = 0.05
CONSTRAINT_ITSELF = "the constraint's own value (mean of its per-row values)"
"""What a certificate measures when its constraint declares no other statistic."""


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
                          bound: str = DEFAULT_BOUND, *, name: str = "constraint",
                          order_seed: Optional[int] = None) -> float:
    """Upper confidence bound at ``1 - delta`` of one constraint's certification statistic
    (``order_seed``: the random row order of an order-dependent bound, see
    :func:`~hf_constrained.certification.bounds.upper_bound`)."""
    v, grouped = _rows(value)
    what = f"constraint {name!r}"
    if grouped is None:
        return upper_bound(v, value_range, delta, bound, what=what, order_seed=order_seed)
    return difference_upper_bound(v, grouped.groups, value_range, delta, bound, absolute=grouped.absolute, what=what,
                                  order_seed=order_seed)


def guarantee_sentence(delta: float, statistics: Mapping[str, str], bounds: Mapping[str, str],
                       num_rows: Mapping[str, int], num_candidates: int, procedure: str) -> str:
    """The certificate's guarantee in words, the one copy (reports, cards and
    :meth:`Certificate.statement` use it): the statistic (per
    constraint), the bound, delta, n and the population."""
    n = len(statistics)
    descriptions = sorted(set(statistics.values()))
    what = descriptions[0] if len(descriptions) == 1 else "its certified statistic (see the table)"
    subject = (f"for each of the {n} constraints, {what}" if n > 1
               else f"for constraint {next(iter(statistics))}, {what}")
    kinds = sorted(set(bounds.values()))
    asymptotic = " (asymptotic: no finite-sample guarantee)" if "clt" in kinds else ""
    rows = sorted(int(r) for r in num_rows.values())
    size = (f"n = {rows[0]}" if rows[0] == rows[-1] else f"n = {rows[0]}-{rows[-1]}") + " rows per constraint" \
        if rows else "n unknown"
    return (f"with probability at least {1 - delta:g} over the certification rows, {subject} is at most its "
            f"tolerance on the population its own certification rows were drawn from ({'/'.join(kinds)} upper "
            f"bounds{asymptotic}, {size}, {num_candidates} candidate(s) by {procedure.replace('_', '-')} testing)")


def certified_candidates(certificate: Mapping[str, Any]) -> list[int]:
    """The certified candidates that a certificate's stored bounds, tolerances and procedure imply
    (recomputed, never read from its stored list: see
    :meth:`Certificate.recomputed_certified`)."""
    tolerance = certificate.get("tolerance", {})
    out = []
    for j, bounds in enumerate(certificate.get("upper_bounds", [])):
        if all(k in bounds and bounds[k] is not None and bounds[k] <= t for k, t in tolerance.items()):
            out.append(j)
        elif certificate.get("procedure") == "fixed_sequence":
            break
    return out


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
        level: the strictest level a candidate's constraint was tested at (``levels``' smallest).
        split_fingerprints: per constraint, the fingerprint of its certification rows.
        row_order_seed: the seed of the random row order of order-dependent bounds (``None``
            when every bound is order-free).
        looks: per constraint, which look at its split this certificate was (1 = the first;
            empty without a ledger: the only look).
        delta_spent: per constraint, the share of its split's budget this look spent (``delta``
            without a ledger).
        levels: per constraint, the level each candidate was tested at (``delta_spent``, divided
            by the number of candidates for Bonferroni).
        spending: the ledger's spending schedule, in words (``None`` without a ledger).
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
    row_order_seed: Optional[int] = None
    looks: dict[str, int] = field(default_factory=dict)
    delta_spent: dict[str, float] = field(default_factory=dict)
    levels: dict[str, float] = field(default_factory=dict)
    spending: Optional[str] = None

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
        """The guarantee in words (:func:`guarantee_sentence`, the one copy), with ``statistics``
        (constraint name -> what its rows measure) when known."""
        described = {k: (statistics or {}).get(k, CONSTRAINT_ITSELF) for k in self.tolerance}
        looks = ""
        if self.looks:  # the ledger's count of certificates on each split, and the level each look was tested at
            spent = ", ".join(f"{k}: look {self.looks[k]}, delta {self.delta_spent[k]:.3g}" for k in self.looks)
            looks = f"; looks at the certification splits counted by a ledger ({self.spending}): {spent}"
        return (f"Certified at delta = {self.delta:g}: "
                + guarantee_sentence(self.delta, described, self.bound, self.num_rows, self.num_candidates,
                                     self.procedure) + looks + ".")

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
            "row_order_seed": self.row_order_seed,
            "looks": dict(self.looks),
            "delta_spent": dict(self.delta_spent),
            "levels": dict(self.levels),
            "spending": self.spending,
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
            row_order_seed=None if data.get("row_order_seed") is None else int(data["row_order_seed"]),
            looks={k: int(x) for k, x in (data.get("looks") or {}).items()},
            delta_spent={k: float(x) for k, x in (data.get("delta_spent") or {}).items()},
            levels={k: float(x) for k, x in (data.get("levels") or {}).items()},
            spending=data.get("spending"),
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
            split_fingerprints: Optional[Mapping[str, str]] = None,
            ledger: Optional[CertificationLedger] = None,
            row_order_seed: Optional[int] = None,
            candidate_ids: Optional[Sequence[Optional[str]]] = None) -> Certificate:
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
        bound: one of :data:`~hf_constrained.certification.bounds.BOUNDS` (``"hoeffding_bentkus"`` by
            default; ``"clopper_pearson"`` for 0/1 rates, ``"paired_change"`` for changes in
            {-1, 0, 1}; ``"clt"`` is asymptotic), or one per name.
        procedure: ``"fixed_sequence"`` (each candidate at ``delta``, stopping at the first
            not certified) or ``"bonferroni"`` (each at ``delta / len(candidates)``).
        split_fingerprints: recorded in the certificate (constraint name -> fingerprint of its
            certification rows); the ledger counts looks by them.
        ledger: counts this call as one look at each certification split and tests each
            constraint at the delta its split's schedule gives the look (module docstring); may
            raise :class:`~hf_constrained.certification.ledger.LookRefused`. ``None``: this is the
            splits' only look (the caller's responsibility).
        row_order_seed: the seed of the random row order of order-dependent bounds; ``None``
            draws one from the operating system (a repeated look of a ledger reuses its seed).
        candidate_ids: what each candidate is (e.g. its weights' fingerprint), part of the look's identity
            in the ledger: a candidate with another id is another claim, hence another look, even when its
            per-row values equal an earlier look's. ``None`` (or a ``None`` entry): known by its values alone.

    Returns:
        a :class:`Certificate` (``certified``: the certified candidate indices;
        ``upper_bounds``: one mapping per tested candidate).
    """
    delta = check_delta(delta)
    if procedure not in PROCEDURES:
        raise ValueError(f"procedure must be one of {', '.join(PROCEDURES)}, got {procedure!r}")
    if not candidates:
        raise ValueError("certify needs at least one candidate")
    if candidate_ids is not None and len(candidate_ids) != len(candidates):
        raise ValueError(f"{len(candidate_ids)} candidate_ids for {len(candidates)} candidates")
    claims = _Claims.checked(candidates, tolerance, value_range, bound, split_fingerprints)
    ordered = any(b in ORDER_DEPENDENT_BOUNDS for b in claims.bounds.values())
    seed = row_order_seed if row_order_seed is not None or not ordered else new_order_seed()
    spent = {n: delta for n in claims.names}
    looks: dict[str, int] = {}
    if ledger is not None:
        key = look_key([procedure, delta, len(candidates)] + claims.identity(candidates, candidate_ids))
        looks, spent, seed = _ledger_look(ledger, claims, key, delta, seed, ordered)
    levels = {n: spent[n] if procedure == "fixed_sequence" else spent[n] / len(candidates) for n in claims.names}
    certified: list[int] = []
    upper_bounds: list[dict[str, float]] = []
    values: list[dict[str, float]] = []
    num_rows: dict[str, int] = {}
    for j, cand in enumerate(candidates):
        ub = {n: statistic_upper_bound(cand[n], claims.ranges[n], levels[n], claims.bounds[n], name=n,
                                       order_seed=seed) for n in claims.names}
        upper_bounds.append(ub)
        values.append({n: point_value(cand[n]) for n in claims.names})
        for n in claims.names:
            num_rows.setdefault(n, int(_rows(cand[n])[0].size))
        if all(ub[n] <= claims.tolerance[n] for n in claims.names):
            certified.append(j)
        elif procedure == "fixed_sequence":
            break  # the candidates after the first failure are never tested
    return Certificate(certified=certified, upper_bounds=upper_bounds, values=values, tolerance=claims.tolerance,
                       value_range=claims.ranges, bound=claims.bounds, num_rows=num_rows, delta=delta,
                       procedure=procedure, num_candidates=len(candidates), level=min(levels.values()),
                       split_fingerprints=claims.fingerprints, row_order_seed=seed if ordered else None,
                       looks=looks, delta_spent=spent if ledger is not None else {}, levels=levels,
                       spending=None if ledger is None else ledger.spending.name)


@dataclass(frozen=True)
class _Claims:
    """What :func:`certify` tests, checked before any look is spent: each constraint's tolerance, value range,
    bound and certification split's fingerprint (names in the order of ``tolerance``)."""

    names: list[str]
    tolerance: dict[str, float]
    ranges: dict[str, tuple[float, float]]
    bounds: dict[str, str]
    fingerprints: dict[str, str]

    @classmethod
    def checked(cls, candidates: Sequence[Mapping[str, RowValues]], tolerance: Mapping[str, float],
                value_range: Any, bound: Any, split_fingerprints: Optional[Mapping[str, str]]) -> "_Claims":
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
        for cand in candidates:  # bad values are errors before any look is spent
            for n in names:
                _check_rows(cand[n], ranges[n], bounds[n], n)
        return cls(names, {n: float(tolerance[n]) for n in names}, ranges, bounds, dict(split_fingerprints or {}))

    def identity(self, candidates: Sequence[Mapping[str, RowValues]],
                 candidate_ids: Optional[Sequence[Optional[str]]]) -> list[Any]:
        """What makes a look the same look again: the claims, the candidates' values and, when given, their ids
        (a different model with the same values is another claim: the key differs)."""
        return ([x for n in self.names for x in (n, self.tolerance[n], self.ranges[n], self.bounds[n],
                                                 self.fingerprints.get(n))]
                + [x for cand in candidates for n in self.names for x in _identity(cand[n])]
                + ([] if candidate_ids is None or all(i is None for i in candidate_ids)
                   else ["candidates", *map(str, candidate_ids)]))


def _ledger_look(ledger: CertificationLedger, claims: _Claims, key: str, delta: float, seed: Optional[int],
                 ordered: bool) -> tuple[dict[str, int], dict[str, float], Optional[int]]:
    """One look at each certification split in the ledger: each constraint's look number and the delta its
    split's schedule gives it, and the row order's seed (a repeated look keeps its seed, so its answer)."""
    splits: dict[str, list[str]] = {}
    for n in claims.names:  # a constraint without a fingerprint is counted under its name
        splits.setdefault(claims.fingerprints.get(n) or f"constraint:{n}", []).append(n)
    taken = ledger.spend(splits, key, delta, seed)
    looks = {n: taken[fp].look for fp, members in splits.items() for n in members}
    spent = {n: taken[fp].delta_spent for fp, members in splits.items() for n in members}
    seeds = {taken[fp].order_seed for fp in splits}
    if ordered and len(seeds) == 1 and None not in seeds:
        seed = seeds.pop()  # the same look again: the same row order, so the same answer
    return looks, spent, seed


def _check_rows(value: RowValues, value_range: tuple[float, float], bound: str, name: str) -> None:
    """The errors :func:`statistic_upper_bound` would raise on these values, without computing a bound."""
    v, grouped = _rows(value)
    what = f"constraint {name!r}"
    unit = unit_values(v, value_range[0], value_range[1], what)
    if grouped is not None:
        g = np.asarray(grouped.groups).reshape(-1)
        if g.shape != v.shape or not np.all((g == 0) | (g == 1)) or not (np.any(g == 0) and np.any(g == 1)):
            difference_upper_bound(v, g, value_range, 0.5, "clt", absolute=grouped.absolute, what=what)
    allowed = {"clopper_pearson": (0.0, 1.0), "paired_change": (0.0, 0.5, 1.0)}.get(bound)
    if allowed is not None and not np.all(np.isin(unit, allowed)):
        upper_bound(v, value_range, 0.5, bound, what=what)  # raises the bound's own message


def _identity(value: RowValues) -> list[Any]:
    """What of a constraint's per-row values decides its bound (for a look's key)."""
    v, grouped = _rows(value)
    if grouped is None:
        return [v]
    return [v, np.asarray(grouped.groups).reshape(-1).astype(np.int64), bool(grouped.absolute)]


# ---------------------------------------------------------------------- before training: can the split ever certify?
def first_look_delta(delta: float = DEFAULT_DELTA, spending: Optional[Spending] = None) -> float:
    """The delta a split's first certificate spends (``delta / 2`` under the default ledger schedule)."""
    level = (spending if spending is not None else GeometricSpending()).level(check_delta(delta), 1)
    if level is None:
        raise ValueError("the spending schedule refuses the first look")
    return float(level)


@dataclass(frozen=True)
class Certifiability:
    """Whether a tolerance can be certified on a certification split of a given size, whatever the model.

    Attributes:
        name: the constraint.
        rows: the certification rows (per group for a difference of group means).
        tolerance: the certified statistic's tolerance.
        delta: the level of the split's first look.
        floor: the smallest bound the split can give (every row at the statistic's best value:
            nothing forgotten); ``None`` when there is none (the asymptotic CLT, or a one-sided
            group difference, which can go down to ``low - high``).
        rows_needed: the fewest rows (per group) at which ``floor <= tolerance`` (``None`` if not computed).
        never: no number of rows can certify the tolerance (e.g. a share forgotten of 0: every
            bound of a rate is above 0).
    """

    name: str
    rows: tuple[int, ...]
    tolerance: float
    delta: float
    floor: Optional[float]
    rows_needed: Optional[int] = None
    never: bool = False

    @property
    def possible(self) -> bool:
        return self.floor is None or self.floor <= self.tolerance

    def message(self) -> str:
        if self.never:
            return (f"constraint {self.name!r}: tolerance {self.tolerance:g} can never be certified, on any number of "
                    "certification rows (the bound stays above it even with every row at its best value): state a "
                    "tolerance above the statistic's best value")
        rows = " and ".join(str(n) for n in self.rows) + (" rows per group" if len(self.rows) > 1 else " rows")
        need = "" if self.rows_needed is None else (
            f"; it needs at least {self.rows_needed}{' per group' if len(self.rows) > 1 else ''}")
        return (f"constraint {self.name!r}: its certification split ({rows}) can never certify tolerance "
                f"{self.tolerance:g} at delta {self.delta:.3g} (the first look's share of the budget), whatever the "
                f"model: even with every row at its best value (nothing forgotten) the bound is {self.floor:.4g}"
                f"{need}. Give it more certification rows or a larger tolerance")


def rows_needed(bound: str, value_range: tuple[float, float], tolerance: float, delta: float) -> Optional[int]:
    """The fewest rows whose best-case bound (:func:`~hf_constrained.certification.bounds.smallest_certifiable`: nothing
    forgotten) at ``delta`` is within ``tolerance``, by doubling, then bisection; ``None`` when no number of rows
    reaches it (or for ``betting``, whose every evaluation is a full betting pass). For a 0/1 rate under
    Clopper-Pearson it is ``ceil(log(delta) / log(1 - tolerance))``."""
    if bound == "betting":
        return None  # each evaluation is a full betting pass: not worth a search
    def fits(n: int) -> bool:
        floor = smallest_certifiable(bound, value_range, n, delta)
        return floor is None or floor <= tolerance
    hi = 1
    while not fits(hi):
        hi *= 2
        if hi > 1 << 30:
            return None
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


def certifiability(name: str, bound: str, value_range: tuple[float, float], tolerance: float,
                   rows: Sequence[int], delta: float, *, absolute: bool = False) -> Certifiability:
    """:class:`Certifiability` of one statistic; a tolerance the statistic cannot express (below the
    range's low end, or above its high end) is a ``ValueError`` naming the constraint.

    ``rows``: one count, or two (the groups of a difference of group means, ``absolute`` for
    ``|mean_0 - mean_1|``; each group's bound is taken at ``delta/4``, as the certificate does)."""
    low, high = float(value_range[0]), float(value_range[1])
    tol = float(tolerance)
    grouped = len(rows) == 2
    lowest, highest = ((0.0 if absolute else low - high), high - low) if grouped else (low, high)
    if not (math.isfinite(tol) and lowest <= tol <= highest):
        raise ValueError(f"constraint {name!r}: tolerance {tol:g} cannot be expressed by its certified statistic, "
                         f"whose value lies in [{lowest:g}, {highest:g}] (value_range ({low:g}, {high:g})"
                         f"{', a difference of group means' if grouped else ''}): state the tolerance in the "
                         "statistic's units (e.g. 0.02 for at most 2 points of accuracy or 2% of the examples)")
    bound = check_bound(bound)
    if grouped and not absolute:
        return Certifiability(name, tuple(int(n) for n in rows), tol, delta, None)
    level = delta / 4.0 if grouped else delta
    floors = [smallest_certifiable(bound, value_range, int(n), level) for n in rows]
    if any(f is None for f in floors):
        return Certifiability(name, tuple(int(n) for n in rows), tol, delta, None)
    floor = max(floors) - (low if grouped else 0.0)
    needed = None
    if floor > tol:
        needed = rows_needed(bound, value_range, tol + (low if grouped else 0.0), level)
        return Certifiability(name, tuple(int(n) for n in rows), tol, delta, floor, needed,
                              never=needed is None and bound != "betting")
    return Certifiability(name, tuple(int(n) for n in rows), tol, delta, floor, needed)


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
    "CONSTRAINT_ITSELF",
    "DEFAULT_BOUND",
    "DEFAULT_DELTA",
    "PROCEDURES",
    "Certifiability",
    "Certificate",
    "GroupRows",
    "RowValues",
    "best_certified",
    "certifiability",
    "certified_candidates",
    "certify",
    "first_look_delta",
    "guarantee_sentence",
    "point_value",
    "rows_needed",
    "statistic_upper_bound",
]
