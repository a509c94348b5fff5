"""``most_forgotten_that_certify``: how many forgotten rows a claim survives, against scipy's beta quantile."""

from __future__ import annotations

import pytest
from scipy.stats import beta

from hf_constrained.certification.bounds import most_forgotten_that_certify


def _cp_upper(x: int, n: int, delta: float) -> float:
    return 1.0 if x >= n else float(beta.ppf(1 - delta, x + 1, n - x))


@pytest.mark.parametrize("n, tolerance, delta", [(70, 0.15, 0.045), (3000, 0.03, 0.045), (2000, 0.03, 0.05),
                                                 (65, 0.1, 0.045)])
def test_the_count_is_the_largest_whose_exact_bound_stays_within_the_claim(n, tolerance, delta):
    x = most_forgotten_that_certify(n, tolerance, delta)
    assert x >= 0
    assert _cp_upper(x, n, delta) <= tolerance < _cp_upper(x + 1, n, delta)


def test_a_split_too_small_for_the_claim_survives_not_even_none():
    assert most_forgotten_that_certify(50, 0.03, 0.045) == -1  # a 3-point claim needs 102 rows with none forgotten
    assert most_forgotten_that_certify(102, 0.03, 0.045) == 0
