"""What may leave the machine: commands, paths and text without secrets or local paths.

A run writes its reproduce command into the model card and its results; those files are
published. :func:`publishable_command` turns a command line into one that can be shown:

- a secret flag (its name has the word ``token``, ``password``, ``passwd``, ``secret``, or
  ``api key`` / ``apikey`` / ``access key``, e.g. ``--hub_token``) is dropped with its value:
  whoever reproduces the run passes their own (or logs in with ``hf auth login``);
- an absolute path is made relative: the run's output folder becomes ``<output_dir>`` (a
  path inside it ``<output_dir>/...``), a path under the current folder becomes relative to
  it, any other absolute path becomes ``<local>/<its last component>``;
- a string shaped like a Hugging Face token (``hf_`` and 30 or more letters and digits) is
  replaced by ``<redacted>`` wherever it is (:func:`redact_secrets`);
- the program is one that exists where the command is run again (:func:`reproduce_program`):
  ``python recipes/x.py`` only in a clone; after ``pip install`` the installed entry point
  (``hf-constrained <recipe>`` or ``python -m hf_constrained.recipes.x``);
- a ``--config FILE`` is copied, without secrets and absolute paths, into the run's output
  folder (``recipe_config.yaml``), and the command cites that copy: the file the run read
  may be edited or missing later, the copy stays with the run.

This module imports nothing beyond the standard library at import time (the copy of a
``--config`` file reads it with :mod:`hf_constrained.recipe_args` when there is one).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import sys
from collections.abc import Sequence
from typing import Any, Optional

from .atomic_files import atomic_write_text

logger = logging.getLogger(__name__)

REDACTED = "<redacted>"
OUTPUT_DIR_PLACEHOLDER = "<output_dir>"
LOCAL_PLACEHOLDER = "<local>"
# a Hugging Face user access token
HF_TOKEN_PATTERN = re.compile(r"hf_[A-Za-z0-9]{30,}")
_SECRET_WORDS = frozenset({"token", "password", "passwd", "pwd", "secret", "secrets", "credential", "credentials"})
# flags with "key" or "token" in a word that hold no secret: names of columns and a tokenizer's special tokens
_NOT_SECRET = frozenset({"group_key", "metric_key_prefix", "label_key", "text_key", "sort_key",
                         "pad_token", "eos_token", "bos_token", "unk_token", "sep_token", "cls_token", "mask_token"})


def is_secret_flag(flag: str) -> bool:
    """Whether a command-line flag (``--hub_token``, ``--api-key``, ``--wandb_api_key``, ``--my_secret``)
    or an environment variable (``HF_TOKEN``) carries a secret: a word of its name is or contains
    ``key`` (``apikey``; not ``keys``, a list of names), ends with ``token`` (``hftoken``; not ``tokens``,
    a count, nor ``tokenizer``), or contains ``password``, ``passwd``, ``secret`` or ``credential``.
    The names of columns and special tokens (``--group_key``, ``--pad_token``) are not secrets.
    A flag whose name is unknown and looks like a secret is treated as one: a reproduce command
    that lacks a flag can be completed, a published secret cannot be taken back."""
    name = flag.lstrip("-").lower()
    words = [w for w in re.split(r"[_\-.]+", name) if w]
    if "_".join(words) in _NOT_SECRET:
        return False
    for word in words:
        if word in _SECRET_WORDS or word.endswith("token") or ("key" in word and word != "keys"):
            return True
        if any(part in word for part in ("password", "passwd", "secret", "credential")):
            return True
    return False


def redact_secrets(text: str) -> str:
    """``text`` with every Hugging Face token-shaped string replaced by ``<redacted>``."""
    return HF_TOKEN_PATTERN.sub(REDACTED, text)


def _inside(path: str, folder: str) -> Optional[str]:
    """``path`` relative to ``folder`` when it is inside it (``"."`` for the folder itself)."""
    try:
        rel = os.path.relpath(path, folder)
    except ValueError:  # another drive
        return None
    return None if rel == ".." or rel.startswith(".." + os.sep) else rel


def publishable_path(path: str, output_dir: Optional[str] = None) -> str:
    """An absolute ``path`` as it may be published (see the module docstring); other
    strings are returned unchanged."""
    if not os.path.isabs(path):
        return path
    path = os.path.normpath(path)
    if output_dir:
        rel = _inside(path, os.path.abspath(output_dir))
        if rel is not None:
            return OUTPUT_DIR_PLACEHOLDER if rel == "." else f"{OUTPUT_DIR_PLACEHOLDER}/{rel}"
    rel = _inside(path, os.getcwd())
    if rel is not None and rel != ".":
        return rel
    return f"{LOCAL_PLACEHOLDER}/{os.path.basename(path) or ''}".rstrip("/")


def _publishable_value(value: str, output_dir: Optional[str]) -> str:
    # lists and mappings given as one flag value: "a=/x/y,b=/z" (each piece on its own)
    parts = re.split(r"([,=])", value)
    return redact_secrets("".join(p if p in ",=" else publishable_path(p, output_dir) for p in parts))


def publishable_argv(argv: Sequence[str], output_dir: Optional[str] = None) -> list[str]:
    """``argv`` without secret flags (and their values) and without absolute local paths
    (see the module docstring). ``output_dir``: the run's output folder (absolute or
    relative), shown as ``<output_dir>``; by default the value of ``--output_dir`` in ``argv``."""
    argv = [str(a) for a in argv]
    if output_dir is None:
        for i, arg in enumerate(argv):
            if arg == "--output_dir" and i + 1 < len(argv):
                output_dir = argv[i + 1]
            elif arg.startswith("--output_dir="):
                output_dir = arg.split("=", 1)[1]
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("-") and is_secret_flag(arg.split("=", 1)[0]):
            # drop the flag, and its value when it is the next word
            if "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                i += 1
            i += 1
            continue
        if arg.startswith("--") and "=" in arg:
            flag, value = arg.split("=", 1)
            out.append(f"{flag}={_publishable_value(value, output_dir)}")
        else:
            out.append(arg if arg.startswith("--") else _publishable_value(arg, output_dir))
        i += 1
    return out


_RECIPE_SCRIPT = re.compile(r"(?:(?<=\s)|^)recipes/([A-Za-z_][A-Za-z0-9_]*)\.py(?=\s|$)")
RECIPES_PACKAGE = "hf_constrained.recipes"


def reproduce_program(program: str) -> str:
    """The program of a reproduce command as it can be run again.

    A run started through the command line (``hf-constrained llm``, which names itself in
    ``sys.argv[0]``) is reproduced by that command. Otherwise ``program`` names a recipe script
    (``python recipes/x.py``, ``accelerate launch recipes/x.py``): kept when ``recipes/x.py``
    exists under the current folder (a clone), else the installed module
    (``python -m hf_constrained.recipes.x``, ``accelerate launch -m hf_constrained.recipes.x``),
    since ``recipes/`` exists only in a clone. Any other program is returned unchanged.
    """
    match = _RECIPE_SCRIPT.search(program)
    if match is None:
        return program
    launcher = sys.argv[0] if sys.argv else ""
    if launcher.startswith("hf-constrained "):
        return launcher
    if os.path.isfile(os.path.join(os.getcwd(), "recipes", f"{match.group(1)}.py")) or not _is_recipe(match.group(1)):
        return program
    return program[:match.start()] + f"-m {RECIPES_PACKAGE}.{match.group(1)}" + program[match.end():]


def _is_recipe(module: str) -> bool:
    """Whether ``hf_constrained.recipes`` ships the module ``module`` (after ``pip install`` as in a clone)."""
    from .recipes import recipe_file

    try:
        recipe_file(f"{module}.py")
    except FileNotFoundError:
        return False
    return True


def _config_value(argv: Sequence[str]) -> tuple[Optional[int], Optional[str]]:
    """(index, value) of ``--config`` in ``argv`` (the flag's own index), or (None, None)."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return i, argv[i + 1]
        if arg.startswith("--config="):
            return i, arg.split("=", 1)[1]
    return None, None


def publishable_command(program: str, argv: Sequence[str], output_dir: Optional[str] = None) -> str:
    """``program`` (see :func:`reproduce_program`) followed by :func:`publishable_argv` of ``argv``,
    quoted for a POSIX shell.

    With ``--config FILE`` in ``argv`` (a file that exists) and an output folder (``output_dir``,
    or ``--output_dir`` in ``argv`` or in the file), the file is saved there without secrets and
    absolute paths (:func:`save_config_copy`) and the command cites the copy.
    """
    argv = [str(a) for a in argv]
    index, config = _config_value(argv)
    if config is not None and index is not None:
        from .config_files import resolve_config_path

        if not os.path.isfile(resolve_config_path(config)):  # nothing to copy: the command names the file
            return " ".join([reproduce_program(program), shlex.join(publishable_argv(argv, output_dir))]).strip()

        folder = output_dir or publishable_output_dir(argv) or config_output_dir(config)
        if folder:
            copy = save_config_copy(config, folder)
            argv = argv[:index] + ["--config", copy] + argv[index + (1 if argv[index].startswith("--config=") else 2):]
            output_dir = folder
    return " ".join([reproduce_program(program), shlex.join(publishable_argv(argv, output_dir))]).strip()


def config_output_dir(path: str) -> Optional[str]:
    """The ``output_dir`` a ``--config`` file sets, or ``None``."""
    from .config_files import load_config_file

    value = load_config_file(path).get("output_dir")
    return None if value is None else str(value)


def save_config_copy(path: str, output_dir: str) -> str:
    """Save the ``--config`` file ``path`` as ``<output_dir>/recipe_config.yaml`` and return how a
    published command cites it: relative to the current folder when the copy lies inside it, else
    ``<output_dir>/recipe_config.yaml``.

    The copy is what may be published: keys that carry a secret (``hub_token``, ``*_api_key``,
    see :func:`is_secret_flag`) are dropped, absolute paths made
    relative or replaced by placeholders, token-shaped strings redacted
    (:func:`publishable_values`). Written through a temporary file,
    so several processes of one run may write it at once.
    """
    import yaml

    from .config_files import SAVED_CONFIG_NAME, load_config_file

    values = load_config_file(path)
    clean = {k: publishable_values(v, output_dir) for k, v in values.items()
             if not (isinstance(k, str) and is_secret_flag(k))}
    target = os.path.join(output_dir, SAVED_CONFIG_NAME)
    atomic_write_text(target, f"# a copy of --config {publishable_values(path, output_dir)} as this run read it "
                      "(secrets dropped, local paths made relative)\n" + yaml.safe_dump(clean, sort_keys=False))
    rel = os.path.relpath(os.path.abspath(target), os.getcwd())
    return rel if not rel.startswith(os.pardir) else publishable_values(os.path.abspath(target), output_dir)


def publishable_output_dir(argv: Sequence[str]) -> Optional[str]:
    """The value of ``--output_dir`` in ``argv``, or ``None``."""
    for i, arg in enumerate(argv):
        if arg == "--output_dir" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--output_dir="):
            return arg.split("=", 1)[1]
    return None


def publishable_values(value: Any, output_dir: Optional[str] = None) -> Any:
    """A JSON-like value (dicts, lists, strings, numbers) with every absolute path and
    token-shaped string made publishable, and the values of secret keys dropped (``None``)."""
    if isinstance(value, str):
        return _publishable_value(value, output_dir)
    if isinstance(value, dict):
        return {k: (None if isinstance(k, str) and is_secret_flag(k) and v is not None
                    else publishable_values(v, output_dir)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [publishable_values(v, output_dir) for v in value]
    return value


def resolve_output_path(value: str, output_dir: str) -> str:
    """The inverse of :func:`publishable_path` for paths inside the output folder:
    ``<output_dir>/checkpoint-20`` -> ``os.path.join(output_dir, "checkpoint-20")``; other
    values are returned unchanged."""
    if value == OUTPUT_DIR_PLACEHOLDER:
        return output_dir
    if value.startswith(OUTPUT_DIR_PLACEHOLDER + "/"):
        return os.path.join(output_dir, value[len(OUTPUT_DIR_PLACEHOLDER) + 1:])
    return value


def publish_trainer_state(path: str, output_dir: str) -> None:
    """Rewrite the ``trainer_state.json`` at ``path`` without local paths: an absolute
    ``best_model_checkpoint`` is stored relative to the current folder when it lies inside it
    (as the Trainer stores it for a relative ``output_dir``), else as ``<output_dir>/...``
    (:func:`resolve_output_path` reads it back on resume). Written through a temporary file
    in the Trainer's own format (sorted keys, indent 2)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    best = data.get("best_model_checkpoint")
    if not isinstance(best, str) or not os.path.isabs(best):
        return
    rel = _inside(best, os.getcwd())
    data["best_model_checkpoint"] = rel if rel not in (None, ".") else publishable_path(best, output_dir)
    atomic_write_text(path, redact_secrets(json.dumps(data, indent=2, sort_keys=True)) + "\n")


__all__ = ["HF_TOKEN_PATTERN", "LOCAL_PLACEHOLDER", "OUTPUT_DIR_PLACEHOLDER", "REDACTED", "is_secret_flag",
           "publish_trainer_state", "publishable_argv", "publishable_command", "publishable_output_dir",
           "publishable_path", "publishable_values", "redact_secrets", "reproduce_program", "resolve_output_path",
           "save_config_copy"]
