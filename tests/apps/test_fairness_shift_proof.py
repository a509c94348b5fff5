"""The shift-proof fairness measures against a direct numpy computation."""

import numpy as np
import pytest

from hf_constrained.fairness import roc_curve_gap, roc_fairness_values, shift_proof_fairness


def data(n=500, seed=0, ties=False):
    rng = np.random.default_rng(seed)
    group = (rng.random(n) < 0.6).astype(np.int64)
    label = (rng.random(n) < 0.4).astype(np.int64)
    s = label * 1.2 + group * 0.7 + rng.normal(size=n) * np.where(group == 1, 1.0, 1.6)
    if ties:
        s = np.round(s, 1)
    return s, label, group


def brute_roc_gap(s, label, group):
    """max over f of |best TPR with FPR <= f, group p - the same, group u|, by enumeration."""
    def curve(g):
        pos, neg = s[(group == g) & (label == 1)], s[(group == g) & (label == 0)]
        ts = list(np.unique(s)) + [np.inf]
        return [((neg >= t).mean(), (pos >= t).mean()) for t in ts]

    cp, cu = curve(1), curve(0)
    fs = sorted({f for f, _ in cp} | {f for f, _ in cu})
    best = lambda c, f: max(t for ff, t in c if ff <= f + 1e-15)  # noqa: E731
    return max(abs(best(cp, f) - best(cu, f)) for f in fs)


@pytest.mark.parametrize("ties", [False, True])
def test_hard_gaps_and_roc_gap_match_direct_numpy(ties):
    s, y, g = data(ties=ties)
    out = shift_proof_fairness(s, y, g, quantiles=(0.25, 0.5, 0.75))
    for q, t, tpr_gap, fpr_gap in zip((0.25, 0.5, 0.75), out["quantile_thresholds"], out["hard_tpr_gaps"],
                                      out["hard_fpr_gaps"]):
        assert t == pytest.approx(np.quantile(s, q))
        assert tpr_gap == pytest.approx(abs((s[(g == 1) & (y == 1)] > t).mean() - (s[(g == 0) & (y == 1)] > t).mean()))
        assert fpr_gap == pytest.approx(abs((s[(g == 1) & (y == 0)] > t).mean() - (s[(g == 0) & (y == 0)] > t).mean()))
    assert out["hard_gap_max"] == max(out["hard_tpr_gaps"] + out["hard_fpr_gaps"])
    assert out["roc_gap"] == pytest.approx(brute_roc_gap(s, y, g))
    assert 0 < out["roc_gap"] <= 1


def test_a_common_shift_fools_the_soft_gaps_but_not_the_shift_proof_ones():
    s, y, g = data(seed=3)
    base = shift_proof_fairness(s, y, g)
    shifted_scores = s + 12.0  # every score beyond the largest threshold (3)
    shifted = shift_proof_fairness(shifted_scores, y, g)
    soft_before = max(roc_fairness_values(s, y, g).values())
    soft_after = max(roc_fairness_values(shifted_scores, y, g).values())
    assert soft_before > 0.05 and soft_after < 1e-3  # the soft constraints call the shifted scores fair
    assert shifted["roc_gap"] == pytest.approx(base["roc_gap"])
    assert shifted["hard_gap_max"] == pytest.approx(base["hard_gap_max"]) and base["hard_gap_max"] > 0.05
    assert base["fraction_outside_thresholds"] < 0.1 and shifted["fraction_above_max_threshold"] == 1.0


def test_identical_groups_have_no_roc_gap():
    s, y, g = data(seed=5)
    s2 = np.concatenate([s, s])
    y2, g2 = np.concatenate([y, y]), np.concatenate([np.ones_like(g), np.zeros_like(g)])
    assert roc_curve_gap(s2, y2, g2) == 0.0
    assert shift_proof_fairness(s2, y2, g2)["hard_gap_max"] == 0.0
