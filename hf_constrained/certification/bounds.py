"""Finite-sample upper confidence bounds for means of bounded per-row values.

Each function returns a number ``U`` such that, over an i.i.d. sample of ``n`` rows from a
population whose values lie in ``[low, high]``, ``P(population mean <= U) >= 1 - delta``
at every ``n`` (no normal approximation), except :func:`clt_upper_bound`, which is
asymptotic and kept for comparison. Certification (:mod:`hf_constrained.certification.certify`)
turns these bounds into a test of "the constraint is violated" for every candidate model.

- :func:`hoeffding_bentkus_upper_bound` (the default for values of no declared type): the
  Hoeffding-Bentkus bound of Learn-Then-Test (Angelopoulos, Bates, Candes, Jordan & Lei 2021,
  eq. (8)), the smallest level whose p-value falls to ``delta``. It does not depend on the
  rows' order, and near 0 it is as tight as Clopper-Pearson with nothing observed.
- :func:`clopper_pearson_upper_bound`: exact for 0/1 values (a rate); the tightest valid
  bound for a rate.
- ``"paired_change"``: for values on the three points ``{low, mid, high}`` of the range (a
  paired change of 0/1 correctness, ``old_correct - new_correct`` in {-1, 0, 1}): the mean is
  ``P(high) - P(low)`` (in units of half the range), bounded by the Clopper-Pearson upper bound
  of ``P(high)`` at ``(1 - PAIRED_LOW_SHARE) delta`` minus its lower bound of ``P(low)`` at
  ``PAIRED_LOW_SHARE delta`` (a union bound over the two; valid whatever their dependence).
  Far tighter than either bound above when most changes are 0, which sits mid-range.
- :func:`betting_upper_bound`: the betting confidence bound of Waudby-Smith & Ramdas
  (JRSS-B 2024, "Estimating means of bounded random variables by betting", the
  predictable-plug-in capital process of their Theorem 3 read at the sample size ``n``).
  It adapts to the variance (tight when most values are equal and away from the range's
  ends), but near 0 it is about twice as loose as Hoeffding-Bentkus (its bets are truncated
  at half the largest allowed bet: about ``2 log(1/delta) / n`` with nothing observed, against
  ``log(1/delta) / n``). It bets in row order, and its guarantee is for rows in exchangeable
  order: the rows are first permuted at random with a seed drawn independently of the data
  (``order_seed``; :func:`~hf_constrained.certification.certify.certify` records it), so a split stored
  sorted by value cannot break it.
- :func:`difference_upper_bound`: a bound for ``mean_0 - mean_1`` (or its absolute value)
  of two independent groups, from one-sided bounds of each group at a share of ``delta``
  (a union bound: every one-sided bound used holds at once with probability >= 1 - delta).

Plain numpy/scipy: no torch. The counts-based bounds have array forms
(:func:`clopper_pearson_upper_bounds`, :func:`paired_change_upper_bounds`,
:func:`hoeffding_bentkus_upper_bounds`) that the one-sample functions call, so a Monte Carlo
check runs the very code a certificate runs.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from typing import Optional

import numpy as np
from scipy.stats import beta as beta_distribution
from scipy.stats import binom, norm

from ..statistics import group_difference_share

BOUNDS = ("hoeffding_bentkus", "clopper_pearson", "paired_change", "betting", "clt")
"""The bound names :func:`upper_bound` accepts; all but ``"clt"`` are valid at every ``n``."""

DEFAULT_BOUND = "hoeffding_bentkus"
"""The bound of a statistic that declares no type: valid for any values in the range, order-free."""

ASYMPTOTIC_BOUNDS = frozenset({"clt"})
ORDER_DEPENDENT_BOUNDS = frozenset({"betting"})
"""Bounds that read the rows in order: their rows are permuted at random first (``order_seed``)."""

PAIRED_LOW_SHARE = 0.2
"""The share of ``delta`` the ``"paired_change"`` bound spends on the lower bound of ``P(low)``
(rows newly right, subtracted); the rest bounds ``P(high)`` (rows forgotten). Fixed before any
data: most of ``delta`` goes where a non-forgetting claim is decided."""

_GRID_POINTS = 4001  # candidate means tested by the betting bound; the bound is rounded UP to this grid


def check_delta(delta: float, name: str = "delta", error: type[ValueError] = ValueError) -> float:
    """``delta`` if it is in (0, 1), else ``error`` naming it as ``name`` (a recipe passes its flag, ``--delta``)."""
    if not (isinstance(delta, (int, float)) and 0.0 < float(delta) < 1.0):
        raise error(f"{name} must be in (0, 1), got {delta!r}")
    return float(delta)


def check_bound(bound: str) -> str:
    """``bound`` if it is one of :data:`BOUNDS`, else a ``ValueError`` naming them."""
    if bound not in BOUNDS:
        raise ValueError(f"bound must be one of {', '.join(BOUNDS)}, got {bound!r}")
    return bound


def unit_values(values: Sequence[float] | np.ndarray, low: float, high: float, what: str) -> np.ndarray:
    """``values`` rescaled from ``[low, high]`` to ``[0, 1]``; a value outside the range, a
    non-finite value or an empty sample is an error naming ``what`` (never clipped)."""
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ValueError(f"{what}: value_range must be two finite numbers low < high, got ({low}, {high})")
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if v.size == 0:
        raise ValueError(f"{what}: no rows to bound")
    if not np.all(np.isfinite(v)):
        raise ValueError(f"{what}: {int(np.sum(~np.isfinite(v)))} per-row value(s) are NaN or infinite")
    # a tolerance of a few ulps for values computed in float32 at the range's ends
    slack = 1e-6 * (high - low)
    outside = (v < low - slack) | (v > high + slack)
    if np.any(outside):
        bad = v[outside]
        raise ValueError(f"{what}: {int(outside.sum())} per-row value(s) lie outside the declared value_range "
                         f"[{low:g}, {high:g}] (e.g. {float(bad[0]):.6g}); a finite-sample bound needs the true "
                         "range: declare a wider value_range")
    return np.clip((v - low) / (high - low), 0.0, 1.0)


def _scale(unit_bound: float, low: float, high: float) -> float:
    return float(low + (high - low) * min(max(unit_bound, 0.0), 1.0))


# ---------------------------------------------------------------------- bounds on [0, 1]
def _betting_unit(x: np.ndarray, delta: float) -> float:
    """Upper bound of the mean of ``x`` in [0, 1] (Waudby-Smith & Ramdas 2024).

    For a candidate mean ``m`` the capital ``K(m) = prod_i (1 + lambda_i (m - x_i))`` is a
    nonnegative martingale when ``m`` is the true mean (each factor has conditional mean 1),
    so by Markov's inequality ``K(mu) >= 1/delta`` with probability at most ``delta``; the
    bound is the largest ``m`` not rejected. The bets are predictable: ``lambda_i`` uses only
    rows before ``i`` (the plug-in of their eq. (26), truncated at ``c / (1 - m)`` with
    ``c = 1/2`` so every factor stays positive).
    """
    n = x.size
    i = np.arange(1, n + 1, dtype=np.float64)
    mu_hat = (0.5 + np.cumsum(x)) / (i + 1)
    sigma2 = (0.25 + np.cumsum((x - mu_hat) ** 2)) / (i + 1)
    sigma2_prev = np.concatenate([[0.25], sigma2[:-1]])  # predictable: rows before i only
    lam = np.sqrt(2.0 * math.log(1.0 / delta) / (n * sigma2_prev))
    grid = np.linspace(0.0, 1.0, _GRID_POINTS)
    threshold = math.log(1.0 / delta)
    rejected = np.zeros(grid.size, dtype=bool)
    # columns of the grid in chunks: memory n x chunk
    chunk = max(1, 2_000_000 // max(n, 1))
    for start in range(0, grid.size, chunk):
        m = grid[start:start + chunk]
        cap = 0.5 / np.maximum(1.0 - m, 1e-12)
        bets = np.minimum(lam[:, None], cap[None, :])
        log_capital = np.log1p(bets * (m[None, :] - x[:, None])).sum(axis=0)
        rejected[start:start + chunk] = log_capital >= threshold
    # m = 0 is never rejected (every factor <= 1); the largest mean not rejected, rounded up to the next
    # grid point so that a mean between two grid points is covered too
    kept = np.flatnonzero(~rejected)
    return float(grid[min(kept[-1] + 1, grid.size - 1)])


def hoeffding_bentkus_p_value(mean: float, n: int, level: float) -> float:
    """The Hoeffding-Bentkus p-value of "the population mean is >= ``level``" for values in
    [0, 1] with sample ``mean`` over ``n`` rows (Learn-Then-Test, eq. (8)):
    ``min(exp(-n h(min(mean, level), level)), e P(Binomial(n, level) <= ceil(n mean)))``."""
    return float(_hoeffding_bentkus_p_values(np.asarray([mean], dtype=np.float64), n,
                                             np.asarray([level], dtype=np.float64))[0])


def _hoeffding_bentkus_p_values(mean: np.ndarray, n: int, level: np.ndarray) -> np.ndarray:
    """:func:`hoeffding_bentkus_p_value` elementwise over arrays of means and levels."""
    mean, level = np.broadcast_arrays(np.asarray(mean, dtype=np.float64), np.asarray(level, dtype=np.float64))
    out = np.ones(mean.shape)
    top = level >= 1.0
    out[top] = np.where(mean[top] >= 1.0, 1.0, 0.0)
    mid = (level > 0.0) & ~top
    a, m = level[mid], mean[mid]
    r = np.minimum(m, a)
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = (np.where(r > 0, r * np.log(np.where(r > 0, r, 1.0) / a), 0.0)
              + np.where(r < 1, (1 - r) * np.log(np.where(r < 1, 1 - r, 1.0) / (1 - a)), 0.0))
    hoeffding = np.exp(-n * kl)
    bentkus = math.e * binom.cdf(np.ceil(n * m - 1e-9), n, a)
    out[mid] = np.minimum(1.0, np.minimum(hoeffding, bentkus))
    return out


def hoeffding_bentkus_upper_bounds(means: Sequence[float] | np.ndarray, n: int, delta: float) -> np.ndarray:
    """The Hoeffding-Bentkus upper bound in [0, 1] for each sample mean in ``means`` (values in
    [0, 1], ``n`` rows each): the smallest level whose p-value is <= delta (bisection; the p-value
    decreases in the level above the sample mean), rounded up."""
    mean = np.clip(np.asarray(means, dtype=np.float64).reshape(-1), 0.0, 1.0)
    lo, hi = mean.copy(), np.ones_like(mean)
    never = _hoeffding_bentkus_p_values(mean, n, hi) > delta
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        rejected = _hoeffding_bentkus_p_values(mean, n, mid) <= delta
        hi = np.where(rejected, mid, hi)
        lo = np.where(rejected, lo, mid)
    return np.where(never, 1.0, hi)


def _hoeffding_bentkus_unit(x: np.ndarray, delta: float) -> float:
    return float(hoeffding_bentkus_upper_bounds([float(x.mean())], x.size, delta)[0])


def clopper_pearson_upper_bounds(successes: Sequence[int] | np.ndarray, n: int, delta: float) -> np.ndarray:
    """The exact (Clopper-Pearson) upper bound of a rate for each count of ones in ``successes`` among ``n``."""
    k = np.asarray(successes, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        inner = beta_distribution.ppf(1.0 - delta, k + 1, np.maximum(n - k, 1))
    return np.where(k >= n, 1.0, inner)


def clopper_pearson_lower_bounds(successes: Sequence[int] | np.ndarray, n: int, delta: float) -> np.ndarray:
    """The exact (Clopper-Pearson) lower bound of a rate for each count of ones in ``successes`` among ``n``."""
    k = np.asarray(successes, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        inner = beta_distribution.ppf(delta, np.maximum(k, 1), n - k + 1)
    return np.where(k <= 0, 0.0, inner)


def paired_change_upper_bounds(high: Sequence[int] | np.ndarray, low: Sequence[int] | np.ndarray, n: int,
                               delta: float) -> np.ndarray:
    """Upper bound of ``P(high) - P(low)`` (in [-1, 1]) from the counts of rows at the range's top
    (``high``: e.g. forgotten) and bottom (``low``: newly right) among ``n``: the Clopper-Pearson
    upper bound of ``P(high)`` at ``(1 - PAIRED_LOW_SHARE) delta`` minus the lower bound of
    ``P(low)`` at ``PAIRED_LOW_SHARE delta``. Both hold together with probability >= 1 - delta."""
    up = clopper_pearson_upper_bounds(high, n, (1.0 - PAIRED_LOW_SHARE) * delta)
    down = clopper_pearson_lower_bounds(low, n, PAIRED_LOW_SHARE * delta)
    return up - down


def _clopper_pearson_unit(x: np.ndarray, delta: float, what: str) -> float:
    if not np.all((x == 0.0) | (x == 1.0)):
        raise ValueError(f"{what}: the Clopper-Pearson bound is for 0/1 values (at the ends of value_range); "
                         "use bound='hoeffding_bentkus' for other values")
    return float(clopper_pearson_upper_bounds([int(x.sum())], x.size, delta)[0])


def _paired_change_unit(x: np.ndarray, delta: float, what: str) -> float:
    if not np.all((x == 0.0) | (x == 0.5) | (x == 1.0)):
        raise ValueError(f"{what}: the paired_change bound is for values at the ends and the middle of value_range "
                         "(e.g. old_correct - new_correct in {-1, 0, 1} with value_range (-1, 1)); use "
                         "bound='hoeffding_bentkus' for other values")
    change = paired_change_upper_bounds([int(np.sum(x == 1.0))], [int(np.sum(x == 0.0))], x.size, delta)[0]
    return 0.5 + 0.5 * float(change)  # P(high) - P(low) is the mean in units of half the range, about its middle


def _clt_unit(x: np.ndarray, delta: float) -> float:
    if x.size < 2:
        return 1.0
    return float(x.mean() + norm.ppf(1.0 - delta) * x.std(ddof=1) / math.sqrt(x.size))


# ---------------------------------------------------------------------- public bounds
def new_order_seed() -> int:
    """A seed for the random row order of an order-dependent bound, drawn from the operating
    system's entropy: independent of the data by construction."""
    return secrets.randbits(63)


