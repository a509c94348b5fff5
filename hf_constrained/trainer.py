"""``ConstrainedTrainer``: the Hugging Face Trainer with the hinge exact penalty and MSVR.

One optimizer step of Algorithm 1 (REFERENCE section 2), done inside
:meth:`ConstrainedTrainer.compute_loss` so there is ONE backward per ``training_step``:

1. B_c^t from :class:`~hf_constrained.sampling.ConstraintSampler` (line 3), and a batch
   B_k^t per sampled constraint from its :class:`~hf_constrained.sampling.ConstraintBatchStream`
   (line 5);
2. h_k(w_t; B_k^t) with grad, all-reduced across processes, feeds the MSVR update (line 6);
   the previous-iterate term h_k(w_{t-1}; B_k^t) was computed one step early: at step
   t-1 the trainer already drew B_c^t and B_k^t and evaluated them under ``no_grad``
   while the parameters were still w_{t-1}. No copy of the parameters is kept;
3. the penalty loss ``(1/|B_c|) sum_k weight(u_k^t) * h_k(w_t; B_k^t)`` with the weight
   detached, so its gradient is G_2 of line 9;
4. added to the objective loss; the Trainer's optimizer then applies G_1 + G_2 (line 10).

Under gradient accumulation the parameters stay w_t for the whole window, so the
constraint part runs on the window's first micro-batch only (scaled so it counts once).
"""

from __future__ import annotations

import logging
import math
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, IntervalStrategy, rotate_checkpoints

from .checkpointing import (
    atomic_torch_save,
    check_named_checkpoint,
    latest_complete_checkpoint,
    load_constraint_state,
    mark_complete,
    mark_incomplete,
)
from .clipping import PENALTY_GRAD_NORM_KEY, ClipMonitor
from .config import ConstrainedTrainingArguments
from .constraint import Constraint, fetch_rows
from .distributed import GradientCoverageCallback, configure_ddp_for_constraints, fsdp_requested, uses_ddp
from .estimators import MSVREstimator, resolve_gamma_prime
from .penalties import make_penalty
from .safety.gate import SafetyMixin
from .sampling import ConstraintBatchStream, ConstraintSampler

logger = logging.getLogger(__name__)

CONSTRAINT_STATE_NAME = "constraint_state.pt"


class ConstraintValueError(RuntimeError):
    """A constraint function returned something the method cannot use."""


@dataclass
class _ConstraintDraw:
    """The constraint part of one step: B_c^t, the global sample indices of each B_k^t,
    and h_k(w_{t-1}; B_k^t) where it was computed (NaN where not)."""

    step: int
    constraint_ids: torch.Tensor
    sample_indices: list[Optional[list[int]]]
    previous: Optional[torch.Tensor] = None

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


