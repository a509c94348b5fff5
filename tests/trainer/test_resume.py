"""Exact resume (issue 6, item 2): 20 steps straight == 10 steps, stop, resume to 20.

Bitwise on CPU: the parameters, the MSVR estimator values and first-visit flags, and the
constraint data streams' positions. The sampler of B_c is seeded by (seed, step) so it
has nothing to save; the prefetched draw of the previous-iterate term (h_k(w_{t-1}; B_k^t)
computed at step t-1) is saved with the checkpoint.
"""

from __future__ import annotations

import os

import pytest
import torch
from scale_tiny import StopAt, make_contrastive_trainer, make_trainer, snapshot

from hf_constrained.trainer import CONSTRAINT_STATE_NAME


def _assert_same(a: dict, b: dict) -> None:
    assert a["global_step"] == b["global_step"]
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), f"parameter {name} differs after resume"
    assert torch.equal(a["estimator_visited"], b["estimator_visited"])
    assert torch.equal(a["estimator_values"], b["estimator_values"]), (
        a["estimator_values"], b["estimator_values"])
    assert a["streams"] == b["streams"]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_resume_is_bitwise_exact(tmp_path, accumulation):
    common = dict(max_steps=20, gradient_accumulation_steps=accumulation, per_device_train_batch_size=8 // accumulation,
                  constraints_per_step=2, save_strategy="steps", save_steps=10)
    straight = make_trainer(str(tmp_path / "straight"), **common)
    straight.train()
    ref = snapshot(straight)
    assert ref["global_step"] == 20
    # every constraint has been visited, the estimators moved away from their first values
    assert bool(ref["estimator_visited"].all())

    # a run of the same configuration interrupted right after its step-10 checkpoint
    first = make_trainer(str(tmp_path / "stopped"), **common)
    first.add_callback(StopAt(10))
    first.train()
    assert first.state.global_step == 10
    assert not (tmp_path / "stopped" / "checkpoint-20").exists()
    ckpt = tmp_path / "stopped" / "checkpoint-10"
    assert (ckpt / CONSTRAINT_STATE_NAME).is_file()
    state = torch.load(ckpt / CONSTRAINT_STATE_NAME, weights_only=False)
    assert state["next_draw"] is not None and state["next_draw"]["step"] == 10  # the prefetched step-10 draw
    assert state["estimator"]["visited"].dtype == torch.bool

    resumed = make_trainer(str(tmp_path / "resumed"), **common)
    resumed.train(resume_from_checkpoint=str(ckpt))
    _assert_same(ref, snapshot(resumed))


def test_resume_without_constraint_state_fails_clearly(tmp_path):
    trainer = make_trainer(str(tmp_path / "a"), max_steps=2, save_strategy="steps", save_steps=2)
    trainer.train()
    ckpt = tmp_path / "a" / "checkpoint-2"
    os.remove(ckpt / CONSTRAINT_STATE_NAME)
    fresh = make_trainer(str(tmp_path / "b"), max_steps=4)
    with pytest.raises(FileNotFoundError, match="constraint estimator state"):
        fresh.train(resume_from_checkpoint=str(ckpt))


def test_resume_continues_the_checkpoints_sampling_sequence(tmp_path):
    """B_c^t and the constraint streams are functions of (seed, step); the seed is saved and a
    resumed run keeps the checkpoint's sequence even when configured with another seed."""
    common = dict(max_steps=6, constraints_per_step=2, save_strategy="steps", save_steps=3)
    straight = make_trainer(str(tmp_path / "straight"), **common)
    straight.train()
    stopped = make_trainer(str(tmp_path / "stopped"), **common)
    stopped.add_callback(StopAt(3))
    stopped.train()
    resumed = make_trainer(str(tmp_path / "resumed"), constraint_seed=99, **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "stopped" / "checkpoint-3"))
    assert resumed.engine.sampler.seed == straight.engine.sampler.seed
    _assert_same(snapshot(straight), snapshot(resumed))
    # and the resumed run's own checkpoint records the sequence it actually followed
    saved = torch.load(tmp_path / "resumed" / "checkpoint-6" / CONSTRAINT_STATE_NAME, weights_only=False)
    assert saved["sampling_seed"] == straight.engine.sampler.seed


def test_per_sample_estimators_saved_and_restored_without_constraints(tmp_path):
    """Setting II without constraints (the unconstrained CLIP baseline): the per-sample
    estimators of ContrastiveConstrainedTrainer still go into the checkpoint and
    ``train(resume_from_checkpoint=...)`` restores them."""
    straight = make_contrastive_trainer(str(tmp_path / "a"), max_steps=4, save_strategy="steps", save_steps=3)
    assert not straight.constraints
    straight.train()
    ckpt = tmp_path / "a" / "checkpoint-3"
    saved = torch.load(ckpt / CONSTRAINT_STATE_NAME, weights_only=False)["objective"]
    resumed = make_contrastive_trainer(str(tmp_path / "b"), max_steps=4)
    resumed.train(resume_from_checkpoint=str(ckpt))  # trains step 4 only
    for side in ("image", "text"):
        est, ref = resumed.objective_estimators[side], straight.objective_estimators[side]
        # samples first seen before the checkpoint are still marked visited after step 4
        assert torch.equal(est.visited, ref.visited)
        # estimators that step 4 did not touch hold exactly the checkpoint's values
        untouched = saved[side]["visited"] & (ref.values == saved[side]["values"])
        assert int(untouched.sum()) > 0
        assert torch.equal(est.values[untouched], saved[side]["values"][untouched])


def test_resume_with_calibrated_margins_is_bitwise_exact(tmp_path):
    """Calibrated constraints (``constraint_confidence``): the margin z_c * s_k / sqrt(n_k) reads the
    running per-row spread, so the spread is part of the saved state and a resumed run equals an
    uninterrupted one, margins included."""
    from scale_tiny import make_rowwise_trainer

    common = dict(max_steps=8, constraint_confidence=0.9, save_strategy="steps", save_steps=4)
    straight = make_rowwise_trainer(str(tmp_path / "straight"), **common)
    straight.train()
    assert straight.constraint_margins() and max(straight.constraint_margins().values()) > 0
    stopped = make_rowwise_trainer(str(tmp_path / "stopped"), **common)
    stopped.add_callback(StopAt(4))
    stopped.train()
    resumed = make_rowwise_trainer(str(tmp_path / "resumed"), **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "stopped" / "checkpoint-4"))
    _assert_same(snapshot(straight), snapshot(resumed))
    assert resumed.constraint_margins() == straight.constraint_margins()
    assert resumed.constraint_noise() == straight.constraint_noise()


def test_resume_at_max_steps_trains_nothing(tmp_path):
    """Resuming from the checkpoint written at ``max_steps`` leaves the run as it was: no extra
    step, the checkpoint's weights and estimators."""
    common = dict(max_steps=4, save_strategy="steps", save_steps=4)
    straight = make_trainer(str(tmp_path / "straight"), **common)
    straight.train()
    resumed = make_trainer(str(tmp_path / "resumed"), **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-4"))
    assert resumed.state.global_step == 4
    _assert_same(snapshot(straight), snapshot(resumed))
    assert not (tmp_path / "resumed" / "checkpoint-5").exists()
