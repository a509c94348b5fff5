"""``SafetyLoop``: the safety side of a run, a component the trainer holds (``trainer.safety``).

Is the fine-tuned model safe to publish? The loop answers it for the weights now in the model:
evaluation on held-out data, the certificate on the certification splits, the safety report, the
model card, the figures (:func:`~hf_constrained.safety.finish.finish_run`) and the gate in front
of every Hub push. It reads the run through one typed value,
:class:`~hf_constrained.safety.view.RunView` (constraints, arguments, the engine's settings), and
evaluates through the trainer's typed operations (:class:`~hf_constrained.safety.view.SafetyHost`);
it never reads the trainer's attributes by name.

It is driven as TRL drives extra behaviour, by a callback the trainer holds
(:class:`SafetyLoopCallback`: the start and end of training, every log entry) and by the Trainer
hooks the trainer overrides with one-line delegations, where no callback runs:

- ``is_new_best`` (the Trainer's best-checkpoint decision): ``load_best_model_at_end`` /
  ``save_strategy="best"`` pick the best ``metric_for_best_model`` among evaluations whose
  constraints all hold on the validation data (:mod:`hf_constrained.certification.selection`); with none feasible,
  the least-violating one, with a warning at the end of training;
- ``save_model``: every checkpoint and the final model get ``README.md`` (the model card) and, when the
  constraints were evaluated for those weights, ``safety_report.json``; ``create_model_card``: the
  constrained card instead of the generic one; ``save_state``: ``trainer_state.json`` without local paths;
- ``push_to_hub(..., allow_unsafe=False)``: refused, before a repository is created or anything uploaded,
  when the weights fail the safety rule (:meth:`SafetyLoop.gated_push`); with ``allow_unsafe=True`` it
  uploads and the card says UNSAFE at the top. Checkpoint pushes (``hub_strategy``, hook ``push_checkpoint``)
  judge the weight files of the pushed folder (:meth:`SafetyLoop.may_push_checkpoint`);
- with constraints the stock TensorBoard callback is replaced, in its place, by
  :class:`~hf_constrained.safety.tensorboard.ConstraintTensorBoardCallback` (constraint scalars grouped).

Without constraints every one of these is the Trainer's own behaviour (no card or report files, no deferred
repository).

A report is tied to the weights it describes by their fingerprint (:mod:`~hf_constrained.safety.model_fingerprint`):
when the weights change after it (more training, ``load_state_dict``, an edit), the cards say NOT CHECKED and
the gate evaluates them again before anything is published. The end of a run: :mod:`~hf_constrained.safety.run_end`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from transformers import TrainerCallback
from transformers.integrations import TensorBoardCallback

from ..certification.certify import Certificate
from ..certification.fingerprint import weights_files_fingerprint
from ..certification.selection import (
    EvaluationRecord,
    FeasibleSelection,
    constraint_feasibility,
    evaluation_records,
    is_better,
    metric_key,
    select_best,
    summarize_selection,
)
from ..checkpointing import TRAINER_STATE_NAME
from ..publishable import publish_trainer_state
from ..publishing.card import ModelCardInfo, describe_model, render_model_card, write_model_card
from ..publishing.push import check_hub_for_deferred_push
from ..publishing.report import (
    EVAL_CONSTRAINT_PREFIX,
    SafetyReport,
    UnsafeModelError,
)
from ..publishing.verify import EXIT_STALE_OR_UNREADABLE, check_run_dir
from ..trainer_internals import trainer_load_checkpoint
from .evaluation import (
    ReportRequest,
    RunContext,
    certify_run,
    checkpoint_report,
    evaluate_report,
    metrics_report,
    relative_checkpoint,
)
from .model_fingerprint import weights_fingerprint
from .run_end import RunEnd
from .saved_weights import SavedWeightFiles
from .settings import CertificateSettings
from .tensorboard import ConstraintTensorBoardCallback
from .view import RunView, SafetyHost

logger = logging.getLogger(__name__)

HUB_OWNER_PLACEHOLDER = "your-username"  # the owner in a card's repo id when the run named none


@dataclass
class WeightsEvaluation:
    """An exact evaluation of the weights in the model: the metrics it logged, the step it
    is valid at, where the weights come from, and their fingerprint when evaluated."""

    valid_at: int  # the trainer's global step when it describes the model's weights
    metrics: dict[str, Any]
    weights_step: int  # the step the weights were trained to
    checkpoint: Optional[str]  # the checkpoint they were loaded from (load_best_model_at_end)
    fingerprint: str


class SafetyLoop(RunEnd):
    """The safety side of one run: reports, certificates, cards and the gate, for the weights in the model.

    Built by the trainer (``trainer.safety``); users call :meth:`check_safe_to_push`,
    :meth:`build_report`, :meth:`current_report`, :meth:`finish` (``finish_run``) and :meth:`configure`, which
    changes the certificate's settings (:attr:`settings`, a
    :class:`~hf_constrained.safety.settings.CertificateSettings`). The trainer's ``push_to_hub``,
    ``save_model``, ``create_model_card`` and ``push_checkpoint`` go through it.

    Args:
        host: the trainer's operations (:class:`~hf_constrained.safety.view.SafetyHost`).
        view: the run (:class:`~hf_constrained.safety.view.RunView`).
        model_card_info: :class:`~hf_constrained.publishing.card.ModelCardInfo` (base model, data, reproduce
            command) for the cards; the base model defaults to the model's ``config._name_or_path``.
        reference_constraint_values: the old model's held-out constraint values (name -> value), shown next
            to the new model's in reports and cards.
        settings: the certificate's settings (default: :class:`~hf_constrained.safety.settings.CertificateSettings`
            with its defaults; ``model_card_info``, when given, is their card).
    """

    def __init__(self, host: SafetyHost, view: RunView, *, model_card_info: Optional[ModelCardInfo] = None,
                 reference_constraint_values: Optional[Mapping[str, float]] = None,
                 settings: Optional[CertificateSettings] = None) -> None:
        self.host, self.view = host, view
        settings = settings or CertificateSettings()
        card = model_card_info or settings.card
        if card.base_model is None:
            config = getattr(host.model, "config", None)  # a transformers model's; a plain module has none
            card = dataclasses.replace(card, base_model=getattr(config, "_name_or_path", None) or None)
        # what the certificate claims and what the end of the run writes: replaced (configure, finish), never edited
        self.settings: CertificateSettings = dataclasses.replace(settings, card=card)
        self.reference_values: Optional[dict[str, float]] = (
            None if reference_constraint_values is None
            else {k: float(v) for k, v in reference_constraint_values.items()})
        self.report: Optional[SafetyReport] = None  # the last report recorded (see current_report)
        self._weights_eval: Optional[WeightsEvaluation] = None  # the last exact evaluation of the model
        self._declared_origin: Optional[tuple[int, Optional[str]]] = None
        self._stale_note = ""  # why the last report no longer describes the weights
        self._saved = SavedWeightFiles()  # the weight files this trainer saved, and which weights they hold
        self._push_allow_unsafe = False

    # ------------------------------------------------------------------ the certificate's settings
    def configure(self, **changes: Any) -> CertificateSettings:
        """Change the loop's settings (:meth:`CertificateSettings.changed
        <hf_constrained.safety.settings.CertificateSettings.changed>`: ``delta``, ``safety_rule``, ``candidates``,
        ``confidence``, ``plots`` and the card's information), checked; returns the new settings."""
        self.settings = self.settings.changed(self.view.output_dir, **changes)
        return self.settings

    @property
    def rule(self) -> str:
        """What decides the verdict (``settings.safety_rule``): ``"certified"``, ``"point"`` or ``"upper_bound"``."""
        return self.settings.safety_rule

    @property
    def confidence(self) -> float:  # of the CLT bounds shown beside the values
        return self.settings.confidence

    @property
    def delta(self) -> float:  # the certificate's error level
        return self.settings.delta

    @property
    def active(self) -> bool:
        """Whether the run has constraints: without, every hook is the Trainer's own behaviour."""
        return bool(self.view.constraints)

    # ------------------------------------------------------------------ callbacks
    def attach(self, callback_handler: Any, *, push_to_hub: bool = False) -> None:
        """Put the loop's callbacks into the trainer's ``callback_handler``: the grouping TensorBoard callback
        in the stock one's place and :class:`SafetyLoopCallback` last; with ``push_to_hub`` (whose repository the
        first push through the gate creates), check the Hub access now (:meth:`check_hub_access`). Without
        constraints, nothing."""
        if not self.active:
            return
        if push_to_hub:
            self.check_hub_access(self.view.args.hub_token)
        callbacks = callback_handler.callbacks
        for i, cb in enumerate(callbacks):
            if type(cb) is TensorBoardCallback:
                callbacks[i] = ConstraintTensorBoardCallback(self.view.names, tb_writer=cb.tb_writer)
        callback_handler.add_callback(SafetyLoopCallback(self))

    def train_begins(self) -> None:
        """A new ``train`` call: the last report describes the weights before it."""
        self.report = None
        self._declared_origin = None

    def train_ended(self) -> None:
        """After training (and after ``load_best_model_at_end`` loaded the best checkpoint): the weights'
        evaluation is the best checkpoint's, from the log history; the selection's outcome is logged."""
        state = self.host.state
        best = state.best_model_checkpoint
        if self.view.args.load_best_model_at_end and best is not None and state.best_global_step:
            merged: dict[str, Any] = {}
            for entry in state.log_history:
                if entry.get("step") == state.best_global_step and any(k.startswith("eval_") for k in entry):
                    merged.update(entry)
            self._weights_eval = None
            if merged:
                self._weights_eval = WeightsEvaluation(state.global_step, merged, state.best_global_step, best,
                                                       self.weights_fingerprint())
        selection = self.feasible_selection()
        if selection is not None and selection.num_evaluations:
            (logger.info if selection.any_feasible else logger.warning)(
                "Feasible-checkpoint selection: %s", selection.message())

    # ------------------------------------------------------------------ feasible-checkpoint selection
    def is_new_best(self, metrics: dict[str, float]) -> Optional[bool]:
        """Whether ``metrics`` make the current weights the best so far: the best objective among feasible
        evaluations (lexicographic order of :mod:`hf_constrained.certification.selection`), updating the Trainer's
        state; ``None`` (the Trainer's stock rule decides) when no constraint was evaluated or without
        ``metric_for_best_model``."""
        state, args = self.host.state, self.view.args
        step = state.global_step
        # evaluate() has just logged (and fingerprinted) these weights: no second hash
        record = self._weights_eval
        self.record_evaluation(metrics, record.fingerprint if record is not None and record.valid_at == step else None)
        feasibility = constraint_feasibility(metrics)
        if args.metric_for_best_model is None or feasibility is None:
            return None
        key = metric_key(args.metric_for_best_model)
        if key not in metrics:
            raise KeyError(f"metric_for_best_model is '{key}', which is not in the evaluation metrics "
                           f"{sorted(metrics)}")
        current = EvaluationRecord(step, float(metrics[key]), feasibility[0], feasibility[1])
        # the incumbent, recomputed from the log history so it survives a resume
        earlier = [r for r in evaluation_records(state.log_history, key) if r.step != step]
        incumbent = select_best(earlier, bool(args.greater_is_better))
        if not current.feasible:
            logger.info("step %d: constraints violated on validation data (largest violation %.6g): "
                        "not eligible as the feasible best checkpoint", step, current.max_violation)
        if not is_better(current, incumbent, bool(args.greater_is_better)):
            return False
        state.best_metric = current.metric
        if args.save_strategy in ("steps", "epoch", "best"):
            state.best_global_step = step
        return True

    def feasible_selection(self) -> Optional[FeasibleSelection]:
        """Feasible-checkpoint selection over this run's evaluations (``None`` without constraints or
        ``metric_for_best_model``)."""
        args = self.view.args
        if args.metric_for_best_model is None or not self.active:
            return None
        state = self.host.state
        return summarize_selection(state.log_history, args.metric_for_best_model, bool(args.greater_is_better),
                                   relative_checkpoint(self.view.output_dir, state.best_model_checkpoint))

    # ------------------------------------------------------------------ trainer_state.json without local paths
    def publish_trainer_state(self) -> None:
        """The output directory's ``trainer_state.json`` (``Trainer.save_state``) without local paths
        (:func:`~hf_constrained.publishable.publish_trainer_state`)."""
        path = os.path.join(self.view.output_dir, TRAINER_STATE_NAME)
        if self.host.is_world_process_zero() and os.path.isfile(path):
            publish_trainer_state(path, self.view.output_dir)

    def publish_checkpoint_state(self, checkpoint_folder: str) -> None:
        """A checkpoint's ``trainer_state.json`` without local paths (called by the checkpoint save before the
        checkpoint is marked complete)."""
        path = os.path.join(checkpoint_folder, TRAINER_STATE_NAME)
        if self.view.args.should_save and os.path.isfile(path):
            publish_trainer_state(path, self.view.output_dir)

    # ------------------------------------------------------------------ which weights were evaluated
    def weights_fingerprint(self) -> str:
        """:func:`~hf_constrained.safety.model_fingerprint.weights_fingerprint` of the model now in the trainer."""
        return weights_fingerprint(self.host.model)

    def record_evaluation(self, metrics: Mapping[str, Any], fingerprint: Optional[str] = None) -> None:
        """Keep an exact evaluation of every constraint (``eval_constraint/<name>``) as the
        evaluation of the weights now in the model, with their fingerprint (computed unless given)."""
        if not self.active or any(EVAL_CONSTRAINT_PREFIX + name not in metrics for name in self.view.names):
            return
        step = self.host.state.global_step
        fingerprint = fingerprint or self.weights_fingerprint()
        previous = self._weights_eval
        if previous is not None and previous.valid_at == step and previous.fingerprint == fingerprint:
            previous.metrics.update(metrics)  # another entry of the same evaluation
            return
        self._weights_eval = WeightsEvaluation(step, dict(metrics), step, None, fingerprint)

    def declare_weights_origin(self, step: int, checkpoint: Optional[str] = None) -> None:
        """The weights now in the model come from ``step`` (and ``checkpoint``), put there by a selection
        outside the Trainer's (e.g. a callback that kept a step's weights in memory); reports name that
        step until the next ``train``."""
        self._declared_origin = (step, checkpoint)

    def weights_origin(self) -> Optional[tuple[int, Optional[str]]]:
        """(step, checkpoint) the weights now in the model were loaded from: declared
        (:meth:`declare_weights_origin`), or put there by ``load_best_model_at_end``; else ``None``."""
        if self._declared_origin is not None:
            return self._declared_origin
        record = self._weights_eval
        if record is None or record.valid_at != self.host.state.global_step or record.checkpoint is None:
            return None
        return record.weights_step, record.checkpoint

    # ------------------------------------------------------------------ reports
    def report_from_metrics(self, metrics: Mapping[str, Any], *, step: Optional[int] = None,
                            checkpoint: Optional[str] = None, fingerprint: Optional[str] = None
                            ) -> Optional[SafetyReport]:
        """A report from the metrics of an evaluation that already ran (no extra pass), under :attr:`rule`."""
        return metrics_report(self.view, self.host, metrics, reference_values=self.reference_values,
                              safety_rule=self.rule, step=step, checkpoint=checkpoint, fingerprint=fingerprint)

    def current_report(self) -> Optional[SafetyReport]:
        """The report of the weights now in the trainer, without a new evaluation pass: the
        last report recorded, or the last exact evaluation, if its weights fingerprint is the
        current weights'; ``None`` when these weights were not evaluated on held-out data
        (never evaluated, or changed since)."""
        self._stale_note = ""
        candidates = []
        if self.report is not None:
            candidates.append(self.report)
        record = self._weights_eval
        # an evaluation logged at an earlier step is of earlier weights (training moved on): not a candidate
        if record is not None and record.valid_at == self.host.state.global_step:
            from_metrics = self.report_from_metrics(record.metrics, step=record.weights_step,
                                                    checkpoint=record.checkpoint, fingerprint=record.fingerprint)
            if from_metrics is not None:
                candidates.append(from_metrics)
        if not candidates:
            return None
        current = self.weights_fingerprint()
        for report in candidates:
            if report.weights_fingerprint == current:
                return report if report.safety_rule == self.rule else report.with_rule(self.rule)
        self._stale_note = (f"the weights changed after the last safety report (step {candidates[0].global_step}, "
                            f"weights {candidates[0].weights_fingerprint}; now {current})")
        logger.warning("%s: it no longer describes the model", self._stale_note)
        return None

    def new_report(self, **request: Any) -> SafetyReport:
        """Evaluate the weights now in the model on held-out data and build their report, under the loop's
        rule, confidence and delta unless given (the fields of
        :class:`~hf_constrained.safety.evaluation.ReportRequest`: ``old_model``, ``old_model_values``,
        ``objective_metrics``, ``extra_columns``, ...). Not recorded."""
        request = {"confidence": self.confidence, "safety_rule": self.rule, "delta": self.delta, **request}
        context = RunContext(reference_values=self.reference_values, selection=self.feasible_selection(),
                             weights_origin=self.weights_origin())
        return evaluate_report(self.view, self.host, ReportRequest(**request), context)

    def build_report(self, checkpoint: Optional[str] = None, **kwargs: Any) -> SafetyReport:
        """Evaluate the current weights (or a saved ``checkpoint``, written into it) on held-out data.

        Keyword arguments as :meth:`new_report`'s. The report of the current weights is recorded
        (:attr:`report`, used by cards and the push gate).
        """
        if checkpoint is not None:
            kwargs.setdefault("confidence", self.confidence)
            kwargs.setdefault("safety_rule", self.rule)
            kwargs.setdefault("delta", self.delta)
            return self.checkpoint_report(checkpoint, **kwargs)
        self.set_report(self.new_report(**kwargs))
        return self.report

    def certify(self, models: Iterable[Any] = (None,), *, delta: Optional[float] = None,
                procedure: str = "fixed_sequence",
                fingerprints: Optional[Sequence[Optional[str]]] = None) -> Optional[Certificate]:
        """Certify candidate models (``None``: the model in the trainer) on the certification splits, one look
        in the run's ledger (:func:`~hf_constrained.safety.evaluation.certify_run`, with its ``fingerprints``:
        the models' weights fingerprints where the caller has them); ``delta`` defaults to :attr:`delta`."""
        return certify_run(self.view, self.host, models, delta=self.delta if delta is None else delta,
                           procedure=procedure, fingerprints=fingerprints)

    def checkpoint_report(self, checkpoint: str, *, save: bool = True, **kwargs: Any) -> SafetyReport:
        """The report of a saved checkpoint, leaving the trainer's model untouched: its weights are
        loaded into a copy of the model (:meth:`checkpoint_model`) and evaluated exactly on held-out data.
        With ``save`` the report is written into the checkpoint directory."""
        if not os.path.isdir(checkpoint):
            raise FileNotFoundError(f"checkpoint directory {checkpoint} does not exist")
        files_before = weights_files_fingerprint(checkpoint)
        model = self.checkpoint_model(checkpoint)
        report = checkpoint_report(self.view, self.host, checkpoint, model, reference_values=self.reference_values,
                                   **kwargs)
        # the report names the files it evaluated, unless they changed while it was evaluated
        report.weights_files_fingerprint = (files_before if files_before is not None
                                            and weights_files_fingerprint(checkpoint) == files_before else None)
        if save and self.host.is_world_process_zero():
            report.save(checkpoint)
        return report

    def checkpoint_model(self, checkpoint: str) -> Any:
        """A copy of the model with the weights of a saved ``checkpoint`` (the Trainer's loader, which
        knows every format: safetensors, sharded, adapters, FSDP); the trainer's model is left alone."""
        if not os.path.isdir(checkpoint):
            raise FileNotFoundError(f"checkpoint directory {checkpoint} does not exist")
        model = copy.deepcopy(self.host.accelerator.unwrap_model(self.host.model))
        trainer_load_checkpoint(self.host, checkpoint, model)
        return model

    def set_report(self, report: SafetyReport) -> None:
        """Record ``report`` as the report of the weights now in the model (until they change:
        it is used while its ``weights_fingerprint`` is the current weights')."""
        if report.weights_fingerprint is None:
            report.weights_fingerprint = self.weights_fingerprint()
        self.report = report

    # ------------------------------------------------------------------ cards and report files
    def write_model_card(self, directory: Optional[str] = None, report: Optional[SafetyReport] = None, *,
                         model_name: Optional[str] = None, card: Optional[ModelCardInfo] = None) -> Optional[str]:
        """Render the card for ``report`` (default: :meth:`current_report`) into ``directory/README.md`` and, with a
        report, ``safety_report.json`` next to it. ``card``: what the card says of the model and its data, for this
        card (default: the settings' card, :attr:`settings`); ``model_name``: default, the output folder's name."""
        if not self.host.is_world_process_zero() or not self.active:
            return None
        args = self.view.args
        directory = directory or args.output_dir
        report = report if report is not None else self.current_report()
        name = model_name or os.path.basename(os.path.normpath(args.output_dir))
        model = self.host.accelerator.unwrap_model(self.host.model)
        repo_id = self.host.hub_model_id or args.hub_model_id or name
        if "/" not in repo_id:  # the Hub adds the owner; the card's snippet needs it written out
            repo_id = f"{HUB_OWNER_PLACEHOLDER}/{repo_id}"
        source = describe_model(model, self.host.processing_class, directory)
        text = render_model_card(report, model_name=name, method=self.view.method_settings(),
                                 info=card or self.settings.card, allow_unsafe=self._push_allow_unsafe, source=source,
                                 repo_id=repo_id)
        if report is not None:
            self.save_report(report, directory)
        return write_model_card(directory, text)

    def create_model_card(self, language: Optional[str] = None, license: Optional[str] = None, tags: Any = None,
                          model_name: Optional[str] = None, finetuned_from: Optional[str] = None,
                          tasks: Any = None, dataset_tags: Any = None, dataset: Any = None,
                          dataset_args: Any = None) -> None:
        """``Trainer.create_model_card`` with the constrained card (verdict, constraint table, model-index,
        usage, method, citation) in ``output_dir/README.md`` (:meth:`write_model_card`): its arguments override
        the settings' card for this card (``finetuned_from``: the base model; ``dataset`` / ``dataset_tags``: the
        datasets; ``tasks``: the model-index task)."""
        if dataset_args is not None:
            logger.warning("create_model_card: dataset_args=%r is not used by the constrained card", dataset_args)
        card = self.settings.card.with_trainer_card_arguments(
            language=language, license=license, tags=tags, finetuned_from=finetuned_from, tasks=tasks,
            dataset_tags=dataset_tags, dataset=dataset)
        self.write_model_card(self.view.output_dir, model_name=model_name, card=card)

    def save_report(self, report: SafetyReport, directory: str, files_fingerprint: Optional[str] = None) -> str:
        """Write ``report`` into ``directory/safety_report.json``, naming the weight files there
        (``weights_files_fingerprint``) only when they hold the weights it describes: files this
        trainer saved from those weights and unchanged since, or ``files_fingerprint`` when the
        caller knows them (the report keeps the value of its last save). Returns the path."""
        if files_fingerprint is None:
            files_fingerprint = self._saved.files_fingerprint(directory, report.weights_fingerprint)
        report.weights_files_fingerprint = files_fingerprint
        return report.save(directory)

    def model_saved(self, directory: str) -> None:
        """After the trainer's ``save_model`` wrote weights into ``directory``: which weights they are
        (a report written next to them names them, ``hf-constrained report --check`` compares them), and
        the model card (with the report) beside them. Without constraints, nothing."""
        if not self.view.args.should_save or not self.active:
            return
        self._saved.record(directory, self.weights_fingerprint)
        self.write_model_card(directory)

    # ------------------------------------------------------------------ the gate
    @contextlib.contextmanager
    def gated_push(self, allow_unsafe: bool = False, safety_rule: Optional[str] = None) -> Iterator[None]:
        """Around the Trainer's ``push_to_hub``: :meth:`check_safe_to_push` first (raising
        :class:`~hf_constrained.publishing.report.UnsafeModelError` before any repository is created or file
        uploaded), and the cards the push writes say UNSAFE when ``allow_unsafe`` let a failing model through."""
        self.check_safe_to_push(allow_unsafe=allow_unsafe, safety_rule=safety_rule)
        self._push_allow_unsafe = allow_unsafe
        try:
            yield
        finally:
            self._push_allow_unsafe = False

    def check_safe_to_push(self, allow_unsafe: bool = False, safety_rule: Optional[str] = None
                           ) -> Optional[SafetyReport]:
        """The gate of ``push_to_hub``, uploading nothing: the safety report of the
        current weights (built if needed), or :class:`~hf_constrained.publishing.report.UnsafeModelError`
        when a constraint fails on held-out data under ``safety_rule`` (``"certified"``, ``"point"`` or
        ``"upper_bound"``; default :attr:`rule`, which a given ``safety_rule`` replaces) and ``allow_unsafe``
        is false (the local card and report are then updated with the verdict)."""
        if not self.active:
            return None
        if safety_rule is not None:
            self.configure(safety_rule=safety_rule)
        report = self.current_report()
        if report is not None and self.rule == "upper_bound" and report.without_bound:
            report = None  # the bounds decide: evaluate again with the per-row statistics
        if report is not None and self.rule == "certified" and report.certificate is None and self.view.certifiable():
            report = None  # an evaluation during training has no certificate: certify these weights now
        note = ""
        if report is None:
            # never evaluated, or the weights changed since: evaluate these weights now
            if self._stale_note:
                note = f"The constraints were evaluated again because {self._stale_note}. "
                logger.warning("%s", note)
            report = self.build_report()
        self.set_report(report)
        args = self.view.args
        if not report.all_satisfied and not allow_unsafe:
            if args.should_save and os.path.isdir(args.output_dir):
                self.write_model_card(args.output_dir, report)  # local files only: the verdict
            raise UnsafeModelError(
                f"push_to_hub refused, nothing was uploaded. {note}{report.summary()}.\n{report.format_table()}\n"
                "Retrain (e.g. a larger penalty_beta, load_best_model_at_end with metric_for_best_model) or pass "
                "push_to_hub(..., allow_unsafe=True) to publish anyway with an UNSAFE model card."
            )
        if not report.all_satisfied:
            logger.warning("push_to_hub with allow_unsafe=True: %s", report.summary())
        return report

    def may_push_checkpoint(self, checkpoint_folder: str) -> bool:
        """Whether a checkpoint push (``hub_strategy``) of ``checkpoint_folder`` may go ahead: only when its own
        weight FILES are known to satisfy the constraints (always, without constraints).

        The decision is about the weights in the folder (what is uploaded), never the weights in memory: the
        report of the current weights is used when this trainer saved exactly these files from them; else the
        folder's own ``safety_report.json`` when it is intact and names these files; else, outside training and
        on one process, the folder is evaluated on held-out data now (during training it is not pushed). When
        it passes, the pushed output directory gets that report and its card.
        """
        if not self.active:
            return True
        report, files = self._checkpoint_folder_report(checkpoint_folder)
        if report is None or not report.all_satisfied:
            why = "not evaluated on held-out data" if report is None else report.summary()
            logger.warning("not pushing %s to the Hub: %s", checkpoint_folder, why)
            return False
        if self.host.is_world_process_zero():
            # the pushed folder's card and report: these weights (the push copies the files over)
            self.write_model_card(self.view.output_dir, report)
            self.save_report(report, self.view.output_dir, files_fingerprint=files)
        return True

    def _checkpoint_folder_report(self, folder: str) -> tuple[Optional[SafetyReport], Optional[str]]:
        """The report of the weight files in ``folder`` under :attr:`rule`, and their
        fingerprint; ``(None, ...)`` when the folder holds no readable weights."""
        try:
            files = weights_files_fingerprint(folder)
        except (OSError, ValueError) as exc:
            logger.warning("the weight files in %s cannot be read: %s", folder, exc)
            return None, None
        if files is None:
            logger.warning("%s holds no weight files", folder)
            return None, None
        saved_from = self._saved.weights_of(folder, files)
        if saved_from is not None:
            current = self.current_report()  # these files were saved from the weights it describes?
            if current is not None and current.weights_fingerprint == saved_from:
                return current, files
        check = check_run_dir(folder)  # the folder's own report, if intact and naming these files
        if check.exit_code != EXIT_STALE_OR_UNREADABLE and check.report is not None:
            return check.report.with_rule(self.rule), files
        if self.host.is_in_train or self.host.accelerator.num_processes > 1:
            # during training (a second copy of the model could exhaust memory) and on several
            # processes (an evaluation is collective, the push is rank 0's): not evaluated, not pushed
            logger.info("%s: %s", folder, check.message)
            return None, files
        logger.info("evaluating the weights in %s before pushing them (%s)", folder, check.message)
        report = self.checkpoint_report(folder, confidence=self.confidence, safety_rule=self.rule)
        if report.weights_files_fingerprint != files:
            logger.warning("the weight files in %s changed while they were evaluated", folder)
            return None, files
        return report, files

    def check_hub_access(self, token: Optional[str] = None) -> None:
        """With ``push_to_hub=True`` the first push through the gate creates the repository: fail now, when the
        trainer is built, if the Hub cannot be reached or refuses the token
        (:func:`~hf_constrained.publishing.push.check_hub_for_deferred_push`)."""
        check_hub_for_deferred_push(token or self.view.args.hub_token)
        logger.info("push_to_hub: the Hub repository will be created when the safety gate first passes")

class SafetyLoopCallback(TrainerCallback):
    """Drives a :class:`SafetyLoop` from the Trainer's events: a new training forgets the last report, every
    log entry with all exact constraint values is the evaluation of the weights in the model, and the end of
    training records the best checkpoint's evaluation and logs the feasible-checkpoint selection."""

    def __init__(self, loop: SafetyLoop) -> None:
        self.loop = loop

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.loop.train_begins()

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[dict[str, float]] = None,
               **kwargs: Any) -> None:
        if logs:
            self.loop.record_evaluation(logs)  # evaluate() outside training logs here too

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.loop.train_ended()


__all__ = ["HUB_OWNER_PLACEHOLDER", "SafetyLoop", "SafetyLoopCallback"]
