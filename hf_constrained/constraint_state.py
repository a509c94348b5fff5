"""Reading and writing ``constraint_state.pt``: never half-written, never silently wrong.

The state (estimators, data-stream positions, the drawn next step) is written through a
temporary file and ``os.replace``, so the file is the old one or the complete new one; a
file that cannot be read, or that is not a constraint state, is a
:class:`~hf_constrained.checkpointing.CheckpointError` that names it and says what to do.

The file is read with ``torch.load(weights_only=True)``: it holds tensors and plain Python
values only, so a crafted file cannot run code when a run resumes from it.
A trainer with nothing of its own to keep (no constraints, no subclass estimators:
:func:`library_state`) writes no constraint state and no completeness marker, so its
checkpoints hold exactly the Trainer's files; :func:`prepare_resume` resolves and checks the
checkpoint to resume from by the rule of :mod:`hf_constrained.checkpointing`.
"""

from __future__ import annotations

import logging
import math
import os
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Union

import torch
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from .atomic_files import atomic_open
from .checkpointing import (
    TRAINER_STATE_NAME,
    CheckpointError,
    check_named_checkpoint,
    latest_complete_checkpoint,
    mark_complete,
    mark_incomplete,
)
from .config import arguments_set
from .trainer_internals import trainer_load_checkpoint, trainer_restore_batch_size, trainer_run_dir

if TYPE_CHECKING:
    from .method.engine import ConstraintEngine

logger = logging.getLogger(__name__)


def atomic_torch_save(obj: Any, path: str) -> None:
    """``torch.save`` to ``path`` through a temporary file and ``os.replace``: the file is
    either the old one or the complete new one, never half-written."""
    with atomic_open(path, "wb", fsync=True) as f:
        torch.save(obj, f)


CONSTRAINT_STATE_KEYS = ("names", "estimator", "streams", "next_draw", "constraint_step")
BASE_STATE_KEYS = CONSTRAINT_STATE_KEYS + ("sampling_seed", "num_processes", "global_constraint_batch_size")
"""The keys of ``ConstrainedTrainer.constraint_state_dict``; a subclass that adds others keeps state of its own."""


def load_constraint_state(path: str) -> dict[str, Any]:
    """Read a ``constraint_state.pt``; a truncated, corrupt or foreign file gives a
    :class:`CheckpointError` naming it and what to do."""
    advice = ("Resume from an earlier checkpoint (resume_from_checkpoint=<path>), or delete this checkpoint "
              "folder so that resume_from_checkpoint=True skips it.")
    try:
        # tensors and plain values only: a crafted file cannot run code here
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError, EOFError, RuntimeError (bad zip), ...: all mean a damaged file
        why = " ".join(f"{type(e).__name__}: {e}".split())  # one line
        if len(why) > 600:  # torch's weights_only message is long: its first lines name the refused object
            why = why[:600] + " ..."
        raise CheckpointError(f"{path} cannot be read with torch.load(weights_only=True): it is damaged or holds "
                              f"objects other than tensors and plain values ({why}). {advice}") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a constraint state. {advice}")
    missing = [k for k in CONSTRAINT_STATE_KEYS if k not in state]
    if missing:
        raise CheckpointError(f"{path} lacks {missing}: not a constraint state written by ConstrainedTrainer. {advice}")
    return state


def _non_finite_paths(value: Any, path: str) -> list[str]:
    if isinstance(value, torch.Tensor):
        return [path] if value.is_floating_point() and not bool(torch.isfinite(value).all()) else []
    if isinstance(value, float):
        return [] if math.isfinite(value) else [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _non_finite_paths(v, f"{path}.{k}" if path else str(k))]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _non_finite_paths(v, f"{path}[{i}]")]
    return []


