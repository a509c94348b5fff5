"""``SafetyMixin``: the Trainer side of the safety loop (selection, cards, gated push).

Mixed into :class:`~hf_constrained.ConstrainedTrainer` (``class ConstrainedTrainer(SafetyMixin,
TrainerInternals)``), before :class:`~hf_constrained.trainer_internals.TrainerInternals`, whose
public hooks it extends (the private ``Trainer`` members behind them are used there only):

- ``is_new_best`` (the Trainer's best-checkpoint decision): ``load_best_model_at_end`` /
  ``save_strategy="best"`` pick the best ``metric_for_best_model`` among evaluations whose
  constraints all hold on the validation data (:mod:`hf_constrained.safety.selection`); with none feasible, the
  least-violating one, with a warning at the end of training;
- ``save_model``: every checkpoint and the final model get ``README.md`` (the model
  card) and, when the constraints were evaluated for those weights,
  ``safety_report.json``;
- ``create_model_card``: the constrained card instead of the generic one;
- ``push_to_hub(..., allow_unsafe=False)``: refuses, before creating a repository or
  uploading anything, when a constraint fails on held-out data; with
  ``allow_unsafe=True`` it uploads and the card says UNSAFE at the top. Checkpoint pushes
  (``hub_strategy``, hook ``push_checkpoint``) judge the weight files of the pushed folder,
  and are skipped when those are infeasible or were not evaluated;
- with constraints, the stock TensorBoard callback is replaced by
  :class:`~hf_constrained.safety.tensorboard.ConstraintTensorBoardCallback` (constraint scalars grouped).

Without constraints every one of these is the Trainer's own behaviour: no card or report
files, no deferred repository, the Trainer's callbacks.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from transformers.integrations import TensorBoardCallback

from ..publishable import publish_trainer_state
from ..trainer_internals import trainer_load_checkpoint
from .card import ModelCardInfo, describe_model, render_model_card, write_model_card
from .certify import DEFAULT_DELTA
from .evaluation import (
    DEFAULT_CONFIDENCE,
    build_safety_report,
    checkpoint_safety_report,
    method_settings,
    relative_checkpoint,
    report_from_metrics,
)
from .fingerprint import weight_files, weights_files_fingerprint, weights_fingerprint
from .report import DEFAULT_SAFETY_RULE, EVAL_CONSTRAINT_PREFIX, SafetyReport, UnsafeModelError, check_safety_rule
from .selection import (
    EvaluationRecord,
    FeasibleSelection,
    constraint_feasibility,
    evaluation_records,
    is_better,
    metric_key,
    select_best,
    summarize_selection,
)
from .tensorboard import ConstraintTensorBoardCallback
from .trainer_state import TRAINER_STATE_NAME, best_checkpoint_restored
from .verify import EXIT_STALE_OR_UNREADABLE, check_run_dir

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


@dataclass
class SavedWeights:
    """Weights this trainer saved into a folder: the fingerprint of the weights in memory then,
    of the files written, and the files' (name, size, mtime) to notice a later change."""

    weights_fingerprint: str
    files_fingerprint: str
    signature: tuple


def _files_signature(folder: str) -> tuple:
    signature = []
    for name in weight_files(folder):
        stat = os.stat(os.path.join(folder, name))
        signature.append((name, stat.st_size, stat.st_mtime_ns))
    return tuple(signature)


