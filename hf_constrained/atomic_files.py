"""Files written whole or not at all: a temporary file beside the target, then ``os.replace``.

A reader (another process, a crash, Ctrl-C between two writes) sees the previous file or the complete new one,
never half a report, ledger, card or results file: ``os.replace`` is atomic on POSIX and Windows when both names
are in one folder. The temporary name carries the process and thread, so concurrent writers never share one, and
it is removed when the write fails. The package's reports, ledgers, cards, help texts and results files and
those of its recipes and benchmarks are written through :func:`atomic_write_text`; ``torch.save`` files through
:func:`hf_constrained.constraint_state.atomic_torch_save`, and a checkpoint's completeness marker, which is also
synced to disk, through :func:`hf_constrained.checkpointing.mark_complete`.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from typing import Any

__all__ = ["atomic_write_json", "atomic_write_text"]


def atomic_write_text(path: str, text: str, *, encoding: str = "utf-8") -> str:
    """Write ``text`` to ``path`` through a temporary file in the same folder and ``os.replace`` (creating the
    folder if needed); on any failure the temporary file is removed and ``path`` is left as it was. Returns
    ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
    try:
        with open(tmp, "w", encoding=encoding) as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return path


def atomic_write_json(path: str, data: Any, *, indent: int = 2, newline: bool = False, **dump_options: Any) -> str:
    """:func:`atomic_write_text` of ``json.dumps(data, indent=indent, **dump_options)`` (e.g. ``sort_keys``,
    ``default``, ``allow_nan``), with a final newline when ``newline``. Nothing is written when the data cannot be
    serialised. Returns ``path``."""
    text = json.dumps(data, indent=indent, **dump_options)
    return atomic_write_text(path, text + "\n" if newline else text)
