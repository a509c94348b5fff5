"""Input checks that turn a library's raw error into one that names the flag and value."""

from __future__ import annotations

import os

from huggingface_hub import constants, try_to_load_from_cache
from huggingface_hub.utils import HFValidationError, validate_repo_id


class RecipeConfigError(ValueError):
    """A recipe's settings that cannot be used (a ``--config`` file, a flag, a combination of flags),
    found before anything loads: ``hf-constrained <recipe>`` shows it as a one-line error (status 2)."""


def check_model_path(name_or_path: str, flag: str = "--model_name_or_path") -> str:
    """``name_or_path`` if it can be loaded with ``from_pretrained``; otherwise an error
    naming ``flag`` and the value, before a hub client reports it as a malformed repo id.

    A local directory passes; a value that looks like a path (absolute, ``./``, ``../``,
    ``~``) but is no directory is a :class:`FileNotFoundError`; anything else must be a
    valid hub id (``name`` or ``org/name``), and with ``HF_HUB_OFFLINE=1`` already cached.
    """
    path = os.path.expanduser(str(name_or_path))
    if os.path.isdir(path):
        return path
    looks_local = path.startswith((os.sep, "./", "../", ".\\", "..\\")) or str(name_or_path).startswith("~")
    if looks_local or os.path.exists(path):
        why = "is a file, not a model directory" if os.path.exists(path) else "does not exist"
        raise FileNotFoundError(f"{flag}={name_or_path!r}: the local path {why} (a model directory holds "
                                "config.json and the weights written by save_pretrained)")
    try:
        validate_repo_id(path)
    except HFValidationError:
        raise RecipeConfigError(f"{flag}={name_or_path!r} is neither a local model directory nor a hub id "
                         "('name' or 'org/name')") from None
    if constants.HF_HUB_OFFLINE and not isinstance(try_to_load_from_cache(path, "config.json"), str):
        raise FileNotFoundError(f"{flag}={name_or_path!r}: not in the local Hugging Face cache, and HF_HUB_OFFLINE "
                                "is set, so it cannot be downloaded")
    return name_or_path


__all__ = ["RecipeConfigError", "check_model_path"]
