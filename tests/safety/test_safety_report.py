"""Safety report, model card (every checkpoint and the final model), checkpoint reports, TensorBoard groups."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from safety_tiny import ThetaConfig, ThetaModel, make_trainer, theta_at

from hf_constrained.publishing.card import TEMPLATE_NAME, template_path
from hf_constrained.publishing.report import SAFETY_REPORT_NAME, SafetyReport
from hf_constrained.safety.finish import finish_run


def card_body(text: str) -> list[str]:
    """The card's non-empty lines after the YAML front matter and its first line, the verdict in one short bold
    line (checked here: every card opens with it)."""
    assert text.startswith("---\n")
    end = text.index("\n---\n", 4)
    lines = [line for line in text[end + 5:].splitlines() if line.strip()]
    verdict = lines[0]
    assert verdict.startswith("**") and verdict.endswith("**") and len(verdict) <= 200, verdict
    assert verdict.split(":")[0].strip("*") in ("Certified", "Not certified", "Passes, not certified", "Unsafe",
                                                "Not checked"), verdict
    return lines[1:]


def card_constraint_rows(text: str) -> dict[str, dict[str, str]]:
    """The constraint table of a card: name -> {column header: cell}."""
    rows = {}
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| constraint |"))

    def cells(line: str) -> list[str]:
        return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]

    header = cells(lines[start])
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        row = cells(line)
        rows[row[0]] = dict(zip(header[1:], row[1:]))
    return rows


def _close(cell: str, value) -> bool:
    if value is None:
        return cell == "n/a"
    return math.isclose(float(cell), value, rel_tol=1e-5, abs_tol=1e-9)


def assert_card_matches_report(card: str, report: SafetyReport) -> None:
    """The card's verdict table carries the report's numbers and the report's one verdict per constraint."""
    rows = card_constraint_rows(card)
    assert [name.replace(" (training data)", "") for name in rows] == [c.name for c in report.constraints]
    verdicts = {v.name: v.word for v in report.verdicts()}
    for (name, row), c in zip(rows.items(), report.constraints):
        assert row["verdict"] == verdicts[c.name]
        if report.safety_rule != "certified":
            assert _close(row["new model (held-out value)"], c.value) and _close(row["tolerance"], c.tolerance)
            assert _close(row["old model"], c.old_value)
            bound = [k for k in row if k.startswith("upper bound")]
            if bound:
                assert _close(row[bound[0]], c.upper_bound)
            for column in report.extra_columns:
                assert _close(row[column], c.extra.get(column))
        elif c.name in report.certified_bounds():
            assert _close(row["new model"], report.certified_values()[c.name])
            assert _close(row["tolerance"], report.certificate["tolerance"][c.name])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """tolerance 2, load_best_model_at_end, finish_run with an old model (theta = 0.5)."""
    out = tmp_path_factory.mktemp("report") / "run"
    trainer = make_trainer(str(out), tolerance=2.0, report_to=["tensorboard"])  # events in out/runs/
    trainer.train()
    old = ThetaModel(ThetaConfig())
    with torch.no_grad():
        old.theta.fill_(0.5)
    report = finish_run(trainer, old_model=old, base_model_name="org/theta-base",
                        dataset_description="Synthetic rows.", reproduce_command="python tests/safety_tiny.py")
    return trainer, report, out


def test_report_holds_exact_heldout_values_old_values_and_objective(run):
    trainer, report, out = run
    # the selected (step-2) weights, evaluated exactly on the held-out data
    exact = trainer.evaluate_constraints(split="eval")
    assert [c.name for c in report.constraints] == ["theta_cap", "scaled_theta"]
    for c in report.constraints:
        assert c.value == pytest.approx(exact[c.name]) and c.value == pytest.approx(theta_at(2), rel=1e-5)
        assert c.old_value == pytest.approx(0.5)  # the old model evaluated the same way
        assert c.tolerance == 2.0 and c.satisfied and c.violation == pytest.approx(theta_at(2) - 2.0, rel=1e-5)
    assert report.all_satisfied and report.global_step == 2 and report.checkpoint.endswith("checkpoint-2")
    assert report.objective_metrics["eval_loss"] == pytest.approx((theta_at(2) - 5.0) ** 2, rel=1e-5)
    assert not any("runtime" in k or "constraint" in k for k in report.objective_metrics)
    assert report.method["constraint_penalty"] == "none" and report.method["msvr_gamma"] == 0.8
    # saved as JSON in the run directory, and reloads to the same report
    saved = SafetyReport.load(str(out))
    assert saved.to_dict() == report.to_dict()
    on_disk = json.loads((out / SAFETY_REPORT_NAME).read_text())
    assert on_disk["all_satisfied"] is True and on_disk["constraints"][0]["old_value"] == pytest.approx(0.5)
    assert not [f for f in os.listdir(out) if ".tmp" in f]  # written via tmp + os.replace