class SafetyMixin:
    """Safety report, feasible-checkpoint selection, model cards and a gated ``push_to_hub``.

    Extra keyword arguments of the trainer:
        model_card_info: :class:`~hf_constrained.safety.card.ModelCardInfo` (base model,
            data, reproduce command) for the cards.
        reference_constraint_values: the old model's held-out constraint values
            (name -> value), shown next to the new model's in reports and cards.

    A report is tied to the weights it describes by their
    :func:`~hf_constrained.safety.fingerprint.weights_fingerprint`: when the weights change
    after it (more training, ``load_state_dict``, an edit), the cards say NOT CHECKED and
    the gate evaluates them again before anything is published. With ``push_to_hub=True``
    in the arguments the Hub repository is created only when the gate first passes (the
    Trainer would create it when it is built).
    """

    def __init__(self, *args: Any, model_card_info: Optional[ModelCardInfo] = None,
                 reference_constraint_values: Optional[Mapping[str, float]] = None, **kwargs: Any) -> None:
        self._defer_hub_repo = True  # Trainer.__init__ calls init_hf_repo: not before the gate
        try:
            super().__init__(*args, **kwargs)
        finally:
            self._defer_hub_repo = False
        self.model_card_info: ModelCardInfo = model_card_info or ModelCardInfo()
        if self.model_card_info.base_model is None:
            config = getattr(getattr(self, "model", None), "config", None)
            name = getattr(config, "_name_or_path", None)
            self.model_card_info.base_model = name or None
        self.reference_constraint_values: Optional[dict[str, float]] = (
            None if reference_constraint_values is None
            else {k: float(v) for k, v in reference_constraint_values.items()}
        )
        self.safety_report: Optional[SafetyReport] = None  # the last report built (see current_safety_report)
        self._weights_eval: Optional[WeightsEvaluation] = None  # the last exact evaluation of the model
        self._stale_note = ""  # why the last report no longer describes the weights
        self._saved_weights: dict[str, SavedWeights] = {}  # folder (real path) -> the weights saved there
        self._push_allow_unsafe = False
        # what decides the verdict ("certified", or the uncertified "point" / "upper_bound"), the CLT bounds'
        # level and the certificate's delta; finish_run sets them
        self.safety_rule = DEFAULT_SAFETY_RULE
        self.safety_confidence = DEFAULT_CONFIDENCE
        self.safety_delta = DEFAULT_DELTA
        self._group_constraint_tensorboard()

    # ------------------------------------------------------------------ TensorBoard
    def _group_constraint_tensorboard(self) -> None:
        """With constraints, the stock TensorBoard callback gives way, in its place in the
        callback order, to the grouping one; without, the Trainer's callbacks stay as they are."""
        names = [c.name for c in getattr(self, "constraints", None) or []]
        if not names:
            return
        callbacks = self.callback_handler.callbacks
        for i, cb in enumerate(callbacks):
            if type(cb) is TensorBoardCallback:
                callbacks[i] = ConstraintTensorBoardCallback(names, tb_writer=cb.tb_writer)

    # ------------------------------------------------------------------ feasible-checkpoint selection
    def is_new_best(self, metrics: dict[str, float], trial: Any) -> bool:
        """Best objective among feasible evaluations (lexicographic order of
        :mod:`hf_constrained.safety.selection`); the stock rule when no constraint was evaluated."""
        step = self.state.global_step
        # evaluate() has just logged (and fingerprinted) these weights: no second hash
        record = self._weights_eval
        self._record_evaluation(metrics, record.fingerprint if record is not None and record.valid_at == step else None)
        feasibility = constraint_feasibility(metrics)
        if self.args.metric_for_best_model is None or feasibility is None:
            return super().is_new_best(metrics, trial)
        key = metric_key(self.args.metric_for_best_model)
        if key not in metrics:
            raise KeyError(
                f"metric_for_best_model is '{key}', which is not in the evaluation metrics {sorted(metrics)}"
            )
        current = EvaluationRecord(step, float(metrics[key]), feasibility[0], feasibility[1])
        # the incumbent, recomputed from the log history so it survives a resume
        earlier = [r for r in evaluation_records(self.state.log_history, key) if r.step != step]
        incumbent = select_best(earlier, bool(self.args.greater_is_better))
        if not current.feasible:
            logger.info("step %d: constraints violated on validation data (largest violation %.6g): "
                        "not eligible as the feasible best checkpoint", step, current.max_violation)
        if not is_better(current, incumbent, bool(self.args.greater_is_better)):
            return False
        self.state.best_metric = current.metric
        if self.args.save_strategy in ("steps", "epoch", "best"):
            self.state.best_global_step = step
        return True

    def feasible_selection(self) -> Optional[FeasibleSelection]:
        """Feasible-checkpoint selection over this run's evaluations (``None`` without
        ``metric_for_best_model``)."""
        if self.args.metric_for_best_model is None or not getattr(self, "constraints", None):
            return None
        return summarize_selection(self.state.log_history, self.args.metric_for_best_model,
                                   bool(self.args.greater_is_better),
                                   relative_checkpoint(self, self.state.best_model_checkpoint))

    def train(self, *args: Any, **kwargs: Any) -> Any:
        self.safety_report = None
        resume = args[0] if args else kwargs.get("resume_from_checkpoint")
        with best_checkpoint_restored(self, resume):  # trainer_state.json stores it without its local part
            result = super().train(*args, **kwargs)
        best = self.state.best_model_checkpoint
        if self.args.load_best_model_at_end and best is not None and self.state.best_global_step:
            # the weights are now the best checkpoint's, whose evaluation is in the log history
            merged: dict[str, Any] = {}
            for entry in self.state.log_history:
                if entry.get("step") == self.state.best_global_step and any(k.startswith("eval_") for k in entry):
                    merged.update(entry)
            self._weights_eval = None
            if merged:
                self._weights_eval = WeightsEvaluation(self.state.global_step, merged, self.state.best_global_step,
                                                       best, self.current_weights_fingerprint())
        selection = self.feasible_selection()
        if selection is not None and selection.num_evaluations:
            if selection.any_feasible:
                logger.info("Feasible-checkpoint selection: %s", selection.message())
            else:
                logger.warning("Feasible-checkpoint selection: %s", selection.message())
        return result

    # ------------------------------------------------------------------ trainer_state.json without local paths
    def save_state(self) -> None:
        """``Trainer.save_state``, with the best checkpoint's path stored without its local part
        (see :func:`~hf_constrained.publishable.publish_trainer_state`)."""
        super().save_state()
        path = os.path.join(self.args.output_dir, TRAINER_STATE_NAME)
        if self.is_world_process_zero() and os.path.isfile(path):
            publish_trainer_state(path, self.args.output_dir)

    def publish_checkpoint_state(self, checkpoint_folder: str) -> None:
        """The checkpoint's ``trainer_state.json`` without local paths (called by the checkpoint
        save before the checkpoint is marked complete)."""
        path = os.path.join(checkpoint_folder, TRAINER_STATE_NAME)
        if self.args.should_save and os.path.isfile(path):
            publish_trainer_state(path, self.args.output_dir)

    # ------------------------------------------------------------------ which weights were evaluated
    def current_weights_fingerprint(self) -> str:
        """:func:`~hf_constrained.safety.fingerprint.weights_fingerprint` of the model now in the trainer."""
        return weights_fingerprint(self.model)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        super().log(logs, *args, **kwargs)
        self._record_evaluation(logs)  # evaluate() outside training logs here too

    def _record_evaluation(self, metrics: Mapping[str, Any], fingerprint: Optional[str] = None) -> None:
        """Keep an exact evaluation of every constraint (``eval_constraint/<name>``) as the
        evaluation of the weights now in the model, with their fingerprint (computed unless given)."""
        constraints = getattr(self, "constraints", None)
        if not constraints or any(EVAL_CONSTRAINT_PREFIX + c.name not in metrics for c in constraints):
            return
        step = self.state.global_step
        fingerprint = fingerprint or self.current_weights_fingerprint()
        previous = self._weights_eval
        if previous is not None and previous.valid_at == step and previous.fingerprint == fingerprint:
            previous.metrics.update(metrics)  # another entry of the same evaluation
            return
        self._weights_eval = WeightsEvaluation(step, dict(metrics), step, None, fingerprint)

    # ------------------------------------------------------------------ reports and cards
    def current_safety_report(self) -> Optional[SafetyReport]:
        """The report of the weights now in the trainer, without a new evaluation pass: the
        last report built, or the last exact evaluation, if its weights fingerprint is the
        current weights'; ``None`` when these weights were not evaluated on held-out data
        (never evaluated, or changed since)."""
        self._stale_note = ""
        candidates = []
        if self.safety_report is not None:
            candidates.append(self.safety_report)
        record = self._weights_eval
        # an evaluation logged at an earlier step is of earlier weights (training moved on): not a candidate
        if record is not None and record.valid_at == self.state.global_step:
            from_metrics = report_from_metrics(self, record.metrics, step=record.weights_step,
                                               checkpoint=record.checkpoint, fingerprint=record.fingerprint)
            if from_metrics is not None:
                candidates.append(from_metrics)
        if not candidates:
            return None
        current = self.current_weights_fingerprint()
        for report in candidates:
            if report.weights_fingerprint == current:
                self._stale_note = ""
                return report if report.safety_rule == self.safety_rule else report.with_rule(self.safety_rule)
        self._stale_note = (f"the weights changed after the last safety report (step {candidates[0].global_step}, "
                            f"weights {candidates[0].weights_fingerprint}; now {current})")
        logger.warning("%s: it no longer describes the model", self._stale_note)
        return None

    def build_safety_report(self, checkpoint: Optional[str] = None, **kwargs: Any) -> SafetyReport:
        """Evaluate the current weights (or a saved ``checkpoint``) on held-out data.

        Keyword arguments go to :func:`~hf_constrained.safety.evaluation.build_safety_report`
        (``old_model``, ``old_model_values``, ``objective_metrics``). The report of the
        current weights is kept as ``self.safety_report`` (used by cards and the push gate).
        """
        kwargs.setdefault("confidence", self.safety_confidence)
        kwargs.setdefault("safety_rule", self.safety_rule)
        kwargs.setdefault("delta", self.safety_delta)
        if checkpoint is not None:
            return self._checkpoint_safety_report(checkpoint, **kwargs)
        self.set_safety_report(build_safety_report(self, **kwargs))
        return self.safety_report

    def _checkpoint_safety_report(self, checkpoint: str, *, save: bool = True, **kwargs: Any) -> SafetyReport:
        """The report of a saved checkpoint, leaving ``self.model`` untouched: its weights are
        loaded into a copy of the model by the Trainer's loader, which knows every format
        (safetensors, sharded, adapters, FSDP) and evaluated exactly on held-out data. With
        ``save`` the report is written into the checkpoint directory."""
        if not os.path.isdir(checkpoint):
            raise FileNotFoundError(f"checkpoint directory {checkpoint} does not exist")
        files_before = weights_files_fingerprint(checkpoint)
        model = self.checkpoint_model(checkpoint)
        report = checkpoint_safety_report(self, checkpoint, model, **kwargs)
        # the report names the files it evaluated, unless they changed while it was evaluated
        report.weights_files_fingerprint = (files_before if files_before is not None
                                            and weights_files_fingerprint(checkpoint) == files_before else None)
        if save and self.is_world_process_zero():
            report.save(checkpoint)
        return report

    def checkpoint_model(self, checkpoint: str) -> Any:
        """A copy of the model with the weights of a saved ``checkpoint`` (the Trainer's loader, which
        knows every format: safetensors, sharded, adapters, FSDP); ``self.model`` is left alone."""
        if not os.path.isdir(checkpoint):
            raise FileNotFoundError(f"checkpoint directory {checkpoint} does not exist")
        model = copy.deepcopy(self.accelerator.unwrap_model(self.model))
        trainer_load_checkpoint(self, checkpoint, model)
        return model

    def weights_origin(self) -> Optional[tuple[int, str]]:
        """(step, checkpoint) the weights now in the model were loaded from, when
        ``load_best_model_at_end`` put a checkpoint's weights there; else ``None``."""
        record = self._weights_eval
        if record is None or record.valid_at != self.state.global_step or record.checkpoint is None:
            return None
        return record.weights_step, record.checkpoint

    def set_safety_report(self, report: SafetyReport) -> None:
        """Record ``report`` as the report of the weights now in the model (until they change:
        it is used while its ``weights_fingerprint`` is the current weights')."""
        if report.weights_fingerprint is None:
            report.weights_fingerprint = self.current_weights_fingerprint()
        self.safety_report = report

    def write_model_card(self, directory: Optional[str] = None, report: Optional[SafetyReport] = None, *,
                         model_name: Optional[str] = None, language: Optional[str] = None,
                         license: Optional[str] = None, tags: Any = None, finetuned_from: Optional[str] = None,
                         tasks: Any = None, dataset_tags: Any = None, dataset: Any = None,
                         dataset_args: Any = None) -> Optional[str]:
        """Render the card for ``report`` (default: :meth:`current_safety_report`) into
        ``directory/README.md`` and, with a report, ``safety_report.json`` next to it.

        The other arguments are those of ``Trainer.create_model_card`` and override
        :attr:`model_card_info` for this card (``finetuned_from``: the base model;
        ``dataset`` / ``dataset_tags``: the datasets; ``tasks``: the model-index task).
        """
        if not self.is_world_process_zero() or not getattr(self, "constraints", None):
            return None
        if dataset_args is not None:
            logger.warning("create_model_card: dataset_args=%r is not used by the constrained card", dataset_args)
        directory = directory or self.args.output_dir
        report = report if report is not None else self.current_safety_report()
        name = model_name or os.path.basename(os.path.normpath(self.args.output_dir))
        info = self.model_card_info.with_trainer_card_arguments(
            language=language, license=license, tags=tags, finetuned_from=finetuned_from, tasks=tasks,
            dataset_tags=dataset_tags, dataset=dataset)
        model = self.accelerator.unwrap_model(self.model)
        repo_id = self.hub_model_id or self.args.hub_model_id or name
        if "/" not in repo_id:  # the Hub adds the owner; the card's snippet needs it written out
            repo_id = f"{HUB_OWNER_PLACEHOLDER}/{repo_id}"
        source = describe_model(model, getattr(self, "processing_class", None), directory)
        card = render_model_card(report, model_name=name, method=method_settings(self), info=info,
                                 allow_unsafe=self._push_allow_unsafe, source=source, repo_id=repo_id)
        if report is not None:
            self.save_safety_report(report, directory)
        return write_model_card(directory, card)

    def save_safety_report(self, report: SafetyReport, directory: str,
                           files_fingerprint: Optional[str] = None) -> str:
        """Write ``report`` into ``directory/safety_report.json``, naming the weight files there
        (``weights_files_fingerprint``) only when they hold the weights it describes: files this
        trainer saved from those weights and unchanged since, or ``files_fingerprint`` when the
        caller knows them (the report keeps the value of its last save). Returns the path."""
        if files_fingerprint is None:
            files_fingerprint = self._saved_files_fingerprint(report, directory)
        report.weights_files_fingerprint = files_fingerprint
        return report.save(directory)

    def _saved_files_fingerprint(self, report: SafetyReport, directory: str) -> Optional[str]:
        """The fingerprint of the weight files in ``directory`` when this trainer saved them from
        the weights ``report`` describes and they have not changed since; else ``None``."""
        saved = self._saved_weights.get(os.path.realpath(directory))
        if (saved is None or report.weights_fingerprint is None
                or saved.weights_fingerprint != report.weights_fingerprint):
            return None
        try:
            if _files_signature(directory) != saved.signature:
                return None
        except (OSError, ValueError):
            return None
        return saved.files_fingerprint

    def _record_saved_weights(self, directory: str) -> None:
        """Remember which weights :meth:`save_model` has just written into ``directory``."""
        try:
            files = weights_files_fingerprint(directory)
            signature = _files_signature(directory)
        except (OSError, ValueError) as exc:
            logger.warning("cannot fingerprint the weight files in %s: %s", directory, exc)
            files = None
        key = os.path.realpath(directory)
        if files is None:
            self._saved_weights.pop(key, None)
            return
        self._saved_weights[key] = SavedWeights(self.current_weights_fingerprint(), files, signature)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False, *,
                   push: Optional[bool] = None) -> None:
        """``Trainer.save_model`` plus the model card (and safety report) next to the weights.

        The card is written before the Trainer's own push of a user-called ``save_model``
        (``args.push_to_hub``), which goes through the gated :meth:`push_to_hub`; ``push=False``
        saves without that push (a recipe that pushes last, after its results are written).
        The files saved here are recorded, so a report written next to them names them
        (``hf-constrained report --check`` compares them).
        """
        if push is False:
            _internal_call = True
        super().save_model(output_dir, _internal_call=True)
        if self.args.should_save:
            if getattr(self, "constraints", None):
                self._record_saved_weights(output_dir or self.args.output_dir)
            self.write_model_card(output_dir or self.args.output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def create_model_card(self, language: Optional[str] = None, license: Optional[str] = None, tags: Any = None,
                          model_name: Optional[str] = None, finetuned_from: Optional[str] = None,
                          tasks: Any = None, dataset_tags: Any = None, dataset: Any = None,
                          dataset_args: Any = None) -> None:
        """The constrained card (verdict, constraint table, model-index, usage, method,
        citation) in ``output_dir/README.md``, with every argument of
        ``Trainer.create_model_card`` honoured (see :meth:`write_model_card`); ``push_to_hub``
        passes its keyword arguments here. Without constraints: the Trainer's card."""
        card_args = dict(language=language, license=license, tags=tags, model_name=model_name,
                         finetuned_from=finetuned_from, tasks=tasks, dataset_tags=dataset_tags, dataset=dataset,
                         dataset_args=dataset_args)
        if not getattr(self, "constraints", None):
            return super().create_model_card(**card_args)
        self.write_model_card(self.args.output_dir, **card_args)

    # ------------------------------------------------------------------ the gated push
    def push_to_hub(self, commit_message: Optional[str] = "End of training", blocking: bool = True,
                    token: Optional[str] = None, revision: Optional[str] = None, private: Optional[bool] = None,
                    *, allow_unsafe: bool = False, safety_rule: Optional[str] = None, **kwargs: Any) -> Any:
        """``Trainer.push_to_hub`` behind the safety gate.

        The constraints of the current weights are checked on held-out data (the report
        built after training if it still describes these weights, else a new exact
        evaluation). If any fails under ``safety_rule`` (default ``self.safety_rule``:
        ``"point"``, or what ``finish_run`` was given), raises
        :class:`~hf_constrained.safety.report.UnsafeModelError` before any repository is created
        or file uploaded, unless ``allow_unsafe=True``: then the push goes ahead and the
        card says UNSAFE at the top. Other keyword arguments go to :meth:`create_model_card`.
        """
        self.check_safe_to_push(allow_unsafe=allow_unsafe, safety_rule=safety_rule)
        self._push_allow_unsafe = allow_unsafe
        try:
            return super().push_to_hub(commit_message=commit_message, blocking=blocking, token=token,
                                       revision=revision, private=private, **kwargs)
        finally:
            self._push_allow_unsafe = False

    def check_safe_to_push(self, allow_unsafe: bool = False, safety_rule: Optional[str] = None
                           ) -> Optional[SafetyReport]:
        """The gate of :meth:`push_to_hub`, uploading nothing: the safety report of the
        current weights (built if needed), or :class:`~hf_constrained.safety.report.UnsafeModelError`
        when a constraint fails on held-out data under ``safety_rule`` (``"point"`` or
        ``"upper_bound"``; default ``self.safety_rule``) and ``allow_unsafe`` is false (the
        local card and report are then updated with the verdict)."""
        if not getattr(self, "constraints", None):
            return None
        if safety_rule is not None:
            self.safety_rule = check_safety_rule(safety_rule)
        report = self.current_safety_report()
        if (report is not None and self.safety_rule == "upper_bound" and report.without_bound
                and hasattr(self, "constraint_statistics")):
            report = None  # the bounds decide: evaluate again with the per-row statistics
        if (report is not None and self.safety_rule == "certified" and report.certificate is None
                and any(getattr(c, "certify_dataset", None) is not None for c in self.constraints)):
            report = None  # an evaluation during training has no certificate: certify these weights now
        note = ""
        if report is None:
            # never evaluated, or the weights changed since: evaluate these weights now
            if self._stale_note:
                note = f"The constraints were evaluated again because {self._stale_note}. "
                logger.warning("%s", note)
            report = self.build_safety_report()
        self.set_safety_report(report)
        if not report.all_satisfied and not allow_unsafe:
            if self.args.should_save and os.path.isdir(self.args.output_dir):
                self.write_model_card(self.args.output_dir, report)  # local files only: the verdict
            raise UnsafeModelError(
                f"push_to_hub refused, nothing was uploaded. {note}{report.summary()}.\n{report.format_table()}\n"
                "Retrain (e.g. a larger penalty_beta, load_best_model_at_end with metric_for_best_model) or pass "
                "push_to_hub(..., allow_unsafe=True) to publish anyway with an UNSAFE model card."
            )
        if not report.all_satisfied:
            logger.warning("push_to_hub with allow_unsafe=True: %s", report.summary())
        return report

    def push_checkpoint(self, checkpoint_folder: str) -> None:
        """Checkpoint pushes during training (``hub_strategy``): only checkpoints whose own weight
        FILES are known to satisfy the constraints.

        The decision is about the weights in ``checkpoint_folder`` (what is uploaded), never the
        weights in memory: the report of the current weights is used when this trainer saved
        exactly these files from them; else the folder's own ``safety_report.json`` when it is
        intact and names these files; else, outside training and on one process, the folder is
        evaluated on held-out data now (during training it is not pushed).
        """
        if getattr(self, "constraints", None):
            report, files = self._checkpoint_folder_report(checkpoint_folder)
            if report is None or not report.all_satisfied:
                why = "not evaluated on held-out data" if report is None else report.summary()
                logger.warning("not pushing %s to the Hub: %s", checkpoint_folder, why)
                return
            if self.is_world_process_zero():
                # the pushed folder's card and report: these weights (the push copies the files over)
                self.write_model_card(self.args.output_dir, report)
                self.save_safety_report(report, self.args.output_dir, files_fingerprint=files)
        if self.hub_model_id is None:
            self.init_hf_repo()  # the first push that passed the gate creates the repository
        super().push_checkpoint(checkpoint_folder)

    def _checkpoint_folder_report(self, folder: str) -> tuple[Optional[SafetyReport], Optional[str]]:
        """The report of the weight files in ``folder`` under :attr:`safety_rule`, and their
        fingerprint; ``(None, ...)`` when the folder holds no readable weights."""
        try:
            files = weights_files_fingerprint(folder)
        except (OSError, ValueError) as exc:
            logger.warning("the weight files in %s cannot be read: %s", folder, exc)
            return None, None
        if files is None:
            logger.warning("%s holds no weight files", folder)
            return None, None
        saved = self._saved_weights.get(os.path.realpath(folder))
        if saved is not None and saved.files_fingerprint == files:
            current = self.current_safety_report()  # these files were saved from the weights it describes?
            if current is not None and current.weights_fingerprint == saved.weights_fingerprint:
                return current, files
        check = check_run_dir(folder)  # the folder's own report, if intact and naming these files
        if check.exit_code != EXIT_STALE_OR_UNREADABLE and check.report is not None:
            return check.report.with_rule(self.safety_rule), files
        if getattr(self, "is_in_train", False) or self.accelerator.num_processes > 1:
            # during training (a second copy of the model could exhaust memory) and on several
            # processes (an evaluation is collective, the push is rank 0's): not evaluated, not pushed
            logger.info("%s: %s", folder, check.message)
            return None, files
        logger.info("evaluating the weights in %s before pushing them (%s)", folder, check.message)
        report = self._checkpoint_safety_report(folder, confidence=self.safety_confidence,
                                                safety_rule=self.safety_rule)
        if report.weights_files_fingerprint != files:
            logger.warning("the weight files in %s changed while they were evaluated", folder)
            return None, files
        return report, files

    def init_hf_repo(self, token: Optional[str] = None, private: Optional[bool] = None) -> None:
        """``Trainer.init_hf_repo``, except while a trainer with constraints is being built: the
        repository is created by the first push that passes the gate (``push_to_hub`` or a
        feasible checkpoint push), so an unsafe run never creates one. Without constraints
        there is no gate, and the repository is created when the trainer is built, as the Trainer does."""
        if self._defer_hub_repo and getattr(self, "constraints", None):
            self._check_hub_access(token)
            logger.info("push_to_hub: the Hub repository will be created when the safety gate first passes")
            self.push_in_progress = None
            return
        super().init_hf_repo(token=token, private=private)

    def _check_hub_access(self, token: Optional[str]) -> None:
        """Fail when the trainer is built, where the Trainer fails when it creates the repository, if
        the Hub cannot be reached or refuses the token; not at the first feasible checkpoint."""
        import transformers.trainer as hf_trainer  # its hf_api: the one the Trainer's pushes use

        try:
            hf_trainer.hf_api().whoami(token=token or self.args.hub_token)
        except Exception as exc:  # noqa: BLE001 - any failure of the Hub client: network, offline mode, auth
            raise RuntimeError(
                f"push_to_hub=True, but the Hugging Face Hub cannot be reached or refuses the token "
                f"({type(exc).__name__}); the run would fail at its first push. Check the network and the token "
                "(`hf auth login`, HF_TOKEN or --hub_token), or train with push_to_hub=False and push afterwards"
            ) from exc


__all__ = ["SafetyMixin"]
