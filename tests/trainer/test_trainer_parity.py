"""Parity with ``transformers.Trainer`` when nothing is constrained (issue 25).

Every test runs the same training with the plain ``Trainer`` and with ``ConstrainedTrainer``
in two settings:

- ``none``: no constraints, ``constraint_penalty="none"``. The run must be the Trainer's:
  the same weights (``torch.equal``), the same log entries (less the wall-clock keys), the
  same files in the output folder and its checkpoints, the same Hub calls and the same errors;
- ``satisfied``: one constraint that always holds (hinge penalty, a huge tolerance). The
  penalty's weight is 0, so the weights are the same too; the logs are the same less the
  constraint keys, and the checkpoints hold the Trainer's files plus the library's own
  (constraint state, completeness marker, model card and safety report).

The model is a small ``PreTrainedModel`` built from its config (nothing is downloaded), so it
saves, reshards and reloads like a Hub model.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import pytest
import torch
import transformers.trainer as hf_trainer
from datasets import Dataset
from scale_tiny import StopAt
from torch import nn
from transformers import EarlyStoppingCallback, PretrainedConfig, PreTrainedModel, Trainer, TrainingArguments

from hf_constrained import ConstrainedTrainer, ConstrainedTrainingArguments, Constraint
from hf_constrained.checkpointing import COMPLETE_MARKER, CheckpointError

VARIANTS = ("none", "satisfied")
LIBRARY_FILES = {"constraint_state.pt", COMPLETE_MARKER, "README.md", "safety_report.json"}
"""What a checkpoint of a constrained run holds beyond the Trainer's files."""
WALL_CLOCK_KEYS = ("_runtime", "_per_second")


# ----------------------------------------------------------------------------- builders
class ParityConfig(PretrainedConfig):
    model_type = "hf_constrained_parity"

    def __init__(self, in_dim: int = 4, hidden: int = 32, num_labels: int = 2, **kwargs: Any) -> None:
        super().__init__(num_labels=num_labels, **kwargs)
        self.in_dim = in_dim
        self.hidden = hidden


class ParityModel(PreTrainedModel):
    config_class = ParityConfig
    base_model_prefix = "parity"

    def __init__(self, config: ParityConfig) -> None:
        super().__init__(config)
        self.lin1 = nn.Linear(config.in_dim, config.hidden)
        self.lin2 = nn.Linear(config.hidden, config.num_labels)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        pass

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None, **_: Any) -> dict[str, Any]:
        logits = self.lin2(torch.tanh(self.lin1(x)))
        out = {"logits": logits}
        if labels is not None:
            out = {"loss": nn.functional.cross_entropy(logits, labels), **out}
        return out


def make_model() -> ParityModel:
    torch.manual_seed(0)
    return ParityModel(ParityConfig())


def make_data(n: int, seed: int) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] - x[:, 1] + 0.5 * torch.randn(n, generator=g) > 0).long()
    return Dataset.from_dict({"x": x.tolist(), "labels": y.tolist()})


TRAIN, EVAL = make_data(48, 0), make_data(16, 1)


def class_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(batch["x"], labels=batch["labels"])["loss"]


BASE_ARGS = dict(per_device_train_batch_size=4, per_device_eval_batch_size=8, learning_rate=0.05, report_to=[],
                 use_cpu=True, disable_tqdm=True, seed=0, logging_steps=1, save_strategy="no")
"""The Trainer's defaults otherwise: AdamW, linear decay, clipping at max_grad_norm=1 (clipped steps)."""


