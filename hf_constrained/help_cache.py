"""A recipe's (and the demo's) ``--help`` without importing torch: the text is kept after its first rendering.

A recipe's flags come from dataclasses in modules that import torch and transformers, which take
10-20 s to import on a busy machine. ``hf-constrained RECIPE --help`` (and ``--help-all``) prints
the text rendered by an earlier call when nothing it depends on has changed: the key is the
command, the help kind, the installed versions of ``transformers`` and ``trl`` and the size and
modification time of every source file of the package and of the recipe. The first call renders
it (and pays the imports); later calls print it in well under a second. The texts live in
``$HF_CONSTRAINED_CACHE`` or ``~/.cache/hf_constrained/help`` (``$XDG_CACHE_HOME`` honoured); a
folder that cannot be written only means no cache.

The short ``--help`` of every recipe and of the demo also ships with the package (``help_texts.json``, rendered by
``python -m hf_constrained.cli --write-shipped-help`` with the ``transformers`` and ``trl`` versions it
records): where the installed versions are those, even the first call prints it without importing
anything heavy. A test renders each of them afresh and compares it with the shipped text.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
from collections.abc import Callable
from importlib import metadata
from typing import Optional

from .atomic_files import atomic_write_text

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
SHIPPED = os.path.join(PACKAGE_DIR, "help_texts.json")
"""The recipes' short help texts, with the versions they were rendered with."""


def cache_dir() -> str:
    explicit = os.environ.get("HF_CONSTRAINED_CACHE")
    if explicit:
        return os.path.join(explicit, "help")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hf_constrained", "help")


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"


def help_key(command: str, kind: str, recipe_file: Optional[str]) -> str:
    """What the help text depends on (see the module docstring), hashed."""
    digest = hashlib.sha256(f"{command}\0{kind}\0{_version('transformers')}\0{_version('trl')}".encode())
    files = [recipe_file] if recipe_file else []
    for root, _, names in os.walk(PACKAGE_DIR):
        files += [os.path.join(root, n) for n in names if n.endswith((".py", ".yaml"))]
    for path in sorted(files):
        try:
            st = os.stat(path)
        except OSError:
            continue
        digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


def versions() -> dict[str, str]:
    return {"transformers": _version("transformers"), "trl": _version("trl")}


def shipped_help(command: str, kind: str) -> Optional[str]:
    """The shipped short help of ``command``, where the installed versions are the ones it was rendered with."""
    if kind != "help":
        return None
    try:
        with open(SHIPPED, encoding="utf-8") as f:
            shipped = json.load(f)
    except (OSError, ValueError):
        return None
    if shipped.get("versions") != versions():
        return None
    return shipped.get("texts", {}).get(command)


def render_help(render: Callable[[], int]) -> tuple[int, str]:
    """``render()``'s exit status and what it printed (argparse exits after printing the help)."""
    buffer = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(buffer):
        try:
            code = render()
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return code, buffer.getvalue()


def cached_help(command: str, kind: str, recipe_file: Optional[str], render: Callable[[], int]) -> tuple[int, str]:
    """The exit status and help text of ``command`` (``kind``: ``"help"`` or ``"help-all"``) for the
    command line to print: the shipped one, the cached one, or ``render()``'s output (its stdout,
    cached when it exits with status 0)."""
    text = shipped_help(command, kind)
    if text is not None:
        return 0, text
    path = os.path.join(cache_dir(), f"{command}-{kind}-{help_key(command, kind, recipe_file)}.txt")
    try:
        with open(path, encoding="utf-8") as f:
            return 0, f.read()
    except OSError:
        pass
    code, text = render_help(render)
    if code == 0 and text:
        try:
            atomic_write_text(path, text)
        except OSError:
            pass  # no cache, same output
    return code, text


__all__ = ["SHIPPED", "cache_dir", "cached_help", "help_key", "render_help", "shipped_help", "versions"]
