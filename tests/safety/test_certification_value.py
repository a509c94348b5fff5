"""Constraint.certify: a constraint's certification (its split, the statistic measured there, the range of the
values) as one value, the only spelling: the separate keywords of an unreleased draft are refused."""

import dataclasses

import pytest
import torch

from hf_constrained import Certification, CertifyStatistic, Constraint
from hf_constrained.method.strategies import split_for_indicator


def rate(model, batch):
    return torch.as_tensor(batch["x"], dtype=torch.float32)


def rows(n, start=0):
    return [{"x": float(i % 2)} for i in range(start, start + n)]


def test_one_value_builds_the_certification_and_no_other_spelling_does():
    train, cert = rows(10), rows(6, 100)
    new = Constraint("r", row_fn=rate, dataset=train, certify=Certification(dataset=cert, value_range=(0, 1)))
    assert new.certify == Certification(dataset=cert, value_range=(0.0, 1.0))
    assert new.certifiable and new.certify.dataset is cert and new.certify.value_range == (0.0, 1.0)
    assert new.certification_range() == (0.0, 1.0) and new.certification_bound() == "hoeffding_bentkus"
    assert "certify_dataset" not in {f.name for f in dataclasses.fields(Constraint)}  # one field, not three
    for name in ("certify_dataset", "certify_statistic", "value_range", "confidence"):
        assert not hasattr(Constraint, name)
        with pytest.raises(TypeError, match=name):
            Constraint("r", row_fn=rate, dataset=train, **{name: None})
    plain = Constraint("r", row_fn=rate, dataset=train)
    assert plain.certify is None and not plain.certifiable


def test_a_statistic_declared_first_and_rows_added_later():
    stat = CertifyStatistic(rate, tolerance=0.3, value_range=(0.0, 1.0), bound="clopper_pearson")
    c = Constraint("r", row_fn=rate, dataset=rows(10), tolerance=0.1, certify=Certification(statistic=stat))
    assert not c.certifiable and c.certification_tolerance() == 0.3
    c.certify = dataclasses.replace(c.certify, dataset=rows(4, 50))
    assert c.certifiable and c.certify.statistic is stat and c.certification_bound() == "clopper_pearson"
    c.certify = dataclasses.replace(c.certify, dataset=rows(5, 70))  # replacing the rows keeps the statistic
    assert len(c.certify.dataset) == 5 and c.certify.statistic is stat


def test_replace_carries_the_certification_and_can_drop_it():
    c = Constraint("r", row_fn=rate, dataset=rows(10), certify=Certification(dataset=rows(4, 50), value_range=(0, 1)))
    moved = dataclasses.replace(c, fn=None, dataset=rows(8))
    assert moved.certify == c.certify
    assert dataclasses.replace(c, fn=None, certify=None).certify is None
    # two-split views draw batches only: no certification rows of their own, the statistic kept
    grad, ind = split_for_indicator([c], 0.5, seed=0)
    assert grad[0].certify == ind[0].certify == Certification(value_range=(0.0, 1.0))
    assert not grad[0].certifiable and c.certifiable


def test_bad_certification_values_name_the_constraint():
    with pytest.raises(TypeError, match="constraint 'r': certify must be a Certification, got list"):
        Constraint("r", row_fn=rate, dataset=rows(4), certify=rows(4))
    with pytest.raises(ValueError, match=r"constraint 'r': certify.value_range must be finite with low < high"):
        Constraint("r", row_fn=rate, dataset=rows(4), certify=Certification(dataset=rows(2, 9), value_range=(1, 0)))
    with pytest.raises(ValueError, match="constraint 'r': certify.dataset is empty"):
        Constraint("r", row_fn=rate, dataset=rows(4), certify=Certification(dataset=[], value_range=(0, 1)))
    with pytest.raises(ValueError, match="a data-free constraint has no certification split"):
        Constraint("r", fn=lambda m, b: torch.zeros(()), certify=Certification(dataset=rows(2), value_range=(0, 1)))