def test_final_card_matches_report(run):
    trainer, report, out = run
    card = (out / "README.md").read_text()
    body = card_body(card)
    assert body[0].startswith("# run")
    assert "NOT CERTIFIED: all 2 constraints hold on held-out data by the uncertified `point` rule" in body[1]
    assert "UNSAFE" not in card
    assert_card_matches_report(card, report)
    assert "base_model: org/theta-base" in card and "Synthetic rows." in card
    assert "python tests/safety_tiny.py" in card and "@article{yang2026singleloop" in card
    assert "| penalty_beta | 10.0 |" in card and "| msvr_gamma_prime | 0.1 |" in card
    assert "feasible best" in card  # the selection summary


def test_every_checkpoint_has_a_card_and_report_of_its_own_weights(run):
    trainer, _, out = run
    for step in range(1, 7):
        ckpt = out / f"checkpoint-{step}"
        card = (ckpt / "README.md").read_text()
        report = SafetyReport.load(str(ckpt))
        assert report.constraints[0].value == pytest.approx(theta_at(step), rel=1e-5)
        assert report.all_satisfied == (step <= 2)
        assert card_body(card)[0].startswith("> **UNSAFE") == (step > 2)
        assert_card_matches_report(card, report)


def test_on_demand_report_for_a_checkpoint_leaves_the_model_alone(run):
    trainer, _, out = run
    before = float(trainer.model.theta.detach())
    report = trainer.safety.build_report(checkpoint=str(out / "checkpoint-4"))
    assert float(trainer.model.theta.detach()) == before
    assert report.global_step == 4 and not report.all_satisfied and report.failed == ["theta_cap", "scaled_theta"]
    assert report.constraints[1].value == pytest.approx(theta_at(4), rel=1e-5)
    assert report.objective_metrics["eval_loss"] == pytest.approx((theta_at(4) - 5.0) ** 2, rel=1e-5)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        trainer.safety.build_report(checkpoint=str(out / "checkpoint-99"))


def test_tensorboard_groups_constraint_scalars(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, _, out = run
    event_dirs = {os.path.dirname(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs
                  if "tfevents" in f}
    tags = set()
    for d in event_dirs:
        acc = EventAccumulator(d)
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    assert {"constraint/theta_cap/heldout", "constraint/scaled_theta/heldout",
            "constraint/summary/heldout_max_violation", "constraint/summary/heldout_all_satisfied"} <= tags
    assert "eval/loss" in tags and "train/loss" in tags  # everything else keeps the stock names
    assert not any(t.startswith("eval/constraint") for t in tags)


def test_tensorboard_rewrite_of_training_estimates():
    from hf_constrained.safety.tensorboard import rewrite_constraint_logs

    tags = rewrite_constraint_logs({"loss": 1.0, "constraint/a": 0.3, "constraint/max_estimate": 0.3,
                                    "constraint/penalty": 2.0, "eval_constraint/a": 0.2, "eval_loss": 0.9}, ["a"])
    assert tags == {"train/loss": 1.0, "constraint/a/estimate": 0.3, "constraint/summary/max_estimate": 0.3,
                    "constraint/summary/penalty": 2.0, "constraint/a/heldout": 0.2, "eval/loss": 0.9}


def test_bad_inputs_are_named(run, tmp_path):
    trainer, _, _ = run
    with pytest.raises(ValueError, match=r"missing \['scaled_theta'\]"):
        finish_run(trainer, old_model_values={"theta_cap": 0.0}, plots=False)
    with pytest.raises(FileNotFoundError, match="no safety report"):
        SafetyReport.load(str(tmp_path))
    (tmp_path / SAFETY_REPORT_NAME).write_text('{"constraints": [{"name": "a"}]}')
    with pytest.raises(ValueError, match="not a safety report"):
        SafetyReport.load(str(tmp_path))


def test_template_ships_from_model_cards_in_editable_and_wheel_installs(tmp_path):
    """One source (model_cards/); setup.py copies it into the wheel, where it is found."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert os.path.samefile(template_path(), os.path.join(repo, "model_cards", TEMPLATE_NAME))
    result = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path / "lib")],
                            cwd=repo, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    shipped = tmp_path / "lib" / "hf_constrained" / "model_cards" / TEMPLATE_NAME
    assert shipped.read_text() == open(os.path.join(repo, "model_cards", TEMPLATE_NAME)).read()


def test_constraints_without_heldout_data_are_flagged():
    from hf_constrained.publishing.card import render_model_card
    from hf_constrained.publishing.report import ConstraintResult

    report = SafetyReport([ConstraintResult("a", 0.1, 0.2, 0.0, "held-out"),
                           ConstraintResult("b", 0.3, 0.2, None, "training")], {"eval_loss": 1.0},
                          safety_rule="point")
    assert report.not_held_out == ["b"] and report.failed == ["b"]
    assert "no held-out data and were checked on their training data: b" in report.summary()
    assert "b (training data)" in report.format_table()
    card = str(render_model_card(report, model_name="m"))
    assert "| b (training data) | n/a | 0.3 | 0.2 | fails |" in card
    assert "1 constraint(s) without held-out data" in card
    assert SafetyReport.from_dict(report.to_dict()).not_held_out == ["b"]
