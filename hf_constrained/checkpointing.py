"""Complete-or-ignored checkpoints, without refusing the Trainer's legitimate ones.

Two kinds of ``checkpoint-<step>`` folders:

* **With the library's state** (a run with constraints, or a trainer subclass that keeps its
  own estimators): the folder ends with :data:`COMPLETE_MARKER`, a small JSON record of the
  folder's files and sizes written last and atomically (a temporary file, ``fsync``,
  ``os.replace``). The trainer removes the marker before it (re)writes a folder, writes it
  after the last file of the checkpoint (model, optimizer, RNG states, trainer state,
  constraint state, every process's files) and only then pushes the checkpoint and lets old
  checkpoints be rotated away.
* **Without it** (nothing constrained): the folder holds exactly the Trainer's files, no
  marker, no constraint state. The Trainer writes ``trainer_state.json`` last, so that file,
  present and readable, shows that the Trainer's save finished.

The completeness rule (:func:`checkpoint_problem`) tells a save cut short by a kill from a
checkpoint that was changed afterwards:

* a folder with the library's state is *cut short* when its marker is absent or unreadable,
  or when a library file the marker records (:data:`LIBRARY_FILES`) is missing or has
  another size than at save time;
* a folder without it is *cut short* when ``trainer_state.json`` is absent or unreadable;
* the Trainer's own files (weights, optimizer, scheduler, RNG states) follow the Trainer's
  rules, not the record: weights resharded with ``save_pretrained(max_shard_size=...)``, a
  deleted ``optimizer.pt`` or a re-saved ``config.json`` resume as the Trainer resumes them
  (a warning lists what changed since the save, :func:`checkpoint_changes`), and a folder
  the Trainer cannot load fails with the Trainer's error.

So a process killed at any moment of a save leaves the previous checkpoint complete, and
``resume_from_checkpoint=True`` resumes from the newest complete checkpoint
(:func:`latest_complete_checkpoint`), naming the cut-short ones it skipped. Where the
Trainer raises (no checkpoint to resume, a path that is no checkpoint), :class:`CheckpointError`
is a ``ValueError`` with the Trainer's wording, followed by the library's detail.

This module needs no torch (the command line uses it); reading and writing the constraint
state itself is :mod:`hf_constrained.constraint_state`.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Optional

from .atomic_files import atomic_write_json

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "checkpoint_complete.json"
"""Written last into a checkpoint folder that holds the library's state (see the module docstring)."""

LIBRARY_FILES = ("constraint_state.pt",)
"""The library's own files in a checkpoint: the marker vouches for these, file by file."""

TRAINER_STATE_NAME = "trainer_state.json"
"""The last file the Trainer writes into a checkpoint (``transformers.trainer.TRAINER_STATE_NAME``, spelt out here so
that the command line reads checkpoints without importing the Trainer; a test holds the two equal)."""

_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(ValueError, RuntimeError):
    """A checkpoint cannot be used to resume (cut short, damaged, or none there).

    A ``ValueError``, as the Trainer's own errors for a missing checkpoint (code that catches
    the Trainer's ``ValueError`` catches it too), and a ``RuntimeError``, as before."""


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory file descriptors
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def mark_incomplete(folder: str) -> None:
    """Remove the completeness marker before ``folder`` is (re)written."""
    try:
        os.remove(os.path.join(folder, COMPLETE_MARKER))
    except FileNotFoundError:
        return
    _fsync_dir(folder)


def _manifest(folder: str) -> dict[str, int]:
    files: dict[str, int] = {}
    for root, _, names in os.walk(folder):
        for name in names:
            if name == COMPLETE_MARKER or name.endswith(".tmp"):
                continue
            full = os.path.join(root, name)
            files[os.path.relpath(full, folder)] = os.path.getsize(full)
    return files