def non_finite_state(state: dict[str, Any]) -> list[str]:
    """What in a constraint state is NaN or infinite, named for a person: the look-ahead value
    h_k(w_t; B_k^(t+1)) of the drawn next step (Algorithm 1, line 6's previous-iterate term) and the
    estimate u_k by constraint name, anything else by its key. Empty when all is finite.

    A checkpoint holding such a value is not marked complete: the step that reads it would stop
    with a :class:`~hf_constrained.constraint.ConstraintValueError`, so resuming from it could only
    fail again."""
    names = list(state.get("names") or [])
    found: list[str] = []
    draw = state.get("next_draw")
    while draw is not None:  # the draw, or its indicator part under two-split estimation
        previous = draw.get("previous")
        if isinstance(previous, torch.Tensor) and previous.is_floating_point():
            ids = draw["constraint_ids"].tolist()
            for k, v in zip(ids, previous.tolist()):
                if not math.isfinite(v):
                    name = names[k] if 0 <= k < len(names) else f"#{k}"
                    found.append(f"constraint {name!r}: look-ahead value {v} for step {draw.get('step')}")
        draw = draw.get("indicator")
    estimator = state.get("estimator")
    if isinstance(estimator, dict) and isinstance(estimator.get("values"), torch.Tensor):
        for k, v in enumerate(estimator["values"].tolist()):
            if not math.isfinite(v):
                found.append(f"constraint {names[k] if k < len(names) else f'#{k}'!r}: estimate u_k {v}")
    rest = {k: v for k, v in state.items() if k not in ("next_draw", "names")}
    if isinstance(estimator, dict):
        rest["estimator"] = {k: v for k, v in estimator.items() if k != "values"}
    found += [f"{p} is not finite" for p in _non_finite_paths(rest, "")]
    return found


def checkpoint_state_is_finite(state: dict[str, Any], folder: str) -> bool:
    """Whether the constraint state saved into ``folder`` may mark it complete: every value is
    finite (:func:`non_finite_state`). Otherwise an error is logged naming the constraint and the
    folder, which stays incomplete (``resume_from_checkpoint=True`` skips it, and old checkpoints are
    not rotated away in its favour)."""
    bad = non_finite_state(state)
    if not bad:
        return True
    logger.error("%s is left incomplete (not resumable): its constraint state holds a non-finite value: %s. "
                 "resume_from_checkpoint=True resumes from the newest complete checkpoint before it",
                 folder, "; ".join(bad))
    return False


class ConstraintStateMissingError(CheckpointError, FileNotFoundError):
    """A checkpoint without the constraint state a trained penalty needs to resume: a
    :class:`~hf_constrained.checkpointing.CheckpointError` (the Trainer's ``ValueError`` for a
    checkpoint it cannot use) and a ``FileNotFoundError`` (as before)."""


def engine_state_dict(engine: Optional[ConstraintEngine]) -> dict[str, Any]:
    """The engine's state for a checkpoint (``ConstraintEngine.state_dict``); without constraints, the empty one."""
    return {"names": [], "estimator": None, "streams": [], "next_draw": None} if engine is None else engine.state_dict()


def load_engine_state_dict(engine: Optional[ConstraintEngine], state: dict[str, Any]) -> None:
    """Load a checkpoint's engine state; a checkpoint with constraints into a trainer without them is an error."""
    if engine is not None:
        engine.load_state_dict(state)
    elif state["names"]:
        raise ValueError(f"checkpoint constraints {state['names']} do not match this trainer's []")


class ResumableTrainer(Protocol):
    """What saving and resuming the constraint state read of a trainer (:class:`~hf_constrained.ConstrainedTrainer`
    has it all; this module does not import the trainer, which imports it)."""

    args: Any  # ConstrainedTrainingArguments
    model: Any
    state: Any  # transformers.TrainerState
    constraints: Any  # the trainer's constraints, in order
    penalty: Any  # its Penalty (``active``: a penalty that trains)

    def constraint_state_dict(self) -> dict[str, Any]: ...

    def load_constraint_state_dict(self, state: dict[str, Any]) -> None: ...

    # saving a checkpoint (:func:`save_complete_checkpoint`)
    accelerator: Any
    safety: Any  # its safety loop (``publish_checkpoint_state``)

    def push_checkpoint(self, checkpoint_folder: str) -> None: ...


def library_state(trainer: ResumableTrainer) -> Optional[dict[str, Any]]:
    """What ``trainer`` saves as its constraint state, or ``None`` when it has nothing of its
    own: no constraints and no state a subclass added to ``constraint_state_dict`` (e.g. the
    per-sample objective estimators of Setting II). Then checkpoints hold the Trainer's files only.
    With constraints it holds, besides ``constraint_state_dict()``, the running spread of the
    row-wise constraints' per-row values (``"spread"``), which sets the calibrated margins."""
    state = trainer.constraint_state_dict()
    if trainer.constraints:  # the engine's state holds the running spread behind calibrated margins too
        return state
    if set(state) - set(BASE_STATE_KEYS):
        return state
    return None