def random_order(n: int, order_seed: int) -> np.ndarray:
    """The permutation of ``n`` rows an order-dependent bound reads them in (a function of the seed and ``n``)."""
    return np.random.default_rng([int(order_seed), 0x0D3E]).permutation(n)


def upper_bound(values: Sequence[float] | np.ndarray, value_range: tuple[float, float], delta: float,
                bound: str = DEFAULT_BOUND, *, what: str = "values", order_seed: Optional[int] = None) -> float:
    """One-sided upper confidence bound at level ``1 - delta`` of the mean of ``values``,
    each known to lie in ``value_range`` (``bound``: one of :data:`BOUNDS`).

    ``order_seed``: for an order-dependent bound (``"betting"``), the seed of the random order the
    rows are read in (:func:`random_order`); ``None`` draws one (:func:`new_order_seed`). It must
    not be chosen by looking at the data or at bounds computed with other seeds."""
    delta, bound = check_delta(delta), check_bound(bound)
    low, high = float(value_range[0]), float(value_range[1])
    x = unit_values(values, low, high, what)
    if bound == "betting":
        seed = new_order_seed() if order_seed is None else int(order_seed)
        unit = _betting_unit(x[random_order(x.size, seed)], delta)
    elif bound == "hoeffding_bentkus":
        unit = _hoeffding_bentkus_unit(x, delta)
    elif bound == "clopper_pearson":
        unit = _clopper_pearson_unit(x, delta, what)
    elif bound == "paired_change":
        unit = _paired_change_unit(x, delta, what)
    else:
        unit = _clt_unit(x, delta)
    return _scale(unit, low, high)


