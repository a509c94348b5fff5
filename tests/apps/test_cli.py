"""``hf-constrained report`` and ``hf-constrained plot`` on a finished tiny run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from safety_tiny import make_trainer, theta_at

from hf_constrained.cli import main
from hf_constrained.publishing.report import SafetyReport
from hf_constrained.safety.finish import finish_run

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
    assert "PASSES, NOT CERTIFIED (uncertified 'point' rule): all 2 constraints hold" in out
    assert "eval_loss = " in out and "feasible best" in out


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
    from hf_constrained.publishing.figures import _series, split_at_train_end

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
    from hf_constrained.publishing.report import SafetyReport as Report

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


# ----------------------------------------------------------------------------- --check verifies
def _copy_checkpoint(run_dir, step: int, dest):
    import shutil

    shutil.copytree(run_dir / f"checkpoint-{step}", dest)
    return dest


def test_check_is_certified_only_for_the_weights_the_report_describes(run_dir, tmp_path, capsys):
    """Exit 0 for an intact safe checkpoint; 2 once its weight file is replaced (here by the
    unsafe checkpoint-4's), or deleted; 1 for an intact unsafe checkpoint."""
    from hf_constrained.publishing.verify import check_run_dir

    safe = _copy_checkpoint(run_dir, 2, tmp_path / "safe")
    assert SafetyReport.load(str(safe)).all_satisfied
    assert SafetyReport.load(str(safe)).weights_files_fingerprint.startswith("sha256:")
    assert main(["report", str(safe), "--check"]) == 0
    assert "--check: PASSES, NOT CERTIFIED (uncertified 'point' rule)" in capsys.readouterr().out  # its own verdict
    assert main(["report", str(_copy_checkpoint(run_dir, 4, tmp_path / "unsafe")), "--check"]) == 1
    assert "--check: UNSAFE: 2 of 2 constraints fail" in capsys.readouterr().out

    replaced = _copy_checkpoint(run_dir, 2, tmp_path / "replaced")
    (replaced / "model.safetensors").write_bytes((run_dir / "checkpoint-4" / "model.safetensors").read_bytes())
    assert main(["report", str(replaced), "--check"]) == 2
    assert "changed after" in capsys.readouterr().err
    assert check_run_dir(str(replaced)).exit_code == 2
    # without --check the table is still printed (exit 0): only --check vouches for the files
    assert main(["report", str(replaced)]) == 0

    (replaced / "model.safetensors").unlink()
    assert main(["report", str(replaced), "--check"]) == 2
    assert "missing" in capsys.readouterr().err


def test_check_refuses_weights_the_report_never_recorded(run_dir, tmp_path, capsys):
    """The output directory's report describes weights evaluated in memory (finish_run saved no
    weights there): certified as long as no weight files appear; unsafe weights put there later
    are not vouched for (exit 2)."""
    import shutil

    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(run_dir / "safety_report.json", out)
    assert SafetyReport.load(str(out)).weights_files_fingerprint is None
    assert main(["report", str(out), "--check"]) == 0
    shutil.copy(run_dir / "checkpoint-4" / "model.safetensors", out)
    assert main(["report", str(out), "--check"]) == 2
    assert "does not record the weight files" in capsys.readouterr().err


@pytest.mark.parametrize("edit", ["value", "verdict", "tolerance", "digest_removed"])
def test_check_refuses_a_report_edited_by_hand(run_dir, tmp_path, capsys, edit):
    """A report changed after it was written (a value, the stored verdict, a tolerance) no
    longer matches its content digest: exit 2, whatever it claims."""
    ckpt = _copy_checkpoint(run_dir, 4, tmp_path / "edited")  # unsafe: an edit would make it look safe
    path = ckpt / "safety_report.json"
    data = json.loads(path.read_text())
    if edit == "value":
        for c in data["constraints"]:
            c["value"] = 0.5
    elif edit == "verdict":
        data["all_satisfied"], data["failed"] = True, []
    elif edit == "tolerance":
        for c in data["constraints"]:
            c["tolerance"] = 100.0
    else:
        for c in data["constraints"]:
            c["value"] = 0.5
        del data["content_digest"]
    path.write_text(json.dumps(data, indent=2))
    assert main(["report", str(ckpt), "--check"]) == 2
    err = capsys.readouterr().err
    assert ("edited" in err) if edit != "digest_removed" else ("no content_digest" in err)
    assert "certified" not in err.replace("not certified", "")


def test_check_refuses_an_unreadable_report(tmp_path, capsys):
    (tmp_path / "safety_report.json").write_text("{not json")
    assert main(["report", str(tmp_path), "--check"]) == 2
    assert "cannot be read" in capsys.readouterr().err


def test_report_into_a_closed_pipe_prints_no_traceback(run_dir):
    """``hf-constrained report RUN --json | head -1``: the reader goes away; no BrokenPipeError
    traceback on stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "hf_constrained.cli", "report", str(run_dir), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    proc.stdout.close()  # before the command writes anything: every write meets a closed pipe
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert "BrokenPipe" not in err and "Traceback" not in err, err


def test_check_certifies_weights_saved_before_finish_run_and_not_older_ones(tmp_path, capsys):
    """``trainer.save_model(out)`` then ``finish_run``: the report names the files (exit 0). Weights
    saved, then changed in memory before ``finish_run``: the files are not the evaluated weights,
    so the report does not vouch for them (exit 2)."""
    import torch

    out = tmp_path / "run"
    trainer = make_trainer(str(out), tolerance=2.0, max_steps=2, eval_strategy="no", save_strategy="no",
                           load_best_model_at_end=False, metric_for_best_model=None)
    trainer.train()
    trainer.save_model(str(out))
    report = finish_run(trainer, plots=False)
    assert report.all_satisfied and SafetyReport.load(str(out)).weights_files_fingerprint is not None
    assert main(["report", str(out), "--check"]) == 0

    with torch.no_grad():
        trainer.model.theta.fill_(1.0)  # still safe, but not the weights in the files
    finish_run(trainer, plots=False)
    assert SafetyReport.load(str(out)).weights_files_fingerprint is None
    assert main(["report", str(out), "--check"]) == 2
    assert "does not record the weight files" in capsys.readouterr().err


def test_weight_files_cover_shards_adapters_and_fsdp_folders(tmp_path):
    """Every kind of saved weights counts: a change to any of their files changes the fingerprint;
    a shard that the index lists but that is missing is an error naming it."""
    from hf_constrained.certification.fingerprint import weight_files, weights_files_fingerprint

    assert weight_files(str(tmp_path)) == [] and weights_files_fingerprint(str(tmp_path)) is None
    (tmp_path / "README.md").write_text("not weights")
    (tmp_path / "config.json").write_text("{}")
    assert weight_files(str(tmp_path)) == []  # a config alone is not a model
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"1")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        weight_files(str(tmp_path))
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"2")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"3")
    (tmp_path / "pytorch_model_fsdp_0").mkdir()
    (tmp_path / "pytorch_model_fsdp_0" / "__0_0.distcp").write_bytes(b"4")
    assert weight_files(str(tmp_path)) == [
        "adapter_model.safetensors", "config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model_fsdp_0/__0_0.distcp"]
    before = weights_files_fingerprint(str(tmp_path))
    for name in weight_files(str(tmp_path)):
        path = tmp_path / name
        data = path.read_bytes()
        path.write_bytes(data + b" ")
        assert weights_files_fingerprint(str(tmp_path)) != before, name
        path.write_bytes(data)
    assert weights_files_fingerprint(str(tmp_path)) == before
