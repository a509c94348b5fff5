"""Measuring a ROC-fairness scorer (paper section 5.1): AUC, every constraint's exact value, and fairness that
a common shift of the scores cannot fake.

The constraints (:mod:`.roc`) bound SOFT group-rate gaps at fixed thresholds Gamma. A model can meet them by
moving every score past Gamma, where every soft rate saturates, without becoming fairer; the shift-proof
measures (:func:`shift_proof_fairness`: hard gaps at thresholds placed at the scores' own quantiles, and the
ROC gap, :func:`roc_curve_gap`) are unchanged by such a shift. :func:`evaluate_roc` reports all of them for
one split, and :class:`ROCHistoryCallback` once per epoch for every split.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
from torch import nn
from transformers import TrainerCallback

from .roc import DEFAULT_KAPPA, DEFAULT_THRESHOLDS, RowSource, check_temperature, roc_fairness_values, score_rows

# --------------------------------------------------------------------------- shift-proof fairness
DEFAULT_QUANTILES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def _roc_points(pos: np.ndarray, neg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(FPR, TPR) of the rule "score >= t" at every distinct score t (and t = +inf)."""
    t = np.unique(np.concatenate([pos, neg]))
    pos_sorted, neg_sorted = np.sort(pos), np.sort(neg)
    tpr = (len(pos) - np.searchsorted(pos_sorted, t, side="left")) / len(pos)
    fpr = (len(neg) - np.searchsorted(neg_sorted, t, side="left")) / len(neg)
    return np.concatenate([fpr, [0.0]]), np.concatenate([tpr, [0.0]])


