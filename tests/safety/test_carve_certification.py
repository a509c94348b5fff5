"""carve_certification: the one place the recipes carve a certification split (a seeded share of the rows,
per class when given labels, drawn from the seed alone)."""

import numpy as np
import pytest
from datasets import Dataset

from hf_constrained.certification.splits import carve_certification, check_certify_fraction


def test_a_seeded_share_disjoint_from_the_rows_left_in_stored_order():
    rows = list(range(100, 137))
    left, certify = carve_certification(rows, 0.3, 5)
    assert len(certify) == round(0.3 * 37) and sorted(left + certify) == rows and not set(left) & set(certify)
    assert left == sorted(left) and certify == sorted(certify)  # stored order kept
    assert carve_certification(rows, 0.3, 5) == (left, certify)  # seeded
    assert carve_certification(rows, 0.3, 6)[1] != certify
    # the draw is numpy's default_rng(seed).permutation: its first rows certify
    assert certify == sorted(rows[i] for i in np.random.default_rng(5).permutation(37)[:11])
    assert carve_certification(rows, 0.0, 5) == (rows, None)


def test_the_draw_does_not_depend_on_the_data_and_keeps_the_container():
    x = np.arange(20) * 3
    data = Dataset.from_dict({"x": (x[::-1]).tolist()})  # other content, same size: the same positions
    left_a, cert_a = carve_certification(x, 0.5, 1)
    left_d, cert_d = carve_certification(data, 0.5, 1)
    assert isinstance(cert_a, np.ndarray) and isinstance(cert_d, Dataset)
    assert [57 - v for v in cert_d["x"]] == cert_a.tolist() and [57 - v for v in left_d["x"]] == left_a.tolist()


def test_per_class_each_class_gets_its_share_and_others_stay():
    labels = np.array([0] * 9 + [1] * 4 + [2] * 6)
    rows = np.arange(len(labels))
    left, certify = carve_certification(rows, 0.5, [3, 1], labels=labels, classes=[0, 1])
    assert [int((labels[certify] == c).sum()) for c in (0, 1, 2)] == [4, 2, 0]  # round(4.5) = 4, round(2) = 2
    assert set(rows[labels == 2]) <= set(left) and len(left) + len(certify) == len(rows)
    # classes drawn in order from one generator (the quickstart's split, kept exactly)
    rng = np.random.default_rng([3, 1])
    expected = np.sort(np.concatenate([rng.permutation(rows[labels == c])[:n] for c, n in ((0, 4), (1, 2))]))
    assert certify.tolist() == expected.tolist()
    # a tiny share still keeps one row on each side
    assert [int((labels[carve_certification(rows, 0.01, 0, labels=labels)[1]] == c).sum()) for c in (0, 1, 2)] \
        == [1, 1, 1]


def test_errors_name_the_flag_the_part_and_the_count():
    with pytest.raises(ValueError, match=r"--certify_fraction must be in \[0, 1\), got 1.0"):
        carve_certification([1, 2, 3], 1.0, 0)
    with pytest.raises(ValueError, match="--audit_fraction must be in"):
        check_certify_fraction(-0.1, "--audit_fraction")
    with pytest.raises(ValueError, match="must be in"):
        check_certify_fraction(float("nan"))
    with pytest.raises(ValueError, match=r"--certify_fraction 0.5: digit 7 has 1 unseen row\(s\); certifying needs "
                                         r"at least 2 .*a larger --x, or --certify_fraction 0"):
        carve_certification(np.arange(5), 0.5, 0, labels=[7, 3, 3, 3, 3], name="digit", unit="unseen row(s)",
                            more="a larger --x")
    with pytest.raises(ValueError, match="2 labels for 3 rows"):
        carve_certification([1, 2, 3], 0.5, 0, labels=[0, 1])


def test_partition_by_class_cuts_each_seeded_class_permutation_into_its_parts():
    """partition_by_class (the demo's splits): per class, default_rng(seed)'s permutation cut into consecutive
    shares, the rest last; the certification split is the tail of each class's held-out part, and nothing but
    ``test`` and ``certify`` depends on ``certify_fraction``."""
    from hf_constrained.certification.splits import certification_tail, partition_by_class

    labels = np.array([0] * 40 + [1] * 23 + [2] * 31)
    shares = [("test", 0.25), ("selection", 0.15)]
    parts = partition_by_class(labels, shares, 3, rest="train", certify_from="test", certify_fraction=0.5)
    assert set(parts) == {"test", "selection", "train", "certify"}
    every = sorted(i for rows in parts.values() for i in rows)
    assert every == list(range(len(labels)))  # disjoint and complete
    rng = np.random.default_rng(3)
    for c in range(3):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_held, n_sel = int(round(len(idx) * 0.25)), int(round(len(idx) * 0.15))
        kept, certify = certification_tail(idx[:n_held], 0.5)
        assert sorted(certify.tolist()) == [i for i in parts["certify"] if labels[i] == c]
        assert sorted(kept.tolist()) == [i for i in parts["test"] if labels[i] == c]
        assert sorted(idx[n_held:n_held + n_sel].tolist()) == [i for i in parts["selection"] if labels[i] == c]
    none = partition_by_class(labels, shares, 3, rest="train", certify_from="test", certify_fraction=0.0)
    every_held = partition_by_class(labels, shares, 3, rest="train", certify_from="test", certify_fraction=1.0)
    assert not none["certify"] and not every_held["test"]
    assert sorted(parts["test"] + parts["certify"]) == none["test"] == every_held["certify"]
    assert all(parts[k] == none[k] == every_held[k] for k in ("selection", "train"))
    with pytest.raises(ValueError, match="--certify_fraction must be in \\[0, 1\\]"):
        partition_by_class(labels, shares, 3, rest="train", certify_from="test", certify_fraction=1.5)
    with pytest.raises(ValueError, match="must leave rows for 'train'"):
        partition_by_class(labels, [("a", 0.6), ("b", 0.4)], 3, rest="train")


def test_certification_tail_takes_the_last_share_in_the_given_order():
    from hf_constrained.certification.splits import certification_tail

    kept, certify = certification_tail([5, 9, 1, 7, 3], 0.4)
    assert kept.tolist() == [5, 9, 1] and certify.tolist() == [7, 3]
    assert certification_tail([5, 9], 0.0)[1].tolist() == [] and certification_tail([5, 9], 1.0)[0].tolist() == []
    with pytest.raises(ValueError, match="--share must be in \\[0, 1\\] \\(a share of the held-out images\\)"):
        certification_tail([1], -0.1, flag="--share", unit="images")
