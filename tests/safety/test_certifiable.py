"""Before training: a certification split that can never certify its tolerance is named, with its size."""

import math

import numpy as np
import pytest
from fairness_tiny import biased_split

from hf_constrained.certification.bounds import clopper_pearson_upper_bound
from hf_constrained.certification.certify import certifiability, first_look_delta, rows_needed
from hf_constrained.fairness import roc_fairness_constraints
from hf_constrained.safety.split_checks import check_certifiable


def test_roc_gaps_that_the_split_can_never_certify_are_named_with_the_group_sizes(caplog):
    certify = biased_split(400, 7)
    with caplog.at_level("WARNING", logger="hf_constrained.safety.split_checks"):
        checks = check_certifiable(roc_fairness_constraints(biased_split(200, 0), thresholds=(0.0,), kappa=0.005,
                                                            certify_data=certify))
    assert [c.name for c in checks] == ["tpr_gap@+0", "fpr_gap@+0"] and not any(c.possible for c in checks)
    positives = (int(np.sum((certify.label == 1) & (certify.group == 1))),
                 int(np.sum((certify.label == 1) & (certify.group == 0))))
    assert sorted(checks[0].rows) == sorted(positives)
    # |rate_p - rate_u| with both rates 0: each group's Clopper-Pearson bound at delta / 4 of the first look
    level = first_look_delta(0.05) / 4
    assert checks[0].floor == pytest.approx(max(clopper_pearson_upper_bound(0, n, level) for n in positives))
    for name in ("tpr_gap@+0", "fpr_gap@+0"):
        assert f"constraint {name!r}: its certification split (" in caplog.text
    assert "can never certify tolerance 0.005" in caplog.text and "per group" in caplog.text
    # a kappa the split can support: no warning
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_constrained.safety.split_checks"):
        ok = check_certifiable(roc_fairness_constraints(biased_split(200, 0), thresholds=(0.0,), kappa=0.2,
                                                        certify_data=certify))
    assert all(c.possible for c in ok) and caplog.text == ""


def test_rows_needed_is_the_fewest_that_certify_with_nothing_forgotten():
    check = certifiability("forget", "clopper_pearson", (0, 1), 0.02, [100], 0.025)
    assert not check.possible and check.floor == pytest.approx(1 - 0.025 ** (1 / 100))
    n = check.rows_needed
    assert clopper_pearson_upper_bound(0, n, 0.025) <= 0.02 < clopper_pearson_upper_bound(0, n - 1, 0.025)
    assert certifiability("forget", "clopper_pearson", (0, 1), 0.02, [n], 0.025).possible
    assert certifiability("forget", "clopper_pearson", (0, 1), 0.0, [10_000], 0.025).never
    with pytest.raises(ValueError, match="'forget': tolerance 1.5 cannot be expressed"):
        certifiability("forget", "clopper_pearson", (0, 1), 1.5, [100], 0.025)
    with pytest.raises(ValueError, match="'gap': tolerance -0.1 cannot be expressed.*difference of group means"):
        certifiability("gap", "clopper_pearson", (0, 1), -0.1, [100, 100], 0.025, absolute=True)


@pytest.mark.parametrize("delta", [0.05, 0.045, 0.0045, 0.00045, 0.025, 0.001])
@pytest.mark.parametrize("tolerance", [0.01, 0.02, 0.03, 0.05, 0.1, 0.15, 0.2, 0.25, 0.5])
def test_rows_needed_for_a_rate_is_the_closed_form_the_demo_states(tolerance, delta):
    """Clopper-Pearson with none of n forgotten bounds at ``1 - delta ** (1 / n)``: the fewest rows within
    ``tolerance`` are ``ceil(log(delta) / log(1 - tolerance))`` (what the demo's "needs at least" line says)."""
    n = rows_needed("clopper_pearson", (0.0, 1.0), tolerance, delta)
    assert n == math.ceil(math.log(delta) / math.log(1 - tolerance))
    assert certifiability("f", "clopper_pearson", (0, 1), tolerance, [n - 1], delta).rows_needed == n