def mark_complete(folder: str, step: int) -> None:
    """Write the marker (a record of the folder's files and sizes) last and atomically."""
    payload = {"step": int(step), "files": _manifest(folder)}
    path = os.path.join(folder, COMPLETE_MARKER)
    atomic_write_json(path, payload, indent=1, sort_keys=True, fsync=True)
    _fsync_dir(folder)


def _recorded_files(folder: str) -> dict[str, int]:
    """The files and sizes the marker of ``folder`` recorded; ``ValueError`` when unreadable."""
    try:
        with open(os.path.join(folder, COMPLETE_MARKER), encoding="utf-8") as f:
            files = json.load(f)["files"]
        if not isinstance(files, dict):
            raise TypeError(f"'files' is a {type(files).__name__}")
        return {str(k): int(v) for k, v in files.items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{COMPLETE_MARKER} is unreadable ({type(e).__name__}: {e})") from None


def _holds_library_files(folder: str) -> bool:
    return any(os.path.exists(os.path.join(folder, name)) for name in (COMPLETE_MARKER,) + LIBRARY_FILES)


def has_library_state(folder: str) -> bool:
    """Whether ``folder`` belongs to a run that keeps the library's state: it holds a marker
    or a library file, or another checkpoint folder next to it holds a marker."""
    if _holds_library_files(folder):
        return True
    parent = os.path.dirname(os.path.normpath(folder))
    return any(os.path.isfile(os.path.join(other, COMPLETE_MARKER)) for other in checkpoint_folders(parent))


def _expects_library_state(folder: str, library_state: Optional[bool]) -> bool:
    """Whether ``folder`` is judged as a checkpoint with the library's state (see :func:`checkpoint_problem`)."""
    if _holds_library_files(folder):
        return True
    return has_library_state(folder) if library_state is None else library_state


def _trainer_state_problem(folder: str) -> Optional[str]:
    path = os.path.join(folder, TRAINER_STATE_NAME)
    if not os.path.isfile(path):
        return f"no {TRAINER_STATE_NAME} (the save was interrupted)"
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError) as e:
        return f"{TRAINER_STATE_NAME} is unreadable ({type(e).__name__}: the save was interrupted)"
    return None


def checkpoint_problem(folder: str, library_state: Optional[bool] = None) -> Optional[str]:
    """Why ``folder`` is a checkpoint cut short (see the module docstring), or ``None``.

    ``library_state``: whether the resuming run keeps the library's state (constraints, or a
    subclass's estimators), so that a folder without a marker is one cut short; ``None``
    (the default) decides from the folders (:func:`has_library_state`). A folder that holds a
    library file is judged as one with the library's state in any case.
    """
    expected = _expects_library_state(folder, library_state)
    if os.path.isfile(os.path.join(folder, COMPLETE_MARKER)):
        try:
            recorded = _recorded_files(folder)
        except ValueError as e:
            return str(e)
        for rel, size in recorded.items():
            if os.path.basename(rel) not in LIBRARY_FILES:
                continue  # the Trainer's files follow the Trainer's rules
            full = os.path.join(folder, rel)
            if not os.path.isfile(full):
                return f"{rel} is missing"
            actual = os.path.getsize(full)
            if actual != size:
                return f"{rel} has {actual} bytes, {COMPLETE_MARKER} says {size}"
        return None
    if expected:
        return f"no {COMPLETE_MARKER} (the save was interrupted, or the folder predates completeness markers)"
    return _trainer_state_problem(folder)


def checkpoint_changes(folder: str) -> list[str]:
    """The files of ``folder`` that differ from its marker's record: removed, resized or added
    since the save (empty without a readable marker). Not a problem by itself: resharded
    weights and a deleted ``optimizer.pt`` are legitimate."""
    try:
        recorded = _recorded_files(folder)
    except ValueError:
        return []
    now = _manifest(folder)
    changes = [f"{rel} removed" for rel in sorted(recorded) if rel not in now]
    changes += [f"{rel} resized ({recorded[rel]} -> {now[rel]} bytes)" for rel in sorted(recorded)
                if rel in now and now[rel] != recorded[rel]]
    changes += [f"{rel} added" for rel in sorted(now) if rel not in recorded]
    return changes


