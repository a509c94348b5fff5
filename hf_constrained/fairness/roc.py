"""AUC maximisation under ROC-fairness constraints (paper section 5.1; REFERENCE section 4).

* Objective: the pairwise AUC surrogate F(w) = 1 - mean_{i pos, j neg} sigmoid(s_i - s_j)
  (the paper's -mean sigmoid(s_i - s_j), shifted by 1 so it reads as "1 - soft AUC").
* Constraints: for each threshold tau in Gamma, one on the positives (TPR gap) and one
  on the negatives (FPR gap),

      h_tau^+(w) = | mean_{pos in p} sigmoid(s - tau) - mean_{pos in u} sigmoid(s - tau) | - kappa <= 0,

  and the same on negatives: 2 |Gamma| constraints. They are compositional: the MSVR
  estimator tracks the INNER group-rate difference (``Constraint.fn`` returns it) and
  ``Constraint.outer = |.|`` with ``tolerance = kappa``, so the trainer weighs the
  mini-batch gradient of the inner value by beta * 1[|u| - kappa > 0] * sign(u)
  (hinge) - the compositional estimator of REFERENCE section 4.
* Batches: a difference of group means needs rows of both groups in every constraint
  batch, and the AUC loss needs both labels in every objective batch. Both use
  :class:`PairedRows`: item j is a pair (a row of side A, a row of side B), so a batch
  of b items holds b rows of each side, whatever the sampler.
* Exact values: a difference of two means is not a per-sample mean, so every
  constraint carries an ``exact_fn`` computing the full-data value (what
  ``ConstrainedTrainer.evaluate`` reports); :func:`roc_fairness_values` computes all of
  them from one score vector with numpy (history, results).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, Optional, Protocol

import numpy as np
import torch
from torch import nn
from transformers import TrainerCallback

from ..constraint import Constraint
from ..trainer import ConstrainedTrainer
from .model import model_scores

DEFAULT_THRESHOLDS = (-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0)
DEFAULT_KAPPA = 0.005


class RowSource(Protocol):
    """Data whose rows a model can score: ``label``, ``group`` arrays and ``fetch(rows)``."""

    label: np.ndarray
    group: np.ndarray

    def __len__(self) -> int: ...

    def fetch(self, rows: Sequence[int] | np.ndarray) -> torch.Tensor: ...


# --------------------------------------------------------------------------- paired batches
class PairedRows(torch.utils.data.Dataset):
    """Item j = (row ``rows_a[j % |A|]``, row ``rows_b[j % |B|]``) of ``source``.

    With the default length max(|A|, |B|), a shuffled pass visits every row of the
    larger side once and cycles the smaller one, so any batch of b items has exactly b
    rows from each side. Collate with :func:`collate_pairs`: the batch is
    ``{"inputs_a": (b, ...), "inputs_b": (b, ...)}`` fetched in one call per side.
    """

    def __init__(self, source: RowSource, rows_a: np.ndarray, rows_b: np.ndarray, *, name: str = "pairs",
                 length: Optional[int] = None) -> None:
        self.source = source
        self.rows_a = np.asarray(rows_a, dtype=np.int64)
        self.rows_b = np.asarray(rows_b, dtype=np.int64)
        self.name = name
        if len(self.rows_a) == 0 or len(self.rows_b) == 0:
            raise ValueError(f"{name}: both sides need at least one row (got {len(self.rows_a)} and {len(self.rows_b)})")
        self.length = int(length) if length is not None else max(len(self.rows_a), len(self.rows_b))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, j: int) -> tuple["PairedRows", int]:
        if not 0 <= j < self.length:
            raise IndexError(f"{self.name}: index {j} out of range [0, {self.length})")
        return (self, int(j))

    def batch(self, items: Sequence[int]) -> dict[str, torch.Tensor]:
        j = np.asarray(items, dtype=np.int64)
        return {"inputs_a": self.source.fetch(self.rows_a[j % len(self.rows_a)]),
                "inputs_b": self.source.fetch(self.rows_b[j % len(self.rows_b)])}


def collate_pairs(examples: Sequence[tuple[PairedRows, int]]) -> dict[str, torch.Tensor]:
    """Collate :class:`PairedRows` items (all from one dataset) into one paired batch."""
    dataset = examples[0][0]
    return dataset.batch([j for _, j in examples])


def _paired_scores(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of both sides in ONE forward (one graph per step: DDP-safe, REFERENCE sec. 6)."""
    n = batch["inputs_a"].shape[0]
    s = model_scores(model, torch.cat([batch["inputs_a"], batch["inputs_b"]]))
    return s[:n], s[n:]


