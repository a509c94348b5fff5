"""The quickstart (recipes/quickstart_digits.py) certifies a bounded proxy of its loss constraints: each
digit's error rate on certification images carved from that digit's unseen images, which nothing else reads."""

import numpy as np
import pytest
from scipy.stats import beta

from hf_constrained import ConstrainedTrainingArguments
from hf_constrained.recipes import quickstart_digits as qs


def _pixels(dataset):
    return {tuple(np.round(np.asarray(p), 6)) for p in dataset["pixels"]}


def test_certification_rows_are_a_seeded_share_of_each_digits_unseen_rows():
    train, constraint, test, certify = qs.make_parts(3, 0.5)
    again = qs.make_parts(3, 0.5)[3]
    assert certify["labels"] == again["labels"] and certify["pixels"] == again["pixels"]  # seeded
    assert qs.make_parts(4, 0.5)[3]["pixels"] != certify["pixels"]
    # the training and constraint rows do not depend on the certification split; the unseen rows are shared out
    base = qs.make_splits(3)
    assert base[0]["pixels"] == train["pixels"] and base[1]["pixels"] == constraint["pixels"]
    assert not _pixels(certify) & (_pixels(train) | _pixels(constraint) | _pixels(test))
    labels, test_labels = np.asarray(certify["labels"]), np.asarray(test["labels"])
    for digit in range(10):
        n_cert, n_test = int((labels == digit).sum()), int((test_labels == digit).sum())
        assert abs(n_cert - n_test) <= 1  # half of the digit's unseen rows each
    # digits 7-9 also have the training images left out to make them rare: more unseen rows
    assert min((labels == d).sum() for d in (7, 8, 9)) > 2 * max((labels == d).sum() for d in range(7))
    with pytest.raises(ValueError, match="--certify_fraction must be in"):
        qs.make_parts(0, 1.0)


def test_the_certificate_bounds_each_digits_error_rate(tmp_path):
    args = ConstrainedTrainingArguments(**{**qs.TRAINING_DEFAULTS, "output_dir": str(tmp_path), "num_train_epochs": 1,
                                           "constraint_penalty": "hinge"})
    opts = qs.QuickstartArguments(error_tolerance=1.0, delta=0.1)
    cert = qs.run(args, 0.4, opts)["certificate"]
    _, _, _, certify = qs.make_parts(0, 0.5)
    labels = np.asarray(certify["labels"])
    assert cert["certified"]  # an error rate is always <= 1
    for d in range(10):
        name, n = f"digit{d}", int((labels == d).sum())
        assert cert["rows"][name] == n
        errors = cert["error_rate"][name] * n
        assert errors == pytest.approx(round(errors))  # a 0/1 rate over the digit's certification images
        k = round(errors)
        # Clopper-Pearson at the delta the split's first look spends (0.9 of delta 0.1: the ledger of looks)
        expected = 1.0 if k == n else float(beta.ppf(1 - 0.09, k + 1, n - k))
        assert cert["upper_bound"][name] == pytest.approx(expected)
    strict = qs.run(args, 0.4, qs.QuickstartArguments(error_tolerance=0.0))["certificate"]
    assert not strict["certified"]  # a bound over finitely many images is never 0
    assert qs.certificate_line(strict, opts).startswith("NOT CERTIFIED")


@pytest.mark.parametrize("flag, value, message", [("certify_fraction", 1.0, "--certify_fraction must be in"),
                                                  ("error_tolerance", 1.5, "--error_tolerance is an error rate"),
                                                  ("delta", 0.0, "--delta must be in")])
def test_bad_certificate_flags_are_errors(flag, value, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        qs.main([f"--{flag}", str(value), "--output_dir", str(tmp_path)])
