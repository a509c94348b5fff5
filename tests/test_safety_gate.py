"""The gated push_to_hub: refuses unsafe models (nothing uploaded) unless allow_unsafe=True.

The Hub is out of reach: ``transformers.trainer.hf_api`` is replaced by a recorder that
captures every call, and the card at upload time.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from safety_tiny import make_trainer, theta_at
from test_safety_report import assert_card_matches_report, card_body

import transformers.trainer as hf_trainer
from hf_constrained.safety.report import SafetyReport, UnsafeModelError


class RecordingHub:
    """Stands in for ``HfApi``: records create_repo / upload_folder calls and the card uploaded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.cards: list[str] = []
        self.reports: list[SafetyReport] = []

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))
        return SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"user/{repo_id}")

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))
        folder = kwargs["folder_path"]
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
    assert report.to_dict() == trainer.safety_report.to_dict()
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
    assert "SAFE: all 2 constraints hold" in card_body(card)[1]
    assert_card_matches_report(card, report)


def test_save_model_with_push_to_hub_goes_through_the_gate(tmp_path, hub):
    trainer = make_trainer(str(tmp_path / "run"), tolerance=2.0, max_steps=4, eval_strategy="no",
                           save_strategy="no", load_best_model_at_end=False, metric_for_best_model=None,
                           push_to_hub=True, hub_model_id="user/theta")
    trainer.train()
    assert hub.names() == ["create_repo"]  # the Trainer creates the repository at init
    with pytest.raises(UnsafeModelError):
        trainer.save_model()
    assert "upload_folder" not in hub.names()
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
    uploads = [kw for name, kw in hub.calls if name == "upload_folder"]
    assert [u["commit_message"] for u in uploads] == ["Training in progress, step 1", "Training in progress, step 2"]
    assert all(r.all_satisfied for r in hub.reports)
