"""What users do instead of constraints to keep what the old model knew, as strategy objects.

The baselines of the forgetting benchmark (``benchmarks/forgetting_frontier.py``), each a change of the
objective F of Algorithm 1 (the G_1 part of a step), so each runs inside the same
:class:`~hf_constrained.ConstrainedTrainer` and combines with any ``constraint_penalty`` ("none", "hinge",
"squared_hinge"): "hinge + a little replay" is one run.

* :class:`Replay`: old-task rows mixed into the objective batches, a share ``ratio`` of the rows.
  The new-task batch stays as it is (every method sees the same new rows per step); the step adds
  ``k = round(ratio / (1 - ratio) * B)`` old rows and the loss is the row-weighted mean
  ``(B * F_new + k * F_old) / (B + k)``, what one mixed batch of ``B + k`` rows gives.
* :class:`ConstraintRowReplay`: replay whose old rows are the constraints' own gradient rows B_k^t
  (one draw of old rows per step, each row's loss computed once; with the hinge, each row carries
  replay's weight plus the penalty's). The way to combine replay with non-forgetting constraints.
* :class:`KLToOld`: ``lam * KL(p_old || p_w)`` on old rows, the old model's next-token (or class)
  distribution against the current one (full vocabulary, forward KL as in LLaMA-Factory), averaged
  over the scored positions (labels other than -100) of a batch of old rows.
* :class:`L2ToOld`: ``lam / 2 * ||w - w_old||^2`` over the trainable parameters (L2-SP).

One dispatch point: :meth:`ObjectiveRegulariser.apply`, called by
:meth:`ConstrainedTrainer.compute_loss` on the objective of every training micro-batch;
:func:`make_regulariser` builds one from its name. The old rows of a step are a deterministic
function of ``(seed, step, micro-batch)``, so a resumed run draws the same rows and every
method of a benchmark draws from the same stream.
"""

from __future__ import annotations

import copy
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from torch import nn

from ..batches import fetch_rows
from .sampling import _mixed_seed

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # labels the loss skips (transformers' convention)

Collate = Callable[[Sequence[Any]], Any]
ToDevice = Callable[[Any], Any]


class OldRowStream:
    """Rows of an old-task dataset, ``k`` per draw, walking shuffled passes over it.

    The draw number ``i`` fixes the rows: draw ``i`` takes positions ``i*k .. i*k+k-1`` of an endless
    sequence of permutations, permutation ``e`` drawn from a generator seeded by ``(seed, e)``. Nothing
    to save: a resumed run that numbers its draws the same way reads the same rows.
    """

    def __init__(self, num_rows: int, seed: int) -> None:
        if num_rows < 1:
            raise ValueError("the old-task rows are empty: give at least one row")
        self.num_rows, self.seed = int(num_rows), int(seed)
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if len(self._perms) > 4:  # draws move forward: only the latest passes are needed
                self._perms.pop(min(self._perms))
            g = torch.Generator().manual_seed(_mixed_seed(self.seed, epoch))
            self._perms[epoch] = torch.randperm(self.num_rows, generator=g)
        return self._perms[epoch]

    def rows(self, draw: int, k: int) -> list[int]:
        """The ``k`` row indices of draw number ``draw``."""
        out = []
        for pos in range(draw * k, draw * k + k):
            epoch, offset = divmod(pos, self.num_rows)
            out.append(int(self._perm(epoch)[offset]))
        return out


class ObjectiveRegulariser(ABC):
    """A change of the training objective that keeps the old model's behaviour (a baseline).

    :meth:`apply` is the one dispatch point: it takes the objective's loss on the step's batch and
    returns the loss to train on. ``draw`` numbers the step's micro-batch on this process (the trainer passes
    ``(global_step * accumulation_steps + micro-batch) * processes + rank``) and fixes any old rows it reads.
    """

    name: str = "regulariser"
    # True for a regulariser whose old rows are the constraints' gradient rows (:class:`ConstraintRowReplay`)
    reads_constraint_rows: bool = False

    def bind(self, model: nn.Module, to_device: ToDevice) -> None:
        """Called once by the trainer before training: the model being trained and how batches reach its device."""
        self.to_device = to_device

    @abstractmethod
    def apply(self, model: nn.Module, objective: torch.Tensor, inputs: Any, draw: int) -> torch.Tensor:
        """The loss to train on, given ``objective`` (F on ``inputs``, the step's new-task batch)."""

    def settings(self) -> dict[str, Any]:
        """The regulariser's settings (recorded in results)."""
        return {"name": self.name}