def lower_bound(values: Sequence[float] | np.ndarray, value_range: tuple[float, float], delta: float,
                bound: str = DEFAULT_BOUND, *, what: str = "values", order_seed: Optional[int] = None) -> float:
    """One-sided lower confidence bound at level ``1 - delta`` (the upper bound of the negated values)."""
    low, high = float(value_range[0]), float(value_range[1])
    v = -np.asarray(values, dtype=np.float64)
    return -upper_bound(v, (-high, -low), delta, bound, what=what, order_seed=order_seed)


def betting_upper_bound(values: Sequence[float] | np.ndarray, value_range: tuple[float, float] = (0.0, 1.0),
                        delta: float = 0.05, *, order_seed: Optional[int] = None) -> float:
    """:func:`upper_bound` with the betting bound of Waudby-Smith & Ramdas (2024), on the rows in
    the random order of ``order_seed`` (drawn when ``None``)."""
    return upper_bound(values, value_range, delta, "betting", order_seed=order_seed)


def hoeffding_bentkus_upper_bound(values: Sequence[float] | np.ndarray,
                                  value_range: tuple[float, float] = (0.0, 1.0), delta: float = 0.05) -> float:
    """:func:`upper_bound` with the Hoeffding-Bentkus bound of Learn-Then-Test."""
    return upper_bound(values, value_range, delta, "hoeffding_bentkus")


