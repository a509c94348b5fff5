"""The safety report with uncertainty: upper confidence bounds, verdicts, the rule that
decides, margins and caller-supplied columns.

The trainer's ``constraint_statistics(split, confidence)`` (per-row values -> CLT bounds)
is provided here by a small subclass that computes each row's value with the constraint's
own function; the bound in the report is checked against a direct numpy computation.
"""

from __future__ import annotations

import json
import math
from statistics import NormalDist

import numpy as np
import pytest
import torch
from safety_tiny import make_trainer, theta_at
from test_safety_gate import hub  # noqa: F401 (fixture)
from test_safety_report import assert_card_matches_report, card_constraint_rows

from hf_constrained import ConstrainedTrainer
from hf_constrained.batches import collate_examples
from hf_constrained.cli import main
from hf_constrained.publishing.report import SafetyReport, UnsafeModelError
from hf_constrained.safety.finish import finish_run
from hf_constrained.statistics import ConstraintStatistic, constraint_statistic

HELD_OUT_X = np.array([0.25, 1.75, 1.0] * 3)  # safety_tiny.constraints(): scaled_theta's held-out rows


class StatsTrainer(ConstrainedTrainer):
    """A trainer with per-row statistics and margins (the interface the report uses)."""

    @torch.no_grad()
    def constraint_statistics(self, split="eval", confidence=0.95, model=None):
        model = model if model is not None else self.model
        out = {}
        for c in self.constraints:
            if c.data_free:
                out[c.name] = ConstraintStatistic(value=float(c.fn(model, None)))
                continue
            data = c.eval_dataset if split == "eval" and c.eval_dataset is not None else c.dataset
            rows = [float(c.fn(model, (c.collate_fn or collate_examples)([data[i]]))) for i in range(len(data))]
            out[c.name] = constraint_statistic(rows, confidence=confidence)
        return out

    def constraint_margins(self):
        return {"scaled_theta": 0.05}


def numpy_upper_bound(theta: float, confidence: float) -> float:
    values = HELD_OUT_X * theta
    z = NormalDist().inv_cdf(confidence)
    return float(values.mean() + z * values.std(ddof=1) / math.sqrt(values.size))


@pytest.fixture
def finished(tmp_path):
    """Two SGD steps (theta = 1.8 <= 2): the values hold, scaled_theta's 95% bound (2.44) does not."""
    trainer = make_trainer(str(tmp_path / "run"), tolerance=2.0, max_steps=2, eval_strategy="no",
                           save_strategy="no", load_best_model_at_end=False, metric_for_best_model=None,
                           trainer_cls=StatsTrainer)
    trainer.train()
    extra = {"old accuracy": {"scaled_theta": 0.9, "theta_cap": 0.8}, "new accuracy": {"scaled_theta": 0.875}}
    report = finish_run(trainer, old_model_values={"theta_cap": 0.0, "scaled_theta": 0.0}, plots=False,
                        extra_columns=extra)
    return trainer, report, tmp_path / "run"


@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_upper_bound_matches_numpy(tmp_path, confidence):
    trainer = make_trainer(str(tmp_path / "run"), tolerance=2.0, max_steps=2, eval_strategy="no",
                           save_strategy="no", load_best_model_at_end=False, metric_for_best_model=None,
                           trainer_cls=StatsTrainer)
    trainer.train()
    report = trainer.safety.build_report(confidence=confidence)
    theta = float(trainer.model.theta.detach())
    scaled = report.constraints[1]
    assert scaled.value == pytest.approx(float(HELD_OUT_X.mean() * theta), rel=1e-6)
    assert scaled.upper_bound == pytest.approx(numpy_upper_bound(theta, confidence), rel=1e-6)
    assert scaled.std_error == pytest.approx(theta * HELD_OUT_X.std(ddof=1) / 3.0, rel=1e-6)
    assert (scaled.num_rows, scaled.confidence, scaled.bound_method) == (9, confidence, "CLT")
    cap = report.constraints[0]  # data-free: exact, no sampling error
    assert cap.upper_bound == cap.value and cap.bound_method == "exact"