def is_complete_checkpoint(folder: str, library_state: Optional[bool] = None) -> bool:
    return checkpoint_problem(folder, library_state) is None


def checkpoint_folders(output_dir: str) -> list[str]:
    """The ``checkpoint-<step>`` folders of ``output_dir``, newest step first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT_RE.match(name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(match.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found, reverse=True)]


def no_checkpoint_message(output_dir: str) -> str:
    """The Trainer's words for ``resume_from_checkpoint=True`` with nothing to resume from."""
    return f"No valid checkpoint found in output directory ({output_dir})"


def latest_complete_checkpoint(output_dir: str, library_state: Optional[bool] = None) -> str:
    """The newest complete checkpoint of ``output_dir``, warning about every newer
    cut-short one it skips; :class:`CheckpointError` when there is none.

    ``library_state``: as for :func:`checkpoint_problem`."""
    skipped: list[str] = []
    for folder in checkpoint_folders(output_dir):
        problem = checkpoint_problem(folder, library_state)
        if problem is None:
            if skipped:
                logger.warning("resuming from %s, the newest complete checkpoint; skipped incomplete: %s",
                               folder, "; ".join(skipped))
            return folder
        skipped.append(f"{folder} ({problem})")
    if not skipped:
        raise CheckpointError(f"{no_checkpoint_message(output_dir)}: no checkpoint-<step> folder")
    raise CheckpointError(
        f"{no_checkpoint_message(output_dir)}: no complete checkpoint; incomplete: {'; '.join(skipped)}. "
        "Pass resume_from_checkpoint=<path> to load one of them anyway, at your own risk."
    )


def check_named_checkpoint(folder: str, library_state: Optional[bool] = None) -> None:
    """A checkpoint named explicitly (``resume_from_checkpoint=<path>``).

    No such directory: :class:`CheckpointError` with the Trainer's wording. The library's
    files damaged (its marker exists, they do not match it): :class:`CheckpointError`. No
    marker where the library's state is expected (interrupted, or written before markers):
    a warning, and it is loaded. The Trainer's files changed since the save (resharded
    weights, a deleted optimizer state): a warning naming them, and it is loaded as the
    Trainer loads it."""
    if not os.path.isdir(folder):
        raise CheckpointError(f"Can't find a valid checkpoint at {folder}: no such directory")
    has_marker = os.path.isfile(os.path.join(folder, COMPLETE_MARKER))
    expected = _expects_library_state(folder, library_state)
    problem = checkpoint_problem(folder, library_state) if (has_marker or expected) else None
    if problem is not None and has_marker:
        raise CheckpointError(f"checkpoint {folder} is damaged: {problem}. Resume from an earlier checkpoint.")
    if problem is not None:
        logger.warning("checkpoint %s may be incomplete: %s. Loading it because it was named explicitly.",
                       folder, problem)
    warn_about_changes(folder)


def warn_about_changes(folder: str) -> None:
    """A warning naming the files of ``folder`` that changed since its save (if any)."""
    changes = checkpoint_changes(folder)
    if changes:
        logger.warning("checkpoint %s changed since it was saved (%s); resuming from it as the Trainer does",
                       folder, ", ".join(changes))


__all__ = [
    "COMPLETE_MARKER",
    "LIBRARY_FILES",
    "TRAINER_STATE_NAME",
    "CheckpointError",
    "check_named_checkpoint",
    "checkpoint_changes",
    "checkpoint_folders",
    "checkpoint_problem",
    "has_library_state",
    "is_complete_checkpoint",
    "latest_complete_checkpoint",
    "mark_complete",
    "mark_incomplete",
    "no_checkpoint_message",
    "warn_about_changes",
]