def clopper_pearson_upper_bound(successes: int, n: int, delta: float = 0.05) -> float:
    """Exact (Clopper-Pearson) upper bound of a rate with ``successes`` ones among ``n`` rows."""
    if not 0 <= successes <= n or n <= 0:
        raise ValueError(f"need 0 <= successes <= n and n > 0, got successes={successes}, n={n}")
    check_delta(delta)
    return float(clopper_pearson_upper_bounds([successes], n, delta)[0])


def most_forgotten_that_certify(n: int, tolerance: float, delta: float) -> int:
    """The largest count ``x`` of 0/1 events (e.g. rows forgotten) among ``n`` whose Clopper-Pearson upper
    bound at ``delta`` is at most ``tolerance`` (-1: not even none): how many events a claim "at most
    ``tolerance``" survives on ``n`` certification rows."""
    x = -1
    while x + 1 <= n and clopper_pearson_upper_bound(x + 1, n, delta) <= tolerance:
        x += 1
    return x


def smallest_certifiable(bound: str, value_range: tuple[float, float], n: int, delta: float) -> Optional[float]:
    """The smallest bound ``bound`` can give on ``n`` rows at ``delta`` when every row sits at the
    best value the statistic can take for the claim (nothing forgotten: every row 0 for a rate or
    a paired change, every row at ``low`` otherwise); a tolerance below it can never be certified,
    whatever the model. ``None`` for the asymptotic CLT (no floor)."""
    check_delta(delta)
    bound = check_bound(bound)
    low, high = float(value_range[0]), float(value_range[1])
    if n <= 0:
        return math.inf
    if bound == "clt":
        return None
    if bound == "paired_change":  # nothing forgotten and nothing newly right: every change 0
        return _scale(0.5 + 0.5 * float(paired_change_upper_bounds([0], [0], n, delta)[0]), low, high)
    if bound == "clopper_pearson":
        return _scale(float(clopper_pearson_upper_bounds([0], n, delta)[0]), low, high)
    if bound == "hoeffding_bentkus":
        return _scale(float(hoeffding_bentkus_upper_bounds([0.0], n, delta)[0]), low, high)
    return _scale(_betting_unit(np.zeros(n), delta), low, high)


