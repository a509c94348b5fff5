"""Files written whole or not at all: a temporary file beside the target, then ``os.replace``.

A reader (another process, a crash, Ctrl-C between two writes) sees the previous file or the complete new one,
never half a report, ledger, card or results file: ``os.replace`` is atomic on POSIX and Windows when both names
are in one folder. The temporary name carries the process and thread, so concurrent writers never share one, ends
with ``.tmp`` (what a checkpoint's manifest and the Hub push leave out), and is removed when the write fails. The
package's reports, ledgers, cards, help texts and results files and those of its recipes and benchmarks are
written through :func:`atomic_write_text`; binary files (``torch.save``, ``numpy.savez``) through
:func:`atomic_open`, e.g. :func:`hf_constrained.constraint_state.atomic_torch_save`. A checkpoint's completeness
marker is also synced to disk (``fsync``, :func:`hf_constrained.checkpointing.mark_complete`).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from typing import IO, Any, Optional

__all__ = ["atomic_open", "atomic_write_json", "atomic_write_text"]


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w", *, encoding: Optional[str] = None, fsync: bool = False) -> Iterator[IO]:
    """A file open for writing (``mode`` ``"w"`` or ``"wb"``) that becomes ``path`` when the block ends without
    an error: a temporary file in the same folder (created if needed), then ``os.replace``. On any failure the
    temporary file is removed and ``path`` is left as it was. With ``fsync`` the data reaches the disk before the
    file is moved into place."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes a whole file: mode 'w' or 'wb', got {mode!r}")
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(tmp, mode, encoding=encoding) as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def atomic_write_text(path: str, text: str, *, encoding: str = "utf-8", fsync: bool = False) -> str:
    """Write ``text`` to ``path`` through :func:`atomic_open` (a temporary file in the same folder and
    ``os.replace``, creating the folder if needed); on any failure the temporary file is removed and ``path`` is
    left as it was. Returns ``path``."""
    with atomic_open(path, "w", encoding=encoding, fsync=fsync) as f:
        f.write(text)
    return path


def atomic_write_json(path: str, data: Any, *, indent: Optional[int] = 2, newline: bool = False, fsync: bool = False,
                      **dump_options: Any) -> str:
    """:func:`atomic_write_text` of ``json.dumps(data, indent=indent, **dump_options)`` (e.g. ``sort_keys``,
    ``default``, ``allow_nan``), with a final newline when ``newline``. Nothing is written when the data cannot be
    serialised. Returns ``path``."""
    text = json.dumps(data, indent=indent, **dump_options)
    return atomic_write_text(path, text + "\n" if newline else text, fsync=fsync)
