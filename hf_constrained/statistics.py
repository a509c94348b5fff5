"""Exact constraint values with their sampling uncertainty.

A held-out value of a per-sample-mean constraint is itself an estimate of the value on
the population the held-out rows were drawn from. From the per-row values the central
limit theorem gives its standard error, ``s / sqrt(n)``, and a one-sided upper
confidence bound ``value + z_c * s / sqrt(n)`` with ``z_c`` the standard normal
quantile at confidence ``c``. A difference of two group means (ROC gaps) has standard
error ``sqrt(s_0^2 / n_0 + s_1^2 / n_1)``. A compositional constraint ``outer(inner)``
with a convex ``outer`` (``|x|``, the identity) takes the larger of ``outer`` at the two
ends of the inner interval ``inner +- z_c * se``, which bounds ``outer`` on the interval.

This module is plain numpy: the trainer, the safety report and the tests share it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import numpy as np
from scipy.stats import norm


def z_value(confidence: float) -> float:
    """The one-sided standard normal quantile ``z_c`` (1.645 at ``c = 0.95``)."""
    if not 0.5 <= confidence < 1.0:
        raise ValueError(f"confidence must be in [0.5, 1), got {confidence}")
    return float(norm.ppf(confidence))


def group_difference_share(grouped: bool, absolute: bool) -> float:
    """The share of ``delta`` each one-sided bound of a group-mean difference gets (a union bound):
    1 for a plain mean, 1/2 for ``m0 - m1`` (an upper end of one group, a lower end of the other),
    1/4 for ``|m0 - m1|`` (both ends of both groups). The certificate's group bounds and the
    certificate-sized training margins use the same split, so a margin sized here is what the
    certificate will need."""
    if not grouped:
        return 1.0
    return 0.25 if absolute else 0.5


def mean_and_standard_error(values: Sequence[float] | np.ndarray) -> tuple[float, float, int]:
    """Mean, CLT standard error ``s / sqrt(n)`` (``s`` with ``n - 1`` degrees of freedom) and ``n``."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    n = int(v.size)
    if n == 0:
        raise ValueError("no values to average")
    se = float(v.std(ddof=1) / math.sqrt(n)) if n > 1 else math.inf
    return float(v.mean()), se, n


def inner_statistics(values: Sequence[float] | np.ndarray,
                     groups: Optional[Sequence[int] | np.ndarray] = None) -> tuple[float, float, int]:
    """(inner value, its standard error, rows) of a mean, or of a group-0 minus group-1 mean."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if groups is None:
        return mean_and_standard_error(v)
    g = np.asarray(groups).reshape(-1)
    if g.shape != v.shape:
        raise ValueError(f"{v.size} values but {g.size} group labels")
    m0, se0, n0 = mean_and_standard_error(v[g == 0])
    m1, se1, n1 = mean_and_standard_error(v[g == 1])
    return m0 - m1, math.sqrt(se0 ** 2 + se1 ** 2), n0 + n1


@dataclass(frozen=True)
class ConstraintStatistic:
    """The exact value of one constraint on a dataset, with its confidence bound.

    ``value`` is ``outer(inner)`` on all rows; ``upper_bound`` the one-sided bound at
    ``confidence`` (``None`` where the constraint gives no per-row values, e.g. a scalar
    ``fn`` or an ``exact_fn``); ``std_error`` the standard error of ``inner``.
    """

    value: float
    upper_bound: Optional[float] = None
    std_error: Optional[float] = None
    num_rows: Optional[int] = None
    confidence: Optional[float] = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ConstraintStatistic":
        return cls(**{k: data.get(k) for k in ("value", "upper_bound", "std_error", "num_rows", "confidence")})


def constraint_statistic(values: Sequence[float] | np.ndarray, *, groups: Optional[Sequence[int] | np.ndarray] = None,
                         outer: Optional[Callable[[float], float]] = None,
                         confidence: float = 0.95) -> ConstraintStatistic:
    """:class:`ConstraintStatistic` of a row-wise constraint from its per-row values.

    Args:
        values: the per-row values on the whole dataset.
        groups: each row's group (0/1) when the constraint is a difference of group means.
        outer: the constraint's convex outer map on the inner value (default: identity).
        confidence: the one-sided confidence of ``upper_bound``.
    """
    inner, se, n = inner_statistics(values, groups)
    f = (lambda x: x) if outer is None else outer
    half = z_value(confidence) * se
    upper = max(float(f(inner - half)), float(f(inner + half))) if math.isfinite(half) else math.inf
    return ConstraintStatistic(value=float(f(inner)), upper_bound=upper, std_error=se, num_rows=n,
                               confidence=confidence)