class RegularisedObjective:
    """How a trainer applies a regulariser: once per training micro-batch, to that micro-batch's own
    mean objective (a loss the Trainer already scaled for gradient accumulation is unscaled for
    :meth:`ObjectiveRegulariser.apply` and rescaled after), with the micro-batch's number as ``draw``
    (``(global_step * accumulation_steps + micro-batch) * world + rank``), so that a resumed run reads the
    same old rows and the ``world`` processes of a run read disjoint ones: together, the rows one process
    with the global batch would read."""

    def __init__(self, regulariser: ObjectiveRegulariser) -> None:
        if not isinstance(regulariser, ObjectiveRegulariser):
            raise TypeError(f"regulariser must be an ObjectiveRegulariser, got {type(regulariser).__name__}")
        self.regulariser = regulariser
        self._last: tuple[int, int] = (-1, 0)  # (global step, micro-batches of it so far)
        self.world, self.rank = 1, 0

    def bind(self, model: nn.Module, to_device: ToDevice, *, world: int = 1, rank: int = 0) -> None:
        """Before training: the model and its device for the regulariser, and this process's place in the run."""
        self.world, self.rank = int(world), int(rank)
        self.regulariser.bind(model, to_device)

    @property
    def reads_constraint_rows(self) -> bool:
        """Whether the regulariser's old rows are the constraints' gradient rows (:class:`ConstraintRowReplay`)."""
        return self.regulariser.reads_constraint_rows

    @property
    def constraint_row_weight(self) -> float:
        """The weight every sampled constraint's rows carry for the regulariser in the constraint part's loss (its
        share of the loss where it replays them: :meth:`ConstraintEngine.penalty_loss`'s ``row_weight``; else 0)."""
        return self.regulariser.ratio if self.reads_constraint_rows else 0.0

    def check_rows(self, engine: Any, penalty_active: bool) -> None:
        """Before training: a regulariser that replays the constraints' rows can (:meth:`ConstraintRowReplay.
        check_constraints` on the engine's gradient rows); one that reads old rows of its own beside an active
        penalty says, once, that a step then draws old rows twice."""
        reg = self.regulariser
        if reg.reads_constraint_rows:
            if engine is None:
                raise ValueError(f"{type(reg).__name__} replays the constraints' rows: give the trainer constraints")
            reg.check_constraints(engine.gradient_rows.views, engine.batch_size * engine.world)
        elif penalty_active and isinstance(reg, (Replay, KLToOld)):
            logger.info("%s draws old rows of its own besides the constraints' rows: two draws of old rows and two "
                        "forwards over them per step (ConstraintRowReplay replays the constraints' rows in one)",
                        type(reg).__name__)

    def __call__(self, model: nn.Module, result: Any, inputs: Any, global_step: int, accumulation_steps: int,
                 scaled_for_accumulation: bool) -> Any:
        """``result`` (a loss, or ``(loss, outputs)``) with the loss regularised."""
        step, micro = self._last
        micro = micro + 1 if step == global_step else 0
        self._last = (global_step, micro)
        scale = accumulation_steps if scaled_for_accumulation else 1
        loss = result[0] if isinstance(result, tuple) else result
        draw = (global_step * accumulation_steps + micro) * self.world + self.rank
        loss = self.regulariser.apply(model, loss * scale, inputs, draw) / scale
        return (loss, result[1]) if isinstance(result, tuple) else loss


def _batch_rows(inputs: Any) -> int:
    """Rows of a batch (its first tensor's length)."""
    if isinstance(inputs, dict):
        for v in inputs.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                return int(v.shape[0])
    if isinstance(inputs, torch.Tensor):
        return int(inputs.shape[0])
    raise TypeError("cannot tell the number of rows of the objective batch; give Replay(rows_per_step=...)")


def _check_rows(dataset: Any, what: str) -> None:
    if dataset is None or len(dataset) == 0:
        raise ValueError(f"{what}: the old-task rows are empty")