def test_verdicts_and_rules(finished, hub, capsys):  # noqa: F811 (fixture)
    trainer, report, out = finished
    cap, scaled = report.constraints
    assert scaled.upper_bound == pytest.approx(numpy_upper_bound(theta_at(2), 0.95), rel=1e-5)
    assert scaled.upper_bound > 2.0 >= scaled.value
    assert cap.bound_satisfied and scaled.bound_satisfied is False  # the CLT bound is a diagnostic, no verdict
    assert report.safety_rule == "point" and report.all_satisfied
    assert [(v.name, v.word) for v in report.verdicts()] == [("theta_cap", "holds"), ("scaled_theta", "holds")]
    strict = report.with_rule("upper_bound")
    assert not strict.all_satisfied and strict.failed == ["scaled_theta"]
    # the gate: the point rule passes, the bound rule refuses (nothing uploaded)
    with pytest.raises(UnsafeModelError, match="upper confidence bounds"):
        trainer.push_to_hub(safety_rule="upper_bound")
    assert hub.calls == []
    trainer.push_to_hub(safety_rule="point")
    assert hub.names() == ["create_repo", "upload_folder"]
    # the command line: same rule, same answer
    assert main(["report", str(out), "--check"]) == 0
    assert main(["report", str(out), "--check", "--rule", "upper_bound"]) == 1
    printed = capsys.readouterr().out
    assert "UNSAFE: 1 of 2" in printed and "upper bound (95% CLT)" in printed
    with pytest.raises(ValueError, match="safety_rule must be one of certified, point, upper_bound"):
        trainer.safety.check_safe_to_push(safety_rule="lower")


def test_finish_run_with_the_bound_rule_is_unsafe(tmp_path):
    trainer = make_trainer(str(tmp_path / "run"), tolerance=2.0, max_steps=2, eval_strategy="no",
                           save_strategy="no", load_best_model_at_end=False, metric_for_best_model=None,
                           trainer_cls=StatsTrainer)
    trainer.train()
    report = finish_run(trainer, plots=False, safety_rule="upper_bound")
    assert not report.all_satisfied and SafetyReport.load(str(tmp_path / "run")).safety_rule == "upper_bound"
    assert main(["report", str(tmp_path / "run"), "--check"]) == 1  # the report's own rule
    assert main(["report", str(tmp_path / "run"), "--check", "--rule", "point"]) == 0
    with pytest.raises(UnsafeModelError):
        trainer.safety.check_safe_to_push()  # finish_run's rule stays in force


def test_bounds_margins_and_extra_columns_in_json_table_and_card(finished):
    trainer, report, out = finished
    data = json.loads((out / "safety_report.json").read_text())
    scaled = data["constraints"][1]
    assert scaled["upper_bound"] == pytest.approx(numpy_upper_bound(theta_at(2), 0.95), rel=1e-5)
    assert (scaled["confidence"], scaled["bound_method"], scaled["margin"]) == (0.95, "CLT", 0.05)
    assert (scaled["verdict"], scaled["passes"]) == ("holds", True)  # the report's rule ('point'), the one verdict
    assert scaled["extra"] == {"old accuracy": 0.9, "new accuracy": 0.875}
    assert data["extra_columns"] == ["old accuracy", "new accuracy"]
    assert SafetyReport.load(str(out)).to_dict() == report.to_dict()
    card = (out / "README.md").read_text()
    assert_card_matches_report(card, report)
    rows = card_constraint_rows(card)
    assert rows["scaled_theta"]["margin"] == "0.05" and rows["theta_cap"]["margin"] == "n/a"
    assert rows["theta_cap"]["old accuracy"] == "0.8" and rows["theta_cap"]["new accuracy"] == "n/a"
    table = report.format_table()
    assert "old accuracy" in table.splitlines()[0] and "0.875" in table


def test_extra_columns_are_checked(tmp_path):
    trainer = make_trainer(str(tmp_path / "run"), max_steps=1, eval_strategy="no", save_strategy="no",
                           load_best_model_at_end=False, metric_for_best_model=None)
    trainer.train()
    with pytest.raises(ValueError, match=r"extra_columns\['acc'\] names unknown constraint\(s\) \['nope'\]"):
        finish_run(trainer, plots=False, extra_columns={"acc": {"nope": 1.0}})


def test_without_statistics_the_report_has_values_only(tmp_path):
    """A trainer without constraint_statistics: no bounds for data constraints; the bound
    rule then judges them on their value and says so."""
    trainer = make_trainer(str(tmp_path / "run"), tolerance=2.0, max_steps=2, eval_strategy="no",
                           save_strategy="no", load_best_model_at_end=False, metric_for_best_model=None)
    trainer.train()
    report = finish_run(trainer, plots=False, safety_rule="upper_bound")
    assert report.constraints[1].upper_bound is None and report.without_bound == ["scaled_theta"]
    assert report.all_satisfied
    assert "have no confidence bound and were judged on their value: scaled_theta" in report.summary()
