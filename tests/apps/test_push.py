"""Publishing (issue 32, item 4): the Hub is checked before training with a one-line error, and
``hf-constrained push RUN_DIR --repo_id owner/name`` uploads a finished run only after the checks of
``report --check`` and of the gate; a refusal is one line; tracebacks only with ``--debug``."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from safety_tiny import make_trainer

from hf_constrained import cli
from hf_constrained.publishing import push
from hf_constrained.recipe_args import parse_recipe_args
from hf_constrained.safety.finish import finish_run


class StubHub:
    """Records what would be sent to the Hub; ``fail``: the exception ``whoami`` raises."""

    def __init__(self, fail: Exception | None = None, upload_error: Exception | None = None):
        self.fail, self.upload_error = fail, upload_error
        self.calls: list[tuple[str, dict]] = []

    def whoami(self, token=None):
        if self.fail is not None:
            raise self.fail
        return {"name": "user"}

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))

    def upload_folder(self, **kwargs):
        if self.upload_error is not None:
            raise self.upload_error
        self.calls.append(("upload_folder", kwargs))
        return SimpleNamespace(commit_url="https://hub.invalid/commit")


def _finished_run(tmp_path, steps: int) -> str:
    """A finished run with its weights, report and card: feasible (certified under the point rule) iff steps <= 2."""
    out = str(tmp_path / f"run{steps}")
    trainer = make_trainer(out, tolerance=2.0, max_steps=steps, eval_strategy="no", save_strategy="no",
                           load_best_model_at_end=False, metric_for_best_model=None)
    trainer.train()
    trainer.save_model()
    finish_run(trainer, plots=False, safety_rule="point")
    return out


@pytest.fixture
def offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_the_access_problem_is_named_in_one_line(monkeypatch, offline):
    problem = push.hub_access_problem(api=StubHub(fail=OSError("offline")))
    assert problem.startswith("HF_HUB_OFFLINE=1 is set") and "\n" not in problem
    assert push.hub_access_problem(api=StubHub()) is None  # a client that answers: nothing to say


def test_no_token_is_named(monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    problem = push.hub_access_problem(api=StubHub(fail=PermissionError("401 Unauthorized")))
    assert problem.startswith("no Hugging Face token") and "hf auth login" in problem


def test_a_recipe_stops_before_training_when_it_could_not_push(tmp_path, capsys, offline):
    """HF_HUB_OFFLINE=1 with --push_to_hub (or --hub_model_id): a usage error in one line, before anything loads."""
    from hf_constrained import ConstrainedTrainingArguments

    for flags in (["--push_to_hub", "true"], ["--hub_model_id", "me/x"]):
        with pytest.raises(SystemExit) as done:
            parse_recipe_args([ConstrainedTrainingArguments], ["--output_dir", str(tmp_path), *flags])
        assert done.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].endswith("and push the finished run later (hf-constrained push RUN_DIR --repo_id owner/name)")
        assert "HF_HUB_OFFLINE=1 is set" in err[-1] and flags[0] in err[-1] and "Traceback" not in "\n".join(err)


def test_push_uploads_a_certified_run_after_the_checks(tmp_path, monkeypatch, capsys):
    run = _finished_run(tmp_path, steps=2)
    hub = StubHub()
    monkeypatch.setattr(push, "hub_api", lambda: hub)
    assert cli.main(["push", run, "--repo_id", "owner/name"]) == 0
    assert [name for name, _ in hub.calls] == ["create_repo", "upload_folder"]
    upload = hub.calls[1][1]
    assert upload["folder_path"] == run and upload["repo_id"] == "owner/name"
    assert "checkpoint-*" in upload["ignore_patterns"]
    assert "pushed" in capsys.readouterr().out


def test_push_leaves_lock_files_and_training_state_out(tmp_path):
    """What the Hub's own filter (the one ``upload_folder`` applies) keeps of a run folder: the model, its card,
    report and ledger, not the empty lock file beside the ledger nor checkpoints."""
    from huggingface_hub.utils import filter_repo_objects

    names = ["model.safetensors", "README.md", "safety_report.json", "certification_ledger.json",
             "certification_ledger.json.lock", "checkpoint-2/model.safetensors", "optimizer.pt"]
    kept = list(filter_repo_objects(names, ignore_patterns=push.PUSH_IGNORE))
    assert kept == ["model.safetensors", "README.md", "safety_report.json", "certification_ledger.json"]


@pytest.mark.parametrize("damage, code, words", [
    ("unsafe", 1, "not pushed: "),
    ("edited", 2, "was edited after it was written"),
    ("no_weights", 2, "holds no weight files"),
    ("bare_name", 2, "give the full id, owner/name"),
])
def test_push_refuses_in_one_line_and_uploads_nothing(tmp_path, monkeypatch, capsys, damage, code, words):
    run = _finished_run(tmp_path, steps=4 if damage == "unsafe" else 2)
    if damage == "edited":
        path = os.path.join(run, "safety_report.json")
        data = json.load(open(path))
        data["constraints"][0]["tolerance"] = 100.0
        json.dump(data, open(path, "w"))
    if damage == "no_weights":
        os.remove(os.path.join(run, "model.safetensors"))
        # a report for weights evaluated in memory
        from hf_constrained.publishing.report import SafetyReport

        report = SafetyReport.load(run)
        report.weights_files_fingerprint = None
        report.save(run)
    hub = StubHub()
    monkeypatch.setattr(push, "hub_api", lambda: hub)
    capsys.readouterr()  # the run's own output
    assert cli.main(["push", run, "--repo_id", "name" if damage == "bare_name" else "owner/name"]) == code
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1 and "push_to_hub refused" not in err
    assert hub.calls == []


def test_push_offline_and_a_failed_upload(tmp_path, monkeypatch, capsys, offline):
    run = _finished_run(tmp_path, steps=2)
    capsys.readouterr()
    monkeypatch.setattr(push, "hub_api", lambda: StubHub(fail=OSError("offline")))
    assert cli.main(["push", run, "--repo_id", "owner/name"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("not pushed: HF_HUB_OFFLINE=1 is set") and "run the push again" in err
    assert "--push_to_hub" not in err  # the push command has no such flag to drop
    broken = StubHub(upload_error=RuntimeError("500 Server Error"))
    monkeypatch.setattr(push, "hub_api", lambda: broken)
    assert cli.main(["push", run, "--repo_id", "owner/name"]) == 2
    err = capsys.readouterr().err
    assert "the upload failed (RuntimeError: 500 Server Error); --debug shows the traceback" in err
    assert "Traceback" not in err
    with pytest.raises(RuntimeError, match="500"):
        cli.main(["push", run, "--repo_id", "owner/name", "--debug"])


def test_safe_release_without_a_push_does_not_say_push_refused(tmp_path, capsys):
    from conftest import import_script

    recipe = import_script("recipes", "safe_release_digits")
    status = recipe.main(["--output_dir", str(tmp_path / "run"), "--constraint_penalty", "none", "--max_steps", "60",
                          "--load_best_model_at_end", "false", "--learning_rate", "0.01",
                          "--eval_steps", "10", "--save_steps", "10"])
    out = capsys.readouterr().out
    gate = [line for line in out.splitlines() if line.startswith("push gate")]
    assert status == 1 and len(gate) == 1 and gate[0].startswith("push gate: closed: ")
    assert "no push was asked for" in gate[0] and "push_to_hub refused" not in out
    assert f"written to {tmp_path / 'run'}: the model, safety_report.json" in out


def test_safe_release_with_an_open_gate_says_how_to_publish(tmp_path, capsys):
    """A certified run without --hub_model_id: the gate line says no push was asked for and names the command
    that publishes this folder; the last line says where the report, card and figures are."""
    from conftest import import_script

    recipe = import_script("recipes", "safe_release_digits")
    run = tmp_path / "run"
    assert recipe.main(["--output_dir", str(run), "--max_steps", "40", "--eval_steps", "20",
                        "--save_steps", "20"]) == 0
    out = capsys.readouterr().out
    gate = [line for line in out.splitlines() if line.startswith("push gate")]
    assert gate == [f"push gate: open (no push was asked for; to publish: hf-constrained push {run} "
                    "--repo_id owner/name)"]
    assert out.rstrip().splitlines()[-1].startswith(f"written to {run}: the model, safety_report.json")
