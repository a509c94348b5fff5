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
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Optional, Protocol

from ..certification.certify import DEFAULT_DELTA, Certificate, best_certified
from ..certification.selection import evaluation_records, metric_key
from ..checkpointing import checkpoint_folders, is_complete_checkpoint
from ..extras import install_hint
from ..publishing.figures import figures_available, plot_log_history, require_figures
from ..publishing.report import SafetyReport, UnsafeModelError, check_safety_rule
from ..redact import redact_command
from .evaluation import (
    DEFAULT_CONFIDENCE,
    certified_statistics,
    checkpoint_step,
    old_model_constraint_values,
)
from .model_fingerprint import weights_fingerprint

if TYPE_CHECKING:  # pragma: no cover
    from .loop import SafetyLoop

logger = logging.getLogger(__name__)


class HoldsSafetyLoop(Protocol):
    """A trainer holding its safety loop (``hf_constrained.ConstrainedTrainer``): the functions of this module
    that take a trainer act through ``trainer.safety``."""

    safety: SafetyLoop


def finish_run(
    trainer: HoldsSafetyLoop,
    *,
    old_model: Optional[Any] = None,
    old_model_values: Optional[Mapping[str, float]] = None,
    base_model_name: Optional[str] = None,
    dataset_description: Optional[str] = None,
    datasets: Optional[list[str]] = None,
    eval_dataset: Optional[str] = None,
    reproduce_command: Optional[str] = None,
    license: Optional[str] = None,
    task: Optional[str] = None,
    population: Optional[str] = None,
    objective_metrics: Optional[Mapping[str, float]] = None,
    plots: Optional[bool] = None,
    candidates: str = "final",
    safety_rule: Optional[str] = None,
    confidence: float = DEFAULT_CONFIDENCE,
    delta: float = DEFAULT_DELTA,
    extra_columns: Optional[Mapping[str, Mapping[str, Any]]] = None,
    show: bool = True,
) -> SafetyReport:
    """End a run: safety report, model card, trainer state and figures in the output directory.

    Call it after ``trainer.train()`` (and after ``load_best_model_at_end`` has loaded the
    feasible best checkpoint). Writes into ``trainer.args.output_dir``:
    ``safety_report.json``, ``README.md`` (the model card, UNSAFE at the top when a
    constraint fails), ``trainer_state.json`` (for ``hf-constrained plot``) and, with
    ``plots``, ``figures/constraints.png`` and ``figures/objective.png``.

    Args:
        trainer: the trainer, after training (its safety loop, ``trainer.safety``, does the work).
        old_model / old_model_values: the old model (or its constraint values) for
            the "old model" column; see :func:`build_safety_report`.
        base_model_name: the Hub id or path of the model that was fine-tuned.
        dataset_description: one sentence on the training / constraint / held-out data.
        datasets: Hub dataset ids for the card's metadata, if any.
        eval_dataset: the identifier of the evaluation data in the card's ``model-index``
            (``dataset.type``): a Hub dataset id or a short name (``"digits"``, ``"adult"``);
            default: the first of ``datasets``, else ``"custom"``.
        reproduce_command: the shell command that reproduces the run.
        license: the card's license (a Hub license id, e.g. ``"apache-2.0"``).
        task: the Hub task id (e.g. ``"text-generation"``): the card's ``pipeline_tag`` and the
            task of its model-index results.
        population: who the certified statistics are about (the population the certification rows
            were drawn from), named in the card.
        objective_metrics: held-out objective metrics, if ``trainer.evaluate()`` is not
            the right way to get them.
        plots: also write the training-curve figures: ``True`` needs matplotlib (the ``figures``
            extra; without it an error naming the extra, before anything is written),
            ``False`` skips them, ``None`` (default) writes them when matplotlib is installed
            and otherwise says, in a log message, how to get them.
        candidates: what the certificate tests: ``"final"`` (default), the model in the
            trainer (the feasible best checkpoint when ``load_best_model_at_end`` chose one on
            the selection data); or ``"checkpoints"``: every complete checkpoint in the
            output directory in training order (then the final weights, if they are none of
            them), by fixed-sequence testing (each at ``delta``, stopping at the first not
            certified: forgetting tends to grow with training, so this order is the one a
            test can go furthest in); the certified candidate with the best selection-split
            objective (``metric_for_best_model``) is loaded into the trainer and released.
        safety_rule: what decides the verdict, here and in later ``push_to_hub`` calls
            (default: ``trainer.safety.rule``, which is ``"certified"`` unless set):
            ``"certified"``: the certificate on each constraint's
            ``certify.dataset`` (rows nothing else touched) certifies the model at ``delta``
            with a finite-sample bound (:mod:`hf_constrained.certification.certify`); a run with a
            constraint lacking such a split is NOT CERTIFIED. The uncertified rules:
            ``"point"`` (each held-out value within its tolerance) and ``"upper_bound"``
            (each CLT upper bound within its tolerance; asymptotic).
        confidence: the level of the CLT upper confidence bounds shown in the table.
        delta: the certificate's error level: with probability at least ``1 - delta`` over
            the certification sample, a certified model satisfies every constraint on the
            population the split was drawn from.
        extra_columns: per-constraint columns to show next to the values,
            ``{column: {constraint name: value}}``, e.g. ``{"old accuracy": {...},
            "new accuracy": {...}}`` for a non-forgetting run (zero-one accuracy per
            protected class beside the loss-based constraint value).
        show: log the verdict (:meth:`SafetyReport.render`: its line, its table, the diagnostics)
            once, at INFO when it passes and WARNING when not; ``False`` when the caller shows
            ``report.render()`` itself, so that it appears once.
    """
    loop = trainer.safety
    view, host = loop.view, loop.host
    safety_rule = check_safety_rule(safety_rule if safety_rule is not None else loop.rule)
    if plots:
        require_figures()  # asked for: fail before anything is written
    elif plots is None:
        plots = figures_available()
        if not plots:
            logger.warning("no training-curve figures: matplotlib is not installed (%s); the report and the card "
                           "are written without them", install_hint("figures"))
    info = loop.model_card_info
    if base_model_name is not None:
        info.base_model = base_model_name
    if dataset_description is not None:
        info.dataset_description = dataset_description
    if datasets is not None:
        info.datasets = list(datasets)
    if eval_dataset is not None:
        info.eval_dataset = eval_dataset
    if reproduce_command is not None:
        info.reproduce_command = redact_command(reproduce_command, view.output_dir)  # no secret, no path
    if license is not None:
        info.license = license
    if task is not None:
        info.task = task
    if population is not None:
        info.population = population
    old = old_model_constraint_values(view, host, old_model, old_model_values)
    if old is not None:
        loop.reference_values = old
    loop.rule, loop.confidence, loop.delta = safety_rule, confidence, delta
    if candidates not in ("final", "checkpoints"):
        raise ValueError(f"candidates must be 'final' or 'checkpoints', got {candidates!r}")
    certificate, candidate, released, fingerprint = None, 0, None, None
    if candidates == "checkpoints":
        fingerprint = weights_fingerprint(host.model)  # the final weights, hashed once for the ledger and the report
        certificate, candidate, released = certify_checkpoints(loop, delta, fingerprint)
        if released is not None:
            fingerprint = None  # a checkpoint's weights replaced them: the report hashes those
    report = loop.new_report(objective_metrics=objective_metrics, confidence=confidence, safety_rule=safety_rule,
                             extra_columns=extra_columns, delta=delta, certificate=certificate,
                             certificate_candidate=candidate, checkpoint=released,
                             statistics=certified_statistics(view, host, old_model), fingerprint=fingerprint)
    if released is not None:
        report.global_step = checkpoint_step(released)
    loop.set_report(report)
    if host.is_world_process_zero():
        out = view.output_dir
        os.makedirs(out, exist_ok=True)
        # names the weight files in ``out`` when the trainer saved them from these weights
        loop.save_report(report, out)
        loop.write_model_card(out, report=report)
        host.save_state()
        if plots:
            try:
                plot_log_history(host.state.log_history, os.path.join(out, "figures"), report=report,
                                 title=report.model_name)
            except ValueError as exc:  # nothing to plot must not lose the report written above
                logger.warning("no training-curve figures: %s", exc)
        # the verdict, shown once: its line, the verdict table and the diagnostics
        if show:
            (logger.info if report.all_satisfied else logger.warning)("%s", report.render())
    return report