# --------------------------------------------------------------------------- objective
def pairwise_auc_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """1 - mean_{i pos, j neg} sigmoid(s_i - s_j) on a batch of (positive, negative) pairs
    (paper sec. 5.1; every positive is compared with every negative of the batch)."""
    s_pos, s_neg = _paired_scores(model, batch)
    return 1.0 - torch.sigmoid(s_pos[:, None] - s_neg[None, :]).mean()


def objective_pairs(source: RowSource, *, length: Optional[int] = None) -> PairedRows:
    """(positive, negative) pairs of ``source`` for :func:`pairwise_auc_loss`.

    Default length: half the rows, so one epoch of b-pair batches sees about as many
    rows as an epoch of 2b-row batches over the data.
    """
    pos, neg = np.flatnonzero(source.label == 1), np.flatnonzero(source.label == 0)
    if len(pos) == 0 or len(neg) == 0:
        raise ValueError(f"the AUC objective needs both labels; the data has {len(pos)} positives and "
                         f"{len(neg)} negatives")
    return PairedRows(source, pos, neg, name="objective", length=length or max(1, len(source) // 2))


# --------------------------------------------------------------------------- constraints
def constraint_name(kind: str, tau: float) -> str:
    return f"{kind}_gap@{tau:+g}"


def _group_rate_gap(tau: float):
    def inner(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """mean_{A} sigmoid(s - tau) - mean_{B} sigmoid(s - tau): the inner value of h_tau."""
        s_a, s_b = _paired_scores(model, batch)
        return torch.sigmoid(s_a - tau).mean() - torch.sigmoid(s_b - tau).mean()

    return inner


@torch.no_grad()
def score_rows(model: nn.Module, source: RowSource, rows: Optional[np.ndarray] = None,
               batch_size: int = 4096) -> np.ndarray:
    """Scores s_w(a) of ``rows`` of ``source`` (all rows by default), in eval mode."""
    rows = np.arange(len(source)) if rows is None else np.asarray(rows, dtype=np.int64)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        out = [model_scores(model, source.fetch(rows[i:i + batch_size]).to(device)).cpu()
               for i in range(0, len(rows), batch_size)]
    finally:
        model.train(was_training)
    return torch.cat(out).numpy() if out else np.zeros(0, dtype=np.float32)


def _exact_gap(tau: float):
    def exact(model: nn.Module, data: PairedRows) -> float:
        """|mean_{A} sigmoid(s - tau) - mean_{B} sigmoid(s - tau)| over ALL rows of both sides."""
        sig = lambda s: 1.0 / (1.0 + np.exp(-(s.astype(np.float64) - tau)))  # noqa: E731
        return float(abs(sig(score_rows(model, data.source, data.rows_a)).mean()
                         - sig(score_rows(model, data.source, data.rows_b)).mean()))

    return exact


def group_label_rows(source: RowSource, split: str = "train") -> dict[tuple[int, int], np.ndarray]:
    """Rows of each (group, label) cell; a missing cell is an error naming it."""
    cells = {(g, y): np.flatnonzero((source.group == g) & (source.label == y)) for g in (1, 0) for y in (1, 0)}
    empty = [f"group {'p' if g else 'u'} ({g}) with label {y}" for (g, y), rows in cells.items() if len(rows) == 0]
    if empty:
        counts = {f"group={g},label={y}": len(r) for (g, y), r in cells.items()}
        raise ValueError(
            f"ROC-fairness constraints need rows of both groups among both positives and negatives; the {split} "
            f"data has none for: {', '.join(empty)} (cell counts: {counts})"
        )
    return cells


def roc_fairness_constraints(train: RowSource, eval_data: Optional[RowSource] = None, *,
                             thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
                             kappa: float = DEFAULT_KAPPA) -> list[Constraint]:
    """The 2|Gamma| ROC-fairness constraints h_tau^{+/-}(w) <= 0 (paper eq. in sec. 5.1).

    Constraint ``tpr_gap@tau`` uses the positives, ``fpr_gap@tau`` the negatives; its data
    is :class:`PairedRows` (group p, group u) of that label, so each B_k holds both groups.
    ``fn`` returns the inner group-rate difference, ``outer = |.|``, ``tolerance = kappa``.
    """
    if not kappa >= 0 or not math.isfinite(kappa):
        raise ValueError(f"kappa must be a finite number >= 0, got {kappa}")
    thresholds = [float(t) for t in thresholds]
    if not thresholds:
        raise ValueError("at least one threshold is needed")
    if len(set(thresholds)) != len(thresholds):
        raise ValueError(f"thresholds must be distinct, got {thresholds}")
    cells = group_label_rows(train, "train")
    eval_cells = group_label_rows(eval_data, "evaluation") if eval_data is not None else None
    out = []
    for kind, y in (("tpr", 1), ("fpr", 0)):
        for tau in thresholds:
            name = constraint_name(kind, tau)
            data = PairedRows(train, cells[(1, y)], cells[(0, y)], name=name)
            eval_pairs = (PairedRows(eval_data, eval_cells[(1, y)], eval_cells[(0, y)], name=name)
                          if eval_cells is not None else None)
            out.append(Constraint(
                name=name, fn=_group_rate_gap(tau), dataset=data, tolerance=float(kappa), eval_dataset=eval_pairs,
                collate_fn=collate_pairs, outer=torch.abs, exact_fn=_exact_gap(tau),
                metadata={"kind": kind, "label": y, "threshold": tau, "kappa": float(kappa)},
            ))
    return out


def roc_fairness_values(scores: np.ndarray, label: np.ndarray, group: np.ndarray,
                        thresholds: Sequence[float] = DEFAULT_THRESHOLDS) -> dict[str, float]:
    """Exact |group-rate gap| of every constraint from one score vector (numpy, float64)."""
    scores = np.asarray(scores, dtype=np.float64)
    out = {}
    for kind, y in (("tpr", 1), ("fpr", 0)):
        for tau in thresholds:
            rate = 1.0 / (1.0 + np.exp(-(scores - float(tau))))
            a = rate[(group == 1) & (label == y)].mean()
            b = rate[(group == 0) & (label == y)].mean()
            out[constraint_name(kind, float(tau))] = float(abs(a - b))
    return out


def auc_score(scores: np.ndarray, label: np.ndarray) -> float:
    """Exact AUC (probability a positive outscores a negative, ties 1/2)."""
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(label, scores))


def evaluate_roc(model: nn.Module, source: RowSource, *, thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
                 kappa: float = DEFAULT_KAPPA) -> dict[str, Any]:
    """AUC, every constraint's exact h = |gap| - kappa, the largest one, and feasibility."""
    scores = score_rows(model, source)
    gaps = roc_fairness_values(scores, source.label, source.group, thresholds)
    h = {k: v - kappa for k, v in gaps.items()}
    return {"auc": auc_score(scores, source.label), "constraints": h, "max_violation": max(h.values()),
            "feasible": bool(max(h.values()) <= 0)}


# --------------------------------------------------------------------------- trainer + history
class AUCConstrainedTrainer(ConstrainedTrainer):
    """``ConstrainedTrainer`` whose objective is :func:`pairwise_auc_loss` on (positive,
    negative) pair batches (train it on :func:`objective_pairs`, collated by
    :func:`collate_pairs`)."""

    def compute_objective_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                               num_items_in_batch: Any = None) -> Any:
        loss = pairwise_auc_loss(model, inputs)
        return (loss, None) if return_outputs else loss


class ROCHistoryCallback(TrainerCallback):
    """After every epoch: exact AUC and constraint values on each split, plus training
    wall time (time spent in epochs, evaluation excluded). ``history`` is a list of dicts."""

    def __init__(self, splits: dict[str, RowSource], *, thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
                 kappa: float = DEFAULT_KAPPA) -> None:
        self.splits = splits
        self.thresholds = list(thresholds)
        self.kappa = kappa
        self.history: list[dict[str, Any]] = []
        self.train_seconds = 0.0
        self._t0: Optional[float] = None

    def record(self, model: nn.Module, epoch: float) -> dict[str, Any]:
        entry: dict[str, Any] = {"epoch": epoch, "train_seconds": self.train_seconds}
        for name, source in self.splits.items():
            entry[name] = evaluate_roc(model, source, thresholds=self.thresholds, kappa=self.kappa)
        self.history.append(entry)
        return entry

    def on_train_begin(self, args, state, control, model=None, **kwargs):  # noqa: D401
        if not self.history:
            self.record(model, 0.0)

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        if self._t0 is not None:
            self.train_seconds += time.perf_counter() - self._t0
            self._t0 = None
        if state.is_world_process_zero:
            self.record(model, round(state.epoch or 0.0, 4))
