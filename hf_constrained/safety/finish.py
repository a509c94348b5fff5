"""``finish_run``: the one call that ends a run with its safety report, card and figures; and the other
functions a recipe calls with its trainer (each acts through ``trainer.safety``).

A recipe ends with::

    report = finish_run(trainer, old_model=base_model, base_model_name="openai/clip-vit-base-patch16",
                        dataset_description="BDD100K weather", reproduce_command="accelerate launch ...")

which evaluates the final model exactly on held-out data, writes ``safety_report.json``,
the model card (``README.md``), ``trainer_state.json`` and the training-curve figures into
``trainer.args.output_dir``, and returns the :class:`~hf_constrained.publishing.report.SafetyReport`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Optional, Protocol

from ..certification.certify import DEFAULT_DELTA, Certificate
from ..publishing.report import SafetyReport, UnsafeModelError

if TYPE_CHECKING:  # pragma: no cover
    from .loop import SafetyLoop

logger = logging.getLogger(__name__)


class HoldsSafetyLoop(Protocol):
    """A trainer holding its safety loop (``hf_constrained.ConstrainedTrainer``): the functions of this module
    that take a trainer act through ``trainer.safety``."""

    safety: SafetyLoop


def finish_run(trainer: HoldsSafetyLoop, *, old_model: Optional[Any] = None,
               old_model_values: Optional[Mapping[str, float]] = None,
               objective_metrics: Optional[Mapping[str, float]] = None,
               extra_columns: Optional[Mapping[str, Mapping[str, Any]]] = None, show: bool = True,
               **settings: Any) -> SafetyReport:
    """End a run: safety report, model card, trainer state and figures in the output directory.

    Call it after ``trainer.train()`` (and after ``load_best_model_at_end`` has loaded the
    feasible best checkpoint). Writes into ``trainer.args.output_dir``:
    ``safety_report.json``, ``README.md`` (the model card, UNSAFE at the top when a
    constraint fails), ``trainer_state.json`` (for ``hf-constrained plot``) and, with
    ``plots``, ``figures/constraints.png`` and ``figures/objective.png``. It is
    ``trainer.safety.finish(...)`` (:meth:`~hf_constrained.safety.run_end.RunEnd.finish`) with the loop's
    :class:`~hf_constrained.safety.settings.CertificateSettings` changed by ``settings``.

    Args:
        trainer: the trainer, after training (its safety loop, ``trainer.safety``, does the work).
        old_model / old_model_values: the old model (or its constraint values) for
            the "old model" column; see :func:`build_safety_report`.
        objective_metrics: held-out objective metrics, if ``trainer.evaluate()`` is not
            the right way to get them.
        extra_columns: per-constraint columns to show next to the values,
            ``{column: {constraint name: value}}``, e.g. ``{"old accuracy": {...},
            "new accuracy": {...}}`` for a non-forgetting run (zero-one accuracy per
            protected class beside the loss-based constraint value).
        show: log the verdict (:meth:`SafetyReport.render`: its line, its table, the diagnostics)
            once, at INFO when it passes and WARNING when not; ``False`` when the caller shows
            ``report.render()`` itself, so that it appears once.
        **settings: the certificate's settings for this run and the pushes after it
            (:class:`~hf_constrained.safety.settings.CertificateSettings`; a setting not given keeps the
            loop's): ``delta`` (the certificate's error level), ``safety_rule`` (``"certified"``, or the
            uncertified ``"point"`` / ``"upper_bound"``), ``candidates`` (``"final"`` or ``"checkpoints"``:
            fixed-sequence testing of every checkpoint, releasing the certified one with the best
            selection-split objective), ``confidence`` (of the CLT bounds shown), ``plots`` (``True``: needs
            the ``figures`` extra; ``None``: when matplotlib is installed); and what the card says:
            ``base_model_name``, ``dataset_description``, ``datasets``, ``eval_dataset``,
            ``reproduce_command`` (recorded without secrets or local paths), ``license``, ``task``,
            ``population``. An unknown name is a ``TypeError`` listing them.
    """
    loop = trainer.safety
    return loop.finish(loop.settings.changed(loop.view.output_dir, **settings), old_model=old_model,
                       old_model_values=old_model_values, objective_metrics=objective_metrics,
                       extra_columns=extra_columns, show=show)


def build_safety_report(trainer: HoldsSafetyLoop, **kwargs: Any) -> SafetyReport:
    """Evaluate ``trainer.model`` on held-out data and build its :class:`SafetyReport`, without making it the
    trainer's current report: :meth:`SafetyLoop.new_report <hf_constrained.safety.loop.SafetyLoop.new_report>`
    (keyword arguments as :func:`evaluate_report`'s: ``old_model``, ``old_model_values``,
    ``objective_metrics``, ``confidence``, ``safety_rule``, ``delta``, ``extra_columns``, ...)."""
    return trainer.safety.new_report(**kwargs)


def certify_models(trainer: HoldsSafetyLoop, models: Iterable[Any] = (None,), *, delta: float = DEFAULT_DELTA,
                   procedure: str = "fixed_sequence") -> Optional[Certificate]:
    """Certify candidate models on each constraint's ``certify.dataset`` (:func:`certify_run`; ``None`` is the
    trainer's model): :meth:`SafetyLoop.certify <hf_constrained.safety.loop.SafetyLoop.certify>`."""
    return trainer.safety.certify(models, delta=delta, procedure=procedure)


def report_from_metrics(trainer: HoldsSafetyLoop, metrics: Mapping[str, Any], **kwargs: Any
                        ) -> Optional[SafetyReport]:
    """A report from the metrics of an evaluation that already ran (:func:`metrics_report`), under the
    trainer's safety rule and with its reference values."""
    return trainer.safety.report_from_metrics(metrics, **kwargs)


def push_last(trainer: Any, allow_unsafe: bool = False) -> int:
    """A recipe's last step: ``trainer.push_to_hub()`` through the gate, called after the model, results,
    report and card are written, so a refusal uploads nothing and loses nothing. Returns the command's
    exit status: 0 pushed, 1 refused (the refusal's first line is logged as an error)."""
    try:
        trainer.push_to_hub(allow_unsafe=allow_unsafe)
    except UnsafeModelError as err:
        logger.error("%s", str(err).splitlines()[0])
        return 1
    return 0


__all__ = ["HoldsSafetyLoop", "build_safety_report", "certify_models", "finish_run", "push_last", "report_from_metrics"]
