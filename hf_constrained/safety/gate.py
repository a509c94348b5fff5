"""``SafetyMixin``: the Trainer side of the safety loop (selection, cards, gated push).

Mixed into :class:`~hf_constrained.ConstrainedTrainer` (``class ConstrainedTrainer(SafetyMixin,
Trainer)``), it extends, not replaces, the Trainer's hooks:

- ``_determine_best_metric``: ``load_best_model_at_end`` / ``save_strategy="best"`` pick the
  best ``metric_for_best_model`` among evaluations whose constraints all hold on the
  validation data (:mod:`hf_constrained.safety.selection`); with none feasible, the
  least-violating one, with a warning at the end of training;
- ``save_model``: every checkpoint and the final model get ``README.md`` (the model
  card) and, when the constraints were evaluated for those weights,
  ``safety_report.json``;
- ``create_model_card``: the constrained card instead of the generic one;
- ``push_to_hub(..., allow_unsafe=False)``: refuses, before creating a repository or
  uploading anything, when a constraint fails on held-out data; with
  ``allow_unsafe=True`` it uploads and the card says UNSAFE at the top. Checkpoint pushes
  during training (``hub_strategy``) are skipped while the latest evaluation is infeasible
  or missing;
- the stock TensorBoard callback is replaced by
  :class:`~hf_constrained.safety.tensorboard.ConstraintTensorBoardCallback` (constraint scalars grouped).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping
from typing import Any, Optional

from transformers.integrations import TensorBoardCallback

from .card import ModelCardInfo, render_model_card, write_model_card
from .evaluation import build_safety_report, checkpoint_safety_report, method_settings, report_from_metrics
from .report import SafetyReport, UnsafeModelError
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

logger = logging.getLogger(__name__)


class SafetyMixin:
    """Safety report, feasible-checkpoint selection, model cards and a gated ``push_to_hub``.

    Extra keyword arguments of the trainer:
        model_card_info: :class:`~hf_constrained.safety.card.ModelCardInfo` (base model,
            data, reproduce command) for the cards.
        reference_constraint_values: the old model's held-out constraint values
            (name -> value), shown next to the new model's in reports and cards.
    """

    def __init__(self, *args: Any, model_card_info: Optional[ModelCardInfo] = None,
                 reference_constraint_values: Optional[Mapping[str, float]] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.model_card_info: ModelCardInfo = model_card_info or ModelCardInfo()
        if self.model_card_info.base_model is None:
            config = getattr(getattr(self, "model", None), "config", None)
            name = getattr(config, "_name_or_path", None)
            self.model_card_info.base_model = name or None
        self.reference_constraint_values: Optional[dict[str, float]] = (
            None if reference_constraint_values is None else {k: float(v) for k, v in reference_constraint_values.items()}
        )
        self.safety_report: Optional[SafetyReport] = None  # the report of the current weights, once built
        self._report_step: Optional[int] = None
        # the evaluation of the weights now in the model: (global step it is valid at, metrics,
        # step the weights come from, checkpoint they were loaded from)
        self._weights_eval: Optional[tuple[int, dict[str, Any], int, Optional[str]]] = None
        self._push_allow_unsafe = False
        self._group_constraint_tensorboard()

    # ------------------------------------------------------------------ TensorBoard
    def _group_constraint_tensorboard(self) -> None:
        stock = [cb for cb in self.callback_handler.callbacks if type(cb) is TensorBoardCallback]
        names = [c.name for c in getattr(self, "constraints", [])]
        for cb in stock:
            self.callback_handler.remove_callback(cb)
            self.callback_handler.add_callback(ConstraintTensorBoardCallback(names, tb_writer=cb.tb_writer))

    # ------------------------------------------------------------------ feasible-checkpoint selection
    def _determine_best_metric(self, metrics: dict[str, float], trial: Any) -> bool:
        """Best objective among feasible evaluations (lexicographic order of
        :mod:`hf_constrained.safety.selection`); the stock rule when no constraint was evaluated."""
        step = self.state.global_step
        self._weights_eval = (step, dict(metrics), step, None)
        feasibility = constraint_feasibility(metrics)
        if self.args.metric_for_best_model is None or feasibility is None:
            return super()._determine_best_metric(metrics, trial)
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
                                   bool(self.args.greater_is_better), self.state.best_model_checkpoint)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        self.safety_report = None
        result = super().train(*args, **kwargs)
        best = self.state.best_model_checkpoint
        if self.args.load_best_model_at_end and best is not None and self.state.best_global_step:
            # the weights are now the best checkpoint's, whose evaluation is in the log history
            merged: dict[str, Any] = {}
            for entry in self.state.log_history:
                if entry.get("step") == self.state.best_global_step and any(k.startswith("eval_") for k in entry):
                    merged.update(entry)
            self._weights_eval = (self.state.global_step, merged, self.state.best_global_step, best) if merged else None
        selection = self.feasible_selection()
        if selection is not None and selection.num_evaluations:
            if selection.any_feasible:
                logger.info("Feasible-checkpoint selection: %s", selection.message())
            else:
                logger.warning("Feasible-checkpoint selection: %s", selection.message())
        return result

    # ------------------------------------------------------------------ reports and cards
    def current_safety_report(self) -> Optional[SafetyReport]:
        """The report of the weights now in the trainer, without a new evaluation pass:
        the one built after training, or the evaluation at the current step; ``None``
        when these weights were not evaluated on held-out data."""
        step = self.state.global_step
        if self.safety_report is not None and self._report_step == step:
            return self.safety_report
        if self._weights_eval is not None and self._weights_eval[0] == step:
            _, metrics, weights_step, checkpoint = self._weights_eval
            return report_from_metrics(self, metrics, step=weights_step, checkpoint=checkpoint)
        return None

    def build_safety_report(self, checkpoint: Optional[str] = None, **kwargs: Any) -> SafetyReport:
        """Evaluate the current weights (or a saved ``checkpoint``) on held-out data.

        Keyword arguments go to :func:`~hf_constrained.safety.evaluation.build_safety_report`
        (``old_model``, ``old_model_values``, ``objective_metrics``). The report of the
        current weights is kept as ``self.safety_report`` (used by cards and the push gate).
        """
        if checkpoint is not None:
            return self._checkpoint_safety_report(checkpoint, **kwargs)
        self.set_safety_report(build_safety_report(self, **kwargs))
        return self.safety_report

    def _checkpoint_safety_report(self, checkpoint: str, *, save: bool = True, **kwargs: Any) -> SafetyReport:
        """The report of a saved checkpoint, leaving ``self.model`` untouched: its weights are
        loaded into a copy of the model (``Trainer._load_from_checkpoint`` knows every format:
        safetensors, sharded, adapters, FSDP) and evaluated exactly on held-out data. With
        ``save`` the report is written into the checkpoint directory."""
        if not os.path.isdir(checkpoint):
            raise FileNotFoundError(f"checkpoint directory {checkpoint} does not exist")
        model = copy.deepcopy(self.accelerator.unwrap_model(self.model))
        self._load_from_checkpoint(checkpoint, model=model)
        report = checkpoint_safety_report(self, checkpoint, model, **kwargs)
        if save and self.is_world_process_zero():
            report.save(checkpoint)
        return report

    def weights_origin(self) -> Optional[tuple[int, str]]:
        """(step, checkpoint) the weights now in the model were loaded from, when
        ``load_best_model_at_end`` put a checkpoint's weights there; else ``None``."""
        weights = self._weights_eval
        if weights is None or weights[0] != self.state.global_step or weights[3] is None:
            return None
        return weights[2], weights[3]

    def set_safety_report(self, report: SafetyReport) -> None:
        """Record ``report`` as the report of the weights now in the model (until they change)."""
        self.safety_report = report
        self._report_step = self.state.global_step

    def write_model_card(self, directory: Optional[str] = None, report: Optional[SafetyReport] = None,
                         **card_kwargs: Any) -> Optional[str]:
        """Render the card for ``report`` (default: :meth:`current_safety_report`) into
        ``directory/README.md`` and, with a report, ``safety_report.json`` next to it."""
        if not self.is_world_process_zero() or not getattr(self, "constraints", None):
            return None
        directory = directory or self.args.output_dir
        report = report if report is not None else self.current_safety_report()
        name = card_kwargs.pop("model_name", None) or os.path.basename(os.path.normpath(self.args.output_dir))
        info = self.model_card_info
        extra_tags = card_kwargs.pop("tags", None)
        if isinstance(extra_tags, str):
            extra_tags = [extra_tags]
        card = render_model_card(report, model_name=name, method=method_settings(self), info=info,
                                 allow_unsafe=self._push_allow_unsafe, extra_tags=extra_tags)
        if report is not None:
            report.save(directory)
        return write_model_card(directory, card)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model`` plus the model card (and safety report) next to the weights.

        The card is written before the Trainer's own push of a user-called ``save_model``
        (``args.push_to_hub``), which goes through the gated :meth:`push_to_hub`.
        """
        super().save_model(output_dir, _internal_call=True)
        if self.args.should_save:
            self.write_model_card(output_dir or self.args.output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def create_model_card(self, **kwargs: Any) -> None:
        """The constrained card (constraint table, method, citation) in ``output_dir/README.md``;
        ``model_name`` and ``tags`` are honoured, the other Trainer arguments are ignored.
        Without constraints: the Trainer's card."""
        if not getattr(self, "constraints", None):
            return super().create_model_card(**kwargs)
        allowed = {k: kwargs[k] for k in ("model_name", "tags") if kwargs.get(k) is not None}
        self.write_model_card(self.args.output_dir, **allowed)

    # ------------------------------------------------------------------ the gated push
    def push_to_hub(self, commit_message: Optional[str] = "End of training", blocking: bool = True,
                    token: Optional[str] = None, revision: Optional[str] = None, private: Optional[bool] = None,
                    *, allow_unsafe: bool = False, **kwargs: Any) -> Any:
        """``Trainer.push_to_hub`` behind the safety gate.

        The constraints of the current weights are checked on held-out data (the report
        built after training, else a new exact evaluation). If any fails, raises
        :class:`~hf_constrained.safety.report.UnsafeModelError` before any repository is created
        or file uploaded, unless ``allow_unsafe=True``: then the push goes ahead and the
        card says UNSAFE at the top.
        """
        self.check_safe_to_push(allow_unsafe=allow_unsafe)
        self._push_allow_unsafe = allow_unsafe
        try:
            return super().push_to_hub(commit_message=commit_message, blocking=blocking, token=token,
                                       revision=revision, private=private, **kwargs)
        finally:
            self._push_allow_unsafe = False

    def check_safe_to_push(self, allow_unsafe: bool = False) -> Optional[SafetyReport]:
        """The gate of :meth:`push_to_hub`, uploading nothing: the safety report of the
        current weights (built if needed), or :class:`~hf_constrained.safety.report.UnsafeModelError`
        when a constraint fails on held-out data and ``allow_unsafe`` is false (the local
        card and report are then updated with the verdict)."""
        if not getattr(self, "constraints", None):
            return None
        report = self.current_safety_report() or self.build_safety_report()
        self.set_safety_report(report)
        if not report.all_satisfied and not allow_unsafe:
            if self.args.should_save and os.path.isdir(self.args.output_dir):
                self.write_model_card(self.args.output_dir, report)  # local files only: the verdict
            raise UnsafeModelError(
                f"push_to_hub refused, nothing was uploaded. {report.summary()}.\n{report.format_table()}\n"
                "Retrain (e.g. a larger penalty_beta, load_best_model_at_end with metric_for_best_model) or pass "
                "push_to_hub(..., allow_unsafe=True) to publish anyway with an UNSAFE model card."
            )
        if not report.all_satisfied:
            logger.warning("push_to_hub with allow_unsafe=True: %s", report.summary())
        return report

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Checkpoint pushes during training (``hub_strategy``): only feasible checkpoints."""
        if getattr(self, "constraints", None):
            report = self.current_safety_report()
            if report is None or not report.all_satisfied:
                why = "not evaluated on held-out data" if report is None else report.summary()
                logger.warning("not pushing %s to the Hub: %s", checkpoint_folder, why)
                return
            if self.is_world_process_zero():
                self.write_model_card(self.args.output_dir, report)  # the pushed folder's card: these weights
        super()._push_from_checkpoint(checkpoint_folder)


__all__ = ["SafetyMixin"]
