"""Complete-or-ignored checkpoints: kill -9 at any point of a save, then resume.

``hf_constrained.checkpointing``: the trainer defers the Trainer's rotation of old
checkpoints until the new one (constraint state included) is complete and marked so;
``resume_from_checkpoint=True`` takes the newest complete checkpoint.

The fault-injection test forks a training process per trial and kills it with SIGKILL at a
seeded random Python/C call event inside a checkpoint save (``sys.setprofile`` counts the
events, so every point of the save, the Trainer's writes and the rotation's deletions
included, can be hit); a second forked process then resumes with
``resume_from_checkpoint=True`` and must end bitwise equal to a run that was never killed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

import pytest
import torch
import transformers
from scale_tiny import TinyClassifier, make_data, make_trainer, snapshot, tiny_args

from hf_constrained import ConstrainedTrainer
from hf_constrained.checkpointing import (
    COMPLETE_MARKER,
    CheckpointError,
    checkpoint_changes,
    checkpoint_problem,
    is_complete_checkpoint,
    latest_complete_checkpoint,
)
from hf_constrained.trainer import CONSTRAINT_STATE_NAME

STEPS = 8
COMMON = dict(max_steps=STEPS, save_strategy="steps", save_steps=2, constraints_per_step=2)


class _SimulatedKill(BaseException):
    """Stands for a kill: BaseException, so nothing in the Trainer swallows it."""


def test_stop_right_after_trainer_save_keeps_previous_checkpoint(tmp_path, monkeypatch, caplog):
    """The deterministic repro: the process dies right after ``Trainer._save_checkpoint``
    returns at step 4, with ``save_total_limit=1``. The step-2 checkpoint must still be
    there and complete, and ``resume_from_checkpoint=True`` must pick it, naming the
    incomplete step-4 folder."""
    original = transformers.Trainer._save_checkpoint

    def dies_after_step_4(self, model, trial):
        original(self, model, trial)
        if self.state.global_step == 4:
            raise _SimulatedKill

    out = str(tmp_path / "run")
    monkeypatch.setattr(transformers.Trainer, "_save_checkpoint", dies_after_step_4)
    with pytest.raises(_SimulatedKill):
        make_trainer(out, save_total_limit=1, **COMMON).train()
    monkeypatch.setattr(transformers.Trainer, "_save_checkpoint", original)

    assert is_complete_checkpoint(os.path.join(out, "checkpoint-2"))
    assert (tmp_path / "run" / "checkpoint-2" / CONSTRAINT_STATE_NAME).is_file()
    assert not is_complete_checkpoint(os.path.join(out, "checkpoint-4"))
    with caplog.at_level("WARNING", logger="hf_constrained.checkpointing"):
        assert latest_complete_checkpoint(out) == os.path.join(out, "checkpoint-2")
    assert "checkpoint-4" in caplog.text

    straight = make_trainer(str(tmp_path / "straight"), **COMMON)
    straight.train()
    resumed = make_trainer(out, save_total_limit=1, **COMMON)
    resumed.train(resume_from_checkpoint=True)
    _assert_same(snapshot(straight), snapshot(resumed))
    # the finished run rotated down to one complete checkpoint
    assert sorted(os.listdir(out)) == [f"checkpoint-{STEPS}"]
    assert is_complete_checkpoint(os.path.join(out, f"checkpoint-{STEPS}"))


def test_completeness_detects_truncated_and_missing_files(tmp_path, caplog):
    """The marker vouches for the library's own files, file by file; the Trainer's files follow
    the Trainer's rules (a change is reported, not refused: see tests/test_trainer_parity.py)."""
    out = str(tmp_path / "run")
    make_trainer(out, max_steps=4, save_strategy="steps", save_steps=2).train()
    c2, c4 = os.path.join(out, "checkpoint-2"), os.path.join(out, "checkpoint-4")
    assert checkpoint_problem(c4) is None and checkpoint_changes(c4) == []
    size = os.path.getsize(os.path.join(c4, "model.safetensors"))
    with open(os.path.join(c4, "model.safetensors"), "r+b") as f:  # the Trainer's file: reported, not refused
        f.truncate(10)
    assert checkpoint_problem(c4) is None
    assert checkpoint_changes(c4) == [f"model.safetensors resized ({size} -> 10 bytes)"]
    with open(os.path.join(c4, CONSTRAINT_STATE_NAME), "r+b") as f:  # a half-written library file
        f.truncate(10)
    assert f"{CONSTRAINT_STATE_NAME} has 10 bytes" in checkpoint_problem(c4)
    with caplog.at_level("WARNING", logger="hf_constrained.checkpointing"):
        assert latest_complete_checkpoint(out) == c2
    assert f"checkpoint-4 ({CONSTRAINT_STATE_NAME} has 10 bytes" in caplog.text
    # named explicitly, a damaged checkpoint is an error, not a silent load
    with pytest.raises(CheckpointError, match="checkpoint-4 is damaged"):
        make_trainer(str(tmp_path / "b"), max_steps=6).train(resume_from_checkpoint=c4)
    os.remove(os.path.join(c2, CONSTRAINT_STATE_NAME))
    with pytest.raises(CheckpointError, match=f"no complete checkpoint.*checkpoint-4.*checkpoint-2.*"
                                              f"{CONSTRAINT_STATE_NAME} is missing"):
        latest_complete_checkpoint(out)


