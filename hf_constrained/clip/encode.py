"""One forward of a CLIP model that returns both normalised embeddings.

Every grad forward of this package goes through ``model(pixel_values=..., input_ids=...)``
on the model the Trainer passes in (the wrapped one), so DDP / FSDP / ZeRO-3 see the same
submodules in every forward (DDP with ``find_unused_parameters`` and FSDP gathering need it).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def clip_embeddings(model: nn.Module, pixel_values: torch.Tensor, input_ids: torch.Tensor,
                    attention_mask: Optional[torch.Tensor] = None,
                    text_class_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalised ``(image_embeds, text_embeds)`` in at least fp32 from one ``model(...)`` call.

    Works for ``transformers.CLIPModel`` (and a PEFT model around it), whose output
    carries normalised ``image_embeds`` / ``text_embeds``, and for
    :class:`~hf_constrained.clip.heads.CLIPWithClassTextHeads`, which also takes
    ``text_class_ids``.
    """
    kwargs = {"pixel_values": pixel_values, "input_ids": input_ids}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if text_class_ids is not None:
        kwargs["text_class_ids"] = text_class_ids
    out = model(**kwargs)
    return normalised(out.image_embeds), normalised(out.text_embeds)


def normalised(embeds: torch.Tensor) -> torch.Tensor:
    """``embeds`` L2-normalised per row in at least fp32: the losses exponentiate (s_ij - s_ii)/t with t = 0.05."""
    return nn.functional.normalize(embeds.to(torch.promote_types(embeds.dtype, torch.float32)), dim=-1)
