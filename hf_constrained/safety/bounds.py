"""Finite-sample upper confidence bounds for means of bounded per-row values.

Each function returns a number ``U`` such that, over an i.i.d. sample of ``n`` rows from a
population whose values lie in ``[low, high]``, ``P(population mean <= U) >= 1 - delta``
at every ``n`` (no normal approximation), except :func:`clt_upper_bound`, which is
asymptotic and kept for comparison. Certification (:mod:`hf_constrained.safety.certify`)
turns these bounds into a test of "the constraint is violated" for every candidate model.

- :func:`betting_upper_bound`: the betting confidence bound of Waudby-Smith & Ramdas
  (JRSS-B 2024, "Estimating means of bounded random variables by betting", the
  predictable-plug-in capital process of their Theorem 3 read at the sample size ``n``).
  It adapts to the variance: far tighter than Hoeffding when most values are equal (a
  non-forgetting change that is 0 for most rows).
- :func:`hoeffding_bentkus_upper_bound`: the Hoeffding-Bentkus bound of Learn-Then-Test
  (Angelopoulos, Bates, Candes, Jordan & Lei 2021, eq. (8)), the smallest level whose
  p-value falls to ``delta``.
- :func:`clopper_pearson_upper_bound`: exact for 0/1 values (a rate).
- :func:`difference_upper_bound`: a bound for ``mean_0 - mean_1`` (or its absolute value)
  of two independent groups, from one-sided bounds of each group at a share of ``delta``
  (a union bound: every one-sided bound used holds at once with probability >= 1 - delta).

Plain numpy/scipy: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import numpy as np
from scipy.stats import beta as beta_distribution
from scipy.stats import binom, norm

BOUNDS = ("betting", "hoeffding_bentkus", "clopper_pearson", "clt")
"""The bound names :func:`upper_bound` accepts; all but ``"clt"`` are valid at every ``n``."""

ASYMPTOTIC_BOUNDS = frozenset({"clt"})

_GRID_POINTS = 4001  # candidate means tested by the betting bound; the bound is rounded UP to this grid


def check_delta(delta: float) -> float:
    """``delta`` if it is in (0, 1), else a ``ValueError``."""
    if not (isinstance(delta, (int, float)) and 0.0 < float(delta) < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    return float(delta)


def check_bound(bound: str) -> str:
    """``bound`` if it is one of :data:`BOUNDS`, else a ``ValueError`` naming them."""
    if bound not in BOUNDS:
        raise ValueError(f"bound must be one of {', '.join(BOUNDS)}, got {bound!r}")
    return bound


def _unit_values(values: Sequence[float] | np.ndarray, low: float, high: float, what: str) -> np.ndarray:
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
    if level >= 1.0:
        return 1.0 if mean >= 1.0 else 0.0
    if level <= 0.0:
        return 1.0
    r = min(mean, level)
    hoeffding = math.exp(-n * _kl_bernoulli(r, level))
    bentkus = math.e * float(binom.cdf(math.ceil(n * mean - 1e-9), n, level))
    return min(1.0, hoeffding, bentkus)


def _kl_bernoulli(x: float, a: float) -> float:
    """h(x, a) = x log(x/a) + (1-x) log((1-x)/(1-a)), with 0 log 0 = 0."""
    out = 0.0
    if x > 0:
        out += x * math.log(x / a)
    if x < 1:
        out += (1 - x) * math.log((1 - x) / (1 - a))
    return out


def _hoeffding_bentkus_unit(x: np.ndarray, delta: float) -> float:
    """Smallest level whose Hoeffding-Bentkus p-value is <= delta (bisection; the p-value
    decreases in the level above the sample mean), rounded up."""
    n, mean = x.size, float(x.mean())
    lo, hi = mean, 1.0
    if hoeffding_bentkus_p_value(mean, n, hi) > delta:
        return 1.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if hoeffding_bentkus_p_value(mean, n, mid) <= delta:
            hi = mid
        else:
            lo = mid
    return hi


def _clopper_pearson_unit(x: np.ndarray, delta: float, what: str) -> float:
    if not np.all((x == 0.0) | (x == 1.0)):
        raise ValueError(f"{what}: the Clopper-Pearson bound is for 0/1 values (at the ends of value_range); "
                         "use bound='betting' for other values")
    n, k = x.size, int(x.sum())
    return 1.0 if k >= n else float(beta_distribution.ppf(1.0 - delta, k + 1, n - k))


def _clt_unit(x: np.ndarray, delta: float) -> float:
    if x.size < 2:
        return 1.0
    return float(x.mean() + norm.ppf(1.0 - delta) * x.std(ddof=1) / math.sqrt(x.size))


# ---------------------------------------------------------------------- public bounds
def upper_bound(values: Sequence[float] | np.ndarray, value_range: tuple[float, float], delta: float,
                bound: str = "betting", *, what: str = "values") -> float:
    """One-sided upper confidence bound at level ``1 - delta`` of the mean of ``values``,
    each known to lie in ``value_range`` (``bound``: one of :data:`BOUNDS`)."""
    delta, bound = check_delta(delta), check_bound(bound)
    low, high = float(value_range[0]), float(value_range[1])
    x = _unit_values(values, low, high, what)
    if bound == "betting":
        unit = _betting_unit(x, delta)
    elif bound == "hoeffding_bentkus":
        unit = _hoeffding_bentkus_unit(x, delta)
    elif bound == "clopper_pearson":
        unit = _clopper_pearson_unit(x, delta, what)
    else:
        unit = _clt_unit(x, delta)
    return _scale(unit, low, high)


def lower_bound(values: Sequence[float] | np.ndarray, value_range: tuple[float, float], delta: float,
                bound: str = "betting", *, what: str = "values") -> float:
    """One-sided lower confidence bound at level ``1 - delta`` (the upper bound of the negated values)."""
    low, high = float(value_range[0]), float(value_range[1])
    v = -np.asarray(values, dtype=np.float64)
    return -upper_bound(v, (-high, -low), delta, bound, what=what)


def betting_upper_bound(values: Sequence[float] | np.ndarray, value_range: tuple[float, float] = (0.0, 1.0),
                        delta: float = 0.05) -> float:
    """:func:`upper_bound` with the betting bound of Waudby-Smith & Ramdas (2024)."""
    return upper_bound(values, value_range, delta, "betting")


def hoeffding_bentkus_upper_bound(values: Sequence[float] | np.ndarray,
                                  value_range: tuple[float, float] = (0.0, 1.0), delta: float = 0.05) -> float:
    """:func:`upper_bound` with the Hoeffding-Bentkus bound of Learn-Then-Test."""
    return upper_bound(values, value_range, delta, "hoeffding_bentkus")


def clopper_pearson_upper_bound(successes: int, n: int, delta: float = 0.05) -> float:
    """Exact (Clopper-Pearson) upper bound of a rate with ``successes`` ones among ``n`` rows."""
    if not 0 <= successes <= n or n <= 0:
        raise ValueError(f"need 0 <= successes <= n and n > 0, got successes={successes}, n={n}")
    check_delta(delta)
    return 1.0 if successes >= n else float(beta_distribution.ppf(1.0 - delta, successes + 1, n - successes))


def clt_upper_bound(values: Sequence[float] | np.ndarray, delta: float = 0.05) -> float:
    """The asymptotic (central-limit) bound ``mean + z_{1-delta} s / sqrt(n)``: no
    finite-sample guarantee (skewed values with few rows exceed it far more often than ``delta``)."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    check_delta(delta)
    if v.size < 2:
        return math.inf
    return float(v.mean() + norm.ppf(1.0 - delta) * v.std(ddof=1) / math.sqrt(v.size))


