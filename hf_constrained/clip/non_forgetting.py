"""CLIP's case of the non-forgetting constraints h_k(w) = L_k(w, D_k) - L_k(w_old, D_k) <= tol_k.

The problem is the paper's section 5.2; the generic machinery (the old model's reference
pass, the rows carrying ``reference_loss``, the shared row function, the constraints) is
:mod:`hf_constrained.non_forgetting`. This module adds CLIP's per-sample loss: the
cross-entropy of the zero-shot classifier over ALL class prompts (target included),
logits = cos(image, prompt_c) / tau, on the images D_k of protected class k, and
zero-shot accuracy. The old model's per-sample losses are computed once before training
(eval mode, the collator's deterministic preprocessing, no augmentation); for a PEFT/LoRA
model the adapter-disabled base serves as the old model (no second copy).

``NonForgettingConfig``, ``NonForgettingConstraint``, ``ReferenceLossDataset`` and ``reference_losses``
are the generic ones, re-exported; they accept a :class:`ZeroShotLoss` as the per-sample loss (its
``per_sample`` method). :func:`non_forgetting_constraints` is the generic builder with CLIP's
zero-shot correctness (:class:`ZeroShotCorrect`) as the default ``correct``: given
certification rows per protected class (``certify_datasets``, rows nothing else reads) and
``config=NonForgettingConfig(forget_tolerance=eps)``, each constraint is certified as "at most
eps of class k's images forgotten" (right under the old model, wrong now; a 0/1 rate with an exact
Clopper-Pearson bound, see :func:`hf_constrained.non_forgetting.forgetting_statistic`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..method.shared_forward import merge_right_padded
from ..non_forgetting import (
    NonForgettingConfig,
    NonForgettingConstraint,
    PerSampleCorrect,
    ReferenceGap,
    ReferenceLossDataset,
    iterate_batches,
    reference_losses,
    to_device,
)
from ..non_forgetting import non_forgetting_constraints as generic_non_forgetting_constraints
from .encode import clip_embeddings, normalised

__all__ = [
    "MergedCLIPForward",
    "NonForgettingConfig",
    "NonForgettingConstraint",
    "ReferenceLossDataset",
    "ZeroShotCorrect",
    "ZeroShotLoss",
    "non_forgetting_constraints",
    "reference_losses",
    "zero_shot_accuracy",
    "zero_shot_predictions",
]


class ZeroShotLoss:
    """Per-sample cross-entropy of CLIP's zero-shot classifier; as a constraint function, h_k.

    Args:
        prompt_input_ids, prompt_attention_mask: the tokenised class prompts, one row per class
            in class-index order (e.g. "the weather is foggy.").
        temperature: tau of the logits (paper: 0.05).
        class_heads: pass ``text_class_ids = arange(C)`` for
            :class:`~hf_constrained.clip.heads.CLIPWithClassTextHeads` models.

    Batches are dicts with ``pixel_values``, ``label`` (class index) and, for the
    constraint value, ``reference_loss``.
    """

    def __init__(self, prompt_input_ids: torch.Tensor, prompt_attention_mask: Optional[torch.Tensor] = None,
                 temperature: float = 0.05, class_heads: bool = False) -> None:
        if prompt_input_ids.dim() != 2:
            raise ValueError(f"prompt_input_ids must be (num_classes, length), got {tuple(prompt_input_ids.shape)}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.prompt_input_ids = prompt_input_ids
        self.prompt_attention_mask = prompt_attention_mask
        self.temperature = float(temperature)
        self.class_heads = class_heads

    @property
    def num_classes(self) -> int:
        return self.prompt_input_ids.shape[0]

    def logits(self, model: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, C) zero-shot logits cos(image, prompt_c) / tau, from one model(...) call."""
        device = pixel_values.device
        ids = self.prompt_input_ids.to(device)
        mask = None if self.prompt_attention_mask is None else self.prompt_attention_mask.to(device)
        class_ids = torch.arange(self.num_classes, device=device) if self.class_heads else None
        image, text = clip_embeddings(model, pixel_values, ids, mask, class_ids)
        return image @ text.T / self.temperature

    def per_sample(self, model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        return self._cross_entropy(self.logits(model, batch["pixel_values"]), batch)

    def per_sample_from_embeddings(self, image: torch.Tensor, text: torch.Tensor,
                                   batch: Mapping[str, Any]) -> torch.Tensor:
        """:meth:`per_sample` from the rows' image embeddings and the prompts' text embeddings of a model call
        made elsewhere (normalised here, as :func:`~hf_constrained.clip.encode.clip_embeddings` does)."""
        return self._cross_entropy(normalised(image) @ normalised(text).T / self.temperature, batch)

    def _cross_entropy(self, logits: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
        labels = torch.as_tensor(batch["label"]).to(logits.device).long()
        if int(labels.max()) >= self.num_classes or int(labels.min()) < 0:
            raise ValueError(f"label {int(labels.max())} outside the {self.num_classes} class prompts")
        return nn.functional.cross_entropy(logits, labels, reduction="none")

    @property
    def merged_forward(self) -> Optional[Callable[[nn.Module, Mapping[str, Any]], "MergedCLIPForward"]]:
        """How a batch of these rows joins the contrastive objective's forward (:class:`MergedCLIPForward`);
        ``None`` with class heads (the prompts need their class ids, the objective's texts have none)."""
        return None if self.class_heads else self._merged

    def _merged(self, model: nn.Module, batch: Mapping[str, Any]) -> "MergedCLIPForward":
        return MergedCLIPForward(model, self, batch["pixel_values"])

    def correct(self, model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        """(rows,) of 0/1 (float): whether the zero-shot prediction (argmax of :meth:`logits`) is the label."""
        labels = torch.as_tensor(batch["label"]).to(batch["pixel_values"].device).long()
        return (self.logits(model, batch["pixel_values"]).argmax(dim=1) == labels).float()

    def __call__(self, model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        """h_k(w; B_k) = mean CE(w) - mean CE(w_old) on the batch's samples (rows carry ``reference_loss``)."""
        return ReferenceGap(self)(model, batch).mean()


class MergedCLIPForward:
    """Called as the CLIP model by the contrastive objective (``clip_embeddings``): ONE model call over the
    objective's images and a constraint batch's images (one vision tower call) and over the objective's texts and
    the class prompts (one text tower call, right-padded to one width, attention mask 0 on the padding: the causal
    text model and its end-of-text pooling give every text the value it has alone). The objective reads the
    embeddings of its own slice; :meth:`row_losses` the zero-shot cross-entropy of the constraint images. CLIP
    embeds every image and text by itself, so no value changes (:mod:`hf_constrained.method.shared_forward`)."""

    def __init__(self, model: nn.Module, loss: ZeroShotLoss, pixel_values: torch.Tensor) -> None:
        self.model, self.loss, self.pixel_values = model, loss, pixel_values
        self.row_image: Optional[torch.Tensor] = None
        self.prompt_text: Optional[torch.Tensor] = None

    def __call__(self, pixel_values: torch.Tensor, input_ids: torch.Tensor,
                 attention_mask: Optional[torch.Tensor] = None, **other: Any) -> Any:
        if other:
            raise ValueError(f"the merged CLIP forward takes images and texts only, got {sorted(other)}")
        prompts = {"input_ids": self.loss.prompt_input_ids.to(input_ids.device)}
        if self.loss.prompt_attention_mask is not None:
            prompts["attention_mask"] = self.loss.prompt_attention_mask.to(input_ids.device)
        texts = {"input_ids": input_ids} if attention_mask is None else \
            {"input_ids": input_ids, "attention_mask": attention_mask}
        images = torch.cat([pixel_values, self.pixel_values.to(pixel_values)])
        out = self.model(pixel_values=images, **merge_right_padded(texts, prompts))
        image, self.row_image = out.image_embeds.split([len(pixel_values), len(self.pixel_values)])
        text, self.prompt_text = out.text_embeds.split([len(input_ids), self.loss.num_classes])
        return SimpleNamespace(image_embeds=image, text_embeds=text)

    def row_losses(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """Each constraint image's zero-shot cross-entropy (:meth:`ZeroShotLoss.per_sample`)."""
        return self.loss.per_sample_from_embeddings(self.row_image, self.prompt_text, batch)


class ZeroShotCorrect:
    """``correct(model, batch) -> (rows,)`` of 0/1: CLIP's zero-shot prediction (argmax over all
    class prompts of ``loss``'s logits) equals the row's ``label``.

    The per-row correctness of a non-forgetting certificate
    (:class:`~hf_constrained.non_forgetting.ForgottenRows`,
    :func:`~hf_constrained.non_forgetting.forgetting_statistic`); it uses the same prompts,
    temperature and class heads as the constraint's :class:`ZeroShotLoss`.
    """

    def __init__(self, loss: ZeroShotLoss) -> None:
        self.loss = loss

    def __call__(self, model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        return self.loss.correct(model, batch)

    def __repr__(self) -> str:
        return f"ZeroShotCorrect({self.loss.num_classes} classes)"


def non_forgetting_constraints(old_model: nn.Module, loss: Any, datasets: Mapping[str, Any],
                               collate_fn: Optional[Callable] = None, *,
                               certify_datasets: Optional[Mapping[str, Any]] = None,
                               correct: Optional[PerSampleCorrect] = None,
                               config: Optional[NonForgettingConfig] = None,
                               **kwargs: Any) -> list[NonForgettingConstraint]:
    """One non-forgetting constraint per protected class
    (:func:`hf_constrained.non_forgetting.non_forgetting_constraints`, whose other options ``kwargs``
    takes: ``eval_datasets``, ``row_fn``; the tolerances and batch size are ``config``'s).

    With ``certify_datasets`` (class name -> certification rows, read only by the certificate)
    and ``config.forget_tolerance`` (one for all classes or per class; or ``accuracy_drop_tolerance``,
    the points of accuracy each class may lose), each constraint gets those rows,
    with the old model's zero-shot correctness stored as ``reference_correct``, and the
    forgetting statistic: the certificate bounds the share of class k's certification images
    that the old model classified right and the new one gets wrong. ``correct`` defaults to
    :class:`ZeroShotCorrect` of ``loss`` when ``loss`` is a :class:`ZeroShotLoss`.
    """
    if certify_datasets is not None:
        if correct is None and isinstance(loss, ZeroShotLoss):
            correct = ZeroShotCorrect(loss)
        if config is None or not config.states_a_certificate:
            raise ValueError("certify_datasets needs forget_tolerance= (the largest share of each protected class's "
                             "images that may be forgotten) or accuracy_drop_tolerance= (the most zero-shot accuracy "
                             "each class may lose, 0.02 = 2 points) in config=NonForgettingConfig(...)")
    return generic_non_forgetting_constraints(old_model, loss, datasets, collate_fn, certify_datasets=certify_datasets,
                                              correct=correct, config=config, **kwargs)


@torch.no_grad()
def zero_shot_predictions(model: nn.Module, dataset: Any, loss: ZeroShotLoss, collate_fn: Callable,
                          batch_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(predicted class, true class) of every row (eval mode)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    preds, labels = [], []
    try:
        for _, batch in iterate_batches(dataset, collate_fn, batch_size, "zero-shot"):
            batch = to_device(batch, device)
            preds.append(loss.logits(model, batch["pixel_values"]).argmax(dim=1).cpu())
            labels.append(torch.as_tensor(batch["label"]).long().cpu())
    finally:
        model.train(was_training)
    return torch.cat(preds), torch.cat(labels)


def zero_shot_accuracy(model: nn.Module, dataset: Any, loss: ZeroShotLoss, collate_fn: Callable,
                       class_names: Sequence[str], batch_size: int = 128) -> dict[str, float]:
    """Per-class zero-shot accuracy on ``dataset`` (classes absent from it are left out)."""
    pred, label = zero_shot_predictions(model, dataset, loss, collate_fn, batch_size)
    out = {}
    for c, name in enumerate(class_names):
        mask = label == c
        if mask.any():
            out[name] = float((pred[mask] == c).float().mean())
    return out
