"""The reference pass: the old model's per-row values, computed once, before training, and stored with the rows.

A non-forgetting constraint (:mod:`hf_constrained.non_forgetting`, the paper's section 5.2) compares each
row's loss under the model being trained with the old model's, ``l(w, x) - l(w_old, x)``. The old model's
part does not change during training, so it is computed once here (eval mode, no grad, batched, with a
progress bar; :func:`reference_losses`) and stored beside each row (:class:`ReferenceLossDataset` adds
``reference_loss``): no second model is kept in memory. Certification rows get the old model's 0/1
correctness the same way (:func:`with_old_correctness`, ``reference_correct``), which the forgetting
statistics read. With a PEFT model, :func:`old_model_context` makes the adapter-disabled base the old model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from tqdm.auto import tqdm

from .batches import collate_examples, fetch_rows

PerSampleLoss = Callable[[nn.Module, Any], torch.Tensor]
"""``loss(model, batch) -> tensor (rows,)``: one loss per row, independent of the other rows."""

REFERENCE_KEY = "reference_loss"
CORRECT_KEY = "reference_correct"

PerSampleCorrect = Callable[[nn.Module, Any], torch.Tensor]
"""``correct(model, batch) -> tensor (rows,)`` of 0/1: whether the model gets each row right
(e.g. :func:`~hf_constrained.per_sample_loss.causal_lm_per_example_correct`)."""


def as_per_sample_loss(loss: Any) -> PerSampleLoss:
    """``loss`` itself, or its ``per_sample`` method for loss objects whose call gives the
    batch's constraint value (e.g. :class:`hf_constrained.clip.ZeroShotLoss`)."""
    per_sample = getattr(loss, "per_sample", None)
    if callable(per_sample):
        return per_sample
    if not callable(loss):
        raise TypeError(f"a per-sample loss must be callable as loss(model, batch), got {type(loss).__name__}")
    return loss


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with its tensors moved to ``device`` (dict batches; others unchanged)."""
    if isinstance(batch, Mapping):
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return batch


def iterate_batches(dataset: Any, collate_fn: Callable, batch_size: int, desc: str) -> Iterator[tuple[list[int], Any]]:
    """(row indices, collated batch) over ``dataset`` in order, with a progress bar for long passes."""
    starts = range(0, len(dataset), batch_size)
    for start in tqdm(starts, desc=desc, leave=False, disable=len(starts) < 20):
        rows = list(range(start, min(start + batch_size, len(dataset))))
        yield rows, collate_fn(fetch_rows(dataset, rows))


def old_model_context(model: nn.Module, use_base: bool = True) -> contextlib.AbstractContextManager:
    """A context in which ``model`` computes the old model's values: for a PEFT model
    (``disable_adapter``) with ``use_base``, its adapter-disabled base; otherwise the model as it is."""
    if use_base and callable(getattr(model, "disable_adapter", None)):
        return model.disable_adapter()
    return contextlib.nullcontext()


@torch.no_grad()
def reference_losses(model: nn.Module, dataset: Any, loss: Union[PerSampleLoss, Any],
                     collate_fn: Optional[Callable] = None, batch_size: int = 64, *,
                     desc: str = "reference losses") -> torch.Tensor:
    """Per-sample loss of ``model`` on every row of ``dataset``, in row order (float32, CPU).

    The model runs in eval mode (dropout off) under ``no_grad``, in batches of
    ``batch_size`` on the model's device; its training mode is restored afterwards.
    This is the old model's L_k(w_old, x) of the constraint h_k (section 5.2), computed once.

    Args:
        model: the old model (or, inside :func:`old_model_context`, a PEFT model's base).
        dataset: indexable rows (a ``datasets.Dataset``, a torch ``Dataset``, a list).
        loss: ``loss(model, batch) -> (rows,)``, or an object with ``per_sample(model, batch)``.
        collate_fn: rows -> batch (default :func:`~hf_constrained.constraint.collate_examples`;
            tokenised text needs a padding collator such as
            :class:`~hf_constrained.per_sample_loss.PaddingCollator`).
        batch_size: rows per forward pass.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    per_sample = as_per_sample_loss(loss)
    collate_fn = collate_fn or collate_examples
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = torch.empty(len(dataset), dtype=torch.float32)
    try:
        for rows, batch in iterate_batches(dataset, collate_fn, batch_size, desc):
            values = per_sample(model, to_device(batch, device))
            if values.dim() != 1 or values.shape[0] != len(rows):
                raise ValueError(f"the per-sample loss returned shape {tuple(values.shape)} for a batch of "
                                 f"{len(rows)} rows; it must return one value per row")
            out[rows] = values.float().cpu()
    finally:
        model.train(was_training)
    if not torch.isfinite(out).all():
        bad = torch.nonzero(~torch.isfinite(out)).flatten()[:5].tolist()
        raise ValueError(f"the old model's loss is not finite on rows {bad} ({desc})")
    return out


class ReferenceLossDataset(torch.utils.data.Dataset):
    """The rows of ``dataset`` with the old model's per-sample loss added as ``reference_loss``.

    Rows that name themselves (a ``row_identities()`` method, read by the certification-split
    check of :mod:`hf_constrained.safety.split_checks`) keep their names."""

    def __init__(self, dataset: Any, losses: torch.Tensor) -> None:
        if len(losses) != len(dataset):
            raise ValueError(f"{len(losses)} reference losses for {len(dataset)} rows")
        self.dataset, self.losses = dataset, torch.as_tensor(losses, dtype=torch.float32)
        identities = getattr(dataset, "row_identities", None)
        if callable(identities):  # rows that name themselves (hf_constrained.safety.split_checks) keep their names
            self.row_identities = identities

    def __len__(self) -> int:
        return len(self.dataset)

    key = REFERENCE_KEY  # the field each row gains

    def _row(self, row: Any, i: int) -> dict[str, Any]:
        if not isinstance(row, Mapping):
            raise TypeError(f"{type(self).__name__} needs dict rows, got {type(row).__name__} at row {i}")
        row = dict(row)
        row[self.key] = float(self.losses[i])
        return row

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self._row(self.dataset[i], i)

    def __getitems__(self, rows: list[int]) -> list[dict[str, Any]]:
        return [self._row(r, i) for r, i in zip(fetch_rows(self.dataset, rows), rows)]

    @property
    def mean_loss(self) -> float:
        return float(self.losses.mean())


class ReferenceCorrectDataset(ReferenceLossDataset):
    """The rows of ``dataset`` with the old model's 0/1 correctness added as ``reference_correct``
    (certification rows: the forgetting statistic needs no reference loss)."""

    key = CORRECT_KEY


def with_old_correctness(old_model: nn.Module, dataset: Any, correct: PerSampleCorrect,
                         collate_fn: Optional[Callable] = None, batch_size: int = 64, *,
                         desc: str = "old model's correctness") -> ReferenceCorrectDataset:
    """``dataset``'s rows with the old model's 0/1 correctness on each as ``reference_correct``
    (:class:`ReferenceCorrectDataset`): one eval-mode pass of ``correct`` (:func:`reference_losses`), before
    training, so that :class:`ForgottenRows` can later tell, per row, whether a model forgot it.
    Rows that already carry ``reference_loss`` (a :class:`ReferenceLossDataset`) keep it."""
    return ReferenceCorrectDataset(dataset, reference_losses(old_model, dataset, correct, collate_fn, batch_size,
                                                             desc=desc))


def rows_answered(old_model: nn.Module, dataset: Any, correct: PerSampleCorrect, collate_fn: Optional[Callable] = None,
                  batch_size: int = 64, *, name: str = "the rows", desc: str = "old model's correctness") -> list[int]:
    """The indices of ``dataset``'s rows that ``old_model`` answers right (``correct`` gives 1), in their order: the
    rows a non-forgetting certificate can count as forgotten, where a constraint keeps only those
    (``rows_kept="old_correct"``). One eval-mode pass (:func:`reference_losses`); none answered is an error naming
    ``name``, since the constraint would have no rows."""
    hits = reference_losses(old_model, dataset, correct, collate_fn, batch_size, desc=desc)
    kept = [i for i, hit in enumerate(hits.tolist()) if hit > 0.5]
    if not kept:
        raise ValueError(f"{name}: the old model answers none of its {len(dataset)} rows right; keep all rows")
    return kept


def row_subset(dataset: Any, indices: list[int]) -> Any:
    """The rows ``indices`` of ``dataset``, in that order: ``dataset.select`` where it has one (a ``datasets.Dataset``),
    else a :class:`torch.utils.data.Subset`."""
    select = getattr(dataset, "select", None)
    return select(indices) if callable(select) else torch.utils.data.Subset(dataset, indices)
