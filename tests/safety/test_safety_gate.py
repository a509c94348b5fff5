"""The gated push_to_hub: refuses unsafe models (nothing uploaded) unless allow_unsafe=True.

The Hub is out of reach: ``transformers.trainer.hf_api`` is replaced by a recorder that
captures every call, and the card at upload time.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch
import transformers.trainer as hf_trainer
from safety_tiny import ThetaConfig, ThetaModel, make_trainer, theta_at
from test_safety_report import assert_card_matches_report, card_body

from hf_constrained import ConstrainedTrainer
from hf_constrained.checkpointing import COMPLETE_MARKER
from hf_constrained.publishing.report import SafetyReport, UnsafeModelError
from hf_constrained.safety.finish import finish_run
from hf_constrained.trainer import CONSTRAINT_STATE_NAME


class RecordingHub:
    """Stands in for ``HfApi``: records create_repo / upload_folder calls and the card uploaded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.cards: list[str] = []
        self.reports: list[SafetyReport] = []
        self.listings: list[list[str]] = []

    def whoami(self, token=None):  # the access check of a gated trainer (no repository, no upload)
        return {"name": "user"}

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))
        return SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"user/{repo_id}")

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))
        folder = kwargs["folder_path"]
        self.listings.append(sorted(os.listdir(folder)))
        if os.path.basename(folder).startswith("checkpoint-"):  # a checkpoint folder: no card of its own
            done: Future = Future()
            done.set_result(SimpleNamespace(commit_url="https://hub.invalid/commit"))
            return done if kwargs.get("run_as_future") else done.result()
        with open(os.path.join(folder, "README.md"), encoding="utf-8") as f:
            self.cards.append(f.read())
        self.reports.append(SafetyReport.load(folder))
        done: Future = Future()
        done.set_result(SimpleNamespace(commit_url="https://hub.invalid/commit"))
        return done if kwargs.get("run_as_future") else done.result()

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


@pytest.fixture
def hub(monkeypatch):
    recorder = RecordingHub()
    monkeypatch.setattr(hf_trainer, "hf_api", lambda: recorder)
    return recorder


def trained(tmp_path, steps: int):
    """No selection: the final model is step ``steps``'s, feasible iff theta_steps <= 2 (steps <= 2)."""
    trainer = make_trainer(str(tmp_path / "run"), tolerance=2.0, max_steps=steps, eval_strategy="no",
                           save_strategy="no", load_best_model_at_end=False, metric_for_best_model=None)
    trainer.train()
    return trainer


def test_unsafe_model_is_refused_and_nothing_is_uploaded(tmp_path, hub):
    trainer = trained(tmp_path, steps=4)  # theta = 2.95 > 2
    with pytest.raises(UnsafeModelError) as err:
        trainer.push_to_hub(commit_message="release")
    message = str(err.value)
    assert "nothing was uploaded" in message and "allow_unsafe=True" in message
    assert "theta_cap" in message and "scaled_theta" in message and "UNSAFE: 2 of 2" in message
    assert hub.calls == []  # not even a repository was created


def test_override_uploads_with_unsafe_card_whose_numbers_are_the_reports(tmp_path, hub):
    trainer = trained(tmp_path, steps=4)
    trainer.push_to_hub(commit_message="release", allow_unsafe=True)
    assert hub.names() == ["create_repo", "upload_folder"]
    upload = hub.calls[1][1]
    assert upload["commit_message"] == "release" and upload["folder_path"] == trainer.args.output_dir
    card, report = hub.cards[0], hub.reports[0]
    first = card_body(card)[0]
    assert first.startswith("> **UNSAFE: 2 of 2 constraints FAIL on held-out data**")
    assert "allow_unsafe=True" in card and "constraints-violated" in card
    assert report.to_dict() == trainer.safety.report.to_dict()
    assert report.constraints[0].value == pytest.approx(theta_at(4), rel=1e-5)
    assert_card_matches_report(card, report)
    # the override is per call: a card written afterwards no longer claims it
    trainer.create_model_card()
    with open(os.path.join(trainer.args.output_dir, "README.md")) as f:
        assert "allow_unsafe=True" not in f.read()


