"""AUC maximisation under ROC-fairness constraints (paper section 5.1).

* Objective: the pairwise AUC surrogate F(w) = 1 - mean_{i pos, j neg} sigmoid(s_i - s_j)
  (the paper's -mean sigmoid(s_i - s_j), shifted by 1 so it reads as "1 - soft AUC").
* Constraints: for each threshold tau in Gamma, one on the positives (TPR gap) and one
  on the negatives (FPR gap),

      h_tau^+(w) = | mean_{pos in p} sigmoid(s - tau) - mean_{pos in u} sigmoid(s - tau) | - kappa <= 0,

  and the same on negatives: 2 |Gamma| constraints. They are compositional (paper
  section 5.1): the MSVR estimator tracks the INNER group-rate difference and
  ``Constraint.outer = |.|`` with ``tolerance = kappa``, so the trainer weighs the
  mini-batch gradient of the inner value by beta * 1[|u| - kappa > 0] * sign(u).
* Row-wise form: all constraints share ONE ``row_fn`` (:func:`roc_row_scores`, the
  model's score of every row: one forward over the rows of all sampled constraints),
  each has its own ``row_transform`` sigmoid(s - tau) and ``group_key`` ``"roc_group"``
  (0: group p, 1: group u), so h(B) = mean over p - mean over u.
* Batches (:class:`PairedRows`): every batch needs rows of both sides (groups p and u
  for a constraint, positives and negatives for the AUC objective). Item j is a pair:
  row j of the LONGER side (each visited once per pass, in the sampler's shuffled
  order) and the next row of a shuffled, per-pass reshuffled walk over the SHORTER
  side (each of its rows once per pass of that side; no row is favoured). Each
  side's batch mean is then an unbiased estimate of that side's full mean.
* All TPR constraints share one dataset object (the positives) and all FPR constraints
  another (the negatives), so a trainer may give the constraints of one dataset a shared
  batch.
* Exact values: :func:`roc_fairness_values` computes all of them from one score vector
  with numpy; every constraint's ``exact_fn`` reuses one scoring pass per model state. The
  AUC, the shift-proof measures and the per-epoch history are :mod:`.evaluation`'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Protocol

import numpy as np
import torch
from torch import nn

from ..constraint import Certification, CertifyStatistic, Constraint
from ..method.sampling import ConstraintBatchStream
from ..trainer import ConstrainedTrainer
from .model import model_scores

DEFAULT_THRESHOLDS = (-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0)
DEFAULT_KAPPA = 0.005
GROUP_KEY = "roc_group"
"""Batch key of each constraint row's group: 0 for group p, 1 for group u."""


class RowSource(Protocol):
    """Data whose rows a model can score: ``label``, ``group`` arrays and ``fetch(rows)``."""

    label: np.ndarray
    group: np.ndarray

    def __len__(self) -> int: ...

    def fetch(self, rows: Sequence[int] | np.ndarray) -> torch.Tensor: ...


def _stream_key(name: str) -> int:
    """A stable integer from a dataset's name (Python's str hash is salted per process)."""
    return int.from_bytes(name.encode()[:8].ljust(8, b"\0"), "little") ^ len(name)


