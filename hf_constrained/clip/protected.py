"""The protected classes' data of a CLIP non-forgetting run, and what reads it besides the constraints.

A run that fine-tunes a zero-shot classifier toward a target class while protecting the other classes reads
each protected class k on four disjoint splits (:class:`ProtectedPools`, built by :func:`protected_pools`):

* ``constraint``: D_k, the data of the constraint h_k(w) = L_k(w) - L_k(w_old) <= tol (the paper's section
  5.2), every row with the old model's zero-shot loss on that very row (augmented copies included:
  :class:`~hf_constrained.non_forgetting.ReferenceLossDataset`);
* ``selection``: the rows that decide which checkpoint is kept
  (:class:`~hf_constrained.safety.in_memory_selection.InMemoryFeasibleSelection`);
* ``test``: the held-out rows of the reported numbers, and :func:`held_out_values` there: each h_k evaluated
  exactly, with its CLT upper bound;
* ``certify``: one row per image (no copies: the bound needs independent rows) with the old model's zero-shot
  correctness, read only by the certificate.

:func:`zero_shot_regulariser` gives the baselines users run instead of constraints (replay of D_k, or a KL
anchor to the old model on D_k) in the form the trainer adds to its objective.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..method.regularisers import KLToOld, ObjectiveRegulariser, Replay
from ..non_forgetting import (
    ROWS_KEPT,
    ReferenceCorrectDataset,
    ReferenceLossDataset,
    reference_losses,
    with_old_correctness,
)
from ..reference_pass import rows_answered
from ..statistics import constraint_statistic
from .data import RowDataset
from .non_forgetting import ZeroShotCorrect, ZeroShotLoss

__all__ = ["BASELINES", "ProtectedPools", "ZeroShotLogits", "ZeroShotMeanLoss", "held_out_values",
           "protected_pools", "zero_shot_regulariser"]

RowsOf = Callable[[str, int, int], Sequence[Mapping[str, Any]]]
"""``rows_of(split, class_index, copies)``: the rows of one class in one split (``"constraint"``,
``"selection"``, ``"held_out"`` or ``"certify"``), each image as ``copies`` augmented copies."""


@dataclass
class ProtectedPools:
    """Every protected class's rows per split (by class name), the old model's reference values included."""

    constraint: dict[str, ReferenceLossDataset]
    selection: dict[str, ReferenceLossDataset]
    test: dict[str, ReferenceLossDataset]
    target_selection: RowDataset  # the target class's selection rows: the selection's objective
    test_all: RowDataset  # every class's held-out rows, for the accuracies
    # the certification images (one row per image) with the old model's zero-shot correctness
    certify: dict[str, ReferenceCorrectDataset] = field(default_factory=dict)


def protected_pools(rows_of: RowsOf, names: Sequence[str], target: int, old_model: nn.Module, loss: ZeroShotLoss,
                    collate_fn: Callable, *, constraint_copies: int, eval_copies: int,
                    constraint_correctness: bool = False, constraint_rows_kept: str = "all") -> ProtectedPools:
    """The pools of every class but ``target`` with the old model's per-row losses, computed on the very rows
    (augmented copies included) they will be compared with: D_k with ``constraint_copies`` copies per image, the
    selection and held-out rows with ``eval_copies``; the certification rows one per image, with the old
    model's zero-shot correctness (absent for a class without any). ``constraint_correctness``: D_k's rows carry
    the old model's correctness too (a proxy indicator reads the share of D_k forgotten). ``constraint_rows_kept``:
    ``"all"``, or ``"old_correct"``: D_k keeps only the rows the old model classifies right (the rows the certificate
    can count as forgotten), for the constraints and for every baseline that reads D_k."""
    if constraint_rows_kept not in ROWS_KEPT:
        raise ValueError(f"constraint_rows_kept must be all or old_correct, got {constraint_rows_kept!r}")
    protected = [c for c in range(len(names)) if c != target]
    correct = ZeroShotCorrect(loss)
    out: dict[str, dict[str, ReferenceLossDataset]] = {}
    # the accuracies and h_k "on the test split" are on every held-out image (test and certification images)
    for split, source, copies in (("constraint", "constraint", constraint_copies),
                                  ("selection", "selection", eval_copies), ("test", "held_out", eval_copies)):
        out[split] = {}
        for c in protected:
            rows = RowDataset(rows_of(source, c, copies))
            if split == "constraint" and constraint_rows_kept == "old_correct":
                rows = RowDataset([rows.rows[i] for i in rows_answered(
                    old_model, rows, correct, collate_fn, name=f"constraint_rows_kept old_correct: protected class "
                                                               f"{names[c]!r}")])
            out[split][names[c]] = ReferenceLossDataset(rows, reference_losses(old_model, rows, loss, collate_fn))
            if split == "constraint" and constraint_correctness:
                out[split][names[c]] = with_old_correctness(old_model, out[split][names[c]], correct, collate_fn)
    test_all = RowDataset([r for c in range(len(names)) for r in rows_of("held_out", c, eval_copies)])
    target_selection = RowDataset(rows_of("selection", target, eval_copies))
    certify = {}
    for c in protected:
        rows = RowDataset(rows_of("certify", c, 1))
        if len(rows):
            certify[names[c]] = with_old_correctness(old_model, rows, correct, collate_fn)
    return ProtectedPools(out["constraint"], out["selection"], out["test"], target_selection, test_all, certify)


def held_out_values(model: nn.Module, datasets: Mapping[str, ReferenceLossDataset], loss: ZeroShotLoss,
                    collate_fn: Callable, transform: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                    name: str = "non_forgetting/{task}") -> tuple[dict[str, float], dict[str, float]]:
    """Each protected class's constraint value h_k on its held-out rows, evaluated exactly, and its one-sided
    95% CLT upper bound (:func:`~hf_constrained.statistics.constraint_statistic`): the mean over the rows of
    the per-row change d_i = CE_i(w) - CE_i(w_old) (``transform`` of it, e.g. ``torch.relu`` for the per-image
    increase). Keyed by ``name`` with ``{task}`` the class name (the constraints' names)."""
    values, bounds = {}, {}
    for task, rows in datasets.items():
        per_row = reference_losses(model, rows, loss, collate_fn) - rows.losses
        if transform is not None:
            per_row = transform(per_row)
        stat = constraint_statistic(per_row.double().numpy())
        values[name.format(task=task)], bounds[name.format(task=task)] = stat.value, stat.upper_bound
    return values, bounds


class ZeroShotMeanLoss:
    """``(model, batch) -> scalar``: the mean zero-shot cross-entropy of a batch of protected images, the loss whose
    per-row increase over the old model's the non-forgetting constraints bound."""

    def __init__(self, loss: ZeroShotLoss) -> None:
        self.loss = loss

    def __call__(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        return self.loss.per_sample(model, batch).mean()


class ZeroShotLogits:
    """``(model, batch) -> (rows, classes)``: the zero-shot class logits the KL anchor compares."""

    def __init__(self, loss: ZeroShotLoss) -> None:
        self.loss = loss

    def __call__(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        return self.loss.logits(model, batch["pixel_values"])


BASELINES = ("replay", "kl")
"""What users do instead of constraints: the names :func:`zero_shot_regulariser` takes."""


def zero_shot_regulariser(spec: Optional[tuple[str, float]], old_model: nn.Module,
                          datasets: Mapping[str, Any], loss: ZeroShotLoss, collate_fn: Callable, *,
                          rows_per_step: int, seed: int) -> Optional[ObjectiveRegulariser]:
    """The baseline ``(name, value)`` added to the contrastive objective (Algorithm 2's F); ``None`` for none:

    * ``("replay", r)``: protected rows mixed into every step at share r of the rows
      (:class:`~hf_constrained.method.regularisers.Replay`), scored by their zero-shot cross-entropy, the loss
      the non-forgetting constraints read;
    * ``("kl", lam)``: ``lam * KL(p_old || p_w)`` of the zero-shot class distribution on ``rows_per_step``
      protected rows per step (:class:`~hf_constrained.method.regularisers.KLToOld`; the old model is
      ``old_model``, copied now, before training).

    Both read only ``datasets`` (the constraint data D_k of every protected class, in their order).
    """
    if spec is None:
        return None
    name, value = spec
    old_rows = torch.utils.data.ConcatDataset([datasets[k] for k in datasets])
    if name == "replay":
        return Replay(old_rows, value, collate_fn, loss_fn=ZeroShotMeanLoss(loss), seed=seed)
    if name == "kl":
        return KLToOld(old_model, old_rows, value, collate_fn, rows_per_step=rows_per_step,
                       logits_fn=ZeroShotLogits(loss), seed=seed)
    raise ValueError(f"unknown baseline {name!r}: one of {list(BASELINES)}")
