"""``ConstrainedTrainer``: the Hugging Face Trainer with the hinge exact penalty and MSVR.

One optimizer step of Algorithm 1 (the paper's section "Stochastic Algorithms"), done inside
:meth:`ConstrainedTrainer.compute_loss` so there is ONE backward per ``training_step``:

1. B_c^t from :class:`~hf_constrained.sampling.ConstraintSampler` (line 3), and a batch
   B_k^t per sampled constraint from its :class:`~hf_constrained.sampling.ConstraintBatchStream`
   (line 5);
2. h_k(w_t; B_k^t) with grad, all-reduced across processes, feeds the MSVR update (line 6);
   the previous-iterate term h_k(w_{t-1}; B_k^t) was computed one step early: at step
   t-1 the trainer already drew B_c^t and B_k^t and evaluated them under ``no_grad``
   while the parameters were still w_{t-1} (``lookahead_placement``: after step t-1's
   backward by default, where its activations no longer coexist with the step's graph;
   or before it; or inside step t-1's row-wise call, outputs detached). No copy of the
   parameters is kept;
3. the penalty loss ``(1/|B_c|) sum_k weight(u_k^t) * h_k(w_t; B_k^t)`` with the weight
   detached, so its gradient is G_2 of line 9;
4. added to the objective loss; the Trainer's optimizer then applies G_1 + G_2 (line 10).

Under gradient accumulation the parameters stay w_t for the whole window, so the
constraint part runs on the window's first micro-batch only (scaled so it counts once).

Row-wise constraints (``Constraint(row_fn=...)``) that share one ``row_fn`` object and one
collate function are evaluated by the fused step of :mod:`hf_constrained.fused`: ONE
``row_fn`` call with grad for all sampled members of the group (step 2) and ONE call under
``no_grad`` for their look-ahead, per-constraint values from segment sums, one all-reduce of
sums and counts across processes. Scalar ``fn`` constraints keep one call each. The two paths
give the same update up to float round-off (``tests/test_fused_step.py``). With
``share_objective_call`` the objective's inputs and one group's rows go through ONE model call
(:meth:`ConstrainedTrainer.objective_with_rows`; ``tests/test_shared_call.py``).

Constraint batches are collated by the constraint's ``collate_fn``; without one, by the
trainer's ``data_collator`` when one other than ``default_data_collator`` was given (e.g.
padding tokenized text), else by :func:`~hf_constrained.collate_examples`.

For row-wise constraints the trainer also keeps the running spread of the per-row values:
it logs the standard error of each mini-batch value (``constraint_std/<name>``, noise you can
compare with the tolerance; :meth:`ConstrainedTrainer.constraint_noise`) and, for calibrated
constraints (``constraint_confidence``, ``Constraint.confidence``/``margin``), enforces the
margin ``z_c * s_k / sqrt(|D_k|)`` (:meth:`ConstrainedTrainer.constraint_margins`; n_k is
``Constraint.independent_rows`` when D_k holds correlated copies).
"""

from __future__ import annotations

import logging
import math
import os
from collections import defaultdict
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import default_data_collator
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, IntervalStrategy, TrainOutput, rotate_checkpoints

from .checkpointing import (
    check_named_checkpoint,
    latest_complete_checkpoint,
    mark_complete,
    mark_incomplete,
)
from .constraint_state import atomic_torch_save, load_constraint_state
from .clipping import PENALTY_GRAD_NORM_KEY, ClipMonitor
from .config import ConstrainedTrainingArguments
from .constraint import Constraint, ConstraintValueError, collate_examples, fetch_rows
from .distributed import GradientCoverageCallback, configure_ddp_for_constraints, fsdp_requested, uses_ddp
from .estimators import MSVREstimator, resolve_gamma_prime, run_precision
from .fused import (RowGroup, RowUnit, batch_variances, collate_units, inner_values, local_contribution,
                    plan_row_groups, row_values_and_owners, same_callable, segment_sums, stats_dtype)
from .penalties import make_penalty
from .safety.gate import SafetyMixin
from .sampling import ConstraintBatchStream, ConstraintSampler
from .statistics import ConstraintStatistic, constraint_statistic, z_value
from .trainer_internals import TrainerInternals, trainer_load_checkpoint, trainer_prepare_input, trainer_run_dir

logger = logging.getLogger(__name__)

CONSTRAINT_STATE_NAME = "constraint_state.pt"
TRAINER_STATE_NAME = "trainer_state.json"  # the Trainer's own state file in a checkpoint
PREFLIGHT_CHUNK = 64  # row-wise constraints checked per no-grad row_fn call before training


SPREAD_DECAY = 0.1
"""Weight of the newest batch in the running per-row variance of a row-wise constraint
(a running mean over the first 10 visits, then an exponential average over about 10)."""


def _float_outer(c: Constraint) -> Any:
    """A constraint's ``outer`` as a float -> float map (for :mod:`hf_constrained.statistics`)."""
    return lambda x: float(c.apply_outer(torch.tensor(x, dtype=torch.float64)))


def _shallow_copy(batch: Any) -> Any:
    """A new dict around the same tensors, so a function that pops keys cannot change the cached batch."""
    return type(batch)(batch) if isinstance(batch, MutableMapping) else batch


def _pinned_to(data: Any, device: torch.device) -> Any:
    """``data`` (nested dicts/lists of tensors) on ``device``, copied from pinned memory without blocking."""
    if isinstance(data, Mapping):
        return type(data)({k: _pinned_to(v, device) for k, v in data.items()})
    if isinstance(data, (list, tuple)):
        return type(data)(_pinned_to(v, device) for v in data)
    if isinstance(data, torch.Tensor):
        if data.device.type == "cpu":
            return data.pin_memory().to(device, non_blocking=True)
        return data.to(device)
    return data


@dataclass
class _ConstraintDraw:
    """The constraint part of one step: B_c^t, the global sample indices of each B_k^t,
    and h_k(w_{t-1}; B_k^t) where it was computed (NaN where not)."""

    step: int
    constraint_ids: torch.Tensor
    sample_indices: list[Optional[list[int]]]
    previous: Optional[torch.Tensor] = None
    # the collated device batches of the look-ahead, reused by the step itself (same rows, new
    # parameters): not part of the state (a resumed run collates them again)
    batches: dict[Any, Any] = field(default_factory=dict)
    # the row units of each row group and the positions of the scalar constraints (derived from
    # the fields above by ConstrainedTrainer._plan_units, kept so a draw is planned once)
    units: Optional[tuple[dict[int, dict[int, Any]], list[int]]] = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "constraint_ids": self.constraint_ids.cpu(),
            "sample_indices": self.sample_indices,
            "previous": None if self.previous is None else self.previous.cpu(),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "_ConstraintDraw":
        return cls(state["step"], state["constraint_ids"], state["sample_indices"], state["previous"])


