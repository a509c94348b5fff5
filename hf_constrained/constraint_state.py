"""Reading and writing ``constraint_state.pt``: never half-written, never silently wrong.

The state (estimators, data-stream positions, the drawn next step) is written through a
temporary file and ``os.replace``, so the file is the old one or the complete new one; a
file that cannot be read, or that is not a constraint state, is a
:class:`~hf_constrained.checkpointing.CheckpointError` that names it and says what to do.

The file is read with ``torch.load(weights_only=True)``: it holds tensors and plain Python
values only, so a crafted file cannot run code when a run resumes from it.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .checkpointing import CheckpointError


def atomic_torch_save(obj: Any, path: str) -> None:
    """``torch.save`` to ``path`` through a temporary file and ``os.replace``: the file is
    either the old one or the complete new one, never half-written."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


CONSTRAINT_STATE_KEYS = ("names", "estimator", "streams", "next_draw", "constraint_step")


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


__all__ = ["CONSTRAINT_STATE_KEYS", "atomic_torch_save", "load_constraint_state"]
