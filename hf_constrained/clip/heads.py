"""Per-class low-rank text heads (the reference code's optional text-projection adapters).

The text embedding of a text of class c is ``pooled @ (P + A_c B_c)`` where P is the
model's text projection, A_c (width x r) random and B_c (r x dim) zero-initialised, so the
wrapped model starts exactly as the old one. Texts with class id -1 use P alone.
"""

from __future__ import annotations

import json
import os
import pickle
from typing import Any, Optional

import torch
from torch import nn
from transformers import CLIPModel
from transformers.models.clip.modeling_clip import CLIPOutput

from ..atomic_files import atomic_open, atomic_write_json

HEADS_FILE = "class_text_heads.pt"
HEADS_CONFIG = "class_text_heads.json"


class CLIPWithClassTextHeads(nn.Module):
    """A ``CLIPModel`` whose text projection gets a low-rank correction per class.

    Args:
        clip: the CLIP model (trained along with the heads unless frozen by the caller).
        num_classes: number of classes with a head.
        rank: r of each A_c B_c.

    ``forward(pixel_values, input_ids, attention_mask, text_class_ids)`` returns a
    ``CLIPOutput`` with normalised ``image_embeds`` / ``text_embeds``.
    """

    def __init__(self, clip: CLIPModel, num_classes: int, rank: int = 4) -> None:
        super().__init__()
        if num_classes < 1 or rank < 1:
            raise ValueError(f"need num_classes >= 1 and rank >= 1, got {num_classes}, {rank}")
        self.clip = clip
        width = clip.text_projection.in_features
        dim = clip.text_projection.out_features
        self.num_classes, self.rank = int(num_classes), int(rank)
        self.head_a = nn.Parameter(torch.randn(num_classes, width, rank) * width ** -0.5)
        self.head_b = nn.Parameter(torch.zeros(num_classes, rank, dim))
        self.config = clip.config

    def forward(self, pixel_values: Optional[torch.Tensor] = None, input_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, text_class_ids: Optional[torch.Tensor] = None,
                **kwargs: Any) -> CLIPOutput:
        vision = self.clip.vision_model(pixel_values=pixel_values)
        image = self.clip.visual_projection(vision.pooler_output)
        text_out = self.clip.text_model(input_ids=input_ids, attention_mask=attention_mask)
        pooled = text_out.pooler_output
        text = self.clip.text_projection(pooled)
        if text_class_ids is not None:
            ids = text_class_ids.to(pooled.device).long()
            if int(ids.max()) >= self.num_classes:
                raise IndexError(f"text class id {int(ids.max())} but only {self.num_classes} heads")
            has_head = (ids >= 0).to(pooled.dtype)[:, None]
            c = ids.clamp_min(0)
            low = torch.einsum("bi,bir->br", pooled, self.head_a[c].to(pooled.dtype))
            delta = torch.einsum("br,bro->bo", low, self.head_b[c].to(pooled.dtype))
            text = text + has_head * delta
        image = image / image.norm(dim=-1, keepdim=True)
        text = text / text.norm(dim=-1, keepdim=True)
        return CLIPOutput(image_embeds=image, text_embeds=text)

    def save_pretrained(self, path: str, **kwargs: Any) -> None:
        """The CLIP model with ``save_pretrained`` plus the heads in their own file."""
        self.clip.save_pretrained(path, **kwargs)
        with atomic_open(os.path.join(path, HEADS_FILE), "wb") as f:
            torch.save({"head_a": self.head_a.detach().cpu(), "head_b": self.head_b.detach().cpu()}, f)
        atomic_write_json(os.path.join(path, HEADS_CONFIG), {"num_classes": self.num_classes, "rank": self.rank},
                          indent=None)

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> "CLIPWithClassTextHeads":
        with open(os.path.join(path, HEADS_CONFIG)) as f:
            cfg = json.load(f)
        model = cls(CLIPModel.from_pretrained(path, **kwargs), cfg["num_classes"], cfg["rank"])
        heads_file = os.path.join(path, HEADS_FILE)
        try:
            # tensors only: torch < 2.6 (which the package allows) would otherwise run any code the pickle holds
            state = torch.load(heads_file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise ValueError(f"{heads_file} holds more than tensors and is not loaded (torch.load with "
                             f"weights_only=True refused it: {str(exc).splitlines()[0]})") from None
        with torch.no_grad():
            model.head_a.copy_(state["head_a"])
            model.head_b.copy_(state["head_b"])
        return model