class ConstrainedTrainer(SafetyMixin, TrainerInternals):
    """A :class:`transformers.Trainer` that trains under constraints ``h_k(w) <= tol_k``.

    Args:
        model, args, ...: as for ``Trainer``; ``args`` must be
            :class:`~hf_constrained.ConstrainedTrainingArguments`.
        constraints: the constraints (see :class:`~hf_constrained.Constraint` and
            :func:`~hf_constrained.constraints_per_value`). With penalty ``none`` they are
            not trained on but still evaluated exactly by :meth:`evaluate`.
        **kwargs: passed to ``Trainer``.

    The objective is whatever ``Trainer.compute_loss`` computes (the model's loss or
    ``compute_loss_func``); subclasses may override :meth:`compute_objective_loss`.
    """

    args: ConstrainedTrainingArguments

    def __init__(self, model: Union[nn.Module, None] = None, args: Optional[ConstrainedTrainingArguments] = None,
                 *, constraints: Sequence[Constraint] = (), **kwargs: Any) -> None:
        if args is not None and not isinstance(args, ConstrainedTrainingArguments):
            raise TypeError(
                f"ConstrainedTrainer needs ConstrainedTrainingArguments, got {type(args).__name__}"
            )
        if args is None:
            args = ConstrainedTrainingArguments(output_dir="trainer_output")
        self.constraints: list[Constraint] = self._check_constraints(constraints)
        self._check_margin_arguments(args)
        m = len(self.constraints)
        self.penalty = make_penalty(args.constraint_penalty, args.penalty_beta)
        if self.penalty.active and m == 0:
            raise ValueError(
                f"constraint_penalty={args.constraint_penalty!r} needs at least one constraint; "
                "pass constraints=[...] or use constraint_penalty='none'"
            )
        self.num_sampled = args.constraints_per_step if args.constraints_per_step is not None else m
        if m and not 1 <= self.num_sampled <= m:
            raise ValueError(
                f"constraints_per_step must be in [1, {m}] (there are {m} constraints), got {self.num_sampled}"
            )
        if self.penalty.active:
            configure_ddp_for_constraints(args)  # before the Trainer builds the Accelerator from args
        # Constraint-only periodic evaluation: the Trainer refuses eval_strategy without an eval_dataset, but
        # with constraints evaluate() has something to evaluate (their exact values), so the check is passed
        # with the strategy off and the strategy restored right after.
        constraint_only_eval = m > 0 and kwargs.get("eval_dataset") is None and args.eval_strategy != "no"
        eval_strategy = args.eval_strategy
        if constraint_only_eval:
            args.eval_strategy = IntervalStrategy.NO
        try:
            super().__init__(model=model, args=args, **kwargs)
        finally:
            args.eval_strategy = eval_strategy
        if fsdp_requested(self.args) and not self.is_fsdp_enabled:
            raise ValueError(
                "FSDP was requested (an Accelerate FSDP config, ACCELERATE_USE_FSDP or --fsdp), but Accelerate set up "
                f"{self.accelerator.distributed_type} without FSDP (FSDP runs on GPUs; use_cpu/--use_cpu turns it off), "
                "so the model would not be sharded. On CPU use recipes/accelerate_configs/multi_gpu.yaml (DDP)."
            )
        if self.penalty.active and uses_ddp(self.args):
            self.add_callback(GradientCoverageCallback())
        seed = self.args.constraint_sampling_seed
        if m:
            gamma_prime = resolve_gamma_prime(self.args.msvr_gamma_prime, m, self.num_sampled, self.args.msvr_gamma)
            self.estimator = MSVREstimator(m, self.args.msvr_gamma, gamma_prime, device=self.args.device,
                                           dtype=run_precision(self.model))
            self.sampler = ConstraintSampler(m, self.num_sampled, seed)
        self.streams: list[Optional[ConstraintBatchStream]] = [
            None if c.data_free else ConstraintBatchStream(len(c.dataset), seed, k)
            for k, c in enumerate(self.constraints)
        ]
        self._tolerances = torch.tensor([c.tolerance for c in self.constraints], dtype=torch.float64)
        self._next_draw: Optional[_ConstraintDraw] = None
        self._constraint_step = -1  # global step whose constraint part has run (once per accumulation window)
        self._in_training_step = False
        self._step_metrics: dict[str, list[torch.Tensor]] = defaultdict(list)
        self._eval_constraint_metrics: dict[str, float] = {}
        self._pending_log_metrics: dict[str, float] = {}
        self.clip_monitor = ClipMonitor(self.args.max_grad_norm, active=self.penalty.active)
        # the exact values of the latest evaluation, all m of them (logs hold them only for small m)
        self.last_constraint_values: dict[str, float] = {}
        self.last_constraint_values_step: Optional[int] = None
        # the fused step (hf_constrained.fused): groups of row-wise constraints, shared streams
        self._tolerance_cache: dict[torch.device, torch.Tensor] = {}
        self._row_groups: list[RowGroup] = plan_row_groups(self.constraints, self._collate_of)
        self._group_of: dict[int, int] = {k: gi for gi, g in enumerate(self._row_groups) for k in g.members}
        self._stream_owner: list[int] = self._plan_stream_owners()
        # running per-row spread of the row-wise constraints, per (constraint, group): noise and margins
        acc = stats_dtype(self.args.device)
        self._spread_var = torch.zeros(2 * m, dtype=acc, device=self.args.device)
        self._spread_rows = torch.zeros(2 * m, dtype=acc, device=self.args.device)
        self._spread_visits = torch.zeros(m, dtype=acc, device=self.args.device)
        self._setup_margins()
        self._noise_warned = False
        # where the look-ahead runs, and the row group (if any) that shares the objective's model call
        self._pending_lookahead: Optional[tuple[nn.Module, int]] = None
        self._shared_group: Optional[int] = self._plan_shared_call()

    def can_share_objective_call(self, row_fn: Any) -> bool:
        """Hook: whether :meth:`objective_with_rows` can compute the objective together with
        ``row_fn``'s rows (default: ``row_fn`` has an ``objective_with_rows`` method)."""
        return callable(getattr(row_fn, "objective_with_rows", None))

    def objective_with_rows(self, model: nn.Module, inputs: dict[str, Any], row_fn: Any, batch: Any,
                            return_outputs: bool = False,
                            num_items_in_batch: Optional[Union[torch.Tensor, int]] = None) -> tuple[Any, torch.Tensor]:
        """Hook: the objective on the Trainer's ``inputs`` (what :meth:`compute_objective_loss`
        returns) and ``row_fn``'s outputs on the constraint ``batch``, from ONE model call
        (``share_objective_call``). Default: ``row_fn.objective_with_rows(model, inputs, batch)``,
        which returns ``(objective loss, row outputs)``; the objective must equal the model's
        own loss on ``inputs`` (the Trainer's ``compute_loss``). ``num_items_in_batch`` is not
        passed on: a model whose loss is normalised by it under gradient accumulation (token-level
        language-model losses) needs this hook overridden to do the same."""
        loss, outputs = row_fn.objective_with_rows(model, inputs, batch)
        return ((loss, None) if return_outputs else loss), outputs

    def _plan_shared_call(self) -> Optional[int]:
        """The row group that shares the objective's model call (``share_objective_call``), and the
        checks that make concatenated calls safe (no BatchNorm: its statistics would change)."""
        concatenates = self.args.share_objective_call or (
            self.args.lookahead_placement == "in_call" and bool(self._row_groups))
        if concatenates and self.model is not None:
            norms = [name for name, mod in self.model.named_modules()
                     if isinstance(mod, nn.modules.batchnorm._BatchNorm)]
            if norms:
                what = "share_objective_call" if self.args.share_objective_call else "lookahead_placement='in_call'"
                raise ValueError(f"{what} concatenates batches in one model call, which changes the batch statistics "
                                 f"of the model's BatchNorm layers {norms[:3]} in training mode; turn it off for this "
                                 "model (or replace BatchNorm, e.g. by GroupNorm)")
        if not self.args.share_objective_call:
            return None
        shared = [gi for gi, g in enumerate(self._row_groups) if self.can_share_objective_call(g.row_fn)]
        if not shared:
            raise ValueError("share_objective_call=True, but no row-wise constraint group can share the objective's "
                             "model call: give the shared row_fn an objective_with_rows(model, inputs, batch) method "
                             "(or override ConstrainedTrainer.objective_with_rows and can_share_objective_call)")
        if len(shared) > 1:
            first = [self.constraints[k].name for k in self._row_groups[shared[0]].members][:3]
            logger.info("share_objective_call: %d row groups could share the objective's call; the first one (%s) "
                        "does", len(shared), first)
        return shared[0]

    def _plan_stream_owners(self) -> list[int]:
        """Which constraint's stream draws each constraint's rows: its own, or with
        ``share_constraint_batches`` the first member of its row group on the same dataset object."""
        owners = list(range(len(self.constraints)))
        if not self.args.share_constraint_batches:
            return owners
        shared = 0
        for group in self._row_groups:
            leader_of: dict[int, int] = {}
            for k in group.members:
                key = id(self.constraints[k].dataset)  # identity: the objects live as long as the trainer
                owners[k] = leader_of.setdefault(key, k)
                shared += owners[k] != k
        logger.info("share_constraint_batches: %d of %d constraints draw their batch from another constraint's "
                    "stream (same row_fn, collate and dataset)", shared, len(owners))
        return owners

    @staticmethod
    def _check_margin_arguments(args: ConstrainedTrainingArguments) -> None:
        if args.constraint_confidence is not None and args.constraint_margin is not None:
            raise ValueError("give constraint_confidence or constraint_margin, not both")
        if args.constraint_confidence is not None and not 0.5 <= float(args.constraint_confidence) < 1.0:
            raise ValueError(f"constraint_confidence must be in [0.5, 1), got {args.constraint_confidence}")
        if args.constraint_margin is not None and not (math.isfinite(float(args.constraint_margin))
                                                       and float(args.constraint_margin) >= 0):
            raise ValueError(f"constraint_margin must be a finite number >= 0, got {args.constraint_margin}")

    def _setup_margins(self) -> None:
        """Per-constraint margin rule: an explicit margin, or z_c for a confidence (calibrated
        constraints); a constraint's own setting wins over the run's."""
        m = len(self.constraints)
        z, fixed = torch.zeros(m, dtype=torch.float64), torch.zeros(m, dtype=torch.float64)
        rows = torch.ones(m, dtype=torch.float64)
        no_rows = []
        for k, c in enumerate(self.constraints):
            if c.rowwise:  # the n of the margin's s / sqrt(n): independent rows, not correlated copies
                rows[k] = c.independent_rows if c.independent_rows is not None else len(c.dataset)
            if c.margin is not None:
                fixed[k] = c.margin
            elif c.confidence is not None:
                z[k] = z_value(c.confidence)
            elif self.args.constraint_margin is not None:
                fixed[k] = float(self.args.constraint_margin)
            elif self.args.constraint_confidence is not None:
                if c.rowwise:
                    z[k] = z_value(float(self.args.constraint_confidence))
                else:
                    no_rows.append(c.name)
        if no_rows:
            logger.warning("constraint_confidence=%s gives no margin to %d constraint(s) without per-row values "
                           "(scalar fn): %s. Declare them with row_fn or give them Constraint(margin=...).",
                           self.args.constraint_confidence, len(no_rows), no_rows[:10])
        dev, acc = self.args.device, stats_dtype(self.args.device)
        self._margin_z, self._margin_fixed = z.to(dev, acc), fixed.to(dev, acc)
        self._data_rows = rows.to(dev, acc)
        self._has_margins = bool((z > 0).any() or (fixed > 0).any())

    # ------------------------------------------------------------------ checks
    @staticmethod
    def _check_constraints(constraints: Sequence[Constraint]) -> list[Constraint]:
        constraints = list(constraints)
        for c in constraints:
            if not isinstance(c, Constraint):
                raise TypeError(f"constraints must be Constraint objects, got {type(c).__name__}")
        names = [c.name for c in constraints]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate constraint names: {duplicates}")
        return constraints

    def _check_value(self, k: int, value: Any, *, need_grad: bool) -> torch.Tensor:
        name = self.constraints[k].name
        if not isinstance(value, torch.Tensor):
            raise ConstraintValueError(f"constraint {name!r} returned {type(value).__name__}, expected a scalar tensor")
        if value.dim() != 0:
            raise ConstraintValueError(
                f"constraint {name!r} returned a tensor of shape {tuple(value.shape)}, expected a scalar "
                "(the mini-batch estimate of h_k: reduce it, e.g. with .mean())"
            )
        if need_grad and not value.requires_grad:
            raise ConstraintValueError(
                f"constraint {name!r} returned a tensor without grad: compute it from the model passed to fn "
                "without .detach()/.item()/torch.no_grad()"
            )
        return value

    def _raise_non_finite(self, ids: torch.Tensor, values: torch.Tensor, what: str) -> None:
        bad = [(self.constraints[int(k)].name, float(v)) for k, v in zip(ids.tolist(), values.tolist())
               if not math.isfinite(v)]
        raise ConstraintValueError(
            f"constraint {bad[0][0]!r} is {bad[0][1]} ({what}) at step {self.state.global_step}; "
            f"all non-finite: {bad}. Training stopped; checkpoints already written are untouched."
        )

    def preflight_constraints(self) -> None:
        """Run every constraint once on a few of its rows, before training.

        Catches non-scalar values, values without grad, NaN/inf, batches that lack a key
        the constraint reads and rows that cannot be collated, before the first optimizer
        step, without advancing any data stream. Every constraint is checked (not each
        distinct function once): constraints that share one function differ in their data.
        Row-wise constraints of one group are checked together, up to
        ``PREFLIGHT_CHUNK`` per no-grad ``row_fn`` call (the group's first constraint also runs
        alone with grad), so many constraints of one formula cost a few calls; a chunk that
        fails is re-run constraint by constraint to name the culprit.
        """
        model = self.model
        was_training = model.training
        model.train()
        b = self.args.constraint_batch_size
        pending: list[int] = []
        try:
            for group in self._row_groups:
                members = list(group.members)
                self._preflight_one(model, members[0], b)  # the gradient path, once per group
                for start in range(0, len(members), PREFLIGHT_CHUNK):
                    chunk = members[start:start + PREFLIGHT_CHUNK]
                    if not self._preflight_row_chunk(model, group, chunk, b):
                        pending.extend(chunk)
            grouped = {k for g in self._row_groups for k in g.members}
            pending.extend(k for k in range(len(self.constraints)) if k not in grouped)
            bar = tqdm(sorted(pending), desc="checking constraints", leave=False,
                       disable=self.args.disable_tqdm or len(pending) < 50 or not self.is_world_process_zero())
            for k in bar:
                self._preflight_one(model, k, b)
        finally:
            model.train(was_training)

    def _preflight_row_chunk(self, model: nn.Module, group: RowGroup, chunk: list[int], b: int) -> bool:
        """One no-grad ``row_fn`` call on ``b`` rows of each constraint of ``chunk``; False when
        anything about it fails (the caller then checks the constraints one by one)."""
        units = []
        for p, k in enumerate(chunk):
            rows = list(range(min(len(self.constraints[k].dataset), b)))
            units.append(RowUnit(self.constraints[k].dataset, rows, positions=[p], constraints=[k]))
        try:
            with torch.no_grad(), self.compute_loss_context_manager():
                batch, slices, outputs = self._row_outputs(model, group, units, need_grad=False)
                values, owners = row_values_and_owners(self.constraints, units, slices, outputs, batch)
                _, stats = segment_sums(values, owners, len(chunk), need_grad=False)
            return bool(torch.isfinite(inner_values(stats)).all().item())
        except Exception:  # noqa: BLE001 - any failure is re-diagnosed per constraint, with its name
            return False

    def _preflight_one(self, model: nn.Module, k: int, b: int) -> None:
        c = self.constraints[k]
        batch = None
        rows: list[int] = []
        if not c.data_free:
            rows = list(range(min(len(c.dataset), b)))
            try:
                batch = self._make_batch(k, rows)
            except (KeyError, ValueError, TypeError, RuntimeError) as e:
                raise ConstraintValueError(
                    f"constraint {c.name!r}: rows {rows[0]}..{rows[-1]} of its dataset cannot be made into a "
                    f"batch: {type(e).__name__}: {e}"
                ) from e
        try:
            with self.compute_loss_context_manager():
                value = self._check_value(k, c.fn(model, batch), need_grad=True)
        except KeyError as e:
            keys = sorted(batch) if isinstance(batch, dict) else None
            missing = e.args[0] if e.args else None
            what = (f"its function reads key {missing!r}, which its batches do not have"
                    if isinstance(missing, str) and " " not in missing else f"KeyError: {missing}")
            raise ConstraintValueError(
                f"constraint {c.name!r}: {what} (batch keys: {keys}); check the constraint's dataset "
                "columns or its collate_fn"
            ) from e
        if not torch.isfinite(value.detach()).item():
            raise ConstraintValueError(f"constraint {c.name!r} is {value.item()} before training")

    # ------------------------------------------------------------------ batches
    def _collate_of(self, c: Constraint) -> Any:
        """The collate function of constraint ``c``'s batches: its own ``collate_fn``; else the
        trainer's ``data_collator`` when one other than ``default_data_collator`` is set (e.g.
        padding tokenized text); else :func:`~hf_constrained.collate_examples`."""
        if c.collate_fn is not None:
            return c.collate_fn
        collator = getattr(self, "data_collator", None)
        if collator is not None and collator is not default_data_collator:
            return collator
        return collate_examples

    def _to_device(self, batch: Any) -> Any:
        """Move a collated batch to the device. On CUDA the tensors are pinned and copied with
        ``non_blocking=True``: a pageable copy would block the host until the device is idle."""
        if self.args.device.type != "cuda" or getattr(self, "is_deepspeed_enabled", False):
            return trainer_prepare_input(self, batch)
        return _pinned_to(batch, self.args.device)

    def _make_batch(self, k: int, indices: list[int]) -> Any:
        c = self.constraints[k]
        batch = self._collate_of(c)(fetch_rows(c.dataset, indices))
        if isinstance(batch, MutableMapping):
            batch["sample_index"] = torch.as_tensor(indices, dtype=torch.long)
        return self._to_device(batch)

    def _local_rows(self, rows: list[int]) -> list[int]:
        """This process's share of a global constraint batch (contiguous slice by rank)."""
        b = self.args.constraint_batch_size
        r = self.accelerator.process_index
        return rows[r * b : (r + 1) * b]

    def _draw(self, step: int) -> _ConstraintDraw:
        """B_c^t (Algorithm 1, line 3) and the global rows of each B_k^t (line 5). Constraints that
        share a batch (``share_constraint_batches``) get the same rows from their group's one stream."""
        ids = self.sampler.sample(step)
        global_b = self.args.constraint_batch_size * self.accelerator.num_processes
        drawn: dict[int, list[int]] = {}
        rows: list[Optional[list[int]]] = []
        for k in ids.tolist():
            if self.streams[k] is None:
                rows.append(None)
                continue
            owner = self._stream_owner[k]
            if owner not in drawn:
                drawn[owner] = self.streams[owner].next_indices(global_b)
            rows.append(drawn[owner])
        return _ConstraintDraw(step, ids, rows)

    def _row_outputs(self, model: nn.Module, group: RowGroup, units: list[RowUnit], *, need_grad: bool,
                     cache: Optional[dict] = None, key: Any = None) -> Any:
        """One collate call and ONE ``row_fn`` call for all sampled members of ``group``
        (the collated batch is kept in ``cache`` for the step that reuses the look-ahead's rows)."""
        if cache is not None and key in cache:
            batch, slices = cache.pop(key)
        else:
            batch, slices = collate_units(units, group.collate)
            batch = self._to_device(batch)
            if cache is not None and not need_grad:  # a look-ahead: the step evaluates the same rows next
                cache[key] = (_shallow_copy(batch), slices)
        outputs = group.row_fn(model, batch)
        slices = self._check_row_outputs(units, slices, outputs, need_grad=need_grad)
        return batch, slices, outputs

    def _check_row_outputs(self, units: list[RowUnit], slices: list[tuple[int, int]], outputs: Any, *,
                           need_grad: bool) -> list[tuple[int, int]]:
        """``row_fn``'s outputs have one row (or the same number of rows) per example; returns the
        units' slices of the output rows."""
        names = [self.constraints[k].name for u in units for k in u.constraints]
        num_examples = slices[-1][1]
        if not isinstance(outputs, torch.Tensor):
            raise ConstraintValueError(f"row_fn of constraints {names} returned {type(outputs).__name__}, expected a "
                                       "tensor with one entry per row")
        if outputs.dim() > 0 and num_examples and outputs.shape[0] != num_examples \
                and outputs.shape[0] % num_examples == 0:
            # a collate that turns every example into the same number of consecutive rows (e.g. a pair of
            # rows of two groups into 2 rows): each unit's slice of the rows scales with it
            per_example = outputs.shape[0] // num_examples
            slices = [(start * per_example, end * per_example) for start, end in slices]
        if outputs.dim() == 0 or outputs.shape[0] != slices[-1][1]:
            raise ConstraintValueError(f"row_fn of constraints {names} returned shape {tuple(outputs.shape)} for a "
                                       f"batch of {num_examples} examples: dim 0 must be the rows (one per example, "
                                       "or the same number per example in example order)")
        if need_grad and not outputs.requires_grad:
            raise ConstraintValueError(f"row_fn of constraints {names} returned a tensor without grad: compute it from "
                                       "the model passed to row_fn without .detach()/.item()/torch.no_grad()")
        return slices

    def _plan_units(self, draw: _ConstraintDraw) -> tuple[dict[int, dict[int, RowUnit]], list[int]]:
        """The row units of each row group in ``draw`` (one per stream owner, in B_c order) and the
        positions of the scalar constraints (planned once per draw: the shared call, the step and
        the look-ahead read the same plan)."""
        if draw.units is not None:
            return draw.units
        ids = draw.constraint_ids.tolist()
        buckets: dict[int, dict[int, RowUnit]] = defaultdict(dict)
        scalar_pos: list[int] = []
        for p, k in enumerate(ids):
            gi = self._group_of.get(k)
            if gi is None:
                scalar_pos.append(p)
                continue
            unit_key = self._stream_owner[k]
            units = buckets[gi]
            if unit_key not in units:
                units[unit_key] = RowUnit(self.constraints[k].dataset, self._local_rows(draw.sample_indices[p]))
            units[unit_key].positions.append(p)
            units[unit_key].constraints.append(k)
        draw.units = (dict(buckets), scalar_pos)  # a plain dict: a lookup must not add a group
        return draw.units

    def _evaluate_draw(self, model: nn.Module, draw: _ConstraintDraw, *, need_grad: bool,
                       precomputed: Optional[dict[int, tuple[Any, list[tuple[int, int]], torch.Tensor]]] = None,
                       ) -> tuple[Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]:
        """h_k(w; B_k) of every constraint of ``draw`` at the current parameters.

        Row-wise constraints go through the fused path (:mod:`hf_constrained.fused`): one
        ``row_fn`` call per group, per-(constraint, group) sums by ``index_add``; scalar ``fn``
        constraints are called one by one. Everything that crosses processes travels in ONE
        all-reduce (a sum): the row sums and counts, and the scalar values (then divided by the
        number of processes, as before).

        Returns ``(local, current, stats)``: ``local`` (with ``need_grad``) this process's part
        of each value, carrying the gradient, scaled so that the data-parallel gradient average
        gives the gradient of the global value; ``current`` the global values, detached (float64
        where the device has it); ``stats`` the global ``(3, 2 |B_c|)`` row sums, sums of squares
        and counts (``None`` without row-wise constraints in the draw).

        ``precomputed`` maps a group to ``(batch, slices, outputs)`` of a model call already made
        on its units (of :meth:`_plan_units`; a call shared with the objective or the look-ahead).
        """
        ids = draw.constraint_ids.tolist()
        n = len(ids)
        device = self.args.device
        buckets, scalar_pos = self._plan_units(draw)

        sums: Optional[torch.Tensor] = None
        stats: Optional[torch.Tensor] = None
        for gi, unit_map in buckets.items():
            units = list(unit_map.values())
            if precomputed is not None and gi in precomputed:
                batch, slices, outputs = precomputed[gi]
            else:
                batch, slices, outputs = self._row_outputs(model, self._row_groups[gi], units, need_grad=need_grad,
                                                           cache=draw.batches, key=("group", gi))
            values, owners = row_values_and_owners(self.constraints, units, slices, outputs, batch)
            g_sums, g_stats = segment_sums(values, owners, n, need_grad=need_grad)
            # each group's owners are its own positions of B_c: adding the groups' sums merges them
            if g_sums is not None:
                sums = g_sums if sums is None else sums + g_sums
            stats = g_stats if stats is None else stats + g_stats

        scalar_local: list[torch.Tensor] = []
        for p in scalar_pos:
            k = ids[p]
            rows = draw.sample_indices[p]
            if ("scalar", p) in draw.batches:
                batch = draw.batches.pop(("scalar", p))
            else:
                batch = None if rows is None else self._make_batch(k, self._local_rows(rows))
                if not need_grad and batch is not None:
                    draw.batches[("scalar", p)] = _shallow_copy(batch)
            value = self._check_value(k, self.constraints[k].fn(model, batch), need_grad=need_grad)
            scalar_local.append(value.to(torch.promote_types(value.dtype, torch.float32)))

        acc = stats_dtype(device)
        world = self.accelerator.num_processes
        pos_t = torch.tensor(scalar_pos, dtype=torch.long).to(device, non_blocking=True) if scalar_pos else None
        scalar_vec = torch.zeros(n, dtype=acc, device=device)
        if scalar_local:
            scalar_vec = scalar_vec.index_copy(0, pos_t, torch.stack(scalar_local).detach().to(acc))
        if world > 1:  # one collective per evaluation: sums and counts, never means of means
            parts = [scalar_vec] if stats is None else [stats.reshape(-1), scalar_vec]
            packed = self.accelerator.reduce(torch.cat(parts), reduction="sum")
            scalar_vec = packed[-n:] / world
            if stats is not None:
                stats = packed[: 6 * n].view(3, 2 * n)
        if stats is None:
            current = scalar_vec
        elif not scalar_pos:
            current = inner_values(stats)
        else:
            is_row = torch.ones(n, dtype=torch.bool).index_fill_(0, torch.tensor(scalar_pos), False)
            current = torch.where(is_row.to(device, non_blocking=True), inner_values(stats), scalar_vec)
        self._check_group_counts(ids, stats)

        local = None
        if need_grad:
            dtype = torch.float32 if sums is None else sums.dtype
            if scalar_local:
                dtype = torch.promote_types(dtype, scalar_local[0].dtype)
            local = torch.zeros(n, dtype=dtype, device=device)
            if sums is not None:
                local = local + local_contribution(sums, stats[2], world)
            if scalar_local:
                local = local.index_add(0, pos_t, torch.stack(scalar_local).to(dtype))
        return local, current, stats

    def _check_group_counts(self, ids: list[int], stats: Optional[torch.Tensor]) -> None:
        """Every ``group_key`` constraint of the draw has rows of both groups in its global batch
        (one host sync, only for draws holding such constraints)."""
        grouped = [p for p, k in enumerate(ids) if self.constraints[k].group_key is not None]
        if stats is None or not grouped:
            return
        counts = stats[2].view(-1, 2)[grouped].cpu().tolist()
        for p, (n0, n1) in zip(grouped, counts):
            self.constraints[ids[p]].check_group_counts(int(n0), int(n1))

    # ------------------------------------------------------------------ the step
    def _outer(self, ids: torch.Tensor, inner: torch.Tensor,
               margin: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """h = outer(inner) - tolerance and d outer / d inner, per constraint.

        With ``margin`` (a calibrated constraint, :meth:`constraint_margins`) h is the upper
        end of ``outer`` over ``[inner - margin, inner + margin]``: ``inner + margin - tol``
        without ``outer``, ``max(outer(inner - margin), outer(inner + margin)) - tol`` with a
        convex ``outer``; the slope stays d outer / d inner at ``inner``.
        """
        id_list = ids.tolist()  # the step passes host ids: no sync
        tol = self._tolerance_on(inner.device)[ids.to(inner.device, non_blocking=True)].to(inner.dtype)
        if not any(self.constraints[k].outer is not None for k in id_list):
            h = inner if margin is None else inner + margin.to(inner)
            return h - tol, torch.ones_like(inner)
        with torch.enable_grad():
            x = inner.detach().clone().requires_grad_(True)
            h = torch.stack([self.constraints[k].apply_outer(x[i]) for i, k in enumerate(id_list)])
            (slope,) = torch.autograd.grad(h.sum(), x, allow_unused=True)
        slope = torch.zeros_like(x) if slope is None else slope
        h = h.detach()
        if margin is not None:
            margin = margin.to(inner)
            lo = torch.stack([self.constraints[k].apply_outer(x[i] - margin[i]) for i, k in enumerate(id_list)])
            hi = torch.stack([self.constraints[k].apply_outer(x[i] + margin[i]) for i, k in enumerate(id_list)])
            h = torch.maximum(lo, hi).detach()
        return h - tol, slope.detach()

    def _tolerance_on(self, device: torch.device) -> torch.Tensor:
        cached = self._tolerance_cache.get(device)
        if cached is None:
            cached = self._tolerance_cache[device] = self._tolerances.to(device)
        return cached

    def _take_draw(self, step: int) -> _ConstraintDraw:
        """B_c^t and its batches: the prefetched draw of this step, else a fresh one."""
        draw = self._next_draw if self._next_draw is not None and self._next_draw.step == step else self._draw(step)
        self._next_draw = None
        return draw

    def _objective_and_penalty(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool,
                               num_items_in_batch: Any) -> tuple[Any, torch.Tensor]:
        """The objective and the constraint step with shared model calls.

        ``share_objective_call``: the shared group's rows of B_k^t go into the objective's model
        call (:meth:`objective_with_rows`). ``lookahead_placement='in_call'``: B_k^{t+1} is drawn
        now and its rows join the same call as B_k^t (their outputs detached), giving the
        look-ahead h_k(w_t; B_k^{t+1}) of Algorithm 1, line 6 at the same parameters w_t as a
        separate no-grad call would. Per-constraint values, sums and the all-reduce are those of
        :meth:`_evaluate_draw`."""
        step = self.state.global_step
        draw = self._take_draw(step)
        in_call = self.args.lookahead_placement == "in_call" and self.estimator.gamma_prime > 0
        ahead = self._draw(step + 1) if in_call else None
        now_units, _ = self._plan_units(draw)
        next_units = self._plan_units(ahead)[0] if ahead is not None else {}
        share = self._shared_group if self._shared_group in now_units or self._shared_group in next_units else None
        result: Any = None
        if share is None:  # the objective's own call (the shared group has no rows this step)
            result = self.compute_objective_loss(model, inputs, return_outputs=return_outputs,
                                                 num_items_in_batch=num_items_in_batch)
        precomputed_now: dict[int, Any] = {}
        precomputed_next: dict[int, Any] = {}
        for gi in dict.fromkeys(list(now_units) + list(next_units)):
            if not in_call and gi != share:
                continue  # evaluated by _evaluate_draw in its own call
            group = self._row_groups[gi]
            units_now = list(now_units.get(gi, {}).values())
            units_next = list(next_units.get(gi, {}).values())
            units = units_now + units_next
            key = ("group", gi)
            if not units_next and key in draw.batches:  # collated by the previous step's look-ahead
                batch, slices = draw.batches.pop(key)
            else:
                draw.batches.pop(key, None)
                batch, slices = collate_units(units, group.collate)
                batch = self._to_device(batch)
            if gi == share:
                result, outputs = self.objective_with_rows(model, inputs, group.row_fn, batch,
                                                           return_outputs=return_outputs,
                                                           num_items_in_batch=num_items_in_batch)
            else:
                outputs = group.row_fn(model, batch)
            slices = self._check_row_outputs(units, slices, outputs, need_grad=bool(units_now))
            cut = len(units_now)
            if units_now:
                precomputed_now[gi] = (batch, slices[:cut], outputs)
            if units_next:
                precomputed_next[gi] = (batch, slices[cut:], outputs.detach())
        lookahead = None
        if ahead is not None:
            with torch.no_grad():
                _, previous, _ = self._evaluate_draw(model, ahead, need_grad=False, precomputed=precomputed_next)
            ahead.previous = previous.to(self.estimator.values)
            lookahead = ahead
        penalty = self.constraint_penalty_loss(model, draw=draw, precomputed=precomputed_now, lookahead=lookahead)
        return result, penalty

    def constraint_penalty_loss(self, model: nn.Module, *, draw: Optional[_ConstraintDraw] = None,
                                precomputed: Optional[dict[int, Any]] = None,
                                lookahead: Optional[_ConstraintDraw] = None) -> torch.Tensor:
        """One step of Algorithm 1, lines 3-9; returns the loss whose gradient is G_2.

        ``draw``/``precomputed``/``lookahead`` come from a call shared with the objective or the
        look-ahead (:meth:`_objective_and_penalty`); by default this step's draw is taken and
        evaluated here, and the look-ahead runs where ``lookahead_placement`` says.

        Host synchronisations left in the step (on a GPU): ONE ``.item()`` for the finite
        check of the step's values and of the look-ahead values it consumes
        (``check_constraint_finite``; off means no sync but a NaN/inf then corrupts the
        estimator silently); the collective of a multi-process run. Batches are collated on
        the host and copied from pinned memory without blocking; the constraint ids are small
        host tensors (B_c is a function of (seed, step), drawn on the host by design).
        """
        step = self.state.global_step
        if draw is None:
            draw = self._take_draw(step)
        ids_cpu = draw.constraint_ids.cpu()
        ids = ids_cpu.to(self.estimator.values.device, non_blocking=True)

        # h_k(w_t; B_k^t), with grad
        values, current, stats = self._evaluate_draw(model, draw, need_grad=True, precomputed=precomputed)
        if self.args.check_constraint_finite:
            self._check_finite(ids_cpu, current, draw.previous)

        u_t = self.estimator.get(ids, fallback=current)  # Algorithm 1 weighs with u^t, before the update
        self.estimator.update(ids, current, draw.previous, check_unique=False)  # B_c is drawn without replacement
        if stats is not None:
            self._update_row_spread(ids, stats)
        margin = self._margin_values(ids) if self._has_margins else None
        h_t, slope = self._outer(ids_cpu, u_t, margin)
        weights = self.penalty.weight(h_t) * slope
        penalty_loss = (weights.detach().to(values.dtype) * values).sum() / ids.numel()

        if self.estimator.gamma_prime > 0:
            if lookahead is not None:  # computed in the step's own call
                self._next_draw = lookahead
            elif self.args.lookahead_placement == "after_backward" and self._in_training_step:
                self._pending_lookahead = (model, step + 1)  # run by training_step once the backward is done
            else:
                self._next_draw = self._prefetch(model, step + 1)

        self._step_metrics["constraint/sampled_active_fraction"].append((weights != 0).float().mean())
        self._step_metrics["constraint/penalty_loss"].append(penalty_loss.detach())
        return penalty_loss

    def _check_finite(self, ids: torch.Tensor, current: torch.Tensor, previous: Optional[torch.Tensor]) -> None:
        """Every value that feeds the estimator is finite: this step's h_k(w_t; B_k^t) and the
        look-ahead h_k(w_{t-1}; B_k^t) computed at the previous step (one host sync for both)."""
        check = current if previous is None else torch.cat([current, previous.to(current)])
        if bool(torch.isfinite(check).all()):
            return
        n = ids.numel()
        if not bool(torch.isfinite(current).all()):
            self._raise_non_finite(ids, current.cpu(), "h_k(w_t; B_k) at this step's parameters")
        self._raise_non_finite(ids, check[n:].cpu(),
                               f"the look-ahead h_k(w_(t-1); B_k^t) computed at step {self.state.global_step - 1}")

    @torch.no_grad()
    def _prefetch(self, model: nn.Module, step: int) -> _ConstraintDraw:
        """Draw step ``step``'s constraint batches now and evaluate them at the current
        parameters, which are w_{step-1} from that step's point of view (one no-grad
        ``row_fn`` call per group)."""
        draw = self._draw(step)
        _, previous, _ = self._evaluate_draw(model, draw, need_grad=False)
        draw.previous = previous.to(self.estimator.values)
        return draw

    # ------------------------------------------------------------------ per-row spread, noise, margins
    @torch.no_grad()
    def _update_row_spread(self, ids: torch.Tensor, stats: torch.Tensor) -> None:
        """Running per-row variance s_k^2 (per group) and rows per batch of each visited row-wise
        constraint, from this step's global sums (at w_t): ``V <- (1 - rho) V + rho s^2_batch``
        with ``rho = max(1 / visits, SPREAD_DECAY)``, so the first visits average equally and
        later ones forget old parameters (non-forgetting constraints start with every per-row
        value 0: the spread grows during training)."""
        n = ids.numel()
        var, rows = batch_variances(stats), stats[2]
        has_rows = rows.view(n, 2).sum(dim=1) > 0  # the row-wise positions of B_c
        visits = self._spread_visits[ids] + has_rows.to(self._spread_visits.dtype)
        rho = torch.where(has_rows, (1.0 / visits.clamp(min=1)).clamp(min=SPREAD_DECAY), torch.zeros_like(visits))
        rho2 = rho.repeat_interleave(2)
        owner = torch.stack([2 * ids, 2 * ids + 1], dim=1).reshape(-1)
        self._spread_var[owner] = (1 - rho2) * self._spread_var[owner] + rho2 * var.to(self._spread_var)
        self._spread_rows[owner] = (1 - rho2) * self._spread_rows[owner] + rho2 * rows.to(self._spread_rows)
        self._spread_visits[ids] = visits

    def _spread_at(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        owner = torch.stack([2 * ids, 2 * ids + 1], dim=1).reshape(-1)
        return self._spread_var[owner].view(-1, 2), self._spread_rows[owner].view(-1, 2)

    def _batch_std_error(self, ids: torch.Tensor) -> torch.Tensor:
        """Standard error of the mini-batch value h_k(w; B_k) from the per-row spread:
        ``s_k / sqrt(|B_k|)``, or ``sqrt(s_0^2 / n_0 + s_1^2 / n_1)`` for a group difference."""
        var, rows = self._spread_at(ids)
        return torch.where(rows > 0, var / rows.clamp(min=1e-12), torch.zeros_like(var)).sum(dim=1).sqrt()

    def _margin_values(self, ids: torch.Tensor) -> torch.Tensor:
        """The margin in force per constraint: the explicit one, or ``z_c * s_k / sqrt(n_k)``
        with n_k = |D_k| or ``Constraint.independent_rows`` (for a group difference ``z_c * sqrt(s_0^2 / n_0 + s_1^2 / n_1)`` with
        n_g = |D_k| times group g's running share of the batch rows)."""
        var, rows = self._spread_at(ids)
        share = rows / rows.sum(dim=1, keepdim=True).clamp(min=1e-12)
        n_data = (self._data_rows[ids].unsqueeze(1) * share).clamp(min=1.0)
        se = torch.where(rows > 0, var / n_data, torch.zeros_like(var)).sum(dim=1).sqrt()
        return self._margin_fixed[ids] + self._margin_z[ids] * se

    def constraint_margins(self) -> dict[str, float]:
        """The margin in force for each constraint that has one (explicit, or from a confidence):
        the hinge's indicator acts on ``u_k + margin > tol_k`` (on the inner value of a
        compositional constraint; see :meth:`_outer`). Empty when no margin is configured."""
        if not self.constraints or not self._has_margins:
            return {}
        ids = torch.arange(len(self.constraints), device=self._spread_var.device)
        margins = self._margin_values(ids).cpu().tolist()
        configured = ((self._margin_z > 0) | (self._margin_fixed > 0)).cpu().tolist()
        return {c.name: float(v) for c, v, on in zip(self.constraints, margins, configured) if on}

    def constraint_noise(self) -> dict[str, float]:
        """Standard error of each visited row-wise constraint's mini-batch value h_k(w; B_k),
        from the running per-row spread (:meth:`_update_row_spread`). Scalar ``fn`` constraints
        give no per-row values and are not listed."""
        if not self.constraints:
            return {}
        ids = torch.arange(len(self.constraints), device=self._spread_var.device)
        se = self._batch_std_error(ids).cpu().tolist()
        visited = (self._spread_visits > 0).cpu().tolist()
        return {c.name: float(v) for c, v, seen in zip(self.constraints, se, visited) if seen}

    def _noise_scale(self, c: Constraint) -> Optional[float]:
        """The scale a constraint's noise is compared with: ``metadata["noise_scale"]`` (e.g. the
        ROC constraints' kappa), else ``|tolerance|`` when nonzero, else none (no warning)."""
        scale = c.metadata.get("noise_scale") if isinstance(c.metadata, Mapping) else None
        if scale is None and c.tolerance != 0:
            scale = abs(float(c.tolerance))
        return None if scale is None or not scale > 0 else float(scale)

    def _row_noise_log_metrics(self) -> dict[str, float]:
        """``constraint_std/<name>`` (standard error of h_k(w; B_k)) and ``constraint_margin/<name>``
        when m <= ``log_constraint_estimates_max``; their maxima always. Warns once when the noise
        an estimate keeps dwarfs a constraint's scale."""
        logs: dict[str, float] = {}
        noise = self.constraint_noise()
        few = len(self.constraints) <= self.args.log_constraint_estimates_max
        if noise:
            if few:
                logs.update({f"constraint_std/{n}": v for n, v in noise.items()})
            logs["constraint_std/max"] = max(noise.values())
            self._maybe_warn_noise(noise)
        margins = self.constraint_margins()
        if margins:
            if few:
                logs.update({f"constraint_margin/{n}": v for n, v in margins.items()})
            logs["constraint_margin/max"] = max(margins.values())
        return logs

    def _maybe_warn_noise(self, noise: dict[str, float]) -> None:
        """ONE warning per run when the noise left in an estimate exceeds the constraint's scale.

        With independent batch noise of standard error se, an exponential average with weight
        gamma keeps a standard deviation of ``se * sqrt(gamma / (2 - gamma))``; when that exceeds
        the scale the hinge's indicator 1[u_k > 0] is close to a coin flip."""
        if self._noise_warned:
            return
        g = self.args.msvr_gamma
        keep = math.sqrt(g / (2.0 - g))
        bad = []
        for k, c in enumerate(self.constraints):
            scale = self._noise_scale(c)
            if scale is None or c.name not in noise:
                continue
            if noise[c.name] * keep > scale:
                bad.append((noise[c.name] * keep / scale, c.name, noise[c.name], scale))
        if not bad:
            return
        self._noise_warned = True
        bad.sort(reverse=True)
        ratio, name, se, scale = bad[0]
        logger.warning(
            "constraint noise: the mini-batch value of %r has standard error %.3g; with msvr_gamma=%g its estimate "
            "keeps about %.3g of it, %.1fx the constraint's scale %.3g (metadata['noise_scale'] or |tolerance|), so the "
            "hinge acts on noise. %d of %d constraints are in this state (worst: %s). Lower msvr_gamma (e.g. 0.1; the "
            "estimate then averages about 2/gamma batches) or raise constraint_batch_size (the noise falls as "
            "1/sqrt(|B_k|)).", name, se, g, se * keep, ratio, scale, len(bad), len(self.constraints),
            [b[1] for b in bad[:5]])

    def compute_objective_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                               num_items_in_batch: Optional[Union[torch.Tensor, int]] = None) -> Any:
        """The objective F on the Trainer's batch (G_1). Override for a custom objective."""
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    def _objective_is_scaled_for_ga(self, num_items_in_batch: Any) -> bool:
        # mirrors Trainer.training_step: when False the Trainer divides the loss by the accumulation steps
        if self.loss_is_scaled_for_ga is not None:
            return self.loss_is_scaled_for_ga
        return (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Optional[Union[torch.Tensor, int]] = None) -> Any:
        if not (self._in_training_step and self.penalty.active) or self._constraint_step == self.state.global_step:
            return self.compute_objective_loss(model, inputs, return_outputs=return_outputs,
                                               num_items_in_batch=num_items_in_batch)
        shared = self._shared_group is not None or self.args.lookahead_placement == "in_call"
        if not shared:  # the objective first, as without constraints
            result = self.compute_objective_loss(model, inputs, return_outputs=return_outputs,
                                                 num_items_in_batch=num_items_in_batch)
        self._constraint_step = self.state.global_step
        self._pending_lookahead = None
        if shared:
            result, penalty_loss = self._objective_and_penalty(model, inputs, return_outputs, num_items_in_batch)
        else:
            penalty_loss = self.constraint_penalty_loss(model)
        if not self._objective_is_scaled_for_ga(num_items_in_batch):
            # the Trainer divides the summed loss by the window length; the penalty counts once per window
            penalty_loss = penalty_loss * self.current_gradient_accumulation_steps
        if return_outputs:
            loss, outputs = result
            return loss + penalty_loss.to(loss.dtype), outputs
        return result + penalty_loss.to(result.dtype)

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Optional[Union[torch.Tensor, int]] = None) -> torch.Tensor:
        self._in_training_step = True
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
            if self._pending_lookahead is not None:
                # lookahead_placement='after_backward': the step's activations are freed, the parameters
                # are still w_t (the optimizer steps after the accumulation window)
                lookahead_model, step = self._pending_lookahead
                self._pending_lookahead = None
                with self.compute_loss_context_manager():
                    self._next_draw = self._prefetch(lookahead_model, step)
        finally:
            self._in_training_step = False
        return loss

    # ------------------------------------------------------------------ logging
    def constraint_estimates(self) -> dict[str, float]:
        """The current estimate of each visited constraint, h_k ~ outer(u_k) (no tolerance subtracted)."""
        if not self.constraints:
            return {}
        ids = torch.arange(len(self.constraints))
        h, _ = self._outer(ids, self.estimator.values.detach().cpu())
        h = h + self._tolerances.to(h)
        visited = self.estimator.visited.cpu().tolist()
        return {c.name: float(v) for c, v, seen in zip(self.constraints, h.tolist(), visited) if seen}

    def _constraint_log_metrics(self) -> dict[str, float]:
        logs: dict[str, float] = {}
        for key, vals in self._step_metrics.items():
            logs[key] = torch.stack(vals).float().mean().item()
        self._step_metrics.clear()
        estimates = self.constraint_estimates()
        if not estimates:
            return logs
        names = list(estimates)
        tol = torch.tensor([self.constraints[i].tolerance for i, c in enumerate(self.constraints) if c.name in estimates])
        h = torch.tensor([estimates[n] for n in names]) - tol
        if len(self.constraints) <= self.args.log_constraint_estimates_max:
            logs.update({f"constraint/{n}": v for n, v in estimates.items()})
        logs["constraint/max_estimate"] = h.max().item()
        logs["constraint/active_fraction"] = (h > 0).float().mean().item()
        # estimate of the penalty term of Phi: (1/m) sum_k penalty([h_k]_+) over the visited constraints
        logs["constraint/penalty"] = self.penalty.value(h).sum().item() / len(self.constraints)
        return logs

    def add_metrics_to_next_log(self, metrics: dict[str, float]) -> None:
        """Queue ``metrics`` for the Trainer's next log entry (training or evaluation).

        The way for a callback to report extra metrics: calling ``trainer.log`` from
        ``on_step_end`` makes the Trainer skip its own log of that step (``on_log`` resets
        ``control.should_log``), losing the loss and constraint estimates. Set
        ``control.should_log = True`` as well to have the entry at this step (see
        :class:`~hf_constrained.callbacks.PeriodicMetricsCallback`).
        """
        self._pending_log_metrics.update(metrics)

    def log(self, logs: dict[str, float], start_time: Optional[float] = None) -> None:
        if "loss" in logs and self.penalty.active:  # a training log
            logs.update(self._constraint_log_metrics())
            logs.update(self._row_noise_log_metrics())
        if self._eval_constraint_metrics and any(k.endswith("_loss") or "_runtime" in k for k in logs):
            logs.update(self._eval_constraint_metrics)
            self._eval_constraint_metrics = {}
        if self._pending_log_metrics:
            logs.update(self._pending_log_metrics)
            self._pending_log_metrics = {}
        if "loss" in logs:  # a training log: the Trainer's pre-clip grad_norm of this step
            logs.update(self.clip_monitor.observe(logs.get("grad_norm"), self.state.global_step,
                                                  logs.get(PENALTY_GRAD_NORM_KEY)))
        super().log(logs, start_time)

    # ------------------------------------------------------------------ evaluation
    def _eval_model(self, model: Optional[nn.Module]) -> nn.Module:
        if model is None:
            # FSDP shards the parameters: only the wrapped module's forward gathers them
            model = self.model_wrapped if getattr(self, "is_fsdp_enabled", False) else self.model
        return model

    def _eval_batches(self, c: Constraint, data: Any, collate: Any) -> Any:
        """The batches of ``data`` for exact evaluation (with ``sample_index``), on the device."""
        batch_size = self.args.constraint_eval_batch_size or self.args.per_device_eval_batch_size
        starts = range(0, len(data), batch_size)
        bar = tqdm(starts, desc=f"constraint {c.name}", leave=False,
                   disable=self.args.disable_tqdm or len(starts) < 20 or not self.is_world_process_zero())
        for start in bar:
            rows = list(range(start, min(start + batch_size, len(data))))
            batch = collate(fetch_rows(data, rows))
            if isinstance(batch, MutableMapping):
                batch["sample_index"] = torch.as_tensor(rows, dtype=torch.long)
            yield rows, self._to_device(batch)

    @torch.no_grad()
    def constraint_statistics(self, model: Optional[nn.Module] = None, split: str = "eval",
                              confidence: float = 0.95) -> dict[str, ConstraintStatistic]:
        """Exact value of every constraint on its data (a full pass, not the estimator), with its
        one-sided upper confidence bound where the constraint gives per-row values.

        Args:
            model: the model to evaluate (default: the trainer's; under FSDP the wrapped one).
            split: ``"eval"`` uses each constraint's ``eval_dataset`` (falling back to its
                training data), ``"train"`` its training data.
            confidence: the one-sided confidence of the bounds.

        Row-wise constraints: the per-row values over the whole data, batched (one ``row_fn``
        call per batch, shared by the constraints with the same ``row_fn``, collate and data),
        then :func:`~hf_constrained.statistics.constraint_statistic` (value, CLT upper bound,
        standard error). A constraint's ``exact_fn`` wins when given; scalar ``fn`` constraints
        give their batch values averaged with batch-size weights (exact for per-sample means)
        and data-free ones their value: value only (``upper_bound`` None).
        """
        if split not in ("eval", "train"):
            raise ValueError(f"split must be 'eval' or 'train', got {split!r}")
        model = self._eval_model(model)
        was_training = model.training
        model.eval()
        out: dict[str, ConstraintStatistic] = {}
        try:
            data_of = [c.dataset if split == "train" or c.eval_dataset is None else c.eval_dataset
                       for c in self.constraints]
            # row-wise constraints sharing row_fn, collate and data: one pass for all of them
            passes: list[tuple[Any, Any, Any, list[int]]] = []
            for k, c in enumerate(self.constraints):
                if c.exact_fn is not None or not c.rowwise:
                    continue
                collate = self._collate_of(c)
                for fn, coll, data, members in passes:
                    if fn is c.row_fn and data is data_of[k] and same_callable(coll, collate):
                        members.append(k)
                        break
                else:
                    passes.append((c.row_fn, collate, data_of[k], [k]))
            for row_fn, collate, data, members in passes:
                values: dict[int, list[torch.Tensor]] = {k: [] for k in members}
                groups: dict[int, list[torch.Tensor]] = {k: [] for k in members}
                for rows, batch in self._eval_batches(self.constraints[members[0]], data, collate):
                    with self.compute_loss_context_manager():
                        outputs = row_fn(model, batch)
                    for k in members:
                        c = self.constraints[k]
                        v = c.row_values(outputs)
                        values[k].append(v.detach().double().cpu())
                        if c.group_key is not None:
                            groups[k].append(c.row_groups(batch, v.shape[0], v.device).cpu())
                for k in members:
                    c = self.constraints[k]
                    if groups[k]:
                        labels = torch.cat(groups[k])
                        c.check_group_counts(int((labels == 0).sum()), int((labels == 1).sum()))
                    outer = None if c.outer is None else _float_outer(c)
                    out[c.name] = constraint_statistic(
                        torch.cat(values[k]).numpy(), groups=torch.cat(groups[k]).numpy() if groups[k] else None,
                        outer=outer, confidence=confidence)
            for k, c in enumerate(self.constraints):
                if c.name in out:
                    continue
                data = data_of[k]
                if c.exact_fn is not None:
                    value = float(c.exact_fn(model, data))
                elif data is None:
                    with self.compute_loss_context_manager():
                        value = float(c.apply_outer(c.fn(model, None).float()))
                else:
                    total, count = 0.0, 0
                    for rows, batch in self._eval_batches(c, data, self._collate_of(c)):
                        with self.compute_loss_context_manager():
                            total += float(c.fn(model, batch)) * len(rows)
                        count += len(rows)
                    value = float(c.apply_outer(torch.tensor(total / count)))
                out[c.name] = ConstraintStatistic(value=value, confidence=confidence)
        finally:
            model.train(was_training)
        return {c.name: out[c.name] for c in self.constraints}

    def evaluate_constraints(self, model: Optional[nn.Module] = None, split: str = "eval") -> dict[str, float]:
        """Exact value of every constraint on its data (the ``value`` of
        :meth:`constraint_statistics`): a full pass, not the estimator."""
        return {name: stat.value for name, stat in self.constraint_statistics(model=model, split=split).items()}

    def constraint_metrics(self, values: dict[str, float], prefix: str = "eval") -> dict[str, float]:
        """``{prefix}_constraint/<name>``, the largest violation and whether all hold."""
        metrics = {f"{prefix}_constraint/{n}": v for n, v in values.items()}
        if values:
            violations = [values[c.name] - c.tolerance for c in self.constraints]
            metrics[f"{prefix}_constraint_max_violation"] = max(violations)
            metrics[f"{prefix}_constraints_satisfied"] = float(all(v <= 0 for v in violations))
        return metrics

    def _loggable(self, metrics: dict[str, float]) -> dict[str, float]:
        """What of the evaluation metrics goes into the logs (and ``log_history``, which every
        checkpoint copies): per-constraint values only up to ``log_constraint_estimates_max``
        constraints, the summaries always. The full table stays in :attr:`last_constraint_values`."""
        if len(self.constraints) <= self.args.log_constraint_estimates_max:
            return dict(metrics)
        return {k: v for k, v in metrics.items() if "_constraint/" not in k}

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Optional[list[str]] = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """The Trainer's evaluation plus the exact value of every constraint (a full pass).

        Without an objective ``eval_dataset`` only the constraints are evaluated, so periodic
        evaluation (``eval_strategy``) and feasible-checkpoint selection work on constraints
        alone (e.g. ``metric_for_best_model="constraint_max_violation"``). The returned metrics
        hold every constraint's value; the logged entry holds them only for at most
        ``log_constraint_estimates_max`` constraints (see :attr:`last_constraint_values`).
        """
        values = self.evaluate_constraints() if self.constraints else {}
        if values:
            self.last_constraint_values = dict(values)
            self.last_constraint_values_step = self.state.global_step
        cmetrics = self.constraint_metrics(values, metric_key_prefix) if self.constraints else {}
        if eval_dataset is None and self.eval_dataset is None and self.constraints:
            self.log(self._loggable(cmetrics))
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, cmetrics)
            return cmetrics
        self._eval_constraint_metrics = self._loggable(cmetrics)  # merged into the evaluation's log entry
        metrics = super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        self._eval_constraint_metrics = {}
        metrics.update(cmetrics)
        return metrics

    # ------------------------------------------------------------------ state
    def constraint_state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the constraint part exactly."""
        return {
            "names": [c.name for c in self.constraints],
            "estimator": self.estimator.state_dict() if self.constraints else None,
            "streams": [None if s is None else s.state_dict() for s in self.streams],
            "next_draw": None if self._next_draw is None else self._next_draw.state_dict(),
            "constraint_step": self._constraint_step,
            # the running per-row spread behind the margins z_c * s_k / sqrt(n_k) and the noise logs
            "spread": {"var": self._spread_var.cpu(), "rows": self._spread_rows.cpu(),
                       "visits": self._spread_visits.cpu(), "noise_warned": self._noise_warned},
            # B_c^t and the streams' permutations are functions of (seed, step): the seed is their RNG state
            "sampling_seed": self.sampler.seed if self.constraints else self.args.constraint_sampling_seed,
            # the prefetched draw holds global batches of this size, split by rank (see _local_rows)
            "num_processes": self.accelerator.num_processes,
            "global_constraint_batch_size": self.args.constraint_batch_size * self.accelerator.num_processes,
        }

    def load_constraint_state_dict(self, state: dict[str, Any]) -> None:
        names = [c.name for c in self.constraints]
        if state["names"] != names:
            raise ValueError(f"checkpoint constraints {state['names']} do not match this trainer's {names}")
        if self.constraints:
            self.estimator.load_state_dict(state["estimator"])
        for stream, s in zip(self.streams, state["streams"]):
            if stream is not None:
                stream.load_state_dict(s)
        nd = state["next_draw"]
        self._next_draw = None if nd is None else _ConstraintDraw.from_state_dict(nd)
        self._check_process_count(state)
        if self._next_draw is not None and self._next_draw.previous is not None:
            self._next_draw.previous = self._next_draw.previous.to(self.estimator.values.device)
        self._constraint_step = state["constraint_step"]
        spread = state.get("spread")
        if spread is not None:
            self._spread_var.copy_(spread["var"].to(self._spread_var))
            self._spread_rows.copy_(spread["rows"].to(self._spread_rows))
            self._spread_visits.copy_(spread["visits"].to(self._spread_visits))
            self._noise_warned = bool(spread["noise_warned"])
        self._restore_sampling_seed(state.get("sampling_seed"))

    def _check_process_count(self, state: dict[str, Any]) -> None:
        """Resuming on another number of processes (or another ``constraint_batch_size``).

        The estimators, streams and sampler are global (every rank holds the same values),
        so they carry over. The prefetched draw does not: its global batches B_k^t were
        drawn for the checkpoint's global size and each rank takes a slice of its own size,
        so it is dropped and step t uses a fresh draw without the previous-iterate term
        (gamma' correction of Algorithm 1, line 6) once.
        """
        global_b = self.args.constraint_batch_size * self.accelerator.num_processes
        saved_procs = state.get("num_processes")
        draw = self._next_draw
        sizes = set() if draw is None else {len(r) for r in draw.sample_indices if r is not None}
        if state.get("global_constraint_batch_size", global_b) == global_b and sizes <= {global_b}:
            return
        self._next_draw = None
        logger.warning(
            "resuming a checkpoint written by %s process(es) with global constraint batches of %s rows on %d "
            "process(es) with %d rows: the estimators, streams and sampler continue, the prefetched draw of step %s "
            "is dropped (that step uses no previous-iterate correction), and the run is not identical to an "
            "uninterrupted run", saved_procs if saved_procs is not None else "?",
            state.get("global_constraint_batch_size", sorted(sizes)), self.accelerator.num_processes, global_b,
            None if draw is None else draw.step)

    def _restore_sampling_seed(self, seed: Optional[int]) -> None:
        """Continue the checkpoint's constraint sampling sequence (B_c^t and each stream's
        shuffles) even when this run was configured with another seed."""
        if seed is None or not self.constraints or seed == self.sampler.seed:
            return
        logger.warning("resuming with the checkpoint's constraint sampling seed %s (this run's arguments say %s)",
                       seed, self.args.constraint_sampling_seed)
        self.sampler.seed = int(seed)
        for stream in self.streams:
            if stream is not None:
                stream.seed, stream._perm = int(seed), None

    def save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """The Trainer's checkpoint save made complete-or-ignored (:mod:`hf_constrained.checkpointing`).

        No public hook of the Trainer runs between the last file of a checkpoint and the
        rotation of old ones (``on_save`` fires after both), so the constraint state and the
        completeness marker could only come after the rotation; this is the save itself
        (:mod:`hf_constrained.trainer_internals`). Here the rotation is deferred: the Trainer saves with ``save_total_limit`` unset, then the
        constraint state and the marker are written, and only then is the checkpoint pushed
        (``hub_strategy``, through the safety gate) and are old checkpoints rotated (with the
        Trainer's own ``rotate_checkpoints`` and arguments). A kill at any moment
        leaves the previous complete checkpoint in place.
        """
        run_dir = trainer_run_dir(self, trial)  # the Trainer's own run folder (hp search trials)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            mark_incomplete(folder)  # re-saving a step: the folder stops being complete before any file changes
        self.accelerator.wait_for_everyone()
        # the Trainer would rotate old checkpoints and push this one before the constraint state
        # and the marker exist: both wait until the checkpoint is complete
        limit, push = self.args.save_total_limit, self.args.push_to_hub
        self.args.save_total_limit, self.args.push_to_hub = None, False
        try:
            super().save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit, self.args.push_to_hub = limit, push
        if self.args.should_save:  # also without constraints: subclasses keep objective estimators here
            atomic_torch_save(self.constraint_state_dict(), os.path.join(folder, CONSTRAINT_STATE_NAME))
        self.accelerator.wait_for_everyone()  # every rank's files (RNG states, shards) are written
        if self.args.should_save:
            mark_complete(folder, self.state.global_step)
        if push:
            self.push_checkpoint(folder)  # the Trainer's checkpoint push (hub_strategy), gated
        if self.args.should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def train(self, resume_from_checkpoint: Optional[Union[str, bool]] = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:
            resume_from_checkpoint = latest_complete_checkpoint(self.args.output_dir)
        if resume_from_checkpoint:
            path = os.path.join(resume_from_checkpoint, CONSTRAINT_STATE_NAME)
            if os.path.exists(path):
                check_named_checkpoint(resume_from_checkpoint)
                self.load_constraint_state_dict(load_constraint_state(path))
            elif self.penalty.active:
                raise FileNotFoundError(
                    f"{path} is missing: the checkpoint holds no constraint estimator state, so the run cannot "
                    "resume exactly"
                )
            else:
                check_named_checkpoint(resume_from_checkpoint)
        if resume_from_checkpoint and self._finished_at(resume_from_checkpoint):
            return TrainOutput(self.state.global_step, 0.0, {})
        if self.penalty.active:
            self.preflight_constraints()
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _finished_at(self, checkpoint: str) -> bool:
        """Whether ``checkpoint`` was written at (or past) ``max_steps``; then its weights and state
        are loaded and nothing is trained (the Trainer would check its bound only after one more step)."""
        path = os.path.join(checkpoint, TRAINER_STATE_NAME)
        if self.args.max_steps <= 0 or not os.path.isfile(path):
            return False
        state = TrainerState.load_from_json(path)
        if state.global_step < self.args.max_steps:
            return False
        logger.info("checkpoint %s is at step %d, max_steps is %d: nothing to train", checkpoint,
                    state.global_step, self.args.max_steps)
        trainer_load_checkpoint(self, checkpoint, self.model)
        self.state = state
        return True
