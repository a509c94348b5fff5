"""The guarantee without holes: rows read in a random order, a default bound as tight as
Hoeffding-Bentkus near 0 (the tightest valid one for rates and paired changes), each checked by
Monte Carlo at n = 20 / 100 / 400 on the code a certificate runs."""

import math

import numpy as np
import pytest

from hf_constrained.certification import bounds
from hf_constrained.certification.bounds import (
    DEFAULT_BOUND,
    PAIRED_LOW_SHARE,
    clopper_pearson_upper_bounds,
    hoeffding_bentkus_upper_bounds,
    paired_change_upper_bounds,
    smallest_certifiable,
    upper_bound,
)
from hf_constrained.certification.certify import certify

DELTA = 0.05
REPS = 4000


def allowed_misses(reps, delta=DELTA):
    return delta + 3 * math.sqrt(delta * (1 - delta) / reps)


# ---------------------------------------------------------------------- item: row order
def test_a_split_stored_sorted_by_value_no_longer_breaks_the_betting_bound():
    rng = np.random.default_rng(0)
    n, mu = 400, 0.5
    samples = [np.sort(rng.random(n)) for _ in range(100)]  # uniform values, stored in increasing order
    # the bets in stored order (what the bound did before rows were permuted) miss the mean almost always
    in_stored_order = [bounds._betting_unit(x, DELTA) for x in samples[:20]]
    assert np.mean(np.asarray(in_stored_order) < mu) > 0.5
    # each sample's rows in the random order of its own seed (seeded here so that the test repeats exactly)
    misses = np.mean([upper_bound(x, (0, 1), DELTA, "betting", order_seed=i) < mu for i, x in enumerate(samples)])
    assert misses <= allowed_misses(len(samples))


def test_the_row_order_seed_is_recorded_and_reproduces_the_certificate():
    rng = np.random.default_rng(1)
    x = np.sort(rng.beta(2, 5, 200))
    cert = certify([{"a": x}], {"a": 0.5}, (0.0, 1.0), bound="betting")
    seed = cert.row_order_seed
    assert isinstance(seed, int)
    again = certify([{"a": x}], {"a": 0.5}, (0.0, 1.0), bound="betting", row_order_seed=seed)
    assert again.upper_bounds == cert.upper_bounds and again.row_order_seed == seed
    assert cert.upper_bounds[0]["a"] == upper_bound(x, (0, 1), DELTA, "betting", order_seed=seed)
    # the order is the seed's, not the data's: another seed reads the rows in another order
    orders = {tuple(bounds.random_order(50, s)[:5]) for s in (seed, seed + 1, seed + 2)}
    assert len(orders) == 3
    # an order-free bound needs no seed
    assert certify([{"a": x}], {"a": 0.5}, (0.0, 1.0)).row_order_seed is None


# ---------------------------------------------------------------------- item: the default bound
@pytest.mark.parametrize("n", [20, 100, 400])
def test_default_bounds_cover_at_every_n(n):
    rng = np.random.default_rng(n)
    # a 0/1 rate: Clopper-Pearson
    for p in (0.02, 0.1, 0.3):
        k = rng.binomial(n, p, REPS)
        assert np.mean(clopper_pearson_upper_bounds(k, n, DELTA) < p) <= allowed_misses(REPS)
    # a paired change in {-1, 0, 1}: P(+1) - P(-1)
    for p_up, p_down in ((0.03, 0.0), (0.05, 0.04), (0.2, 0.1)):
        counts = rng.multinomial(n, [p_up, p_down, 1 - p_up - p_down], REPS)
        u = paired_change_upper_bounds(counts[:, 0], counts[:, 1], n, DELTA)
        assert np.mean(u < p_up - p_down) <= allowed_misses(REPS)
    # values of no declared type in [0, 1]: Hoeffding-Bentkus, the default
    for a, b in ((0.5, 4.0), (2.0, 2.0)):
        means = rng.beta(a, b, (REPS, n)).mean(axis=1)
        assert np.mean(hoeffding_bentkus_upper_bounds(means, n, DELTA) < a / (a + b)) <= allowed_misses(REPS)


def test_the_array_forms_are_the_bounds_a_certificate_computes():
    rng = np.random.default_rng(3)
    for n in (20, 100):
        rate = (rng.random(n) < 0.1).astype(float)
        assert upper_bound(rate, (0, 1), DELTA, "clopper_pearson") == pytest.approx(
            clopper_pearson_upper_bounds([rate.sum()], n, DELTA)[0], abs=1e-12)
        change = rng.choice([-1.0, 0.0, 1.0], size=n, p=[0.05, 0.85, 0.1])
        assert upper_bound(change, (-1, 1), DELTA, "paired_change") == pytest.approx(
            paired_change_upper_bounds([np.sum(change == 1)], [np.sum(change == -1)], n, DELTA)[0], abs=1e-12)
        x = rng.beta(1, 3, n)
        assert upper_bound(x, (0, 1), DELTA) == pytest.approx(hoeffding_bentkus_upper_bounds([x.mean()], n, DELTA)[0])


def test_the_paired_bound_splits_delta_and_subtracts_rows_newly_right():
    n = 400
    forgotten_only = clopper_pearson_upper_bounds([4], n, (1 - PAIRED_LOW_SHARE) * DELTA)[0]
    assert paired_change_upper_bounds([4], [0], n, DELTA)[0] == pytest.approx(forgotten_only)
    # rows newly right lower the bound on the net change, by at most their count's lower bound
    assert paired_change_upper_bounds([4], [20], n, DELTA)[0] < forgotten_only - 0.02


@pytest.mark.parametrize("n", [20, 100, 400])
def test_the_default_is_at_least_as_tight_as_hoeffding_bentkus_near_zero(n):
    hb = smallest_certifiable("hoeffding_bentkus", (0, 1), n, DELTA)
    assert DEFAULT_BOUND == "hoeffding_bentkus"
    assert smallest_certifiable("clopper_pearson", (0, 1), n, DELTA) <= hb + 1e-12
    # betting is about twice as loose near 0 (why it is no longer the default)
    assert smallest_certifiable("betting", (0, 1), n, DELTA) > 1.5 * hb
    # a paired change with nothing forgotten: far tighter than either general bound on the range [-1, 1]
    paired = smallest_certifiable("paired_change", (-1, 1), n, DELTA)
    unchanged = np.zeros(n)
    assert paired < 0.35 * upper_bound(unchanged, (-1, 1), DELTA, "hoeffding_bentkus")
    assert paired < 0.65 * upper_bound(unchanged, (-1, 1), DELTA, "betting", order_seed=0)
    assert paired == pytest.approx(1 - ((1 - PAIRED_LOW_SHARE) * DELTA) ** (1 / n))
    # on observed rows as well: 2 of 400 forgotten, none newly right
    change = np.zeros(400)
    change[:2] = 1.0
    assert upper_bound(change, (-1, 1), DELTA, "paired_change") < upper_bound(change, (-1, 1), DELTA, "betting",
                                                                              order_seed=0)


def test_the_paired_bound_refuses_values_off_its_three_points():
    with pytest.raises(ValueError, match="constraint 'x'.*paired_change"):
        certify([{"x": np.array([0.0, 0.5, 1.0])}], {"x": 0.1}, (-1.0, 1.0), bound="paired_change")
