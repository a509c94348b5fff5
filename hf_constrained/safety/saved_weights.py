"""The weight files a trainer saved, and which weights in memory they hold.

A report saved next to weights names their files (``weights_files_fingerprint``) only when they hold the
weights it describes, and a checkpoint push judges the files it uploads, never the weights in memory. So each
``save_model`` records, per folder, the fingerprint of the weights in memory then, of the files written, and
the files' (name, size, mtime) to notice a later change (:class:`SavedWeightFiles`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional

from ..certification.fingerprint import weight_files, weights_files_fingerprint

logger = logging.getLogger(__name__)


@dataclass
class SavedWeights:
    """Weights saved into a folder: the fingerprint of the weights in memory then, of the files written, and
    the files' (name, size, mtime) to notice a later change."""

    weights_fingerprint: str
    files_fingerprint: str
    signature: tuple


def files_signature(folder: str) -> tuple:
    """(name, size, mtime) of each weight file of ``folder``: a change of any of them changes it."""
    signature = []
    for name in weight_files(folder):
        stat = os.stat(os.path.join(folder, name))
        signature.append((name, stat.st_size, stat.st_mtime_ns))
    return tuple(signature)


class SavedWeightFiles:
    """Folder (real path) -> the weights a trainer saved there."""

    def __init__(self) -> None:
        self._by_folder: dict[str, SavedWeights] = {}

    def record(self, directory: str, weights_fingerprint: Callable[[], str]) -> None:
        """After weights were saved into ``directory`` from the weights in memory (``weights_fingerprint()``
        hashes those, only when the files could be read)."""
        key = os.path.realpath(directory)
        try:
            files = weights_files_fingerprint(directory)
            signature = files_signature(directory)
        except (OSError, ValueError) as exc:
            logger.warning("cannot fingerprint the weight files in %s: %s", directory, exc)
            files = None
        if files is None:
            self._by_folder.pop(key, None)
        else:
            self._by_folder[key] = SavedWeights(weights_fingerprint(), files, signature)

    def files_fingerprint(self, directory: str, weights_fingerprint: Optional[str]) -> Optional[str]:
        """The fingerprint of the weight files in ``directory`` when they were saved from the weights with
        ``weights_fingerprint`` and have not changed since; else ``None``."""
        saved = self._by_folder.get(os.path.realpath(directory))
        if saved is None or weights_fingerprint is None or saved.weights_fingerprint != weights_fingerprint:
            return None
        try:
            if files_signature(directory) != saved.signature:
                return None
        except (OSError, ValueError):
            return None
        return saved.files_fingerprint

    def weights_of(self, folder: str, files_fingerprint: str) -> Optional[str]:
        """The fingerprint of the weights in memory that the files of ``folder`` (with ``files_fingerprint``)
        were saved from, when this trainer saved them; else ``None``."""
        saved = self._by_folder.get(os.path.realpath(folder))
        return saved.weights_fingerprint if saved is not None and saved.files_fingerprint == files_fingerprint \
            else None


__all__ = ["SavedWeightFiles", "SavedWeights", "files_signature"]