def test_safe_model_is_pushed_with_safe_card(tmp_path, hub):
    trainer = trained(tmp_path, steps=2)  # theta = 1.8 <= 2
    trainer.push_to_hub()
    assert hub.names() == ["create_repo", "upload_folder"]
    card, report = hub.cards[0], hub.reports[0]
    assert report.all_satisfied and "UNSAFE" not in card
    assert ("NOT CERTIFIED: all 2 constraints hold on held-out data by the uncertified `point` rule"
            in card_body(card)[1])
    assert_card_matches_report(card, report)


def test_save_model_with_push_to_hub_goes_through_the_gate(tmp_path, hub):
    trainer = make_trainer(str(tmp_path / "run"), tolerance=2.0, max_steps=4, eval_strategy="no",
                           save_strategy="no", load_best_model_at_end=False, metric_for_best_model=None,
                           push_to_hub=True, hub_model_id="user/theta")
    trainer.train()
    assert hub.names() == []  # no repository before the gate has passed (the Trainer would create it at init)
    with pytest.raises(UnsafeModelError):
        trainer.save_model()
    assert hub.names() == []
    # the weights and the (UNSAFE) card were still written locally
    out = trainer.args.output_dir
    assert os.path.isfile(os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "README.md")) as f:
        assert card_body(f.read())[0].startswith("> **UNSAFE")


def test_checkpoint_pushes_during_training_only_for_feasible_checkpoints(tmp_path, hub):
    """hub_strategy='every_save': steps 1-2 are feasible and pushed; steps 3-5 are not pushed."""
    trainer = make_trainer(str(tmp_path / "run"), tolerance=2.0, max_steps=5, push_to_hub=True,
                           hub_model_id="user/theta", hub_strategy="every_save")
    trainer.train()
    # the repository is created by the first push that passed the gate, once
    assert hub.names() == ["create_repo", "upload_folder", "upload_folder"]
    uploads = [kw for name, kw in hub.calls if name == "upload_folder"]
    assert [u["commit_message"] for u in uploads] == ["Training in progress, step 1", "Training in progress, step 2"]
    assert all(r.all_satisfied for r in hub.reports)


def test_checkpoint_is_pushed_only_once_complete(tmp_path, hub):
    """hub_strategy='checkpoint' uploads the checkpoint folder: by then it holds the constraint
    state and the completeness marker (the Trainer alone would push before both are written)."""
    trainer = make_trainer(str(tmp_path / "run"), tolerance=2.0, max_steps=2, push_to_hub=True,
                           hub_model_id="user/theta", hub_strategy="checkpoint")
    trainer.train()
    checkpoint_uploads = [listing for (name, kw), listing in zip([c for c in hub.calls if c[0] == "upload_folder"],
                                                                 hub.listings)
                          if os.path.basename(kw["folder_path"]).startswith("checkpoint-")]
    assert checkpoint_uploads, "no checkpoint folder was uploaded"
    for listing in checkpoint_uploads:
        assert CONSTRAINT_STATE_NAME in listing and COMPLETE_MARKER in listing, listing


def test_push_to_hub_in_arguments_creates_no_repository_for_an_unsafe_model(tmp_path, hub):
    trainer = make_trainer(str(tmp_path / "run"), tolerance=2.0, max_steps=4, eval_strategy="no",
                           save_strategy="no", load_best_model_at_end=False, metric_for_best_model=None,
                           push_to_hub=True, hub_model_id="user/theta")
    assert hub.names() == []
    trainer.train()
    with pytest.raises(UnsafeModelError):
        trainer.push_to_hub()
    assert hub.names() == []
    trainer.push_to_hub(allow_unsafe=True)  # an explicit override: now the repository is created
    assert hub.names() == ["create_repo", "upload_folder"] and hub.calls[0][1]["repo_id"] == "user/theta"


def unsafe_state_dict() -> dict:
    unsafe = ThetaModel(ThetaConfig())
    with torch.no_grad():
        unsafe.theta.fill_(10.0)  # both constraints: 10 against a tolerance of 2
    return unsafe.state_dict()