@pytest.mark.parametrize("damage,what", [
    (lambda p: open(p, "wb").write(b"\x80\x02garbage"), "cannot be read"),
    (lambda p: open(p, "r+b").truncate(os.path.getsize(p) // 2), "cannot be read"),
    (lambda p: torch.save({"estimator": None}, p), "lacks \\['names'"),
])
def test_corrupt_constraint_state_names_the_file(tmp_path, damage, what):
    out = str(tmp_path / "run")
    make_trainer(out, max_steps=2, save_strategy="steps", save_steps=2).train()
    ckpt = os.path.join(out, "checkpoint-2")
    state = os.path.join(ckpt, CONSTRAINT_STATE_NAME)
    damage(state)
    os.remove(os.path.join(ckpt, COMPLETE_MARKER))  # a damaged file that the marker would not catch
    with pytest.raises(CheckpointError, match=f"{CONSTRAINT_STATE_NAME}.* {what}.*earlier checkpoint"):
        make_trainer(str(tmp_path / "b"), max_steps=4).train(resume_from_checkpoint=ckpt)


# ----------------------------------------------------------------------------- fault injection
def _assert_same(a: dict, b: dict) -> None:
    assert a["global_step"] == b["global_step"]
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), f"parameter {name} differs after resume"
    if "estimator_values" in a:
        assert torch.equal(a["estimator_values"], b["estimator_values"])
        assert a["streams"] == b["streams"]


def _unconstrained_trainer(out: str, **overrides) -> ConstrainedTrainer:
    """The run of ``make_trainer`` without constraints: checkpoints of the Trainer's files only."""
    torch.manual_seed(1234)
    train, _ = make_data(0)
    overrides.pop("constraints_per_step", None)
    return ConstrainedTrainer(model=TinyClassifier(), args=tiny_args(out, constraint_penalty="none", **overrides),
                              train_dataset=train)


def _unconstrained_snapshot(trainer: ConstrainedTrainer) -> dict:
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {"params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
            "global_step": trainer.state.global_step}


def _in_child(fn, timeout: float = 60.0) -> int:
    """Run ``fn()`` in a forked process; returns the wait status."""
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 0
        try:
            fn()
        except BaseException:  # noqa: BLE001 - report through the exit code
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("training child hung")
        time.sleep(0.01)


def _run(out: str, limit, *, kill_at: int = 0, count_file: str = "", snap_file: str = "",
         resume: bool = False, constrained: bool = True) -> None:
    """Train (or resume) in this process; with ``kill_at`` SIGKILL ourselves at that profile
    event of the saves after the first; with ``count_file`` record how many events they had."""
    build = make_trainer if constrained else _unconstrained_trainer
    trainer = build(out, save_total_limit=limit, **dict(COMMON, max_steps=6))
    events = [0]
    original = trainer.save_checkpoint  # the hook Trainer._save_checkpoint calls

    rotations: list[list[int]] = []  # [first, last] event of each rotate_checkpoints call

    def profiler(frame, event, arg):
        events[0] += 1
        if events[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if event in ("call", "return") and frame.f_code.co_name == "rotate_checkpoints":
            if event == "call":
                rotations.append([events[0], events[0]])
            else:
                rotations[-1][1] = events[0]

    def counted_save(model, trial):
        if trainer.state.global_step <= 2:  # the first save completes: a previous checkpoint exists
            return original(model, trial)
        sys.setprofile(profiler)
        try:
            return original(model, trial)
        finally:
            sys.setprofile(None)

    trainer.save_checkpoint = counted_save
    trainer.train(resume_from_checkpoint=True if resume else None)
    if count_file:
        with open(count_file, "w") as f:
            json.dump({"total": events[0], "rotations": rotations}, f)
    if snap_file:
        torch.save((snapshot if constrained else _unconstrained_snapshot)(trainer), snap_file)


@pytest.mark.skipif(not hasattr(os, "fork"),
                    reason="the kill -9 is delivered to a forked child mid-save; os.fork exists on Linux and "
                           "macOS (where this runs, CI included), not on Windows")
@pytest.mark.slow
@pytest.mark.parametrize("constrained", [True, False], ids=["constrained", "unconstrained"])
def test_kill9_during_checkpoint_saves_then_resume(tmp_path, constrained):
    """Seeded kill points: 3 runs with ``save_total_limit=1`` killed anywhere in a save, 1 killed
    while the rotation deletes the previous checkpoint, 1 without a limit (the newest folder
    is the half-written one). The limit does not change the weights, so one uninterrupted
    run is the reference of all. Without constraints the checkpoints hold the Trainer's files
    only (no marker): ``trainer_state.json``, the Trainer's last file, tells a save cut short."""
    ref_snap, count = str(tmp_path / "ref.pt"), str(tmp_path / "count.txt")
    assert _in_child(lambda: _run(str(tmp_path / "ref"), 1, count_file=count, snap_file=ref_snap,
                                  constrained=constrained)) == 0
    if not constrained:
        assert not any(COMPLETE_MARKER in names or CONSTRAINT_STATE_NAME in names
                       for _, _, names in os.walk(tmp_path / "ref"))
    reference = torch.load(ref_snap, weights_only=False)
    with open(count) as f:
        counted = json.load(f)
    total = counted["total"]
    # the Trainer's own call returns at once (rotation deferred: no limit); the trainer's call deletes
    rotations = [r for r in counted["rotations"] if r[1] - r[0] > 10]
    assert total > 1000 and len(rotations) == 2  # the saves of steps 4 and 6 under the profiler
    rng = random.Random(1234)
    plan = [(1, rng.randint(1, total)) for _ in range(3)]
    # the rotation is a small part of a save: one kill inside the step-4 rotation (deleting checkpoint-2)
    plan.append((1, rng.randint(*rotations[0])))
    # without a limit there is no rotation: its saves have fewer events, the first half are surely inside them
    plan.append((None, rng.randint(1, total // 2)))
    for trial, (limit, kill_at) in enumerate(plan):
        out = str(tmp_path / f"kill{trial}")
        status = _in_child(lambda: _run(out, limit, kill_at=kill_at, constrained=constrained))
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (limit, kill_at, status)
        resume_snap = str(tmp_path / f"resumed{trial}.pt")
        status = _in_child(lambda: _run(out, limit, resume=True, snap_file=resume_snap, constrained=constrained))
        assert status == 0, f"resume after a kill at save event {kill_at}/{total} failed (see captured stderr)"
        _assert_same(reference, torch.load(resume_snap, weights_only=False))


class _Payload:
    """A pickle that runs code when it is loaded: what a crafted checkpoint would carry."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # loading it creates the marker file


def test_crafted_constraint_state_is_refused_without_running_its_payload(tmp_path):
    """``constraint_state.pt`` is read with ``torch.load(weights_only=True)``: a file whose pickle
    calls a function (here: creates a file) is a CheckpointError naming it, and nothing runs."""
    out = str(tmp_path / "run")
    make_trainer(out, max_steps=2, save_strategy="steps", save_steps=2).train()
    ckpt = os.path.join(out, "checkpoint-2")
    state_path = os.path.join(ckpt, CONSTRAINT_STATE_NAME)
    state = torch.load(state_path, weights_only=True)  # what the trainer writes loads safely
    marker = str(tmp_path / "payload_ran")
    state["names"] = _Payload(marker)
    torch.save(state, state_path)
    os.remove(os.path.join(ckpt, COMPLETE_MARKER))  # whoever crafts the file can rewrite the manifest too
    with pytest.raises(CheckpointError, match=f"{CONSTRAINT_STATE_NAME}.*cannot be read.*weights_only"):
        make_trainer(str(tmp_path / "b"), max_steps=4).train(resume_from_checkpoint=ckpt)
    assert not os.path.exists(marker), "the checkpoint's payload ran"


def test_a_non_finite_look_ahead_value_never_marks_a_checkpoint_complete(tmp_path, monkeypatch, caplog):
    """The look-ahead value of the next draw (the engine's step 4, 0-based: the fifth optimizer step)
    comes out NaN in the fourth step, whose checkpoint is saved before the fifth step reads it and stops. That
    checkpoint must stay incomplete (an error names the constraint),
    the step-2 checkpoint must survive ``save_total_limit=1``, and ``resume_from_checkpoint=True``
    must resume from it and finish as an uninterrupted run does."""
    from hf_constrained.constraint import ConstraintValueError
    from hf_constrained.method.engine import ConstraintEngine

    original = ConstraintEngine.look_ahead

    def nan_for_step_4(self, model, step):
        original(self, model, step)
        if step == 4:
            self.next_draw.estimate_draw.previous[0] = float("nan")

    out = str(tmp_path / "run")
    monkeypatch.setattr(ConstraintEngine, "look_ahead", nan_for_step_4)
    with caplog.at_level("ERROR", logger="hf_constrained.constraint_state"), \
            pytest.raises(ConstraintValueError, match="look-ahead"):
        make_trainer(out, save_total_limit=1, **COMMON).train()
    monkeypatch.setattr(ConstraintEngine, "look_ahead", original)

    c2, c4 = os.path.join(out, "checkpoint-2"), os.path.join(out, "checkpoint-4")
    assert not is_complete_checkpoint(c4) and is_complete_checkpoint(c2)
    assert "checkpoint-4 is left incomplete" in caplog.text and "look-ahead value nan for step 4" in caplog.text
    name = caplog.text.split("constraint '", 1)[1].split("'", 1)[0]
    assert name in {c.name for c in make_data(0)[1]}
    assert latest_complete_checkpoint(out) == c2

    straight = make_trainer(str(tmp_path / "straight"), **COMMON)
    straight.train()
    resumed = make_trainer(out, save_total_limit=1, **COMMON)
    resumed.train(resume_from_checkpoint=True)
    _assert_same(snapshot(straight), snapshot(resumed))


def test_the_trainer_state_file_is_named_as_the_trainer_names_it():
    """The library names ``trainer_state.json`` once (``checkpointing.TRAINER_STATE_NAME``, read by the command line
    without importing the Trainer): it must be the file the Trainer writes."""
    from transformers.trainer import TRAINER_STATE_NAME

    import hf_constrained.checkpointing as checkpointing

    assert checkpointing.TRAINER_STATE_NAME == TRAINER_STATE_NAME