class Replay(ObjectiveRegulariser):
    """Old-task rows mixed into the objective batches: a share ``ratio`` of the rows trained on.

    Args:
        dataset: the old-task rows (e.g. the constraints' rows, concatenated).
        ratio: the share of old rows in each mixed batch, in (0, 1).
        collate: makes a batch of old rows (the trainer's ``data_collator`` for the same model).
        loss_fn: ``loss_fn(model, batch) -> scalar``, the objective on a batch of old rows; default:
            the model's own loss (``model(**batch).loss``), what the Trainer computes.
        rows_per_step: old rows per step; default ``round(ratio / (1 - ratio) * B)`` for the step's
            ``B`` new rows.
        seed: the seed of the old rows' order.
    """

    name = "replay"

    def __init__(self, dataset: Any, ratio: float, collate: Collate, *,
                 loss_fn: Optional[Callable[[nn.Module, Any], torch.Tensor]] = None,
                 rows_per_step: Optional[int] = None, seed: int = 0) -> None:
        if not (isinstance(ratio, (int, float)) and 0.0 < ratio < 1.0):
            raise ValueError(f"Replay: ratio is the share of old rows in a batch, in (0, 1); got {ratio!r}")
        _check_rows(dataset, "Replay")
        self.dataset, self.ratio, self.collate = dataset, float(ratio), collate
        self.loss_fn = loss_fn or _model_loss
        self.rows_per_step, self.seed = rows_per_step, seed
        self.stream = OldRowStream(len(dataset), seed)
        self.to_device: ToDevice = lambda b: b

    def old_rows_for(self, num_new: int) -> int:
        """Old rows mixed into a batch of ``num_new`` new rows (at least 1)."""
        if self.rows_per_step is not None:
            return self.rows_per_step
        return max(1, round(self.ratio / (1.0 - self.ratio) * num_new))

    def replay_rows(self, draw: int, num_new: int) -> list[int]:
        """Indices (in ``dataset``) of the old rows of draw ``draw``."""
        return self.stream.rows(draw, self.old_rows_for(num_new))

    def apply(self, model: nn.Module, objective: torch.Tensor, inputs: Any, draw: int) -> torch.Tensor:
        num_new = _batch_rows(inputs)
        rows = self.replay_rows(draw, num_new)
        batch = self.to_device(self.collate(fetch_rows(self.dataset, rows)))
        old = self.loss_fn(model, batch)
        k = len(rows)
        return (num_new * objective + k * old.to(objective.dtype)) / (num_new + k)

    def settings(self) -> dict[str, Any]:
        return {"name": self.name, "ratio": self.ratio, "rows": len(self.dataset), "seed": self.seed}


class ConstraintRowReplay(ObjectiveRegulariser):
    """Replay that reads the constraints' own rows: one draw of old rows per step, one forward over them.

    A non-forgetting constraint's row value is ``l(w, x) - l(w_old, x)`` (section 5.2), a per-row training
    loss minus a constant, so the hinge's term of Algorithm 1, line 9, ``(beta/|B_c|) sum_k 1[u_k > 0] grad
    h_k(w_t; B_k^t)``, is a gradient of the old tasks' loss on old rows: the gradient replay computes, with
    another weight. This replay takes its old rows from the same draw: the gradient rows B_k^t of the sampled
    constraints (line 5), balanced over the tasks, so a step's loss is

        (1 - ratio) * F_new + (1/|B_c|) sum_{k in B_c} (ratio + weight(u_k^t)) * h_k(w_t; B_k^t)

    (plus a constant): each old row's loss is computed once (in the objective's forward where
    :mod:`~hf_constrained.method.shared_forward` allows) and one backward applies replay's weight plus the
    penalty's. With ``constraint_penalty="none"`` it is plain replay of those rows: the same rows and weights
    without the hinge, the baseline at equal cost.

    Args:
        ratio: the old rows' share of the step's loss, in (0, 1). :class:`Replay` mixes ``k`` old rows into
            ``B`` new ones, a share ``k / (B + k)``; here the share is ``ratio`` whatever the number of
            constraint rows, ``|B_c| * constraint_batch_size`` per process and step.

    The old term is the mean over rows of each row's loss as the constraint measures it (for a causal LM the
    mean token loss of each example), counted once per optimizer step (the constraint part runs on a gradient
    accumulation window's first micro-batch; the other micro-batches' objectives are scaled by ``1 - ratio``).
    Every constraint of the run must be such a loss gap (:meth:`check_constraints`).
    """

    name = "replay"
    reads_constraint_rows = True

    def __init__(self, ratio: float) -> None:
        if not (isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0.0 < ratio < 1.0):
            raise ValueError(f"ConstraintRowReplay: ratio is the old rows' share of the loss, in (0, 1); got {ratio!r}")
        self.ratio = float(ratio)

    def apply(self, model: nn.Module, objective: torch.Tensor, inputs: Any, draw: int) -> torch.Tensor:
        return (1.0 - self.ratio) * objective  # the old rows' share comes with the constraint part (row_weight)

    @staticmethod
    def check_constraints(views: Sequence[Any], global_batch_size: int) -> None:
        """Every constraint's rows are a loss gap (``row_fn.rows_are_loss_gaps``, no ``row_transform``, ``outer``
        or ``group_key``) and hold at least one draw's rows (``global_batch_size``); else a ValueError naming it."""
        if not views:
            raise ValueError("ConstraintRowReplay replays the constraints' rows: the run has no constraints")
        for c in views:
            why = None
            if c.data_free or not getattr(c.row_fn, "rows_are_loss_gaps", False):
                why = "its rows are not a per-row loss minus the old model's (a non_forgetting_constraints row_fn)"
            elif c.row_transform is not None:
                why = "it has a row_transform (e.g. --constraint_surrogate loss_increase): its gradient is not replay's"
            elif c.outer is not None or c.group_key is not None:
                why = "it is compositional (outer / group_key)"
            elif len(c.dataset) < global_batch_size:
                why = (f"it has {len(c.dataset)} rows to draw from, fewer than one step's draw of {global_batch_size} "
                       "(constraint_batch_size x processes): lower constraint_batch_size or give it more rows")
            if why is not None:
                raise ValueError(f"ConstraintRowReplay cannot replay constraint {c.name!r}: {why}")

    def settings(self) -> dict[str, Any]:
        return {"name": self.name, "ratio": self.ratio, "rows": "constraint_rows"}


