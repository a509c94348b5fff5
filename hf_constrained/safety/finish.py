"""``finish_run``: the one call that ends a run with its safety report, card and figures.

A recipe ends with::

    report = finish_run(trainer, old_model=base_model, base_model_name="openai/clip-vit-base-patch16",
                        dataset_description="BDD100K weather", reproduce_command="accelerate launch ...")

which evaluates the final model exactly on held-out data, writes ``safety_report.json``,
the model card (``README.md``), ``trainer_state.json`` and the training-curve figures into
``trainer.args.output_dir``, and returns the :class:`~hf_constrained.safety.report.SafetyReport`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, Optional, Protocol

from .card import ModelCardInfo
from .evaluation import DEFAULT_CONFIDENCE, ReportableTrainer, build_safety_report, old_model_constraint_values
from .figures import plot_log_history
from .report import SafetyReport, check_safety_rule

logger = logging.getLogger(__name__)


class FinishableTrainer(ReportableTrainer, Protocol):
    """A :class:`~hf_constrained.safety.evaluation.ReportableTrainer` with the safety gate's
    methods (:class:`~hf_constrained.safety.gate.SafetyMixin`) and ``save_state``."""

    model_card_info: Optional[ModelCardInfo]
    reference_constraint_values: Optional[dict[str, float]]
    safety_rule: str
    safety_confidence: float

    def set_safety_report(self, report: SafetyReport) -> None: ...

    def save_safety_report(self, report: SafetyReport, directory: str) -> str: ...

    def write_model_card(self, directory: Optional[str] = None, report: Optional[SafetyReport] = None,
                         **card_kwargs: Any) -> Optional[str]: ...

    def save_state(self) -> None: ...


def finish_run(
    trainer: FinishableTrainer,
    *,
    old_model: Optional[Any] = None,
    old_model_values: Optional[Mapping[str, float]] = None,
    base_model_name: Optional[str] = None,
    dataset_description: Optional[str] = None,
    datasets: Optional[list[str]] = None,
    reproduce_command: Optional[str] = None,
    objective_metrics: Optional[Mapping[str, float]] = None,
    plots: bool = True,
    safety_rule: str = "point",
    confidence: float = DEFAULT_CONFIDENCE,
    extra_columns: Optional[Mapping[str, Mapping[str, Any]]] = None,
) -> SafetyReport:
    """End a run: safety report, model card, trainer state and figures in the output directory.

    Call it after ``trainer.train()`` (and after ``load_best_model_at_end`` has loaded the
    feasible best checkpoint). Writes into ``trainer.args.output_dir``:
    ``safety_report.json``, ``README.md`` (the model card, UNSAFE at the top when a
    constraint fails), ``trainer_state.json`` (for ``hf-constrained plot``) and, with
    ``plots``, ``figures/constraints.png`` and ``figures/objective.png``.

    Args:
        trainer: the trainer, after training.
        old_model / old_model_values: the old model (or its constraint values) for
            the "old model" column; see :func:`build_safety_report`.
        base_model_name: the Hub id or path of the model that was fine-tuned.
        dataset_description: one sentence on the training / constraint / held-out data.
        datasets: Hub dataset ids for the card's metadata, if any.
        reproduce_command: the shell command that reproduces the run.
        objective_metrics: held-out objective metrics, if ``trainer.evaluate()`` is not
            the right way to get them.
        plots: also write the training-curve figures.
        safety_rule: what decides SAFE/UNSAFE, here and in later ``push_to_hub`` calls:
            ``"point"`` (default; each held-out value within its tolerance) or
            ``"upper_bound"`` (each upper confidence bound within its tolerance; a
            constraint without per-row values, hence without a bound, is judged on its
            value and the report lists it).
        confidence: the level of the upper confidence bounds (CLT, one-sided; they come
            from ``trainer.constraint_statistics`` when the trainer provides them).
        extra_columns: per-constraint columns to show next to the values,
            ``{column: {constraint name: value}}``, e.g. ``{"old accuracy": {...},
            "new accuracy": {...}}`` for a non-forgetting run (zero-one accuracy per
            protected class beside the loss-based constraint value).
    """
    check_safety_rule(safety_rule)
    info = getattr(trainer, "model_card_info", None) or ModelCardInfo()
    if base_model_name is not None:
        info.base_model = base_model_name
    if dataset_description is not None:
        info.dataset_description = dataset_description
    if datasets is not None:
        info.datasets = list(datasets)
    if reproduce_command is not None:
        info.reproduce_command = reproduce_command
    trainer.model_card_info = info
    old = old_model_constraint_values(trainer, old_model, old_model_values)
    if old is not None:
        trainer.reference_constraint_values = old
    trainer.safety_rule, trainer.safety_confidence = safety_rule, confidence
    report = build_safety_report(trainer, objective_metrics=objective_metrics, confidence=confidence,
                                 safety_rule=safety_rule, extra_columns=extra_columns)
    trainer.set_safety_report(report)
    if trainer.is_world_process_zero():
        out = trainer.args.output_dir
        os.makedirs(out, exist_ok=True)
        # names the weight files in ``out`` when the trainer saved them from these weights
        trainer.save_safety_report(report, out)
        trainer.write_model_card(out, report=report)
        trainer.save_state()
        if plots:
            try:
                plot_log_history(trainer.state.log_history, os.path.join(out, "figures"), report=report,
                                 title=report.model_name)
            except ValueError as exc:  # nothing to plot must not lose the report written above
                logger.warning("no training-curve figures: %s", exc)
        (logger.info if report.all_satisfied else logger.warning)("%s\n%s", report.summary(), report.format_table())
    return report


__all__ = ["FinishableTrainer", "finish_run"]