def test_report_is_tied_to_the_weights_it_describes(tmp_path, hub):
    """finish_run says SAFE; then the weights are replaced by an unsafe model's: the cached SAFE
    report must not be used (the gate evaluates again and refuses), and cards stop saying SAFE."""
    trainer = trained(tmp_path, steps=2)
    report = finish_run(trainer, old_model_values={"theta_cap": 0.0, "scaled_theta": 0.0}, plots=False)
    assert report.all_satisfied and report.weights_fingerprint.startswith("sha256:")
    assert trainer.safety.current_report() is report
    evaluated = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.model.load_state_dict(unsafe_state_dict())
    assert trainer.safety.current_report() is None  # the report no longer describes these weights
    trainer.create_model_card()
    card = (tmp_path / "run" / "README.md").read_text()
    assert card_body(card)[0].startswith("> **NOT CHECKED") and "constraints hold on held-out data" not in card
    with pytest.raises(UnsafeModelError) as err:
        trainer.safety.check_safe_to_push()
    assert "weights changed after the last safety report" in str(err.value)
    with pytest.raises(UnsafeModelError) as err:
        trainer.push_to_hub()
    assert "UNSAFE: 2 of 2" in str(err.value) and hub.calls == []
    refused = trainer.safety.report  # the re-evaluation, of the weights now in the model
    assert refused.constraints[0].value == pytest.approx(10.0) and refused.constraints[0].old_value == 0.0
    assert refused.weights_fingerprint == trainer.safety.weights_fingerprint() != report.weights_fingerprint
    # back to the evaluated weights: evaluated again, SAFE, pushed
    trainer.model.load_state_dict(evaluated)
    trainer.push_to_hub()
    assert hub.names() == ["create_repo", "upload_folder"] and hub.reports[0].all_satisfied
    assert hub.reports[0].weights_fingerprint == report.weights_fingerprint


def test_card_after_evaluate_shows_the_evaluation(tmp_path):
    """evaluate() outside training is an exact evaluation of these weights: the card shows it."""
    trainer = trained(tmp_path, steps=2)
    trainer.evaluate()
    trainer.create_model_card()
    card = (tmp_path / "run" / "README.md").read_text()
    assert "NOT CHECKED" not in card
    assert ("NOT CERTIFIED: all 2 constraints hold on held-out data by the uncertified `point` rule"
            in card_body(card)[1])


def test_weights_fingerprint_changes_with_any_weight():
    from hf_constrained.safety.model_fingerprint import weights_fingerprint

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    before = weights_fingerprint(model)
    assert weights_fingerprint(model) == before  # deterministic
    for tensor in [model[0].weight, model[0].bias, model[1].running_mean]:
        with torch.no_grad():
            tensor.view(-1)[-1] += 1e-6
        after = weights_fingerprint(model)
        assert after != before
        before = after
    assert weights_fingerprint(model.to(torch.bfloat16)) != before  # dtype is part of the state


def test_no_method_named_in_a_hint_is_missing(tmp_path):
    """The error hints name methods that exist."""
    import re

    with pytest.raises(FileNotFoundError) as err:
        SafetyReport.load(str(tmp_path))
    from hf_constrained.safety.loop import SafetyLoop

    methods = re.findall(r"trainer\.(safety\.)?(\w+)\(", str(err.value))
    assert methods and all(hasattr(SafetyLoop if loop else ConstrainedTrainer, m) for loop, m in methods), methods


def test_checkpoints_between_evaluations_are_not_checked_and_not_flagged(tmp_path, caplog):
    """Saved every step, evaluated every second step: cards of unevaluated checkpoints say
    NOT CHECKED, evaluated ones carry their evaluation; training is no 'weights changed' event."""
    import logging

    trainer = make_trainer(str(tmp_path / "run"), tolerance=2.0, max_steps=4, eval_steps=2, save_steps=1,
                           load_best_model_at_end=False, metric_for_best_model=None)
    with caplog.at_level(logging.WARNING, logger="hf_constrained.safety.loop"):
        trainer.train()
    assert "weights changed" not in caplog.text
    for step in (1, 2, 3, 4):
        card = (tmp_path / "run" / f"checkpoint-{step}" / "README.md").read_text()
        assert card_body(card)[0].startswith("> **NOT CHECKED") == (step % 2 == 1)


