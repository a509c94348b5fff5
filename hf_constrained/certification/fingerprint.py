"""Fingerprints of saved weight files: tie a certificate and its report to the files they describe.

A report says "these constraints hold for these weights". :func:`weights_files_fingerprint` is the
fingerprint of the saved FILES of a folder (weights, shards and their index, adapters, and the configs
that say how the weights are used): SHA-256 over each file's name, size and content. A report saved next
to weights records it, so ``hf-constrained report --check`` and the checkpoint push can tell that the
files on disk are the ones that were evaluated. It reads files only (no torch); the fingerprint of
weights in memory is the run's (:func:`hf_constrained.safety.model_fingerprint.weights_fingerprint`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Optional

# the files that make up a saved model: single-file weights (full model, adapters, an FSDP
# full state dict) and the configs that decide how they are used; shards come from the indexes
WEIGHT_FILE_NAMES = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin",
                     "pytorch_model_fsdp.bin")
WEIGHT_INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
MODEL_CONFIG_NAMES = ("config.json", "adapter_config.json")
_FSDP_SHARDS = re.compile(r"pytorch_model_fsdp_\d+")
_CHUNK = 1 << 24


def weight_files(folder: str) -> list[str]:
    """The names (relative to ``folder``, sorted) of the files that hold a saved model: its
    weight files, the shards its indexes list, the files of an FSDP sharded state dict
    (``pytorch_model_fsdp_0/``), and ``config.json`` / ``adapter_config.json`` next to weights. Empty when
    ``folder`` holds no weights; ``FileNotFoundError`` naming the shard when an index lists a shard that is
    missing, ``ValueError`` for an unreadable index."""
    found = {name for name in WEIGHT_FILE_NAMES if os.path.isfile(os.path.join(folder, name))}
    # an FSDP sharded state dict: a folder of shards per model (pytorch_model_fsdp_0/*.distcp, .metadata)
    if os.path.isdir(folder):
        for entry in os.listdir(folder):
            shards = os.path.join(folder, entry)
            if _FSDP_SHARDS.fullmatch(entry) and os.path.isdir(shards):
                found |= {f"{entry}/{f}" for f in os.listdir(shards) if os.path.isfile(os.path.join(shards, f))}
    for index in WEIGHT_INDEX_NAMES:
        path = os.path.join(folder, index)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                shards = set(json.load(f)["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}: not a readable weight index ({exc!r})") from exc
        for shard in shards:
            if os.path.basename(shard) != shard or not os.path.isfile(os.path.join(folder, shard)):
                raise FileNotFoundError(f"{path} lists the shard {shard}, which is not in {folder}")
        found |= shards | {index}
    if found:
        found |= {name for name in MODEL_CONFIG_NAMES if os.path.isfile(os.path.join(folder, name))}
    return sorted(found)


def weights_files_fingerprint(folder: str) -> Optional[str]:
    """``sha256:<hex>`` over the model files of ``folder`` (:func:`weight_files`): each file's
    name, size and content. ``None`` when the folder holds no weights. Any change to a weight,
    a shard, an index or a config changes it; its cost is one read of the files."""
    names = weight_files(folder)
    if not names:
        return None
    digest = hashlib.sha256()
    for name in names:
        path = os.path.join(folder, name)
        file_digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                file_digest.update(chunk)
        digest.update(f"{name}|{os.path.getsize(path)}|{file_digest.hexdigest()}\n".encode())
    return "sha256:" + digest.hexdigest()


__all__ = ["MODEL_CONFIG_NAMES", "WEIGHT_FILE_NAMES", "WEIGHT_INDEX_NAMES", "weight_files",
           "weights_files_fingerprint"]
