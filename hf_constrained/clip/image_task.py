"""A small zero-shot image task for CLIP non-forgetting runs: its classes and prompts, augmented copies of
its images, and the old model trained on it (offline: the demo, its shapes example and their benchmark).

* :class:`ImageTask`: the classes (in label order), the prompt and caption template of a class, the image
  and patch sizes of the small CLIP that reads them, and how the task's splits are drawn;
* :func:`load_digit_images`: scikit-learn's digits as 1x8x8 images in [-1, 1] (the demo's task);
  :mod:`hf_constrained.clip.shapes` draws generated shapes, as many per class as a claim needs;
* :func:`augmented_copies`: shifted, rotated, scaled and noised copies of each image, grouped per image (the
  image itself first), so that a non-forgetting constraint's data can hold several copies of each protected
  image, each with the old model's loss on THAT copy as its reference (the same inputs on both sides of
  h_k(w) = L_k(w) - L_k(w_old), the per-sample mean Algorithm 2, line 12 estimates);
* :func:`train_zero_shot_classifier`: the old model (stage 1), a CLIP trained as a zero-shot classifier over
  the class prompts, one augmented copy of each image per epoch;
* :func:`save_pretrained_once`: a model folder written whole or not at all, the first writer's copy kept.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

__all__ = ["ImageTask", "augmented_copies", "load_digit_images", "save_pretrained_once",
           "train_zero_shot_classifier"]


@dataclass(frozen=True)
class ImageTask:
    """One image task a CLIP non-forgetting run fine-tunes on (chosen by name at one dispatch point).

    ``split(settings)`` draws the task's images and their splits (a dict of ``images``, ``labels`` and a list of
    row positions per split name). ``supply``: for a fixed data set, why it cannot certify more (said after the
    certificate); ``None`` for a generator, which draws as many images as a claim needs (``supply_flag`` sets
    how many)."""

    names: tuple[str, ...]
    template: str  # the zero-shot prompt and the caption of a class
    noun: str  # what a class is called in summaries and model cards
    image_size: int
    patch_size: int
    split: Callable[[Any], dict[str, Any]]
    description: str  # the data, for the model card
    supply: Optional[str] = None
    supply_flag: str = ""

    @property
    def prompt_texts(self) -> list[str]:
        """The zero-shot prompt of every class, in label order."""
        return [self.template.format(n) for n in self.names]

    def prompts(self, tokenizer: Any) -> dict[str, torch.Tensor]:
        """The class prompts, tokenized (``input_ids`` and ``attention_mask``, one row per class)."""
        return tokenizer(self.prompt_texts, padding=True, return_tensors="pt")


def load_digit_images() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits: (images (N, 1, 8, 8) as float32 in [-1, 1], labels (N,) as int)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images.astype(np.float32) / 16.0 - 0.5) / 0.5
    return images[:, None], digits.target.astype(int)


def augmented_copies(images: np.ndarray, copies: int, seed: int, shift: float = 0.5, rotate: float = 10.0,
                     noise: float = 0.1) -> np.ndarray:
    """``copies`` versions of each image (N, C, H, W), grouped per image: the image itself,
    then copies under a random affine map (rotation up to ``rotate`` degrees, scale within
    10%, translation up to ``shift`` pixels; bilinear, background fill) plus Gaussian noise
    (std ``noise``), clipped to [-1, 1]; deterministic in ``seed``."""
    from scipy.ndimage import affine_transform

    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    rng = np.random.default_rng(seed)
    out = np.repeat(images, copies, axis=0).copy()
    background = float(images.min()) if images.size else -1.0
    h, w = images.shape[-2:]
    center = np.array([(h - 1) / 2, (w - 1) / 2])
    for n in range(len(images)):
        for j in range(1, copies):
            angle = np.deg2rad(rng.uniform(-rotate, rotate))
            scale = rng.uniform(0.9, 1.1)
            rot = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]]) / scale
            offset = center - rot @ center + rng.uniform(-shift, shift, size=2)
            img = np.stack([affine_transform(ch, rot, offset=offset, order=1, mode="constant", cval=background)
                            for ch in images[n]])
            img = img + rng.normal(0.0, noise, size=img.shape)
            out[n * copies + j] = np.clip(img, -1.0, 1.0).astype(images.dtype)
    return out


BATCH_SIZE = 128
"""Images per step of :func:`train_zero_shot_classifier`."""


def train_zero_shot_classifier(model: nn.Module, bank: np.ndarray, labels: np.ndarray,
                               prompts: Mapping[str, torch.Tensor], *, copies: int, epochs: int, lr: float,
                               temperature: float, rng: np.random.Generator, seed: int) -> nn.Module:
    """Train ``model`` (a CLIP) in place as a zero-shot classifier: cross-entropy of the logits
    cos(image, prompt_c) / ``temperature`` over every class prompt, AdamW (``lr``, weight decay 0.01),
    :data:`BATCH_SIZE` images per step.

    ``bank`` holds ``copies`` versions of each of the ``len(labels)`` images, grouped per image
    (:func:`augmented_copies`); every epoch draws one version of each image and an order of the images from
    ``rng``. ``seed`` seeds torch before the first step. Returns the model."""
    bank_t, y = torch.as_tensor(bank), torch.as_tensor(labels)
    n = len(labels)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    torch.manual_seed(seed)
    model.train()
    for _ in tqdm(range(epochs), desc="stage 1: training the old model", unit="epoch", leave=False):
        x = bank_t[torch.arange(n) * copies + torch.as_tensor(rng.integers(0, copies, n))]
        perm = torch.as_tensor(rng.permutation(n))
        for start in range(0, n, BATCH_SIZE):
            b = perm[start : start + BATCH_SIZE]
            out = model(pixel_values=x[b], input_ids=prompts["input_ids"], attention_mask=prompts["attention_mask"])
            logits = out.image_embeds @ out.text_embeds.T / temperature
            loss = torch.nn.functional.cross_entropy(logits, y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model


def save_pretrained_once(model: Any, tokenizer: Any, path: str) -> None:
    """Save ``model`` and ``tokenizer`` (``save_pretrained``) as the folder ``path``: written into a temporary
    folder beside it and renamed, so a reader never sees half a model; when another process wrote ``path``
    first, its copy is kept."""
    parent = os.path.dirname(path) or "."
    tmp = tempfile.mkdtemp(dir=parent, prefix=".stage1-")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if os.path.exists(path):  # another run finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, path)