def finished_at(trainer: ResumableTrainer, checkpoint: str) -> bool:
    """Whether ``checkpoint`` was written at (or past) ``max_steps``; then its weights and state
    are loaded and nothing is trained (the Trainer would check its bound only after one more step)."""
    path = os.path.join(checkpoint, TRAINER_STATE_NAME)
    if trainer.args.max_steps <= 0 or not os.path.isfile(path):
        return False
    state = TrainerState.load_from_json(path)
    if state.global_step < trainer.args.max_steps:
        return False
    logger.info("checkpoint %s is at step %d, max_steps is %d: nothing to train", checkpoint,
                state.global_step, trainer.args.max_steps)
    trainer_load_checkpoint(trainer, checkpoint, trainer.model)
    trainer_restore_batch_size(trainer, state.train_batch_size)  # what Trainer.train restores on resume
    trainer.state = state
    return True


def prepare_resume(trainer: ResumableTrainer, resume_from_checkpoint: Optional[Union[str, bool]],
                   state_name: str) -> Optional[Union[str, bool]]:
    """The checkpoint ``trainer.train`` resumes from, checked, with the constraint state loaded.

    ``True``: the newest complete checkpoint of ``output_dir``
    (:func:`~hf_constrained.checkpointing.latest_complete_checkpoint`). A path: checked by
    :func:`~hf_constrained.checkpointing.check_named_checkpoint` (no such directory is the
    Trainer's ``ValueError``). A trained penalty needs the checkpoint's ``state_name``
    (:class:`ConstraintStateMissingError` without it); a checkpoint of a run without constraints resumes as
    the Trainer resumes it.
    """
    keeps_state = library_state(trainer) is not None
    if resume_from_checkpoint is True:
        resume_from_checkpoint = latest_complete_checkpoint(trainer.args.output_dir, library_state=keeps_state)
    if not resume_from_checkpoint:
        return resume_from_checkpoint
    folder = str(resume_from_checkpoint)
    path = os.path.join(folder, state_name)
    if os.path.isdir(folder) and not os.path.exists(path) and trainer.penalty.active:
        raise ConstraintStateMissingError(
            f"Can't find a valid checkpoint at {folder}: {path} is missing: the checkpoint holds no constraint "
            "estimator state, so the run cannot resume exactly"
        )
    check_named_checkpoint(folder, library_state=keeps_state)
    if os.path.exists(path):
        state = load_constraint_state(path)
        trainer.load_constraint_state_dict(state)
    return resume_from_checkpoint


def save_complete_checkpoint(trainer: ResumableTrainer, save: Callable[[], None], trial: Any,
                             state_name: str) -> None:
    """The Trainer's checkpoint save (``save``) made complete-or-ignored (:mod:`hf_constrained.checkpointing`).

    No public hook runs between a checkpoint's last file and the rotation of old ones, so the Trainer saves without
    ``save_total_limit``; the library's state (``state_name``) and the completeness marker are written (when it
    keeps state of its own), then the checkpoint is pushed (gated) and old ones rotated. A kill at any moment leaves
    the last complete checkpoint."""
    args = trainer.args
    run_dir = trainer_run_dir(trainer, trial)  # the Trainer's own run folder (hp search trials)
    folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")
    if args.should_save:
        mark_incomplete(folder)  # re-saving a step: the folder stops being complete before any file changes
    trainer.accelerator.wait_for_everyone()
    limit, push = args.save_total_limit, args.push_to_hub
    with arguments_set(args, save_total_limit=None, push_to_hub=False):
        save()
    trainer.safety.publish_checkpoint_state(folder)  # trainer_state.json without local paths
    state = library_state(trainer)  # None with nothing of our own to keep: the Trainer's files only
    if state is not None and args.should_save:  # subclasses may keep objective estimators here
        atomic_torch_save(state, os.path.join(folder, state_name))
    trainer.accelerator.wait_for_everyone()  # every rank's files (RNG states, shards) are written
    if state is not None and not checkpoint_state_is_finite(state, folder):
        return  # left incomplete, nothing pushed, nothing rotated: the previous complete checkpoint stays
    if state is not None and args.should_save:
        mark_complete(folder, trainer.state.global_step)
    if push:
        trainer.push_checkpoint(folder)  # the Trainer's checkpoint push (hub_strategy), gated
    if args.should_save:
        rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                           best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)


__all__ = ["BASE_STATE_KEYS", "CONSTRAINT_STATE_KEYS", "ConstraintStateMissingError", "ResumableTrainer",
           "atomic_torch_save", "checkpoint_state_is_finite", "engine_state_dict", "finished_at", "library_state",
           "load_constraint_state", "load_engine_state_dict", "non_finite_state", "prepare_resume",
           "save_complete_checkpoint"]