def _model_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The model's own loss on a batch (``outputs["loss"]``, as ``Trainer.compute_loss`` reads it)."""
    return model(**batch)["loss"]


def scored_logits(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    """The logits the KL compares: for a causal LM (3-d logits and ``labels``), position t's logits predict
    token t+1, kept where that label is scored (not -100); class logits (2-d) are kept whole."""
    if logits.dim() == 2:
        return logits
    labels = batch.get("labels") if isinstance(batch, dict) else None
    if labels is None:
        mask = batch["attention_mask"][:, 1:].bool() if isinstance(batch, dict) and "attention_mask" in batch \
            else torch.ones(logits.shape[:2], dtype=torch.bool, device=logits.device)[:, 1:]
    else:
        mask = labels[:, 1:] != IGNORE_INDEX
    return logits[:, :-1][mask]


def kl_old_new(old_logits: torch.Tensor, new_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(p_old || p_new) = sum_v p_old(v) (log p_old(v) - log p_new(v)), from logits
    of shape (rows, vocabulary). Its gradient in the new logits is (p_new - p_old) / rows."""
    old_logp = torch.log_softmax(old_logits.float(), dim=-1)
    new_logp = torch.log_softmax(new_logits.float(), dim=-1)
    return (old_logp.exp() * (old_logp - new_logp)).sum(-1).mean()


def _logits(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"} if isinstance(batch, dict) else batch
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return out["logits"] if isinstance(out, dict) else getattr(out, "logits", out)


class KLToOld(ObjectiveRegulariser):
    """``lam * KL(p_old || p_w)`` on a batch of old rows per step (an anchor to the old model).

    Args:
        reference_model: the old model (frozen; a copy is kept in eval mode, no gradients).
        dataset: the old-task rows.
        lam: the weight lambda (> 0).
        collate: makes a batch of old rows.
        rows_per_step: old rows per step.
        logits_fn: ``logits_fn(model, batch) -> logits``; default ``model(**batch without labels).logits``.
        seed: the seed of the old rows' order.

    The old model's logits cost one forward pass without gradient per step, the current model's one
    forward and backward: the method's own passes, nothing else.
    """

    name = "kl"

    def __init__(self, reference_model: nn.Module, dataset: Any, lam: float, collate: Collate, *,
                 rows_per_step: int = 32, logits_fn: Optional[Callable[[nn.Module, Any], torch.Tensor]] = None,
                 seed: int = 0) -> None:
        if not (isinstance(lam, (int, float)) and math.isfinite(lam) and lam > 0):
            raise ValueError(f"KLToOld: lam must be a positive number, got {lam!r}")
        if rows_per_step < 1:
            raise ValueError(f"KLToOld: rows_per_step must be >= 1, got {rows_per_step}")
        _check_rows(dataset, "KLToOld")
        self.reference = copy.deepcopy(reference_model).eval().requires_grad_(False)
        self.dataset, self.lam, self.collate = dataset, float(lam), collate
        self.rows_per_step, self.seed = int(rows_per_step), seed
        self.logits_fn = logits_fn or _logits
        self.stream = OldRowStream(len(dataset), seed)
        self.to_device: ToDevice = lambda b: b

    def bind(self, model: nn.Module, to_device: ToDevice) -> None:
        super().bind(model, to_device)
        self.reference.to(next(model.parameters()).device)

    def kl(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """KL(p_old || p_w) averaged over the scored positions of ``batch``."""
        with torch.no_grad():
            old = scored_logits(self.logits_fn(self.reference, batch), batch)
        return kl_old_new(old, scored_logits(self.logits_fn(model, batch), batch))

    def apply(self, model: nn.Module, objective: torch.Tensor, inputs: Any, draw: int) -> torch.Tensor:
        rows = self.stream.rows(draw, self.rows_per_step)
        batch = self.to_device(self.collate(fetch_rows(self.dataset, rows)))
        return objective + self.lam * self.kl(model, batch).to(objective.dtype)

    def settings(self) -> dict[str, Any]:
        return {"name": self.name, "lam": self.lam, "rows_per_step": self.rows_per_step, "seed": self.seed}


class L2ToOld(ObjectiveRegulariser):
    """``lam / 2 * ||w - w_old||^2`` over the trainable parameters (L2-SP), gradient ``lam * (w - w_old)``.

    ``w_old`` is copied from the model when the trainer binds it (before training), or given as
    ``reference_model``. Costs no forward pass; one copy of the trainable weights.
    """

    name = "l2"

    def __init__(self, lam: float, reference_model: Optional[nn.Module] = None) -> None:
        if not (isinstance(lam, (int, float)) and math.isfinite(lam) and lam > 0):
            raise ValueError(f"L2ToOld: lam must be a positive number, got {lam!r}")
        self.lam = float(lam)
        self.anchor: Optional[dict[str, torch.Tensor]] = None
        if reference_model is not None:
            self.anchor = {n: p.detach().clone() for n, p in reference_model.named_parameters() if p.requires_grad}

    def bind(self, model: nn.Module, to_device: ToDevice) -> None:
        super().bind(model, to_device)
        if self.anchor is None:
            self.anchor = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        names = {n for n, p in model.named_parameters() if p.requires_grad}
        if set(self.anchor) != names:
            raise ValueError("L2ToOld: the reference model's trainable parameters do not match the model's "
                             f"({len(set(self.anchor) ^ names)} names differ)")
        device = next(model.parameters()).device
        self.anchor = {n: a.to(device) for n, a in self.anchor.items()}
        # the parameters themselves: a wrapper (DDP) passed to apply names them "module.<name>"
        self._pairs = [(p, self.anchor[n]) for n, p in model.named_parameters() if p.requires_grad]

    def distance(self, model: nn.Module) -> torch.Tensor:
        """``1/2 ||w - w_old||^2`` over the parameters of the model bound before training."""
        if self.anchor is None or not hasattr(self, "_pairs"):
            raise RuntimeError("L2ToOld: no old weights yet (bind the model first)")
        return 0.5 * torch.stack([((p - a) ** 2).sum() for p, a in self._pairs]).sum()

    def apply(self, model: nn.Module, objective: torch.Tensor, inputs: Any, draw: int) -> torch.Tensor:
        return objective + self.lam * self.distance(model).to(objective.dtype)

    def settings(self) -> dict[str, Any]:
        return {"name": self.name, "lam": self.lam}


REGULARISERS: dict[str, type[ObjectiveRegulariser]] = {"replay": Replay, "kl": KLToOld, "l2": L2ToOld}


def make_regulariser(name: str, **kwargs: Any) -> ObjectiveRegulariser:
    """A regulariser from its name (``replay``, ``kl``, ``l2``) and its constructor's arguments."""
    if name not in REGULARISERS:
        raise ValueError(f"unknown regulariser {name!r}; one of {sorted(REGULARISERS)}")
    return REGULARISERS[name](**kwargs)


__all__ = [
    "REGULARISERS",
    "ConstraintRowReplay",
    "KLToOld",
    "L2ToOld",
    "ObjectiveRegulariser",
    "OldRowStream",
    "RegularisedObjective",
    "Replay",
    "kl_old_new",
    "make_regulariser",
    "scored_logits",
]