@pytest.mark.parametrize("folder_report", ["its own", "a safe one copied from another checkpoint", "none"])
def test_checkpoint_push_decides_on_the_folders_weights_not_the_models(tmp_path, hub, folder_report):
    """A SAFE model in memory (the feasible best, step 2) and an UNSAFE checkpoint folder (step 4):
    ``push_checkpoint(folder)`` uploads the folder's files, so it must judge those; whatever
    report the folder holds (its own, a SAFE one of other weights, none), nothing is uploaded."""
    import shutil

    trainer = make_trainer(str(tmp_path / "run"), tolerance=2.0, max_steps=4, push_to_hub=True,
                           hub_model_id="user/theta", hub_strategy="every_save")
    trainer.train()
    assert trainer.safety.current_report().all_satisfied  # the feasible best (step 2) is in memory
    unsafe = tmp_path / "run" / "checkpoint-4"
    if folder_report == "a safe one copied from another checkpoint":
        shutil.copy(tmp_path / "run" / "checkpoint-2" / "safety_report.json", unsafe / "safety_report.json")
    elif folder_report == "none":
        os.remove(unsafe / "safety_report.json")
    hub.calls.clear()
    trainer.push_checkpoint(str(unsafe))
    assert hub.calls == []
    if folder_report != "its own":  # the folder was evaluated: its own report now says UNSAFE
        assert not SafetyReport.load(str(unsafe)).all_satisfied
    # the safe checkpoint is pushed, with a report that names the files uploaded
    from hf_constrained.certification.fingerprint import weights_files_fingerprint

    safe = tmp_path / "run" / "checkpoint-2"
    trainer.push_checkpoint(str(safe))
    assert hub.names() == ["upload_folder"] and hub.reports[-1].all_satisfied
    assert hub.reports[-1].weights_files_fingerprint == weights_files_fingerprint(str(safe))
    assert weights_files_fingerprint(trainer.args.output_dir) == weights_files_fingerprint(str(safe))


def test_checkpoint_push_during_training_never_evaluates_an_unreported_folder(tmp_path, hub, monkeypatch):
    """During training a folder without a report for its files is skipped, not evaluated (an
    evaluation would copy the model in the middle of training)."""
    trainer = make_trainer(str(tmp_path / "run"), tolerance=2.0, max_steps=2, push_to_hub=True,
                           hub_model_id="user/theta", hub_strategy="every_save")
    trainer.train()
    folder = tmp_path / "run" / "checkpoint-1"
    os.remove(folder / "safety_report.json")
    hub.calls.clear()
    monkeypatch.setattr(trainer, "is_in_train", True)
    monkeypatch.setattr(trainer.safety, "checkpoint_report",
                        lambda *a, **k: pytest.fail("the folder was evaluated during training"))
    trainer.push_checkpoint(str(folder))
    assert hub.calls == []


def test_a_pushed_folder_passes_report_check(tmp_path, hub):
    """What push_to_hub uploads (weights, card, report) verifies with ``hf-constrained report
    --check``: the report names the weight files uploaded with it."""
    from hf_constrained.certification.fingerprint import weights_files_fingerprint
    from hf_constrained.cli import main

    trainer = trained(tmp_path, steps=2)
    finish_run(trainer, plots=False)
    trainer.push_to_hub()
    assert hub.names() == ["create_repo", "upload_folder"]
    out = trainer.args.output_dir
    assert hub.reports[0].weights_files_fingerprint == weights_files_fingerprint(out) is not None
    assert main(["report", out, "--check"]) == 0


def test_an_unreachable_hub_fails_when_the_trainer_is_built(tmp_path, monkeypatch):
    """With constraints the repository is created by the first push that passes the gate; the Hub
    is still checked when the trainer is built, where the Trainer fails, not mid-training."""
    class Offline(RecordingHub):
        def whoami(self, token=None):
            raise ConnectionError("[Errno 101] Network is unreachable")

    import hf_constrained.publishing.push as push

    hub = Offline()
    monkeypatch.setattr(hf_trainer, "hf_api", lambda: hub)
    monkeypatch.setattr(push, "_offline", lambda: False)  # online, but the network is down
    with pytest.raises(RuntimeError,
                       match="the Hugging Face Hub cannot be reached or refuses the token \\(ConnectionError"):
        make_trainer(str(tmp_path / "run"), push_to_hub=True, hub_model_id="user/model", hub_token="hf_" + "x" * 34)
    # the same one-line reason as the recipes' check before training (hub_access_problem): offline mode named
    monkeypatch.setattr(push, "_offline", lambda: True)
    with pytest.raises(RuntimeError, match="push_to_hub=True, but HF_HUB_OFFLINE=1 is set") as offline:
        make_trainer(str(tmp_path / "run2"), push_to_hub=True, hub_model_id="user/model", hub_token="hf_" + "x" * 34)
    # advice in the words of the code that built the trainer: no recipe flags to drop
    assert "push_to_hub=False" in str(offline.value) and "--push_to_hub" not in str(offline.value)
    assert hub.calls == []  # nothing created