def difference_upper_bound(values: Sequence[float] | np.ndarray, groups: Sequence[int] | np.ndarray,
                           value_range: tuple[float, float], delta: float, bound: str = "betting", *,
                           absolute: bool = False, what: str = "values") -> float:
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
    share = delta / (4.0 if absolute else 2.0)
    up0 = upper_bound(v0, value_range, share, bound, what=f"{what} (group 0)")
    lo1 = lower_bound(v1, value_range, share, bound, what=f"{what} (group 1)")
    if not absolute:
        return up0 - lo1
    up1 = upper_bound(v1, value_range, share, bound, what=f"{what} (group 1)")
    lo0 = lower_bound(v0, value_range, share, bound, what=f"{what} (group 0)")
    return max(up0 - lo1, up1 - lo0)


def bound_is_asymptotic(bound: Optional[str]) -> bool:
    """True for bounds without a finite-sample guarantee (the CLT)."""
    return bound in ASYMPTOTIC_BOUNDS


__all__ = [
    "ASYMPTOTIC_BOUNDS",
    "BOUNDS",
    "betting_upper_bound",
    "bound_is_asymptotic",
    "check_bound",
    "check_delta",
    "clopper_pearson_upper_bound",
    "clt_upper_bound",
    "difference_upper_bound",
    "hoeffding_bentkus_p_value",
    "hoeffding_bentkus_upper_bound",
    "lower_bound",
    "upper_bound",
]
