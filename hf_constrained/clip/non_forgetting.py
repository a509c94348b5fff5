"""Non-forgetting constraints: h_k(w) = L_k(w, D_k) - L_k(w_old, D_k) <= 0 (REFERENCE section 4).

L_k is the mean cross-entropy of the zero-shot classifier over ALL class prompts (target
included), logits = cos(image, prompt_c) / tau, on the images D_k of protected class k.
The old model's per-sample losses are computed once before training (eval mode, the
collator's deterministic preprocessing, no augmentation) and stored with each row
(:class:`ReferenceLossDataset`), so h_k on a batch is "mean CE now - mean stored CE on the
same samples", the estimate the MSVR update of Algorithm 2 (line 12) tracks. The old model
is only needed for that pass: pass the model itself before training, or, for a PEFT/LoRA
model, call inside ``with model.disable_adapter():`` (no second copy).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

import torch
from torch import nn
from tqdm.auto import tqdm

from ..constraint import Constraint
from .encode import clip_embeddings

logger = logging.getLogger(__name__)


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
        labels = torch.as_tensor(batch["label"]).to(batch["pixel_values"].device).long()
        if int(labels.max()) >= self.num_classes or int(labels.min()) < 0:
            raise ValueError(f"label {int(labels.max())} outside the {self.num_classes} class prompts")
        return nn.functional.cross_entropy(self.logits(model, batch["pixel_values"]), labels, reduction="none")

    def __call__(self, model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        """h_k(w; B_k) = mean CE(w) - mean CE(w_old) on the batch's samples."""
        if "reference_loss" not in batch:
            raise KeyError("constraint batch has no 'reference_loss': wrap the data in ReferenceLossDataset")
        current = self.per_sample(model, batch)
        reference = torch.as_tensor(batch["reference_loss"]).to(current)
        return (current - reference).mean()


def _batches(dataset: Any, collate_fn: Callable, batch_size: int, desc: str) -> Any:
    starts = range(0, len(dataset), batch_size)
    for start in tqdm(starts, desc=desc, leave=False, disable=len(starts) < 20):
        rows = list(range(start, min(start + batch_size, len(dataset))))
        yield rows, collate_fn([dataset[i] for i in rows])


def _to(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@torch.no_grad()
def reference_losses(model: nn.Module, dataset: Any, loss: ZeroShotLoss, collate_fn: Callable,
                     batch_size: int = 64) -> torch.Tensor:
    """Per-sample zero-shot CE of ``model`` on ``dataset`` (eval mode, no grad), in row order."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = torch.empty(len(dataset), dtype=torch.float32)
    try:
        for rows, batch in _batches(dataset, collate_fn, batch_size, "reference losses"):
            out[rows] = loss.per_sample(model, _to(batch, device)).float().cpu()
    finally:
        model.train(was_training)
    if not torch.isfinite(out).all():
        raise ValueError("the old model's zero-shot loss is not finite on some samples")
    return out


@torch.no_grad()
def zero_shot_predictions(model: nn.Module, dataset: Any, loss: ZeroShotLoss, collate_fn: Callable,
                          batch_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(predicted class, true class) of every row (eval mode)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    preds, labels = [], []
    try:
        for _, batch in _batches(dataset, collate_fn, batch_size, "zero-shot"):
            batch = _to(batch, device)
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


class ReferenceLossDataset(torch.utils.data.Dataset):
    """Rows of ``dataset`` with the old model's loss added as ``reference_loss``."""

    def __init__(self, dataset: Any, losses: torch.Tensor) -> None:
        if len(losses) != len(dataset):
            raise ValueError(f"{len(losses)} reference losses for {len(dataset)} rows")
        self.dataset, self.losses = dataset, losses

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = dict(self.dataset[i])
        row["reference_loss"] = float(self.losses[i])
        return row


class NonForgettingConstraint(Constraint):
    """h_k(w) = L_k(w, D_k) - L_k(w_old, D_k) <= tolerance for one protected class.

    Build it with :meth:`from_old_model`, which runs the reference pass.
    """

    @classmethod
    def from_old_model(cls, class_name: str, old_model: nn.Module, loss: ZeroShotLoss, dataset: Any,
                       collate_fn: Callable, *, eval_dataset: Optional[Any] = None, tolerance: float = 0.0,
                       batch_size: int = 64) -> "NonForgettingConstraint":
        """Compute the old model's per-sample losses on ``dataset`` (and ``eval_dataset``) and
        return the constraint over those rows."""
        train = ReferenceLossDataset(dataset, reference_losses(old_model, dataset, loss, collate_fn, batch_size))
        held_out = None
        if eval_dataset is not None:
            held_out = ReferenceLossDataset(
                eval_dataset, reference_losses(old_model, eval_dataset, loss, collate_fn, batch_size))
        return cls(name=f"non_forgetting/{class_name}", fn=loss, dataset=train, tolerance=tolerance,
                   eval_dataset=held_out, collate_fn=collate_fn,
                   metadata={"class": class_name, "old_loss": float(train.losses.mean())})


def non_forgetting_constraints(old_model: nn.Module, loss: ZeroShotLoss, datasets: Mapping[str, Any],
                               collate_fn: Callable, *, eval_datasets: Optional[Mapping[str, Any]] = None,
                               tolerance: float = 0.0, batch_size: int = 64) -> list[NonForgettingConstraint]:
    """One :class:`NonForgettingConstraint` per protected class (``datasets``: class name -> rows)."""
    if not datasets:
        raise ValueError("no protected classes: pass at least one class's data")
    out = []
    for name, data in datasets.items():
        held_out = None if eval_datasets is None else eval_datasets.get(name)
        out.append(NonForgettingConstraint.from_old_model(name, old_model, loss, data, collate_fn,
                                                          eval_dataset=held_out, tolerance=tolerance,
                                                          batch_size=batch_size))
        logger.info("non-forgetting constraint %s: %d samples, old loss %.4f", name, len(data),
                    out[-1].metadata["old_loss"])
    return out