def clt_upper_bound(values: Sequence[float] | np.ndarray, delta: float = 0.05) -> float:
    """The asymptotic (central-limit) bound ``mean + z_{1-delta} s / sqrt(n)``: no
    finite-sample guarantee (skewed values with few rows exceed it far more often than ``delta``)."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    check_delta(delta)
    if v.size < 2:
        return math.inf
    return float(v.mean() + norm.ppf(1.0 - delta) * v.std(ddof=1) / math.sqrt(v.size))


def difference_upper_bound(values: Sequence[float] | np.ndarray, groups: Sequence[int] | np.ndarray,
                           value_range: tuple[float, float], delta: float, bound: str = DEFAULT_BOUND, *,
                           absolute: bool = False, what: str = "values", order_seed: Optional[int] = None) -> float:
    """Upper bound of ``mean over group 0 - mean over group 1`` (or of its absolute value with
    ``absolute``), the two groups being independent samples.

    ``d = m0 - m1 <= U0 - L1`` whenever ``m0 <= U0`` and ``m1 >= L1``; each one-sided bound is
    taken at ``delta / 2`` (``delta / 4`` for ``|d|``, which needs both ends of each group) so
    that all hold together with probability >= 1 - delta (a union bound).
    """
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    g = np.asarray(groups).reshape(-1)
    if g.shape != v.shape:
        raise ValueError(f"{what}: {v.size} values but {g.size} group labels")
    if not np.all((g == 0) | (g == 1)):
        raise ValueError(f"{what}: group labels must be 0 or 1")
    v0, v1 = v[g == 0], v[g == 1]
    for label, part in ((0, v0), (1, v1)):
        if part.size == 0:
            raise ValueError(f"{what}: group {label} has no rows on the certification split, so the difference of "
                             "group means has no bound")
    share = delta * group_difference_share(grouped=True, absolute=absolute)
    seed = order_seed if order_seed is not None or bound not in ORDER_DEPENDENT_BOUNDS else new_order_seed()
    up0 = upper_bound(v0, value_range, share, bound, what=f"{what} (group 0)", order_seed=seed)
    lo1 = lower_bound(v1, value_range, share, bound, what=f"{what} (group 1)", order_seed=seed)
    if not absolute:
        return up0 - lo1
    up1 = upper_bound(v1, value_range, share, bound, what=f"{what} (group 1)", order_seed=seed)
    lo0 = lower_bound(v0, value_range, share, bound, what=f"{what} (group 0)", order_seed=seed)
    return max(up0 - lo1, up1 - lo0)


def bound_is_asymptotic(bound: Optional[str]) -> bool:
    """True for bounds without a finite-sample guarantee (the CLT)."""
    return bound in ASYMPTOTIC_BOUNDS


__all__ = [
    "ASYMPTOTIC_BOUNDS",
    "BOUNDS",
    "DEFAULT_BOUND",
    "ORDER_DEPENDENT_BOUNDS",
    "PAIRED_LOW_SHARE",
    "betting_upper_bound",
    "bound_is_asymptotic",
    "check_bound",
    "check_delta",
    "clopper_pearson_lower_bounds",
    "clopper_pearson_upper_bound",
    "most_forgotten_that_certify",
    "clopper_pearson_upper_bounds",
    "clt_upper_bound",
    "difference_upper_bound",
    "hoeffding_bentkus_p_value",
    "hoeffding_bentkus_upper_bound",
    "hoeffding_bentkus_upper_bounds",
    "lower_bound",
    "new_order_seed",
    "paired_change_upper_bounds",
    "random_order",
    "smallest_certifiable",
    "upper_bound",
]
