"""Margins and estimate sources as strategy objects (:mod:`hf_constrained.method.strategies`).

* each margin rule gives the documented margin on a fixed running spread, float64, recomputed here with
  numpy/scipy (the formulas the earlier flag code used: ``fixed``, ``z_c * s / sqrt(n)``, the
  empirical-Bernstein width at the union bound's share of delta);
* the one dispatch point (``margin_rules`` / ``run_margin`` / ``estimate_source``) rejects contradictory
  settings naming the constraint and the flags, and a constraint's own rule overrides the run's;
* the short spellings: ``Constraint(margin=0.1)`` is a ``FixedMargin``, and the run flags map to the same
  rules; a calibrated margin has one spelling, ``margin=CalibratedMargin(c)``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from scale_tiny import ListDataset, TinyClassifier, make_rows, per_row_ce, tiny_args
from scipy.stats import norm

from hf_constrained import (
    CalibratedMargin,
    CertificateMargin,
    Certification,
    ConstrainedTrainer,
    Constraint,
    FixedMargin,
)
from hf_constrained.constraint import CertifyStatistic
from hf_constrained.margin import Margin, margin_settings, run_margin
from hf_constrained.method.margins import RowSpread
from hf_constrained.method.strategies import OneSplit, TwoSplit, estimate_source, margin_rules, split_for_indicator


def rows(n: int) -> list[dict]:
    return [{"x": torch.zeros(6), "labels": torch.tensor(0), "g": torch.tensor(i % 2)} for i in range(n)]


def constraint(name: str, **kw) -> Constraint:
    kw.setdefault("dataset", rows(50))
    return Constraint(name, row_fn=per_row_ce, tolerance=0.3, **kw)


def eb(var: float, n: float, log_term: float, width: float) -> float:
    """The empirical-Bernstein width (Maurer & Pontil 2009) as the docs state it."""
    return math.sqrt(2.0 * var * log_term / n) + 7.0 * width * log_term / (3.0 * (n - 1.0))


def test_each_rule_gives_the_documented_margin_on_a_fixed_spread():
    cons = [constraint("fixed", margin=FixedMargin(0.07)),
            constraint("calibrated", margin=CalibratedMargin(0.9), independent_rows=20),
            constraint("gap_calibrated", margin=CalibratedMargin(0.8), dataset=rows(60), group_key="g"),
            constraint("certificate", margin=CertificateMargin(0.05),
                       certify=Certification(dataset=rows(40), value_range=(0.0, 2.0))),
            constraint("gap_certificate", margin=CertificateMargin(0.05), group_key="g", outer=torch.abs,
                       certify=Certification(dataset=rows(80), value_range=(-1.0, 1.0))),
            constraint("none")]
    spread = RowSpread(cons, margin_rules(cons, None), dtype=torch.float64)
    var = np.array([[0.3, 0.0], [0.25, 0.0], [0.4, 0.1], [0.2, 0.0], [0.5, 0.3], [0.9, 0.0]])
    batch_rows = np.array([[6, 0], [6, 0], [4, 2], [6, 0], [3.5, 2.5], [6, 0]])
    spread.var.copy_(torch.from_numpy(var.reshape(-1)))
    spread.rows.copy_(torch.from_numpy(batch_rows.reshape(-1)))
    share = batch_rows / batch_rows.sum(axis=1, keepdims=True)
    log_plain, log_gap = math.log(2 / 0.05), math.log(2 / (0.05 / 4))  # |difference|: delta / 4 per group side
    expected = [0.07,
                norm.ppf(0.9) * math.sqrt(var[1, 0] / 20),
                norm.ppf(0.8) * math.sqrt(var[2, 0] / (60 * share[2, 0]) + var[2, 1] / (60 * share[2, 1])),
                eb(var[3, 0], 40, log_plain, 2.0),
                sum(eb(var[4, g], 80 * share[4, g], log_gap, 2.0) for g in (0, 1)),
                0.0]
    got = spread.margin_values(torch.arange(len(cons))).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)
    assert got[-1] == 0.0 and min(got[:-1]) > 0.05  # not vacuous
    # a subset of constraints, in another order, gets the same numbers (the dispatch is by each one's rule)
    ids = torch.tensor([4, 0, 2])
    assert torch.equal(spread.margin_values(ids), torch.from_numpy(got)[ids])
    assert set(spread.margins()) == {c.name for c in cons[:-1]}


def test_a_constraints_own_rule_overrides_the_run_flag():
    own, plain = constraint("own", margin=0.02), constraint("plain")
    scalar = Constraint("scalar", fn=lambda m, b: m(**b)["loss"], dataset=rows(10))
    run = run_margin(confidence=0.9)
    assert run == CalibratedMargin(0.9)
    assert margin_rules([own, plain, scalar], run) == [FixedMargin(0.02), run, None]  # calibrated needs per-row values
    assert margin_rules([own, plain], None) == [FixedMargin(0.02), None]


def test_a_constraints_own_rule_overrides_the_run_flag_in_training(tmp_path):
    torch.manual_seed(0)
    train, _ = make_rows(64, 0)
    data, _ = make_rows(60, 1)
    cons = [Constraint(f"c{k}", row_fn=per_row_ce, dataset=ListDataset(data[20 * k:20 * k + 20]), tolerance=0.3,
                       margin=FixedMargin(0.02) if k == 0 else None) for k in range(3)]
    trainer = ConstrainedTrainer(model=TinyClassifier(), train_dataset=ListDataset(train), constraints=cons,
                                 args=tiny_args(str(tmp_path), constraints_per_step=3, max_steps=3,
                                                constraint_confidence=0.9))
    trainer.train()
    margins = trainer.constraint_margins()
    assert margins["c0"] == 0.02
    assert margins["c1"] > 0 and margins["c2"] > 0 and margins["c1"] != margins["c2"]  # calibrated: from the spread
    settings = trainer.engine.settings()
    assert settings.margin_rule == "calibrated(confidence=0.9)" and settings.constraint_confidence == 0.9
    assert settings.margin_rules == {"fixed(value=0.02)": 1, "calibrated(confidence=0.9)": 2}


def test_contradictory_settings_are_errors_naming_the_constraint_and_the_flags():
    with pytest.raises(ValueError, match="constraint_margin=0.1 and constraint_confidence=0.9"):
        run_margin(margin=0.1, confidence=0.9)
    with pytest.raises(ValueError, match="constraint_confidence=0.9 and constraint_certificate_delta=0.05"):
        run_margin(confidence=0.9, certificate_delta=0.05)
    with pytest.raises(TypeError, match="confidence"):  # margin=CalibratedMargin(c) is the one spelling
        constraint("c", confidence=0.9)
    with pytest.raises(ValueError, match="constraint 's': confidence needs per-row values"):
        Constraint("s", fn=lambda m, b: m(**b)["loss"], dataset=rows(10), margin=CalibratedMargin(0.9))
    # a margin sized to the certificate on a constraint that certifies another statistic: named, before training
    stat = CertifyStatistic(per_row_ce, tolerance=0.1, value_range=(0, 1))
    proxy = constraint("proxy", margin=CertificateMargin(0.05), certify=Certification(dataset=rows(20), statistic=stat))
    with pytest.raises(ValueError, match=r"constraint 'proxy': Constraint.margin=certificate\(delta=0.05\)"):
        margin_rules([proxy], None)
    with pytest.raises(ValueError, match="constraint_confidence must be in"):
        run_margin(confidence=1.2)
    with pytest.raises(ValueError, match="constraint 'c': margin must be a finite number >= 0"):
        constraint("c", margin=-0.1)
    with pytest.raises(TypeError, match="constraint 'c': margin must be a number or a Margin"):
        constraint("c", margin="0.1")
    assert estimate_source(proxy_indicator=True) == OneSplit(proxy_statistic=True)  # the gradient's own rows
    with pytest.raises(ValueError, match="give constraint_indicator_fraction too"):
        estimate_source(indicator_batch_size=8)
    with pytest.raises(ValueError, match="constraint_indicator_fraction must be in"):
        estimate_source(indicator_fraction=1.5)


def test_a_run_rule_that_cannot_size_some_constraints_says_which(caplog):
    scalar = Constraint("scalar", fn=lambda m, b: m(**b)["loss"], dataset=rows(10))
    with caplog.at_level(logging.WARNING, logger="hf_constrained.method.strategies"):
        assert margin_rules([scalar, constraint("c")], run_margin(certificate_delta=0.05)) == [None, None]
    assert "constraint_certificate_delta" in caplog.text and "['scalar', 'c']" in caplog.text


def test_a_number_is_a_fixed_margin_and_the_flags_map_to_the_same_rules():
    assert constraint("c", margin=0.1).margin == FixedMargin(0.1)
    assert constraint("c", margin=CalibratedMargin(0.9)).margin == CalibratedMargin(0.9)
    assert run_margin() is None and run_margin(margin=0.0) == FixedMargin(0.0)
    assert run_margin(certificate_delta=0.1) == CertificateMargin(0.1)


def test_a_margin_rule_stands_for_its_flag_and_its_value():
    """Each run flag gives the rule that reports that flag back with the same value, the other flags ``None``;
    a rule no flag spells (a user's own class, even a subclass of a flag's) reports no flag."""
    for flag, value in (("margin", 0.05), ("confidence", 0.9), ("certificate_delta", 0.01)):
        expected = dict.fromkeys(("constraint_margin", "constraint_confidence", "constraint_certificate_delta"))
        expected[f"constraint_{flag}"] = value
        assert margin_settings(run_margin(**{flag: value})) == expected

    @dataclass(frozen=True)
    class Wider(FixedMargin):
        extra: float = 1.0

    assert set(margin_settings(Wider(0.1)).values()) == {None} and set(margin_settings(None).values()) == {None}

    @dataclass(frozen=True)
    class Constant(Margin):  # a user's own rule on the base class: what it must define is what a margin needs
        def coefficient(self, constraint: Constraint) -> float:
            return 0.02

        @classmethod
        def margins(cls, coefficient: torch.Tensor, at: object) -> torch.Tensor:
            return coefficient

    assert Constant().flag_value() is None and set(margin_settings(Constant()).values()) == {None}


def test_a_bad_indicator_fraction_is_one_error_naming_the_flag_before_training(tmp_path):
    """One check (``check_indicator_fraction``), one message, from the arguments, the strategy and the split
    itself. The arguments read 0 as one split (documented in the field's help: a command line or a config file
    cannot pass None); the strategy and the split refuse it."""
    from hf_constrained import ConstrainedTrainingArguments

    message = r"constraint_indicator_fraction must be in \(0, 1\), got "
    for bad in (0.0, 1.0, -0.2, 1.5):
        if bad:
            with pytest.raises(ValueError, match=message + str(bad)):
                ConstrainedTrainingArguments(output_dir=str(tmp_path), report_to=[], constraint_indicator_fraction=bad)
        with pytest.raises(ValueError, match=message + str(bad)):
            TwoSplit(bad)
        with pytest.raises(ValueError, match=message + str(bad)):
            split_for_indicator([], bad, seed=0)
    off = ConstrainedTrainingArguments(output_dir=str(tmp_path), report_to=[], constraint_indicator_fraction=0)
    assert off.constraint_indicator_fraction is None and off.estimate_source() == OneSplit()
    assert "0 (or unset): one split" in ConstrainedTrainingArguments.__dataclass_fields__[
        "constraint_indicator_fraction"].metadata["help"]
    with pytest.raises(ValueError, match=message + "True"):
        TwoSplit(True)
    assert ConstrainedTrainingArguments(output_dir=str(tmp_path), report_to=[],
                                        constraint_indicator_fraction=0.25).estimate_source() == TwoSplit(0.25)


def test_the_estimate_source_stands_for_its_flags():
    assert estimate_source() == OneSplit() and estimate_source(indicator_fraction=0.0) == OneSplit()
    source = estimate_source(indicator_fraction=0.25, indicator_batch_size=12, proxy_indicator=True)
    assert source == TwoSplit(0.25, 12, True)
    assert source.describe() == "two_split(fraction=0.25, indicator_batch_size=12, proxy_statistic=True)"
    assert source.settings(batch_size=8) == {"constraint_indicator_fraction": 0.25,
                                             "constraint_indicator_batch_size": 12,
                                             "constraint_proxy_indicator": True}
    assert TwoSplit(0.5).settings(batch_size=8)["constraint_indicator_batch_size"] == 8  # resolved: |B_k|
    assert OneSplit().describe() == "one_split" and OneSplit().estimate_batch_size(8) is None
    assert OneSplit(True).describe() == "one_split(proxy_statistic=True)"
    assert OneSplit(True).settings(batch_size=8) == {"constraint_indicator_fraction": None,
                                                     "constraint_indicator_batch_size": None,
                                                     "constraint_proxy_indicator": True}


def test_the_engine_holds_one_row_part_under_one_split_and_two_under_two(tmp_path):
    torch.manual_seed(0)
    train, _ = make_rows(64, 0)
    data, _ = make_rows(60, 1)

    def trainer(**kw):
        cons = [Constraint(f"c{k}", row_fn=per_row_ce, dataset=ListDataset(data[20 * k:20 * k + 20]), tolerance=0.3)
                for k in range(3)]
        return ConstrainedTrainer(model=TinyClassifier(), train_dataset=ListDataset(train), constraints=cons,
                                  args=tiny_args(str(tmp_path), **kw))

    one = trainer().engine
    assert one.estimate_rows is one.gradient_rows and not one.separate_estimate
    two = trainer(constraint_indicator_fraction=0.5, constraint_indicator_batch_size=4).engine
    assert two.separate_estimate and two.estimate_rows.values.batch_size == 4
    assert [len(v.dataset) for v in two.estimate_rows.views] == [10, 10, 10]
    assert two.settings().estimate_source == "two_split(fraction=0.5, indicator_batch_size=4, proxy_statistic=False)"
