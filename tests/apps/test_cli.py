"""``hf-constrained report`` and ``hf-constrained plot`` on a finished tiny run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from safety_tiny import make_trainer, theta_at

from hf_constrained.cli import main
from hf_constrained.safety.finish import finish_run
from hf_constrained.safety.report import SafetyReport

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A hinge-penalty run (so training estimates are logged too), finished with finish_run."""
    out = tmp_path_factory.mktemp("cli") / "run"
    trainer = make_trainer(str(out), tolerance=2.0, max_steps=4, penalty="hinge")
    trainer.train()
    finish_run(trainer, old_model_values={"theta_cap": 0.0, "scaled_theta": 0.0}, plots=False)
    return out


def test_report_prints_the_safety_table(run_dir, capsys):
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    report = SafetyReport.load(str(run_dir))
    assert report.format_table() in out
    for c in report.constraints:
        assert c.name in out
    assert "SAFE: all 2 constraints hold" in out and "eval_loss = " in out and "feasible best" in out


def test_report_json_and_check_exit_codes(run_dir, tmp_path, capsys):
    assert main(["report", str(run_dir), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == SafetyReport.load(str(run_dir)).to_dict()
    # an unsafe checkpoint: --check turns the verdict into the exit status
    ckpt = run_dir / "checkpoint-4"
    assert not SafetyReport.load(str(ckpt)).all_satisfied
    assert main(["report", str(ckpt)]) == 0
    assert "UNSAFE: 2 of 2" in capsys.readouterr().out
    assert main(["report", str(ckpt), "--check"]) == 1
    assert main(["report", str(run_dir), "--check"]) == 0
    assert main(["report", str(tmp_path)]) == 2
    assert "no safety report" in capsys.readouterr().err


def test_plot_writes_constraint_and_objective_figures(run_dir, tmp_path, capsys):
    out = tmp_path / "figs"
    assert main(["plot", str(run_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(os.path.basename(p) for p in printed) == ["constraints.png", "objective.png"]
    for name in ("constraints.png", "objective.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "no trainer_state.json" in capsys.readouterr().err


def test_plot_uses_training_estimates_and_heldout_values(run_dir):
    """The plotted series are the log history's: estimates (constraint/<name>) and exact values."""
    from hf_constrained.safety.figures import _series, split_at_train_end

    with open(run_dir / "trainer_state.json") as f:
        history = json.load(f)["log_history"]
    during, after = split_at_train_end(history)
    steps, values = _series(during, "eval_constraint/theta_cap")
    assert steps == [1, 2, 3, 4]
    assert len(after) == 1 and after[0]["eval_constraints_satisfied"] == 1.0  # the report's evaluation
    est_steps, _ = _series(during, "constraint/theta_cap")
    assert est_steps == [1, 2, 3, 4]  # the MSVR estimate, logged every step
    assert values[0] == pytest.approx(theta_at(1), rel=1e-5)  # step 1: no penalty gradient yet


def test_console_script(run_dir):
    exe = os.path.join(os.path.dirname(sys.executable), "hf-constrained")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "hf_constrained.cli"]
    result = subprocess.run(cmd + ["report", str(run_dir)], capture_output=True, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    assert "held-out value" in result.stdout and "theta_cap" in result.stdout


def test_check_refuses_a_report_without_constraints(tmp_path, capsys):
    from hf_constrained.safety.report import SafetyReport as Report

    Report(constraints=[]).save(str(tmp_path))
    assert main(["report", str(tmp_path)]) == 0
    assert "NOT CHECKED: the report has no constraints" in capsys.readouterr().out
    assert main(["report", str(tmp_path), "--check"]) == 2
    assert "holds no constraints" in capsys.readouterr().err


def test_find_trainer_state_skips_an_incomplete_checkpoint(tmp_path):
    """A checkpoint a kill interrupted (no completeness marker) is not read by the command line."""
    from hf_constrained.checkpointing import mark_complete
    from hf_constrained.cli import find_trainer_state

    for step in (2, 4):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    mark_complete(str(tmp_path / "checkpoint-2"), 2)  # checkpoint-4 was interrupted
    assert find_trainer_state(str(tmp_path)) == str(tmp_path / "checkpoint-2" / "trainer_state.json")
    mark_complete(str(tmp_path / "checkpoint-4"), 4)
    assert find_trainer_state(str(tmp_path)) == str(tmp_path / "checkpoint-4" / "trainer_state.json")
