"""The fingerprint of a model's weights in memory: ties a safety report to the weights it describes.

If the weights change after a report (more training, an edit, ``load_state_dict`` of another model), the
report no longer describes them; the gate compares the fingerprint stored in the report with the
fingerprint of the weights it is about to publish and evaluates again when they differ.

The fingerprint is SHA-256 over every tensor of ``model.state_dict()`` (parameters and persistent
buffers): its name, dtype, shape and raw bytes, so any change of any weight changes it. Its cost is one
read of the weights: about as long as copying them to CPU memory once (see ``docs/safety.md`` for
measured times). The fingerprint of saved weight FILES needs no torch:
:func:`hf_constrained.certification.fingerprint.weights_files_fingerprint`.
"""

from __future__ import annotations

import hashlib
from typing import Any


def weights_fingerprint(model: Any) -> str:
    """``sha256:<hex>`` of the model's state (parameters and persistent buffers).

    Sharded tensors (FSDP2 ``DTensor``) are hashed by their local shard, so the
    fingerprint is per process; each process compares its own.
    """
    import torch  # here, not at the top: reading a report's files needs no torch

    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if not isinstance(tensor, torch.Tensor):
                continue
            if hasattr(tensor, "to_local"):  # a DTensor shard
                tensor = tensor.to_local()
            tensor = tensor.detach()
            digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
            flat = tensor.reshape(-1).contiguous().cpu()
            digest.update(flat.view(torch.uint8).numpy() if flat.numel() else b"")
    return "sha256:" + digest.hexdigest()


__all__ = ["weights_fingerprint"]