def build(variant: str, out: str, callbacks: Optional[list] = None, **overrides: Any) -> Trainer:
    """A ``Trainer`` (``variant="trainer"``) or a ``ConstrainedTrainer`` (``"none"``, ``"satisfied"``)."""
    kw = dict(BASE_ARGS, output_dir=out, **overrides)
    common = dict(model=make_model(), train_dataset=TRAIN, eval_dataset=EVAL, callbacks=callbacks)
    if variant == "trainer":
        return Trainer(args=TrainingArguments(**kw), **common)
    if variant == "none":
        return ConstrainedTrainer(args=ConstrainedTrainingArguments(constraint_penalty="none", **kw), **common)
    assert variant == "satisfied"
    holds = Constraint("holds", class_loss, dataset=TRAIN, tolerance=1e6)
    trainer = ConstrainedTrainer(args=ConstrainedTrainingArguments(constraint_batch_size=4, **kw), constraints=[holds],
                                 **common)
    # a scalar constraint has no certification split: the gate runs under the explicit, uncertified point rule
    # (the certificate itself is tested in test_certificate_gate.py)
    trainer.safety.configure(safety_rule="point")
    return trainer


# ----------------------------------------------------------------------------- comparisons
def is_library_key(key: str) -> bool:
    """A log key of the constraint machinery (estimates, exact values, clipping diagnostics)."""
    return key.startswith(("constraint/", "constraint_std/", "clip/")) or "_constraint" in key


def comparable_logs(history: list[dict[str, Any]], variant: str) -> list[dict[str, Any]]:
    """``log_history`` less the wall-clock keys; with a constraint, less the library's keys."""
    out = []
    for entry in history:
        kept = {k: v for k, v in entry.items() if not any(w in k for w in WALL_CLOCK_KEYS)}
        if variant == "satisfied":
            kept = {k: v for k, v in kept.items() if not is_library_key(k)}
        out.append(kept)
    return out


def files_of(folder: str, variant: str) -> list[str]:
    """Every file under ``folder`` (relative paths); with a constraint, less the library's files."""
    found = []
    for root, _, names in os.walk(folder):
        for name in names:
            if variant == "satisfied" and name in LIBRARY_FILES:
                continue
            found.append(os.path.relpath(os.path.join(root, name), folder))
    return sorted(found)


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"parameter {name} differs"


def assert_same_run(reference: Trainer, ours: Trainer, variant: str) -> None:
    """Weights, training state, logs and files of two finished runs."""
    assert_same_weights(weights(reference), weights(ours))
    assert ours.state.global_step == reference.state.global_step
    assert ours.state.best_global_step == reference.state.best_global_step
    assert ours.state.best_metric == reference.state.best_metric
    best = [t.state.best_model_checkpoint for t in (reference, ours)]
    assert [b and os.path.basename(b) for b in best] == [best[0] and os.path.basename(best[0])] * 2
    assert comparable_logs(ours.state.log_history, variant) == comparable_logs(reference.state.log_history, variant)
    if variant == "none":  # nothing extra: not a single constraint or clipping key
        assert not [k for entry in ours.state.log_history for k in entry if is_library_key(k)]
    assert files_of(ours.args.output_dir, variant) == files_of(reference.args.output_dir, variant)


def run_pair(tmp_path, variant: str, name: str, callbacks=None, **overrides: Any) -> tuple[Trainer, Trainer]:
    """The same run with ``Trainer`` and with ``ConstrainedTrainer``, each in its own folder."""
    runs = []
    for kind in ("trainer", variant):
        make_callbacks = callbacks or (lambda: None)
        trainer = build(kind, str(tmp_path / f"{name}-{kind}"), callbacks=make_callbacks(), **overrides)
        trainer.train()
        runs.append(trainer)
    return runs[0], runs[1]