def _best_tpr_at(fpr: np.ndarray, tpr: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """max{TPR(t) : FPR(t) <= f} for every f in ``grid`` (the group's ROC curve as a step function)."""
    order = np.argsort(fpr, kind="stable")
    f_sorted, best = fpr[order], np.maximum.accumulate(tpr[order])
    idx = np.searchsorted(f_sorted, grid, side="right") - 1
    return np.where(idx >= 0, best[np.clip(idx, 0, None)], 0.0)


def roc_curve_gap(scores: np.ndarray, label: np.ndarray, group: np.ndarray) -> float:
    """Largest vertical distance between the two groups' ROC curves:
    max_f |TPR_p(f) - TPR_u(f)|, TPR_g(f) = the best TPR of a threshold rule on group g
    whose FPR on group g is at most f. Unchanged by any strictly increasing map of the
    scores (a common shift included)."""
    s = np.asarray(scores, dtype=np.float64)
    curves = []
    for g in (1, 0):
        pos, neg = s[(group == g) & (label == 1)], s[(group == g) & (label == 0)]
        if len(pos) == 0 or len(neg) == 0:
            return float("nan")
        curves.append(_roc_points(pos, neg))
    grid = np.unique(np.concatenate([curves[0][0], curves[1][0]]))
    return float(np.max(np.abs(_best_tpr_at(*curves[0], grid) - _best_tpr_at(*curves[1], grid))))


def shift_proof_fairness(scores: np.ndarray, label: np.ndarray, group: np.ndarray, *,
                         quantiles: Sequence[float] = DEFAULT_QUANTILES,
                         soft_thresholds: Sequence[float] = DEFAULT_THRESHOLDS) -> dict[str, Any]:
    """Fairness measures that moving every score by the same amount cannot change.

    * hard TPR / FPR gaps |P(s > t | y, p) - P(s > t | y, u)| at thresholds t placed at the
      ``quantiles`` of the pooled scores of this split (they move with the scores);
    * ``roc_gap``: :func:`roc_curve_gap`, the largest TPR difference at equal FPR.

    Also reports where the scores lie relative to the soft constraints' fixed thresholds
    Gamma: the fraction above max(Gamma) and below min(Gamma). When (nearly) all scores lie
    beyond Gamma every soft rate saturates and the soft gaps vanish whatever the ranking
    within each group; the hard gaps and the ROC gap still show it.
    """
    s = np.asarray(scores, dtype=np.float64)
    label, group = np.asarray(label), np.asarray(group)
    cuts = np.quantile(s, np.asarray(quantiles, dtype=np.float64))
    hard: dict[str, list[float]] = {"tpr": [], "fpr": []}
    for kind, y in (("tpr", 1), ("fpr", 0)):
        a, b = s[(group == 1) & (label == y)], s[(group == 0) & (label == y)]
        for t in cuts:
            hard[kind].append(float(abs((a > t).mean() - (b > t).mean())))
    lo, hi = float(min(soft_thresholds)), float(max(soft_thresholds))
    return {
        "quantiles": [float(q) for q in quantiles],
        "quantile_thresholds": [float(t) for t in cuts],
        "hard_tpr_gaps": hard["tpr"],
        "hard_fpr_gaps": hard["fpr"],
        "hard_tpr_gap_max": max(hard["tpr"]),
        "hard_fpr_gap_max": max(hard["fpr"]),
        "hard_gap_max": max(hard["tpr"] + hard["fpr"]),
        "roc_gap": roc_curve_gap(s, label, group),
        "fraction_above_max_threshold": float((s > hi).mean()),
        "fraction_below_min_threshold": float((s < lo).mean()),
        "fraction_outside_thresholds": float(((s > hi) | (s < lo)).mean()),
        "score_quantiles": {str(q): float(v) for q, v in zip((0.0, 0.05, 0.5, 0.95, 1.0),
                                                              np.quantile(s, [0.0, 0.05, 0.5, 0.95, 1.0]))},
    }


def auc_score(scores: np.ndarray, label: np.ndarray) -> float:
    """Exact AUC (probability a positive outscores a negative, ties 1/2)."""
    from ..extras import require_extra

    roc_auc_score = require_extra("sklearn.metrics", "fairness", "the AUC").roc_auc_score

    return float(roc_auc_score(label, scores))


def evaluate_roc(model: nn.Module, source: RowSource, *, thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
                 kappa: float = DEFAULT_KAPPA, temperature: float = 1.0) -> dict[str, Any]:
    """AUC, every constraint's exact h = |gap| - kappa (soft rates at ``temperature``), the largest
    one, feasibility, and the shift-proof measures (:func:`shift_proof_fairness`)."""
    scores = score_rows(model, source)
    gaps = roc_fairness_values(scores, source.label, source.group, thresholds, temperature=temperature)
    h = {k: v - kappa for k, v in gaps.items()}
    return {"auc": auc_score(scores, source.label), "constraints": h, "max_violation": max(h.values()),
            "feasible": bool(max(h.values()) <= 0),
            "shift_proof": shift_proof_fairness(scores, source.label, source.group, soft_thresholds=thresholds)}


# --------------------------------------------------------------------------- history
class ROCHistoryCallback(TrainerCallback):
    """After every epoch: exact AUC and constraint values on each split, plus training
    wall time (time spent in epochs, evaluation excluded). ``history`` is a list of dicts;
    the shift-proof measures are kept for the first and the last entry only (``record``
    with ``full=True``), to keep results files small."""

    def __init__(self, splits: dict[str, RowSource], *, thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
                 kappa: float = DEFAULT_KAPPA, temperature: float = 1.0) -> None:
        self.splits = splits
        self.thresholds = list(thresholds)
        self.kappa = kappa
        self.temperature = check_temperature(temperature)
        self.history: list[dict[str, Any]] = []
        self.train_seconds = 0.0
        self._t0: Optional[float] = None

    def record(self, model: nn.Module, epoch: float) -> dict[str, Any]:
        entry: dict[str, Any] = {"epoch": epoch, "train_seconds": self.train_seconds}
        for name, source in self.splits.items():
            entry[name] = evaluate_roc(model, source, thresholds=self.thresholds, kappa=self.kappa,
                                       temperature=self.temperature)
        if len(self.history) > 1:  # only the first and the latest entry keep the per-quantile detail
            for name in self.splits:
                sp = self.history[-1][name]["shift_proof"]
                self.history[-1][name]["shift_proof"] = {k: sp[k] for k in ("hard_gap_max", "roc_gap",
                                                                             "fraction_outside_thresholds")}
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
