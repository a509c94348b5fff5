"""``ConstrainedTrainer``: the Hugging Face Trainer driving Algorithm 1 of the paper (section 4).

The algorithm lives in :class:`~hf_constrained.method.engine.ConstraintEngine`; this class
adapts it to the ``Trainer``: :meth:`ConstrainedTrainer.compute_loss` adds the engine's
penalty loss (lines 3-9, whose gradient is G_2) to the objective (G_1), so there is ONE
backward per ``training_step`` and the Trainer's optimizer applies G_1 + G_2 (line 10);
:meth:`ConstrainedTrainer.training_step` then computes the next step's previous-iterate
values (line 6) once the step's activations are freed. Under gradient accumulation the
parameters stay w_t for the whole window, so the constraint part runs on the window's first
micro-batch only (scaled so it counts once). The trainer also logs, evaluates every
constraint exactly (:mod:`hf_constrained.exact`) and writes the engine's state into every
checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import torch
from torch import nn
from transformers.trainer_utils import IntervalStrategy, TrainOutput

from . import constraint_state, exact
from .batches import BatchMaker, pinned_to
from .clipping import PENALTY_GRAD_NORM_KEY, ClipMonitor
from .config import ConstrainedTrainingArguments, arguments_set
from .constraint import Constraint, ConstraintValueError, checked_constraints  # noqa: F401 (re-exported)
from .constraint_state import finished_at, prepare_resume, save_complete_checkpoint
from .distributed import (
    GradientCoverageCallback,
    check_fsdp_set_up,
    configure_ddp_for_constraints,
    fsdp2_on_cpu,
    full_state_dict_save,
    uses_ddp,
)
from .method.engine import ConstraintEngine, Placement
from .method.estimators import run_precision
from .method.penalties import make_penalty
from .method.projection import GradientProjection, ProjectedGradient
from .method.regularisers import ObjectiveRegulariser, RegularisedObjective
from .method.shared_forward import SharedObjectiveForward, causal_lm_head, trains_as_it_evaluates
from .preflight import preflight_constraints
from .publishing.card import ModelCardInfo
from .safety.loop import SafetyLoop
from .safety.split_checks import check_certification_splits
from .safety.trainer_state import best_checkpoint_restored
from .safety.view import RunView
from .statistics import ConstraintStatistic
from .trainer_internals import (
    TrainerInternals,
    trainer_loss_scaled_for_accumulation,
    trainer_objective_is_model_loss,
    trainer_prepare_input,
)

logger = logging.getLogger(__name__)

CONSTRAINT_STATE_NAME = "constraint_state.pt"


class ConstrainedTrainer(TrainerInternals):
    """A :class:`transformers.Trainer` that trains under constraints ``h_k(w) <= tol_k``.

    Args:
        model, args, ...: as for ``Trainer``; ``args`` must be :class:`~hf_constrained.ConstrainedTrainingArguments`.
        constraints: the constraints (:class:`~hf_constrained.Constraint`, ``constraints_per_value``, ...).
            With penalty ``none`` they are not trained on but still evaluated exactly by :meth:`evaluate`.
        regulariser: an optional change of the objective on every training micro-batch (replay, KL or L2
            to the old model: :mod:`hf_constrained.method.regularisers`), with any ``constraint_penalty``.
        gradient_projection: an optional change of every step's gradient (A-GEM: :mod:`.method.projection`).
        model_card_info, reference_constraint_values: for the safety loop (held as ``trainer.safety``,
            :class:`~hf_constrained.safety.loop.SafetyLoop`): what the card says of the model and its data, and
            the old model's constraint values (the reports' "old model" column).
        **kwargs: passed to ``Trainer``.

    The objective is whatever ``Trainer.compute_loss`` computes (subclasses may override
    :meth:`compute_objective_loss`). Constraint batches are collated by the constraint's ``collate_fn``, else by a
    ``data_collator`` given to the trainer, else by :func:`~hf_constrained.batches.collate_examples`.
    """

    args: ConstrainedTrainingArguments

    def __init__(self, model: Union[nn.Module, None] = None, args: Optional[ConstrainedTrainingArguments] = None,
                 *, constraints: Sequence[Constraint] = (), regulariser: Optional[ObjectiveRegulariser] = None,
                 gradient_projection: Optional[GradientProjection] = None,
                 model_card_info: Optional[ModelCardInfo] = None,
                 reference_constraint_values: Optional[Mapping[str, float]] = None, **kwargs: Any) -> None:
        if args is not None and not isinstance(args, ConstrainedTrainingArguments):
            raise TypeError(f"ConstrainedTrainer needs ConstrainedTrainingArguments, got {type(args).__name__}")
        if args is None:
            args = ConstrainedTrainingArguments(output_dir="trainer_output")
        self.constraints: list[Constraint] = checked_constraints(constraints)
        self.regularised = None if regulariser is None else RegularisedObjective(regulariser)
        m = len(self.constraints)
        self.penalty = make_penalty(args.constraint_penalty, args.penalty_beta)
        if self.penalty.active and m == 0:
            raise ValueError(f"constraint_penalty={args.constraint_penalty!r} needs at least one constraint; "
                             "pass constraints=[...] or use constraint_penalty='none'")
        num_sampled = args.constraints_per_step if args.constraints_per_step is not None else m
        if m and not 1 <= num_sampled <= m:
            raise ValueError(f"constraints_per_step must be in [1, {m}] (there are {m} constraints), got {num_sampled}")
        constraint_step = self.penalty.active or bool(getattr(regulariser, "reads_constraint_rows", False))
        if constraint_step:
            configure_ddp_for_constraints(args)  # before the Trainer builds the Accelerator from args
        # Constraint-only periodic evaluation: the Trainer refuses eval_strategy without an eval_dataset, but evaluate()
        # has the constraints' exact values to evaluate, so the check is passed with the strategy off, then restored.
        hidden: dict[str, Any] = {"push_to_hub": False} if m else {}  # the first push the gate passes creates the repo
        if m and kwargs.get("eval_dataset") is None and args.eval_strategy != "no":
            hidden["eval_strategy"] = IntervalStrategy.NO
        with arguments_set(args, **hidden):
            super().__init__(model=model, args=args, **kwargs)
        check_fsdp_set_up(self)
        self.projected = ProjectedGradient.attach(self, gradient_projection)  # None without one
        if constraint_step and uses_ddp(self.args):
            self.add_callback(GradientCoverageCallback())
        # certification rows must be touched by nothing else: refuse an overlap before any training
        self.certification_fingerprints: dict[str, str] = check_certification_splits(
            self.constraints, train_dataset=self.train_dataset, eval_dataset=self.eval_dataset)
        self.batches = BatchMaker(getattr(self, "data_collator", None), self._to_device)
        self.engine: Optional[ConstraintEngine] = None if not m else ConstraintEngine(
            self.constraints, self.penalty, self.batches, self.args.step_config(num_sampled),
            Placement(self.args.device, run_precision(self.model), world=self.accelerator.num_processes,
                      rank=self.accelerator.process_index,
                      reduce_sum=lambda x: self.accelerator.reduce(x, reduction="sum")),
            margin=self.args.margin_rule(), source=self.args.estimate_source())
        if self.regularised is not None:  # one draw of old rows per step where it can, or a log line saying why not
            self.regularised.check_rows(self.engine, self.penalty.active)
        self.in_training_step = False  # True inside training_step (subclasses' objectives read it)
        self._constraint_step = -1  # global step whose constraint part has run (once per accumulation window)
        self._forward_shareable: Optional[bool] = None
        self._eval_constraint_metrics: dict[str, float] = {}
        self._pending_log_metrics: dict[str, float] = {}
        self.clip_monitor = ClipMonitor(self.args.max_grad_norm, active=self.penalty.active)
        self.last_constraint_values: dict[str, float] = {}  # the latest evaluation's exact values, all m (logs: few)
        self.last_constraint_values_step: Optional[int] = None
        view = RunView(tuple(self.constraints), self.args, self.engine, self.certification_fingerprints)
        self.safety = SafetyLoop(self, view, model_card_info=model_card_info,  # reports, certificates, the push gate
                                 reference_constraint_values=reference_constraint_values)
        self.safety.attach(self.callback_handler, push_to_hub=self.args.push_to_hub)  # a deferred push: Hub checked now

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's Accelerator; an FSDP2 request on CPU processes shards too (:func:`fsdp2_on_cpu`)."""
        with fsdp2_on_cpu(self.args):
            super().create_accelerator_and_postprocess()

    # ------------------------------------------------------------------ the safety loop's Trainer hooks
    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False, *,
                   push: Optional[bool] = None) -> None:
        """``Trainer.save_model`` plus the card and safety report beside the weights (``SafetyLoop.model_saved``),
        then a user call's gated push (``args.push_to_hub``) unless ``push=False``. Under FSDP2 the release gets
        full, gathered weights (:func:`full_state_dict_save`). Call it on every process."""
        with full_state_dict_save(self, enabled=not _internal_call):
            super().save_model(output_dir, _internal_call=True)
            self.safety.model_saved(output_dir or self.args.output_dir)
            if self.args.push_to_hub and not _internal_call and push is not False:
                self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def push_to_hub(self, *args: Any, allow_unsafe: bool = False, safety_rule: Optional[str] = None,
                    **kwargs: Any) -> Any:
        """``Trainer.push_to_hub`` behind the safety gate (``SafetyLoop.gated_push``; ``allow_unsafe`` overrides)."""
        with self.safety.gated_push(allow_unsafe=allow_unsafe, safety_rule=safety_rule):
            return super().push_to_hub(*args, **kwargs)

    def push_checkpoint(self, checkpoint_folder: str) -> None:
        """Checkpoint pushes (``hub_strategy``) of folders whose weights pass ``SafetyLoop.may_push_checkpoint``."""
        if self.safety.may_push_checkpoint(checkpoint_folder):
            if self.hub_model_id is None:
                self.init_hf_repo()  # the first push that passed the gate creates the repository
            super().push_checkpoint(checkpoint_folder)

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        """With constraints the constrained card (``SafetyLoop.create_model_card``); without, the Trainer's."""
        (self.safety.create_model_card if self.constraints else super().create_model_card)(*args, **kwargs)

    def is_new_best(self, metrics: dict[str, float], trial: Any) -> bool:
        best = self.safety.is_new_best(metrics)  # feasible checkpoints first; None: the Trainer's rule
        return super().is_new_best(metrics, trial) if best is None else best

    def save_state(self) -> None:
        super().save_state()
        self.safety.publish_trainer_state()  # without local paths

    def _to_device(self, batch: Any) -> Any:
        """A collated constraint batch on the device; on CUDA pinned and copied ``non_blocking`` (a pageable copy
        would block the host until the device is idle)."""
        if self.args.device.type != "cuda" or getattr(self, "is_deepspeed_enabled", False):
            return trainer_prepare_input(self, batch)  # the Trainer's placement (dtype, DeepSpeed)
        return pinned_to(batch, self.args.device)

    # ------------------------------------------------------------------ the step
    def compute_objective_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                               num_items_in_batch: Optional[Union[torch.Tensor, int]] = None) -> Any:
        """The objective F on the Trainer's batch (G_1). Override for a custom objective."""
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Optional[Union[torch.Tensor, int]] = None) -> Any:
        def objective(runner: Any = model, outputs: bool = return_outputs) -> Any:  # runner: the model, or merged
            return self.compute_objective_loss(runner, inputs, return_outputs=outputs,
                                               num_items_in_batch=num_items_in_batch)
        scaled = trainer_loss_scaled_for_accumulation(self, num_items_in_batch)
        regularised = self.regularised if self.in_training_step else None

        def regularise(result: Any) -> Any:
            return result if regularised is None else regularised(
                model, result, inputs, self.state.global_step, self.current_gradient_accumulation_steps, scaled)
        penalised = self.in_training_step and self.constraint_part_runs and \
            self._constraint_step != self.state.global_step
        shared = None  # the constraint rows in the objective's forward (no other old rows), where that changes no value
        if penalised and (regularised is None or regularised.reads_constraint_rows) \
                and self.objective_forward_shareable():
            shared = self.shared_objective_forward(inputs, lambda merged: objective(merged, True))
        result = regularise(objective()) if shared is None else None
        if not penalised:
            return result
        self._constraint_step = self.state.global_step
        row_weight = 0.0 if regularised is None else regularised.constraint_row_weight  # replay of these rows
        penalty_loss = self.engine.penalty_loss(model, self.state.global_step, shared, row_weight=row_weight)
        if result is None:  # shared, unless no row group of this draw could join
            result = regularise(shared.objective_result(return_outputs) if shared.loss is not None else objective())
        if not scaled:  # the Trainer divides the summed loss by the window length; the penalty counts once per window
            penalty_loss = penalty_loss * self.current_gradient_accumulation_steps
        if return_outputs:
            return result[0] + penalty_loss.to(result[0].dtype), result[1]
        return result + penalty_loss.to(result.dtype)

    @property
    def constraint_part_runs(self) -> bool:
        """Whether training steps run lines 3-9: with a penalty, or for a replay of the constraints' rows."""
        return self.engine is not None and (self.penalty.active or bool(
            self.regularised is not None and self.regularised.reads_constraint_rows))

    def objective_forward_shareable(self) -> bool:
        """Whether constraint rows may join the objective's forward (:func:`trainer_objective_is_model_loss` and a
        model that trains as it evaluates: :mod:`.method.shared_forward`)."""
        if self._forward_shareable is None:
            self._forward_shareable = (trainer_objective_is_model_loss(self, ConstrainedTrainer)
                                       and causal_lm_head(self.model) is not None
                                       and trains_as_it_evaluates(self.model))
            logger.info("constraint rows %s the objective's forward", "share" if self._forward_shareable else "skip")
        return self._forward_shareable

    def shared_objective_forward(self, inputs: dict[str, Any], objective: Any) -> Optional[SharedObjectiveForward]:
        """The objective's micro-batch ready to take constraint rows into its forward; ``None`` where its keys or
        shapes do not allow it (:meth:`.SharedObjectiveForward.for_inputs`: a causal LM's token batch)."""
        return SharedObjectiveForward.for_inputs(inputs, objective)

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Optional[Union[torch.Tensor, int]] = None) -> torch.Tensor:
        self.in_training_step = True
        ran = self._constraint_step
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
            if self.projected is not None:  # the window's reference gradient, at w_t
                self.projected.micro_batch(inputs)
            if self._constraint_step != ran and self.penalty.active:
                # after the backward the step's activations are freed and the parameters are still w_t (the
                # optimizer steps after the window): the previous-iterate values of step t+1 (line 6)
                with self.compute_loss_context_manager():
                    self.engine.look_ahead(model, self.state.global_step + 1)
        finally:
            self.in_training_step = False
        return loss

    def preflight_constraints(self) -> None:
        """Run every constraint once on a few of its rows, before training (:mod:`hf_constrained.preflight`)."""
        if self.engine is not None:
            preflight_constraints(self.model, self.engine.values, self.args.constraint_batch_size,
                                  self.compute_loss_context_manager)

    # ------------------------------------------------------------------ reading the estimates
    def constraint_estimates(self) -> dict[str, float]:
        """The current estimate of each visited constraint, h_k ~ outer(u_k) (no tolerance subtracted)."""
        return {} if self.engine is None else self.engine.estimates()

    def constraint_margins(self) -> dict[str, float]:
        """The margin in force per constraint that has one: the hinge's indicator acts on ``u_k + margin > tol_k``."""
        return {} if self.engine is None else self.engine.spread.margins()

    def constraint_noise(self) -> dict[str, float]:
        """Standard error of each visited row-wise constraint's mini-batch value h_k(w; B_k)."""
        return {} if self.engine is None else self.engine.spread.noise()

    # ------------------------------------------------------------------ logging
    def add_metrics_to_next_log(self, metrics: dict[str, float]) -> None:
        """Queue ``metrics`` for the Trainer's next log entry: the way for a callback to report extra metrics
        (``trainer.log`` from ``on_step_end`` would make the Trainer skip its own log of that step). Set
        ``control.should_log = True`` too for an entry at this step (see ``callbacks.PeriodicMetricsCallback``)."""
        self._pending_log_metrics.update(metrics)

    def log(self, logs: dict[str, float], start_time: Optional[float] = None) -> None:
        if "loss" in logs and self.penalty.active:  # a training log
            logs.update(self.engine.log_metrics(len(self.constraints) <= self.args.log_constraint_estimates_max))
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

    # ------------------------------------------------------------------ exact evaluation
    def constraint_statistics(self, model: Optional[nn.Module] = None, split: str = "eval",
                              confidence: float = 0.95) -> dict[str, ConstraintStatistic]:
        """Exact value of every constraint on its data (a full pass, not the estimator), with a one-sided upper
        bound at ``confidence`` where it gives per-row values (:func:`hf_constrained.exact.constraint_statistics`),
        for ``model`` (default: the trainer's; under FSDP the wrapped one) on ``split``: ``"eval"`` (each
        constraint's ``eval_dataset``, falling back to its training data) or ``"train"`` (its training data)."""
        return self._exact_pass(exact.constraint_statistics, model, split=split, confidence=confidence)

    def _exact_pass(self, run: Any, model: Optional[nn.Module], **kwargs: Any) -> Any:
        """``run`` of :mod:`hf_constrained.exact` in eval mode, with the eval batch size, autocast and progress bars."""
        if model is None:  # FSDP shards the parameters: only the wrapped module's forward gathers them
            model = self.model_wrapped if getattr(self, "is_fsdp_enabled", False) else self.model
        progress = exact.progress_bars(self.args.disable_tqdm or not self.is_world_process_zero())
        batch_size = self.args.constraint_eval_batch_size or self.args.per_device_eval_batch_size
        return exact.in_eval_mode(run, model, self.constraints, self.batches, batch_size=batch_size, progress=progress,
                                  context=self.compute_loss_context_manager, **kwargs)

    def constraint_row_values(self, model: Optional[nn.Module] = None, split: str = "certify") -> dict[str, Any]:
        """Per-row values of each certification statistic on its ``certify.dataset``, the only place
        those rows are read (:func:`hf_constrained.exact.certification_values`)."""
        if split != "certify":
            raise ValueError(f"constraint_row_values reads the certification split only ('certify'), got {split!r}")
        return self._exact_pass(exact.certification_values, model)

    def evaluate_constraints(self, model: Optional[nn.Module] = None, split: str = "eval") -> dict[str, float]:
        """Exact value of every constraint on its data (the ``value`` of :meth:`constraint_statistics`)."""
        return {name: stat.value for name, stat in self.constraint_statistics(model=model, split=split).items()}

    def constraint_metrics(self, values: dict[str, float], prefix: str = "eval") -> dict[str, float]:
        """``{prefix}_constraint/<name>``, the largest violation and whether all hold."""
        return exact.constraint_metrics(values, self.constraints, prefix)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Optional[list[str]] = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """The Trainer's evaluation plus the exact value of every constraint (a full pass). Without an objective
        ``eval_dataset`` only the constraints are evaluated, so periodic evaluation and feasible-checkpoint selection
        work on constraints alone (e.g. ``metric_for_best_model="constraint_max_violation"``). The returned metrics
        hold every constraint's value; the log entry only up to ``log_constraint_estimates_max`` of them."""
        values = self.evaluate_constraints() if self.constraints else {}
        if values:
            self.last_constraint_values = dict(values)
            self.last_constraint_values_step = self.state.global_step
        cmetrics = self.constraint_metrics(values, metric_key_prefix) if self.constraints else {}
        logged = exact.loggable(cmetrics, len(self.constraints), self.args.log_constraint_estimates_max)
        if eval_dataset is None and self.eval_dataset is None and self.constraints:
            self.log(logged)
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, cmetrics)
            return cmetrics
        self._eval_constraint_metrics = logged  # merged into the evaluation's log entry
        metrics = super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        self._eval_constraint_metrics = {}
        metrics.update(cmetrics)
        return metrics

    # ------------------------------------------------------------------ state and checkpoints
    def constraint_state_dict(self) -> dict[str, Any]:
        """What resumes the constraint part exactly: the engine's state and the step whose constraint part ran."""
        return {**constraint_state.engine_state_dict(self.engine), "constraint_step": self._constraint_step}

    def load_constraint_state_dict(self, state: dict[str, Any]) -> None:
        constraint_state.load_engine_state_dict(self.engine, state)
        self._constraint_step = state["constraint_step"]

    def save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """The Trainer's checkpoint save made complete-or-ignored (:func:`.constraint_state.save_complete_checkpoint`):
        the constraint state and completeness marker before the rotation of old checkpoints; a kill leaves the last
        complete one."""
        save_complete_checkpoint(self, lambda: super(ConstrainedTrainer, self).save_checkpoint(model, trial), trial,
                                 CONSTRAINT_STATE_NAME)

    def train(self, resume_from_checkpoint: Optional[Union[str, bool]] = None, *args: Any, **kwargs: Any) -> Any:
        resume_from_checkpoint = prepare_resume(self, resume_from_checkpoint, CONSTRAINT_STATE_NAME)
        if resume_from_checkpoint and finished_at(self, str(resume_from_checkpoint)):
            return TrainOutput(self.state.global_step, 0.0, {})
        if self.constraint_part_runs:
            self.preflight_constraints()
        if self.regularised is not None:
            self.regularised.bind(self.model, self._to_device, world=self.accelerator.num_processes,
                                  rank=self.accelerator.process_index)
        with best_checkpoint_restored(self, resume_from_checkpoint):  # trainer_state.json stores it without its path
            return super().train(resume_from_checkpoint, *args, **kwargs)


__all__ = ["CONSTRAINT_STATE_NAME", "ConstrainedTrainer", "ConstraintValueError"]