# --------------------------------------------------------------------------- paired batches
class PairedRows(torch.utils.data.Dataset):
    """Pairs (a row of side A, a row of side B) of ``source``, ``len`` = max(|A|, |B|).

    Item j holds row j of the longer side (a shuffled pass over the items visits each of
    its rows once) and the next row of the shorter side's own stream: shuffled passes,
    each with a fresh permutation (:class:`~hf_constrained.method.sampling.ConstraintBatchStream`
    seeded by ``seed``, the name, the process rank and the data-loader worker), so every
    row of the shorter side is drawn once per pass of that side and the per-row visit
    counts never differ by more than one. A batch of b items therefore holds b rows of
    each side, and each side's batch mean is an unbiased estimate of its full mean.

    The shorter side is drawn when a batch is built (:meth:`pairs`), so the pairing of
    item j changes from pass to pass. A resumed run starts that walk afresh (still
    uniform). Collate with :func:`collate_pairs` (objective: ``inputs_a``, ``inputs_b``)
    or :func:`collate_rows` (constraints: rows flattened with their group).
    """

    def __init__(self, source: RowSource, rows_a: np.ndarray, rows_b: np.ndarray, *, name: str = "pairs",
                 seed: int = 0) -> None:
        self.source = source
        self.rows_a = np.asarray(rows_a, dtype=np.int64)
        self.rows_b = np.asarray(rows_b, dtype=np.int64)
        self.name = name
        self.seed = int(seed)
        if len(self.rows_a) == 0 or len(self.rows_b) == 0:
            raise ValueError(
                f"{name}: both sides need at least one row (got {len(self.rows_a)} and {len(self.rows_b)})")
        self.a_is_long = len(self.rows_a) >= len(self.rows_b)
        self.length = max(len(self.rows_a), len(self.rows_b))
        self._streams: dict[tuple[int, int], ConstraintBatchStream] = {}

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, j: int) -> tuple["PairedRows", int]:
        if not 0 <= j < self.length:
            raise IndexError(f"{self.name}: index {j} out of range [0, {self.length})")
        return (self, int(j))

    def _short_stream(self) -> ConstraintBatchStream:
        # one walk per (process, loader worker): copies of the dataset in other processes
        # must not replay the same sequence of short-side rows
        rank = torch.distributed.get_rank() if torch.distributed.is_available() and \
            torch.distributed.is_initialized() else 0
        info = torch.utils.data.get_worker_info()
        key = (rank, info.id if info is not None else -1)
        if key not in self._streams:
            short = len(self.rows_b) if self.a_is_long else len(self.rows_a)
            self._streams[key] = ConstraintBatchStream(short, self.seed, _stream_key(self.name) + 7919 * (key[0] + 1)
                                                       + 104729 * (key[1] + 1))
        return self._streams[key]

    def pairs(self, items: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Rows (of ``source``) of side A and side B for the items ``items``."""
        j = np.asarray(items, dtype=np.int64)
        short = np.asarray(self._short_stream().next_indices(len(j)), dtype=np.int64)
        if self.a_is_long:
            return self.rows_a[j], self.rows_b[short]
        return self.rows_a[short], self.rows_b[j]

    def batch(self, items: Sequence[int]) -> dict[str, torch.Tensor]:
        """``{"inputs_a": (b, ...), "inputs_b": (b, ...)}``, fetched in one call per side."""
        a, b = self.pairs(items)
        return {"inputs_a": self.source.fetch(a), "inputs_b": self.source.fetch(b)}

    def rows(self, items: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Rows of the items flattened pair by pair (a_0, b_0, a_1, b_1, ...) and their
        groups (0 for side A, 1 for side B)."""
        a, b = self.pairs(items)
        return np.stack([a, b], axis=1).reshape(-1), np.tile(np.array([0, 1], dtype=np.int64), len(a))

    def row_identities(self) -> list[str]:
        """The identity of every row of both sides (see :func:`hf_constrained.safety.split_checks.row_hashes`)."""
        return _identities(self.source, np.concatenate([self.rows_a, self.rows_b]))


def _identities(source: Any, rows: np.ndarray) -> list[str]:
    """Row identities from ``source.identities`` (a :class:`~hf_constrained.fairness.data.TabularSplit`);
    other sources have none, and their rows are named by source object and position."""
    identities = getattr(source, "identities", None)
    if callable(identities):
        return identities(rows)
    return [f"{id(source)}:{int(r)}" for r in rows]


class GroupRows(torch.utils.data.Dataset):
    """Every row of side A (group 0) and of side B (group 1) of ``source`` once, in order:
    the data for an exact (full-pass) evaluation of a row-wise group-gap constraint.
    Collate with :func:`collate_rows`."""

    def __init__(self, source: RowSource, rows_a: np.ndarray, rows_b: np.ndarray, *, name: str = "rows") -> None:
        self.source = source
        self.rows_a = np.asarray(rows_a, dtype=np.int64)
        self.rows_b = np.asarray(rows_b, dtype=np.int64)
        self.name = name
        if len(self.rows_a) == 0 or len(self.rows_b) == 0:
            raise ValueError(
                f"{name}: both sides need at least one row (got {len(self.rows_a)} and {len(self.rows_b)})")
        self._all = np.concatenate([self.rows_a, self.rows_b])
        self._groups = np.concatenate([np.zeros(len(self.rows_a), np.int64), np.ones(len(self.rows_b), np.int64)])

    def __len__(self) -> int:
        return len(self._all)

    def __getitem__(self, i: int) -> tuple["GroupRows", int]:
        if not 0 <= i < len(self._all):
            raise IndexError(f"{self.name}: index {i} out of range [0, {len(self._all)})")
        return (self, int(i))

    def rows(self, items: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        i = np.asarray(items, dtype=np.int64)
        return self._all[i], self._groups[i]

    def row_identities(self) -> list[str]:
        """The identity of every row (see :func:`hf_constrained.safety.split_checks.row_hashes`)."""
        return _identities(self.source, self._all)


def collate_pairs(examples: Sequence[tuple[PairedRows, int]]) -> dict[str, torch.Tensor]:
    """Collate :class:`PairedRows` items (all from one dataset) into one paired batch."""
    dataset = examples[0][0]
    if any(ds is not dataset for ds, _ in examples):
        raise ValueError("collate_pairs: all items of a batch must come from one PairedRows dataset")
    return dataset.batch([j for _, j in examples])


def collate_rows(examples: Sequence[tuple[Any, int]]) -> dict[str, torch.Tensor]:
    """Collate :class:`PairedRows` / :class:`GroupRows` items into ``{"inputs": rows,
    "roc_group": group of each row}``, rows in item order (a pair gives 2 rows).

    Items of several datasets (several constraints collated together) keep their order;
    the rows of one source are fetched in one call.
    """
    rows, groups, sources = [], [], []
    start = 0
    while start < len(examples):  # runs of consecutive items of one dataset
        ds = examples[start][0]
        end = start
        while end < len(examples) and examples[end][0] is ds:
            end += 1
        r, g = ds.rows([j for _, j in examples[start:end]])
        rows.append(r)
        groups.append(g)
        sources.append(ds.source)
        start = end
    if all(s is sources[0] for s in sources):
        inputs = sources[0].fetch(np.concatenate(rows))
    else:
        inputs = torch.cat([s.fetch(r) for s, r in zip(sources, rows)])
    return {"inputs": inputs, GROUP_KEY: torch.from_numpy(np.concatenate(groups))}


def _paired_scores(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of both sides in ONE forward (one graph per step, as DDP requires)."""
    n = batch["inputs_a"].shape[0]
    s = model_scores(model, torch.cat([batch["inputs_a"], batch["inputs_b"]]))
    return s[:n], s[n:]


# --------------------------------------------------------------------------- objective
def pairwise_auc_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """1 - mean_{i pos, j neg} sigmoid(s_i - s_j) on a batch of (positive, negative) pairs
    (paper sec. 5.1; every positive is compared with every negative of the batch)."""
    s_pos, s_neg = _paired_scores(model, batch)
    return 1.0 - torch.sigmoid(s_pos[:, None] - s_neg[None, :]).mean()


def objective_pairs(source: RowSource, *, seed: int = 0) -> PairedRows:
    """(positive, negative) pairs of ``source`` for :func:`pairwise_auc_loss`.

    One pass (an epoch) visits every row of the larger label class once and walks the
    smaller class in reshuffled passes (:class:`PairedRows`), so no row is left out or
    favoured.
    """
    pos, neg = np.flatnonzero(source.label == 1), np.flatnonzero(source.label == 0)
    if len(pos) == 0 or len(neg) == 0:
        raise ValueError(f"the AUC objective needs both labels; the data has {len(pos)} positives and "
                         f"{len(neg)} negatives")
    return PairedRows(source, pos, neg, name="objective", seed=seed)


# --------------------------------------------------------------------------- constraints
def constraint_name(kind: str, tau: float) -> str:
    return f"{kind}_gap@{tau:+g}"


def roc_row_scores(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The shared ``row_fn`` of the ROC constraints: the score s_w(a) of every row of a
    :func:`collate_rows` batch, one forward."""
    return model_scores(model, batch["inputs"])


class HardRate:
    """The certification statistic of the constraint at threshold tau: the hard rate 1[s > tau] of
    each row (what users check: TPR / FPR at the threshold), from the ``row_fn`` scores."""

    def __init__(self, tau: float) -> None:
        self.tau = float(tau)

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (roc_row_scores(model, batch) > self.tau).double()

    def __repr__(self) -> str:
        return f"HardRate(tau={self.tau:g})"


def check_temperature(temperature: float) -> float:
    """``temperature`` as a float; anything but a finite number > 0 is an error naming it."""
    try:
        t = float(temperature)
    except (TypeError, ValueError):
        raise ValueError(f"the soft rates' temperature must be a finite number > 0, got {temperature!r}") from None
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"the soft rates' temperature must be a finite number > 0, got {temperature!r}")
    return t


def soft_rate(scores: np.ndarray, tau: float, temperature: float = 1.0) -> np.ndarray:
    """The soft rate sigmoid((s - tau) / T) of every score (numpy, float64)."""
    return 1.0 / (1.0 + np.exp(-(np.asarray(scores, dtype=np.float64) - float(tau)) / float(temperature)))


class SigmoidRate:
    """``row_transform`` of the constraint at threshold tau: the soft rate sigmoid((s - tau) / T).

    T = 1 is the paper's rate. A smaller temperature T brings the soft rate closer to the hard
    rate 1[s > tau] that the certificate bounds, so a model that meets the soft constraints on
    scores spread within a few T of the thresholds also has small hard gaps."""

    def __init__(self, tau: float, temperature: float = 1.0) -> None:
        self.tau = float(tau)
        self.temperature = check_temperature(temperature)

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid((scores - self.tau) / self.temperature)

    def __repr__(self) -> str:
        extra = "" if self.temperature == 1.0 else f", temperature={self.temperature:g}"
        return f"SigmoidRate(tau={self.tau:g}{extra})"


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


class _ExactGap:
    """``exact_fn`` of one constraint: |mean_A sigmoid(s - tau) - mean_B sigmoid(s - tau)|
    over EVERY row of both sides once (float64), for :class:`PairedRows` (training data)
    and :class:`GroupRows` (evaluation data) alike. The scores are computed once per
    (model, parameters' versions, data) and shared by all constraints on that data, so
    evaluating the 2|Gamma| constraints costs one pass per dataset, and drawing no batch
    it leaves the shorter side's walk untouched."""

    _cache: dict[str, Any] = {"key": None, "scores": None}

    def __init__(self, tau: float, temperature: float = 1.0) -> None:
        self.tau = float(tau)
        self.temperature = check_temperature(temperature)

    @classmethod
    def scores(cls, model: nn.Module, data: PairedRows | GroupRows) -> tuple[np.ndarray, np.ndarray]:
        versions = tuple(p._version for p in model.parameters())
        key = (id(model), versions, id(data), id(data.source))
        if cls._cache["key"] != key:
            rows = np.concatenate([data.rows_a, data.rows_b])
            s = score_rows(model, data.source, rows).astype(np.float64)
            cls._cache.update(key=key, scores=(s[:len(data.rows_a)], s[len(data.rows_a):]))
        return cls._cache["scores"]

    def __call__(self, model: nn.Module, data: PairedRows | GroupRows) -> float:
        s_a, s_b = self.scores(model, data)
        return float(abs(soft_rate(s_a, self.tau, self.temperature).mean()
                         - soft_rate(s_b, self.tau, self.temperature).mean()))


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
                             kappa: float = DEFAULT_KAPPA, seed: int = 0,
                             certify_data: Optional[RowSource] = None,
                             temperature: float = 1.0) -> list[Constraint]:
    """The 2|Gamma| ROC-fairness constraints |gap_tau| <= kappa (paper section 5.1), row-wise.

    ``tpr_gap@tau`` uses the positives, ``fpr_gap@tau`` the negatives. All share the
    ``row_fn`` :func:`roc_row_scores`; each has ``row_transform`` sigmoid(s - tau),
    ``group_key`` ``"roc_group"`` (0: group p, 1: group u), ``outer = |.|`` and
    ``tolerance = kappa``. The TPR constraints share ONE :class:`PairedRows` of the
    positives (group p, group u), the FPR ones one of the negatives; evaluation data
    (``eval_dataset``) is a :class:`GroupRows` with every row once. ``seed`` seeds the
    shorter group's walk. ``metadata["noise_scale"] = kappa``: the scale the mini-batch
    dispersion is compared with. ``certify_data``: the certification split (every row once);
    the certificate measures what users check, the hard gap |rate_p - rate_u| of 1[s > tau]
    (:class:`HardRate`), from each group's exact Clopper-Pearson bounds, while training follows
    the soft rates. ``temperature``: T of the soft rates sigmoid((s - tau) / T) (the paper: 1).
    """
    temperature = check_temperature(temperature)
    if not kappa >= 0 or not math.isfinite(kappa):
        raise ValueError(f"kappa must be a finite number >= 0, got {kappa}")
    thresholds = [float(t) for t in thresholds]
    if not thresholds:
        raise ValueError("at least one threshold is needed")
    if len(set(thresholds)) != len(thresholds):
        raise ValueError(f"thresholds must be distinct, got {thresholds}")
    cells = group_label_rows(train, "train")
    eval_cells = group_label_rows(eval_data, "evaluation") if eval_data is not None else None
    certify_cells = group_label_rows(certify_data, "certification") if certify_data is not None else None
    out = []
    for kind, y in (("tpr", 1), ("fpr", 0)):
        data = PairedRows(train, cells[(1, y)], cells[(0, y)], name=f"{kind}_rows", seed=seed)
        eval_rows = (GroupRows(eval_data, eval_cells[(1, y)], eval_cells[(0, y)], name=f"{kind}_eval_rows")
                     if eval_cells is not None else None)
        certify_rows = (GroupRows(certify_data, certify_cells[(1, y)], certify_cells[(0, y)],
                                  name=f"{kind}_certify_rows") if certify_cells is not None else None)
        for tau in thresholds:
            out.append(Constraint(
                name=constraint_name(kind, tau), row_fn=roc_row_scores, row_transform=SigmoidRate(tau, temperature),
                group_key=GROUP_KEY, dataset=data, eval_dataset=eval_rows, tolerance=float(kappa),
                collate_fn=collate_rows, outer=torch.abs, exact_fn=_ExactGap(tau, temperature),
                # certified: the hard |TPR/FPR gap| at tau (each group's 0/1 rate, exact Clopper-Pearson bounds);
                # trained: the soft rates' gap (the surrogate)
                certify=None if certify_rows is None else Certification(
                    dataset=certify_rows, statistic=CertifyStatistic(
                        HardRate(tau), tolerance=float(kappa), value_range=(0.0, 1.0), bound="clopper_pearson",
                        description=f"hard {kind.upper()} gap at {tau:g}", group_key=GROUP_KEY, absolute=True)),
                metadata={"kind": kind, "label": y, "threshold": tau, "kappa": float(kappa),
                          "noise_scale": float(kappa), "temperature": temperature},
            ))
    return out


def smallest_certified_gap(bounds: Mapping[str, float]) -> float:
    """The smallest tolerance at which the certificate certifies every hard gap, from its upper
    bounds (constraint name -> bound, e.g. ``results["certificate"]["bounds"]``).

    A constraint is certified when its bound is <= its tolerance, and the bounds (each group's
    Clopper-Pearson interval on the certification split, at the certificate's delta) do not depend
    on the tolerance: the smallest certified gap is therefore exactly the largest bound. An empty
    or non-finite set of bounds is an error."""
    values = [float(v) for v in bounds.values()]
    if not values or not all(math.isfinite(v) for v in values):
        raise ValueError(f"the certificate's bounds must be a non-empty set of finite numbers, got {dict(bounds)}")
    return max(values)


def roc_fairness_values(scores: np.ndarray, label: np.ndarray, group: np.ndarray,
                        thresholds: Sequence[float] = DEFAULT_THRESHOLDS, *, hard: bool = False,
                        temperature: float = 1.0) -> dict[str, float]:
    """Exact |group-rate gap| of every constraint from one score vector (numpy, float64): of the
    soft rates sigmoid((s - tau) / T) (the constraints, T = ``temperature``), or with ``hard`` of
    1[s > tau] (the certificate)."""
    temperature = check_temperature(temperature)
    scores = np.asarray(scores, dtype=np.float64)
    out = {}
    for kind, y in (("tpr", 1), ("fpr", 0)):
        for tau in thresholds:
            rate = (scores > float(tau)).astype(np.float64) if hard else soft_rate(scores, tau, temperature)
            a = rate[(group == 1) & (label == y)].mean()
            b = rate[(group == 0) & (label == y)].mean()
            out[constraint_name(kind, float(tau))] = float(abs(a - b))
    return out


# --------------------------------------------------------------------------- trainer
class AUCConstrainedTrainer(ConstrainedTrainer):
    """``ConstrainedTrainer`` whose objective is :func:`pairwise_auc_loss` on (positive,
    negative) pair batches (train it on :func:`objective_pairs`, collated by
    :func:`collate_pairs`)."""

    def compute_objective_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                               num_items_in_batch: Any = None) -> Any:
        loss = pairwise_auc_loss(model, inputs)
        return (loss, None) if return_outputs else loss