class ConstrainedTrainer(SafetyMixin, Trainer):
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
            self.estimator = MSVREstimator(m, self.args.msvr_gamma, gamma_prime, device=self.args.device)
            self.sampler = ConstraintSampler(m, self.num_sampled, seed)
        self.streams: list[Optional[ConstraintBatchStream]] = [
            None if c.data_free else ConstraintBatchStream(len(c.dataset), seed, k)
            for k, c in enumerate(self.constraints)
        ]
        self._tolerances = torch.tensor([c.tolerance for c in self.constraints], dtype=torch.float32)
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
        step, without advancing any data stream. Every constraint runs (not each distinct
        function once): constraints that share one function differ in their data.
        """
        model = self.model
        was_training = model.training
        model.train()
        bar = tqdm(self.constraints, desc="checking constraints", leave=False,
                   disable=self.args.disable_tqdm or len(self.constraints) < 50 or not self.is_world_process_zero())
        try:
            for k, c in enumerate(bar):
                batch = None
                rows: list[int] = []
                if not c.data_free:
                    rows = list(range(min(len(c.dataset), self.args.constraint_batch_size)))
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
        finally:
            model.train(was_training)

    # ------------------------------------------------------------------ batches
    def _make_batch(self, k: int, indices: list[int]) -> Any:
        c = self.constraints[k]
        batch = c.collate(fetch_rows(c.dataset, indices))
        if isinstance(batch, dict):
            batch["sample_index"] = torch.as_tensor(indices, dtype=torch.long)
        return self._prepare_input(batch)

    def _local_rows(self, rows: list[int]) -> list[int]:
        """This process's share of a global constraint batch (contiguous slice by rank)."""
        b = self.args.constraint_batch_size
        r = self.accelerator.process_index
        return rows[r * b : (r + 1) * b]

    def _draw(self, step: int) -> _ConstraintDraw:
        ids = self.sampler.sample(step)
        global_b = self.args.constraint_batch_size * self.accelerator.num_processes
        rows = [None if self.streams[k] is None else self.streams[k].next_indices(global_b) for k in ids.tolist()]
        return _ConstraintDraw(step, ids, rows)

    def _constraint_values(self, model: nn.Module, draw: _ConstraintDraw, *, need_grad: bool) -> torch.Tensor:
        values = []
        for k, rows in zip(draw.constraint_ids.tolist(), draw.sample_indices):
            batch = None if rows is None else self._make_batch(k, self._local_rows(rows))
            values.append(self._check_value(k, self.constraints[k].fn(model, batch), need_grad=need_grad))
        return torch.stack([v.float() for v in values])

    def _all_reduce_mean(self, values: torch.Tensor) -> torch.Tensor:
        if self.accelerator.num_processes > 1:
            values = self.accelerator.reduce(values.contiguous(), reduction="mean")
        return values

    # ------------------------------------------------------------------ the step
    def _outer(self, ids: torch.Tensor, inner: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h = outer(inner) - tolerance and d outer / d inner, per constraint."""
        tol = self._tolerances.to(inner.device)[ids.to(inner.device)]
        if all(self.constraints[k].outer is None for k in ids.tolist()):
            return inner - tol, torch.ones_like(inner)
        with torch.enable_grad():
            x = inner.detach().clone().requires_grad_(True)
            h = torch.stack([self.constraints[k].apply_outer(x[i]) for i, k in enumerate(ids.tolist())])
            (slope,) = torch.autograd.grad(h.sum(), x, allow_unused=True)
        slope = torch.zeros_like(x) if slope is None else slope
        return h.detach() - tol, slope.detach()

    def constraint_penalty_loss(self, model: nn.Module) -> torch.Tensor:
        """One step of Algorithm 1, lines 3-9; returns the loss whose gradient is G_2."""
        step = self.state.global_step
        draw = self._next_draw if self._next_draw is not None and self._next_draw.step == step else self._draw(step)
        self._next_draw = None
        ids = draw.constraint_ids.to(self.estimator.values.device)

        values = self._constraint_values(model, draw, need_grad=True)  # h_k(w_t; B_k^t), with grad
        current = self._all_reduce_mean(values.detach())
        if self.args.check_constraint_finite and not torch.isfinite(current).all().item():
            self._raise_non_finite(ids, current, "h_k(w_t; B_k)")

        u_t = self.estimator.get(ids, fallback=current)  # Algorithm 1 weighs with u^t, before the update
        self.estimator.update(ids, current, draw.previous)
        h_t, slope = self._outer(ids, u_t)
        weights = self.penalty.weight(h_t) * slope
        penalty_loss = (weights.detach() * values).sum() / ids.numel()

        if self.estimator.gamma_prime > 0:
            self._next_draw = self._prefetch(model, step + 1)

        self._step_metrics["constraint/sampled_active_fraction"].append((weights != 0).float().mean())
        self._step_metrics["constraint/penalty_loss"].append(penalty_loss.detach())
        return penalty_loss

    @torch.no_grad()
    def _prefetch(self, model: nn.Module, step: int) -> _ConstraintDraw:
        """Draw step ``step``'s constraint batches now and evaluate them at the current
        parameters, which are w_{step-1} from that step's point of view."""
        draw = self._draw(step)
        previous = self._all_reduce_mean(self._constraint_values(model, draw, need_grad=False))
        draw.previous = previous.to(self.estimator.values.device)
        return draw

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
        result = self.compute_objective_loss(model, inputs, return_outputs=return_outputs,
                                             num_items_in_batch=num_items_in_batch)
        if not (self._in_training_step and self.penalty.active) or self._constraint_step == self.state.global_step:
            return result
        self._constraint_step = self.state.global_step
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
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._in_training_step = False

    # ------------------------------------------------------------------ logging
    def constraint_estimates(self) -> dict[str, float]:
        """The current estimate of each visited constraint, h_k ~ outer(u_k) (no tolerance subtracted)."""
        if not self.constraints:
            return {}
        ids = torch.arange(len(self.constraints))
        h, _ = self._outer(ids, self.estimator.values.detach().float().cpu())
        h = h + self._tolerances
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
    @torch.no_grad()
    def evaluate_constraints(self, model: Optional[nn.Module] = None, split: str = "eval") -> dict[str, float]:
        """Exact value of every constraint on its data: a full pass, not the estimator.

        Args:
            model: the model to evaluate (default: the trainer's).
            split: ``"eval"`` uses each constraint's ``eval_dataset`` (falling back to its
                training data), ``"train"`` its training data.

        A constraint's value is its ``exact_fn`` when given; otherwise the batch values
        averaged with batch-size weights (exact for per-sample means), then ``outer``.
        """
        if model is None:
            # FSDP shards the parameters: only the wrapped module's forward gathers them
            model = self.model_wrapped if getattr(self, "is_fsdp_enabled", False) else self.model
        was_training = model.training
        model.eval()
        batch_size = self.args.constraint_eval_batch_size or self.args.per_device_eval_batch_size
        out: dict[str, float] = {}
        try:
            for k, c in enumerate(self.constraints):
                data = c.dataset if split == "train" or c.eval_dataset is None else c.eval_dataset
                if c.exact_fn is not None:
                    out[c.name] = float(c.exact_fn(model, data))
                    continue
                if data is None:
                    with self.compute_loss_context_manager():
                        out[c.name] = float(c.apply_outer(c.fn(model, None).float()))
                    continue
                total, count = 0.0, 0
                starts = range(0, len(data), batch_size)
                bar = tqdm(starts, desc=f"constraint {c.name}", leave=False,
                           disable=self.args.disable_tqdm or len(starts) < 20 or not self.is_world_process_zero())
                for start in bar:
                    rows = list(range(start, min(start + batch_size, len(data))))
                    batch = c.collate(fetch_rows(data, rows))
                    if isinstance(batch, dict):
                        batch["sample_index"] = torch.as_tensor(rows, dtype=torch.long)
                    with self.compute_loss_context_manager():
                        value = c.fn(model, self._prepare_input(batch))
                    total += float(value) * len(rows)
                    count += len(rows)
                out[c.name] = float(c.apply_outer(torch.tensor(total / count)))
        finally:
            model.train(was_training)
        return out

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

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """``Trainer._save_checkpoint`` made complete-or-ignored (:mod:`hf_constrained.checkpointing`).

        ``Trainer._save_checkpoint`` is private, but no public hook runs between the last file
        of a checkpoint and the rotation of old ones (``on_save`` fires after both), so the
        constraint state and the completeness marker could only come after the rotation. Here
        the rotation is deferred: the Trainer saves with ``save_total_limit`` unset, then the
        constraint state and the marker are written, and only then are old checkpoints rotated
        (with the Trainer's own ``rotate_checkpoints`` and arguments). A kill at any moment
        leaves the previous complete checkpoint in place.
        """
        run_dir = self._get_output_dir(trial=trial)  # private: the Trainer's own run folder (hp search trials)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            mark_incomplete(folder)  # re-saving a step: the folder stops being complete before any file changes
        self.accelerator.wait_for_everyone()
        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        if self.args.should_save:  # also without constraints: subclasses keep objective estimators here
            atomic_torch_save(self.constraint_state_dict(), os.path.join(folder, CONSTRAINT_STATE_NAME))
        self.accelerator.wait_for_everyone()  # every rank's files (RNG states, shards) are written
        if self.args.should_save:
            mark_complete(folder, self.state.global_step)
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
        if self.penalty.active:
            self.preflight_constraints()
        return super().train(resume_from_checkpoint, *args, **kwargs)