def certify_checkpoints(loop: SafetyLoop, delta: float, current: Optional[str] = None
                        ) -> tuple[Optional[Certificate], int, Optional[str]]:
    """Certify every complete checkpoint of the output directory in training order (then the
    final weights when they are none of them) and load the released one into the trainer:
    the certified candidate with the best selection-split objective, else the final weights.
    ``current``: the :func:`weights_fingerprint` of the trainer's weights, where the caller has it.
    Returns the certificate, the released candidate's index and, when the trainer's weights
    were replaced, the checkpoint they now come from."""
    args, state, model = loop.view.args, loop.host.state, loop.host.model
    # training order (checkpoint_folders lists the newest first)
    folders = [f for f in reversed(checkpoint_folders(args.output_dir)) if is_complete_checkpoint(f)]
    current = current if current is not None else weights_fingerprint(model)
    fingerprints: list[Optional[str]] = []

    def models() -> Iterator[Any]:
        for folder in folders:  # one copy of the model at a time
            candidate = loop.checkpoint_model(folder)
            fingerprints.append(weights_fingerprint(candidate))
            yield candidate
        if current not in fingerprints:
            fingerprints.append(current)
            yield None  # the model in the trainer

    # the generator fills ``fingerprints`` before it yields each model: the ledger's identities are not hashed again
    certificate = loop.certify(models(), delta=delta, procedure="fixed_sequence", fingerprints=fingerprints)
    if certificate is None:
        return None, 0, None
    steps = [checkpoint_step(f) for f in folders] + ([state.global_step] if len(fingerprints) > len(folders)
                                                     else [])
    final = fingerprints.index(current)
    key = args.metric_for_best_model
    objective: list[Optional[float]] = [None] * len(steps)
    if key is not None:
        by_step = {r.step: r.metric for r in evaluation_records(state.log_history, metric_key(key))}
        objective = [by_step.get(s) for s in steps]
    release = best_certified(certificate, objective, bool(args.greater_is_better))
    if release is None or release == final:
        return certificate, final, None
    logger.info("releasing %s: the certified checkpoint with the best selection objective", folders[release])
    model.load_state_dict(loop.checkpoint_model(folders[release]).state_dict())
    return certificate, release, folders[release]


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


__all__ = ["HoldsSafetyLoop", "build_safety_report", "certify_checkpoints", "certify_models", "finish_run", "push_last",
           "report_from_metrics"]
