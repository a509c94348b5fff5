"""``trainer_state.json`` without local paths, and its best checkpoint put back on resume.

The Trainer records ``best_model_checkpoint`` as a local path. The library writes it without its
local part (:func:`~hf_constrained.publishable.publish_trainer_state`), so a resumed run reads a
path that does not exist: :func:`best_checkpoint_restored` puts this run's path back for the
time of ``train`` (a callback added only then, so the callbacks are otherwise the Trainer's)
and hides the Trainer's warning about the placeholder.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from typing import Any, Optional

from transformers import TrainerCallback

from ..checkpointing import TRAINER_STATE_NAME
from ..publishable import OUTPUT_DIR_PLACEHOLDER, resolve_output_path

logger = logging.getLogger(__name__)


class RestoreBestCheckpoint(TrainerCallback):
    """On resume, puts back the best checkpoint's path that ``trainer_state.json`` stores without
    its local part (the Trainer reads the file before any hook: it sees no such folder)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if os.path.isdir(self.path):
            logger.info("resumed: the best checkpoint so far is %s", self.path)
            state.best_model_checkpoint = self.path


def not_a_missing_placeholder(record: logging.LogRecord) -> bool:
    """Drops the Trainer's warning that a best checkpoint stored as ``<output_dir>/...`` does not
    exist (:class:`RestoreBestCheckpoint` puts its real path back)."""
    message = record.getMessage()
    return not (OUTPUT_DIR_PLACEHOLDER in message and "recorded in the resumed state" in message)


def stored_best_checkpoint(checkpoint: str, output_dir: str) -> Optional[str]:
    """The best checkpoint recorded in ``checkpoint``'s state, as this run names it
    (under ``output_dir`` as given), or ``None``."""
    try:
        with open(os.path.join(checkpoint, TRAINER_STATE_NAME), encoding="utf-8") as f:
            best = json.load(f).get("best_model_checkpoint")
    except (OSError, ValueError):
        return None
    if not isinstance(best, str):
        return None
    best = resolve_output_path(best, output_dir)
    if os.path.isabs(output_dir) and not os.path.isabs(best):
        rel = os.path.relpath(os.path.abspath(best), os.path.abspath(output_dir))
        best = os.path.join(output_dir, rel)
    return best


@contextlib.contextmanager
def best_checkpoint_restored(trainer: Any, resume: Any) -> Iterator[None]:
    """While ``trainer.train(resume)`` runs: the resumed state's best checkpoint as this run names it."""
    best_path = stored_best_checkpoint(resume, trainer.args.output_dir) if isinstance(resume, str) else None
    restorer = RestoreBestCheckpoint(best_path) if best_path is not None else None
    if restorer is not None:
        trainer.add_callback(restorer)
    # the Trainer warns that "<output_dir>/checkpoint-N" does not exist before the path is put back
    trainer_logger = logging.getLogger("transformers.trainer")
    trainer_logger.addFilter(not_a_missing_placeholder)
    try:
        yield
    finally:
        trainer_logger.removeFilter(not_a_missing_placeholder)
        if restorer is not None:
            trainer.remove_callback(restorer)


__all__ = ["RestoreBestCheckpoint", "best_checkpoint_restored", "stored_best_checkpoint"]
