"""Complete-or-ignored checkpoints.

A checkpoint folder is *complete* when it holds :data:`COMPLETE_MARKER`, a small JSON
manifest (every file of the folder and its size) written last and atomically (a
temporary file, ``fsync``, ``os.replace``), and every file the manifest lists is there
with that size. The trainer removes the marker before it (re)writes a folder, writes it
after the last file of the checkpoint (model, optimizer, RNG states, trainer state,
constraint state) and only then lets old checkpoints be rotated away, so a process
killed at any moment of a save leaves the previous complete checkpoint on disk.

``resume_from_checkpoint=True`` resumes from the newest complete checkpoint
(:func:`latest_complete_checkpoint`) and names the incomplete ones it skipped.

This module needs no torch (the command line uses it); reading and writing the constraint
state itself is :mod:`hf_constrained.constraint_state`.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Optional

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "checkpoint_complete.json"
"""Written last into a checkpoint folder; its presence (with a matching manifest) makes it complete."""

_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used to resume (incomplete, corrupt, or none complete)."""


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
    """Write the marker (a manifest of the folder's files and sizes) last and atomically."""
    payload = {"step": int(step), "files": _manifest(folder)}
    path = os.path.join(folder, COMPLETE_MARKER)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(folder)


def checkpoint_problem(folder: str) -> Optional[str]:
    """Why ``folder`` is not a complete checkpoint, or ``None`` when it is."""
    path = os.path.join(folder, COMPLETE_MARKER)
    if not os.path.isfile(path):
        return f"no {COMPLETE_MARKER} (the save was interrupted, or the folder predates completeness markers)"
    try:
        with open(path, encoding="utf-8") as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{COMPLETE_MARKER} is unreadable ({type(e).__name__}: {e})"
    for rel, size in files.items():
        full = os.path.join(folder, rel)
        if not os.path.isfile(full):
            return f"{rel} is missing"
        actual = os.path.getsize(full)
        if actual != size:
            return f"{rel} has {actual} bytes, the manifest says {size}"
    return None


def is_complete_checkpoint(folder: str) -> bool:
    return checkpoint_problem(folder) is None


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


def latest_complete_checkpoint(output_dir: str) -> str:
    """The newest complete checkpoint of ``output_dir``, warning about every newer
    incomplete one it skips; :class:`CheckpointError` when there is none."""
    skipped: list[str] = []
    for folder in checkpoint_folders(output_dir):
        problem = checkpoint_problem(folder)
        if problem is None:
            if skipped:
                logger.warning("resuming from %s, the newest complete checkpoint; skipped incomplete: %s",
                               folder, "; ".join(skipped))
            return folder
        skipped.append(f"{folder} ({problem})")
    if not skipped:
        raise CheckpointError(f"resume_from_checkpoint=True: no checkpoint-<step> folder in {output_dir}")
    raise CheckpointError(
        f"resume_from_checkpoint=True: no complete checkpoint in {output_dir}; incomplete: {'; '.join(skipped)}. "
        "Pass resume_from_checkpoint=<path> to load one of them anyway, at your own risk."
    )


def check_named_checkpoint(folder: str) -> None:
    """A checkpoint named explicitly: an error when its marker exists but its files do not
    match (a damaged copy); a warning when it has no marker (interrupted or older)."""
    if not os.path.isdir(folder):
        raise CheckpointError(f"resume_from_checkpoint={folder!r} is not a directory")
    problem = checkpoint_problem(folder)
    if problem is None:
        return
    if os.path.isfile(os.path.join(folder, COMPLETE_MARKER)):
        raise CheckpointError(f"checkpoint {folder} is damaged: {problem}. Resume from an earlier checkpoint.")
    logger.warning("checkpoint %s may be incomplete: %s. Loading it because it was named explicitly.",
                   folder, problem)


__all__ = [
    "COMPLETE_MARKER",
    "CheckpointError",
    "check_named_checkpoint",
    "checkpoint_folders",
    "checkpoint_problem",
    "is_complete_checkpoint",
    "latest_complete_checkpoint",
    "mark_complete",
    "mark_incomplete",
]