# ----------------------------------------------------------------------------- training, logging, evaluation
@pytest.mark.parametrize("variant", VARIANTS)
def test_training_with_accumulation_eval_and_checkpoints(tmp_path, variant):
    """max_steps, gradient accumulation, clipping (the Trainer's default max_grad_norm), periodic
    evaluation, logging at every step, checkpoints with save_total_limit."""
    reference, ours = run_pair(tmp_path, variant, "run", max_steps=6, gradient_accumulation_steps=2,
                               eval_strategy="steps", eval_steps=3, save_strategy="steps", save_steps=2,
                               save_total_limit=2)
    assert_same_run(reference, ours, variant)
    assert sorted(os.listdir(ours.args.output_dir)) == ["checkpoint-4", "checkpoint-6"]
    # clipping happened (the diagnostics would have had something to report)
    assert any(h.get("grad_norm", 0) > 1.0 for h in reference.state.log_history)

    # evaluation and prediction after training
    got, want = ours.evaluate(), reference.evaluate()
    assert comparable_logs([got], variant) == comparable_logs([want], variant)
    test = make_data(12, 2)
    p_ours, p_ref = ours.predict(test), reference.predict(test)
    assert np.array_equal(p_ours.predictions, p_ref.predictions)
    assert np.array_equal(p_ours.label_ids, p_ref.label_ids)
    assert comparable_logs([p_ours.metrics], variant) == comparable_logs([p_ref.metrics], variant)
    assert comparable_logs(ours.state.log_history, variant) == comparable_logs(reference.state.log_history, variant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_epoch_strategies(tmp_path, variant):
    """Epoch-based training: logging, evaluation and checkpoints per epoch, the first step logged."""
    reference, ours = run_pair(tmp_path, variant, "epochs", num_train_epochs=2, per_device_train_batch_size=12,
                               logging_strategy="epoch", logging_first_step=True, eval_strategy="epoch",
                               save_strategy="epoch")
    assert reference.state.global_step == 8
    assert_same_run(reference, ours, variant)
    assert sorted(os.listdir(ours.args.output_dir)) == ["checkpoint-4", "checkpoint-8"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_load_best_model_at_end_with_save_total_limit(tmp_path, variant):
    """The best checkpoint survives the rotation of save_total_limit=1 and its weights are
    loaded at the end."""
    reference, ours = run_pair(tmp_path, variant, "best", max_steps=8, eval_strategy="steps", eval_steps=2,
                               save_strategy="steps", save_steps=2, save_total_limit=1, load_best_model_at_end=True,
                               metric_for_best_model="eval_loss", greater_is_better=True)
    assert reference.state.best_global_step == 2  # the loss falls: "greater is better" keeps the first
    assert_same_run(reference, ours, variant)
    assert "checkpoint-2" in os.listdir(ours.args.output_dir)


@pytest.mark.parametrize("variant", VARIANTS)
def test_early_stopping(tmp_path, variant):
    reference, ours = run_pair(tmp_path, variant, "early", callbacks=lambda: [EarlyStoppingCallback(1)],
                               max_steps=20, eval_strategy="steps", eval_steps=2, save_strategy="steps",
                               save_steps=2, load_best_model_at_end=True, metric_for_best_model="eval_loss",
                               greater_is_better=True)
    assert reference.state.global_step == 4  # stopped long before max_steps
    assert_same_run(reference, ours, variant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_save_only_model_checkpoints_and_resume(tmp_path, variant):
    """save_only_model: the checkpoints hold the model and the trainer state only; resuming from
    one continues with a fresh optimizer, as the Trainer does."""
    first, ours_first = run_pair(tmp_path, variant, "only", max_steps=4, save_strategy="steps", save_steps=2,
                                 save_only_model=True)
    assert_same_run(first, ours_first, variant)
    assert "optimizer.pt" not in os.listdir(os.path.join(first.args.output_dir, "checkpoint-4"))
    resumed = []
    for trainer in (first, ours_first):
        kind = "trainer" if type(trainer) is Trainer else variant
        again = build(kind, trainer.args.output_dir, max_steps=6, save_strategy="steps", save_steps=2,
                      save_only_model=True)
        again.train(resume_from_checkpoint=True)
        resumed.append(again)
    assert_same_run(resumed[0], resumed[1], variant)


# ----------------------------------------------------------------------------- resume
def _interrupted_pair(tmp_path, variant: str, name: str, **overrides: Any) -> tuple[Trainer, Trainer]:
    """8-step runs interrupted after their step-4 checkpoint."""
    kw = dict(max_steps=8, save_strategy="steps", save_steps=2, **overrides)
    return run_pair(tmp_path, variant, name, callbacks=lambda: [StopAt(4)], **kw)


def _resume_pair(stopped: tuple[Trainer, Trainer], variant: str, checkpoint: Any = True,
                 **overrides: Any) -> tuple[Trainer, Trainer]:
    out = []
    for trainer in stopped:
        kind = "trainer" if type(trainer) is Trainer else variant
        again = build(kind, trainer.args.output_dir, max_steps=8, save_strategy="steps", save_steps=2, **overrides)
        where = checkpoint if checkpoint is True else os.path.join(trainer.args.output_dir, checkpoint)
        again.train(resume_from_checkpoint=where)
        out.append(again)
    return out[0], out[1]


@pytest.mark.parametrize("variant", VARIANTS)
def test_resume_matches_the_trainer_and_the_uninterrupted_run(tmp_path, variant):
    stopped = _interrupted_pair(tmp_path, variant, "stop")
    assert_same_run(*stopped, variant)
    reference, ours = _resume_pair(stopped, variant)
    assert_same_run(reference, ours, variant)
    straight = build(variant, str(tmp_path / "straight"), max_steps=8)
    straight.train()
    assert_same_weights(weights(straight), weights(ours))


@pytest.mark.parametrize("variant", VARIANTS)
def test_resume_with_ignore_data_skip(tmp_path, variant):
    stopped = _interrupted_pair(tmp_path, variant, "skip")
    reference, ours = _resume_pair(stopped, variant, "checkpoint-4", ignore_data_skip=True)
    assert_same_run(reference, ours, variant)


def _reshard(checkpoint: str) -> None:
    """Rewrite the checkpoint's weights in shards, as ``save_pretrained(max_shard_size=...)`` does."""
    model = ParityModel.from_pretrained(checkpoint)
    os.remove(os.path.join(checkpoint, "model.safetensors"))
    model.save_pretrained(checkpoint, max_shard_size=600)
    assert "model.safetensors.index.json" in os.listdir(checkpoint)


def _drop_optimizer(checkpoint: str) -> None:
    os.remove(os.path.join(checkpoint, "optimizer.pt"))


@pytest.mark.parametrize("change", [_reshard, _drop_optimizer], ids=["resharded", "optimizer_removed"])
@pytest.mark.parametrize("how", ["latest", "named"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_resume_from_a_checkpoint_the_user_changed(tmp_path, caplog, variant, how, change):
    """Sharded weights and a deleted optimizer.pt are legitimate checkpoints: the Trainer resumes
    from them, and so does ConstrainedTrainer, to the same weights. With a constraint the
    checkpoint's record of its files names what changed, in a warning."""
    stopped = _interrupted_pair(tmp_path, variant, "changed")
    for trainer in stopped:
        change(os.path.join(trainer.args.output_dir, "checkpoint-4"))
    with caplog.at_level("WARNING", logger="hf_constrained.checkpointing"):
        reference, ours = _resume_pair(stopped, variant, True if how == "latest" else "checkpoint-4")
    assert reference.state.global_step == 8
    assert_same_run(reference, ours, variant)
    changed = [r.getMessage() for r in caplog.records if "changed since it was saved" in r.getMessage()]
    if variant == "none":
        assert changed == []  # no record, nothing to compare: the Trainer's checkpoint as it is
    else:
        removed = "model.safetensors removed" if change is _reshard else "optimizer.pt removed"
        assert len(changed) == 1 and removed in changed[0], changed


# ----------------------------------------------------------------------------- errors
def _error_of(trainer: Trainer, resume: Any) -> Exception:
    with pytest.raises(Exception) as info:
        trainer.train(resume_from_checkpoint=resume)
    return info.value


@pytest.mark.parametrize("variant", VARIANTS)
def test_missing_checkpoints_raise_the_trainers_error(tmp_path, variant):
    """A wrong path, a folder that holds no checkpoint, and ``resume_from_checkpoint=True`` with
    nothing saved: the Trainer's ``ValueError`` and wording (the library's detail may follow)."""
    os.makedirs(tmp_path / "not-a-checkpoint")
    for resume in (str(tmp_path / "no-such-checkpoint"), str(tmp_path / "not-a-checkpoint"), True):
        want = _error_of(build("trainer", str(tmp_path / "t"), max_steps=2), resume)
        got = _error_of(build(variant, str(tmp_path / "c"), max_steps=2), resume)
        assert type(want) is ValueError
        assert isinstance(got, ValueError)
        assert str(got).startswith(str(want).replace(str(tmp_path / "t"), str(tmp_path / "c"))), (got, want)
        if not isinstance(got, CheckpointError):  # the library's own error is the Trainer's, subclassed
            assert type(got) is ValueError


def test_checkpoint_error_is_the_trainers_value_error():
    assert issubclass(CheckpointError, ValueError)
    assert issubclass(CheckpointError, RuntimeError)  # what it was before: existing handlers still catch it


# ----------------------------------------------------------------------------- checkpoint pushes
class RecordingHub:
    """Stands in for ``HfApi``: records each call with the files of the uploaded folder."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def whoami(self, token=None):  # the access check of a gated trainer (no repository, no upload)
        return {"name": "user"}

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id))
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, **kwargs):
        folder = kwargs["folder_path"]
        name = os.path.basename(folder)
        self.calls.append(("upload_folder", name if name.startswith("checkpoint-") else "output_dir",
                           kwargs.get("path_in_repo"),
                           kwargs["commit_message"], sorted(os.listdir(folder))))
        done: Future = Future()
        done.set_result(SimpleNamespace(commit_url="https://hub.invalid/commit"))
        return done if kwargs.get("run_as_future") else done.result()


def _without_library_files(calls: list[tuple]) -> list[tuple]:
    return [c[:-1] + ([n for n in c[-1] if n not in LIBRARY_FILES],) if c[0] == "upload_folder" else c for c in calls]


@pytest.mark.parametrize("strategy", ["every_save", "checkpoint"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_checkpoint_pushes(tmp_path, monkeypatch, variant, strategy):
    """``hub_strategy`` and the end-of-training ``push_to_hub``: the same uploads of the same
    files. With a constraint, the pushes pass the safety gate (each checkpoint was evaluated
    and is feasible), carry the library's files too, and the repository is created by the
    first push that passed the gate instead of when the trainer is built."""
    calls = []
    for kind in ("trainer", variant):
        hub = RecordingHub()
        monkeypatch.setattr(hf_trainer, "hf_api", lambda: hub)
        trainer = build(kind, str(tmp_path / kind), max_steps=4, save_strategy="steps", save_steps=2,
                        eval_strategy="steps", eval_steps=2, push_to_hub=True, hub_model_id="user/parity",
                        hub_strategy=strategy)
        built = list(hub.calls)
        trainer.train()
        trainer.push_to_hub()  # the end-of-training push, with the model card
        with open(os.path.join(trainer.args.output_dir, "README.md"), encoding="utf-8") as f:
            card = f.read()
        calls.append((built, hub.calls, card))
    (built, pushed, card), (our_built, our_pushed, our_card) = calls
    assert built == [("create_repo", "user/parity")]  # the Trainer creates the repository when it is built
    assert [c[0] for c in pushed].count("upload_folder") >= 3
    if variant == "none":
        assert (our_built, our_pushed, our_card) == (built, pushed, card)
    else:
        assert our_built == [] and our_pushed[0] == built[0]
        # the card (README.md) is the constrained one, written with each gated push
        assert _without_library_files(our_pushed[1:]) == _without_library_files(pushed[1:])
        assert "constraint" in our_card.lower()


# ----------------------------------------------------------------------------- crash safety without extra files
class _SimulatedKill(BaseException):
    """Stands for a kill: BaseException, so nothing in the Trainer swallows it."""


def test_unconstrained_save_cut_short_leaves_the_previous_checkpoint(tmp_path, monkeypatch, caplog):
    """Without constraints a checkpoint holds the Trainer's files only (no marker), and a save
    killed before the Trainer's last file (``trainer_state.json``) is still told apart: with
    ``save_total_limit=1`` the previous checkpoint stays on disk (the rotation waits for the new
    one) and ``resume_from_checkpoint=True`` resumes from it, ending where an uninterrupted run ends."""
    original = Trainer._save_rng_state

    def dies_at_step_4(self, output_dir):
        original(self, output_dir)
        if self.state.global_step == 4:  # weights, optimizer and RNG state written; trainer_state.json not
            raise _SimulatedKill

    out = str(tmp_path / "run")
    monkeypatch.setattr(Trainer, "_save_rng_state", dies_at_step_4)
    with pytest.raises(_SimulatedKill):
        build("none", out, max_steps=8, save_strategy="steps", save_steps=2, save_total_limit=1).train()
    monkeypatch.setattr(Trainer, "_save_rng_state", original)
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4"]
    assert "trainer_state.json" not in os.listdir(os.path.join(out, "checkpoint-4"))
    assert not any(COMPLETE_MARKER in names for _, _, names in os.walk(out))

    with caplog.at_level("WARNING", logger="hf_constrained.checkpointing"):
        resumed = build("none", out, max_steps=8, save_strategy="steps", save_steps=2, save_total_limit=1)
        resumed.train(resume_from_checkpoint=True)
    assert "skipped incomplete" in caplog.text and "checkpoint-4 (no trainer_state.json" in caplog.text
    straight = build("trainer", str(tmp_path / "straight"), max_steps=8)
    straight.train()
    assert_same_weights(weights(straight), weights(resumed))
    assert sorted(os.listdir(out)) == ["checkpoint-8"]


# ----------------------------------------------------------------------------- diagnostics when asked for
def test_clipping_diagnostics_only_with_a_penalty_or_when_asked(tmp_path):
    """Clipping happens at every step here (max_grad_norm tiny). Penalty ``none`` with a
    constraint (evaluated, not trained): no clipping keys; ``clip_monitor.report = True``: they appear."""
    holds = Constraint("holds", class_loss, dataset=TRAIN, tolerance=1e6)
    args = ConstrainedTrainingArguments(constraint_penalty="none", max_steps=3, max_grad_norm=1e-3,
                                        output_dir=str(tmp_path / "a"), **{k: v for k, v in BASE_ARGS.items()})
    quiet = ConstrainedTrainer(model=make_model(), args=args, train_dataset=TRAIN, constraints=[holds])
    quiet.train()
    assert not [k for h in quiet.state.log_history for k in h if is_library_key(k)]

    asked = build("none", str(tmp_path / "b"), max_steps=3, max_grad_norm=1e-3)
    asked.clip_monitor.report = True
    asked.train()
    entries = [h for h in asked.state.log_history if "loss" in h]
    assert len(entries) == 3 and all(h["clip/clipped_fraction"] == 1.0 for h in entries)


def test_library_file_names_agree():
    from hf_constrained.checkpointing import LIBRARY_FILES
    from hf_constrained.trainer import CONSTRAINT_STATE_NAME

    assert LIBRARY_FILES == (CONSTRAINT_STATE_NAME,)


@pytest.mark.parametrize("variant", VARIANTS)
def test_callbacks_are_the_trainers(tmp_path, variant):
    """The Trainer's callbacks, in the Trainer's order. With constraints the library adds its behaviour as
    callbacks the trainer holds (TRL style), never by replacing one of the Trainer's: the TensorBoard one groups
    the constraint scalars (a subclass of the stock callback, in its place) and the callback driving the safety
    loop the trainer holds comes last, once. Without constraints: exactly the Trainer's callbacks."""
    pytest.importorskip("tensorboard")
    from transformers.integrations import TensorBoardCallback

    from hf_constrained.safety.loop import SafetyLoopCallback

    kinds = []
    for kind in ("trainer", variant):
        trainer = build(kind, str(tmp_path / kind), max_steps=1, report_to=["tensorboard"])
        kinds.append([type(cb) for cb in trainer.callback_handler.callbacks])
    if variant == "none":
        assert kinds[0] == kinds[1]
        return
    *trainers, last = kinds[1]
    assert [TensorBoardCallback if issubclass(k, TensorBoardCallback) else k for k in trainers] == kinds[0]
    assert last is SafetyLoopCallback and SafetyLoopCallback not in trainers
    assert trainer.callback_handler.callbacks[-1].loop is trainer.safety  # it drives the loop this trainer holds
