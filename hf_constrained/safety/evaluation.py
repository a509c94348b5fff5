"""Building a :class:`~hf_constrained.safety.report.SafetyReport` from a trainer.

Everything here goes through the trainer's public methods (``evaluate``,
``evaluate_constraints``, ``constraints``, ``args``, ``state``), described by the
:class:`ReportableTrainer` protocol, so this module does not import the trainer: the
trainer imports the safety package, never the other way round.

The values are exact: a full pass over each constraint's held-out data (its
``eval_dataset``, falling back to its training data), not the MSVR estimate u_k of
Algorithm 1, line 6 (Yang et al., TMLR 2026).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional, Protocol, runtime_checkable

from .certify import DEFAULT_DELTA, Certificate, certify, point_value
from .fingerprint import weights_fingerprint
from .ledger import CertificationLedger
from .report import (
    CONSTRAINT_ITSELF,
    DEFAULT_SAFETY_RULE,
    EVAL_CONSTRAINT_PREFIX,
    ConstraintResult,
    SafetyReport,
    check_safety_rule,
    objective_metrics_from,
)

BOUND_METHOD = "CLT"  # hf_constrained.statistics: value + z_c * s / sqrt(n), one-sided
DEFAULT_CONFIDENCE = 0.95

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR


@runtime_checkable
class ReportableTrainer(Protocol):
    """What a report needs from a trainer (``hf_constrained.ConstrainedTrainer`` has it all).

    Optional, looked up with ``getattr``: ``constraint_statistics(split, confidence)``
    (name -> :class:`~hf_constrained.statistics.ConstraintStatistic`: the upper confidence
    bounds), ``constraint_margins()`` (name -> the margin in force), ``feasible_selection()``,
    ``weights_origin()`` (the step and checkpoint the current weights come from),
    ``reference_constraint_values`` (the old model's values).
    """

    engine: Any  # the ConstraintEngine (None without constraints): its settings() are what reports record

    constraints: Sequence[Any]
    args: Any
    state: Any
    model: Any

    def evaluate(self) -> dict[str, float]: ...

    def evaluate_constraints(self, model: Any = None, split: str = "eval") -> dict[str, float]: ...

    def is_world_process_zero(self) -> bool: ...


# ---------------------------------------------------------------------- settings and values
METHOD_NAMES = {
    "hinge": "single-loop hinge exact penalty with MSVR constraint estimators (Algorithm 1)",
    "squared_hinge": "squared-hinge penalty (Li et al. 2024 baseline) with MSVR estimators",
    "none": "no penalty (unconstrained Trainer)",
}
# the Trainer's own settings a report records beside the method's
TRAINER_SETTINGS = ("learning_rate", "optim", "weight_decay", "lr_scheduler_type", "per_device_train_batch_size",
                    "gradient_accumulation_steps", "num_train_epochs", "max_steps", "seed")


def library_option_names() -> list[str]:
    """The options :class:`~hf_constrained.ConstrainedTrainingArguments` adds to ``TrainingArguments``."""
    from transformers import TrainingArguments

    from ..config import ConstrainedTrainingArguments

    trainer_fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    return [f.name for f in dataclasses.fields(ConstrainedTrainingArguments) if f.name not in trainer_fields]


def _plain(value: Any) -> Any:
    value = getattr(value, "value", value)  # enums (optim, lr_scheduler_type) as their strings
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def method_settings(trainer: ReportableTrainer) -> dict[str, Any]:
    """The method and its settings as recorded in reports and cards (Algorithm 1 and its parameters,
    section 4): the engine's :meth:`~hf_constrained.method.engine.ConstraintEngine.settings` (what
    the run used, resolved), then every other option of the library's arguments as configured,
    then the Trainer's optimisation settings."""
    args = trainer.args
    engine = getattr(trainer, "engine", None)
    settings: dict[str, Any] = {"method": METHOD_NAMES.get(args.constraint_penalty, args.constraint_penalty)}
    if engine is not None:
        settings.update(engine.settings().to_dict())
    else:
        settings["num_constraints"] = len(trainer.constraints)
    for name in library_option_names() + list(TRAINER_SETTINGS):
        settings.setdefault(name, _plain(getattr(args, name)))
    return settings


def _check_names(trainer: ReportableTrainer, values: Mapping[str, float], what: str) -> None:
    names = [c.name for c in trainer.constraints]
    missing = [n for n in names if n not in values]
    extra = [n for n in values if n not in names]
    if missing or extra:
        raise ValueError(f"{what} must have one value per constraint {names}; missing {missing}, unknown {extra}")


def old_model_constraint_values(trainer: ReportableTrainer, old_model: Optional[Any] = None,
                                old_model_values: Optional[Mapping[str, float]] = None) -> Optional[dict[str, float]]:
    """h_k(w_old) on the held-out data: given as a dict, or evaluated on ``old_model``
    exactly like the new model (``trainer.evaluate_constraints(old_model, split="eval")``)."""
    if old_model_values is not None:
        _check_names(trainer, old_model_values, "old_model_values")
        return {k: float(v) for k, v in old_model_values.items()}
    if old_model is not None:
        old_model.to(trainer.args.device)
        return trainer.evaluate_constraints(old_model, split="eval")
    return None


def _field(stat: Any, key: str) -> Any:
    """A field of a ConstraintStatistic or of its dict form."""
    return stat.get(key) if isinstance(stat, Mapping) else getattr(stat, key, None)


def constraint_statistics(trainer: ReportableTrainer, confidence: float, model: Optional[Any] = None
                          ) -> Optional[Mapping[str, Any]]:
    """The trainer's ``constraint_statistics(split="eval", confidence=...)`` (per-row values ->
    CLT upper confidence bounds, :mod:`hf_constrained.statistics`), or ``None`` when the
    trainer does not provide them (or cannot for another ``model``)."""
    method = getattr(trainer, "constraint_statistics", None)
    if method is None:
        return None
    if model is None:
        return method(split="eval", confidence=confidence)
    if "model" in inspect.signature(method).parameters:
        return method(split="eval", confidence=confidence, model=model)
    return None


def check_extra_columns(trainer: ReportableTrainer, extra_columns: Optional[Mapping[str, Mapping[str, Any]]]
                        ) -> dict[str, dict[str, Any]]:
    """``{column: {constraint name: value}}`` checked against the trainer's constraints."""
    if not extra_columns:
        return {}
    names = [c.name for c in trainer.constraints]
    out = {}
    for column, values in extra_columns.items():
        if not isinstance(values, Mapping):
            raise TypeError(f"extra_columns[{column!r}] must map constraint names to values, got "
                            f"{type(values).__name__}")
        unknown = [n for n in values if n not in names]
        if unknown:
            raise ValueError(f"extra_columns[{column!r}] names unknown constraint(s) {unknown}; the constraints "
                             f"are {names}")
        out[str(column)] = dict(values)
    return out


def constraint_results(trainer: ReportableTrainer, values: Mapping[str, float],
                       old: Optional[Mapping[str, float]], *,
                       statistics: Optional[Mapping[str, Any]] = None,
                       margins: Optional[Mapping[str, Optional[float]]] = None,
                       extra_columns: Optional[Mapping[str, Mapping[str, Any]]] = None,
                       confidence: Optional[float] = None) -> list[ConstraintResult]:
    """One :class:`ConstraintResult` per constraint of ``trainer``, recording whether its value
    comes from held-out data (its ``eval_dataset``) or, lacking one, from its training data,
    with its upper confidence bound (from ``statistics``), margin and extra columns."""
    out = []
    for c in trainer.constraints:
        data = "data-free" if c.data_free else ("held-out" if c.eval_dataset is not None else "training")
        value = float(values[c.name])
        result = ConstraintResult(c.name, value, float(c.tolerance),
                                  None if old is None or old.get(c.name) is None else float(old[c.name]), data)
        if data == "data-free":
            # no data, no sampling error: the value is exact
            result.upper_bound, result.bound_method = value, "exact"
        elif statistics is not None and _field(statistics.get(c.name), "upper_bound") is not None:
            stat = statistics[c.name]
            result.upper_bound = float(_field(stat, "upper_bound"))
            result.confidence = float(_field(stat, "confidence") or confidence)
            result.bound_method = BOUND_METHOD
            se, rows = _field(stat, "std_error"), _field(stat, "num_rows")
            result.std_error = None if se is None else float(se)
            result.num_rows = None if rows is None else int(rows)
        if margins is not None and margins.get(c.name) is not None:
            result.margin = float(margins[c.name])
        result.extra = {col: vals[c.name] for col, vals in (extra_columns or {}).items() if c.name in vals}
        out.append(result)
    return out


def constraint_margins(trainer: ReportableTrainer) -> Optional[Mapping[str, Optional[float]]]:
    """The trainer's ``constraint_margins()`` (calibrated constraints), if it has them."""
    method = getattr(trainer, "constraint_margins", None)
    return None if method is None else method()


# ---------------------------------------------------------------------- certification
def not_certifiable(trainer: ReportableTrainer) -> list[str]:
    """Constraints (other than data-free ones, which are exact) without a certification split."""
    return [c.name for c in trainer.constraints
            if not c.data_free and getattr(c, "certify_dataset", None) is None]


def certify_models(trainer: ReportableTrainer, models: Iterable[Any] = (None,), *, delta: float = DEFAULT_DELTA,
                   procedure: str = "fixed_sequence") -> Optional[Certificate]:
    """Certify candidate models (in the order given, fixed before the certification data is
    read; ``None`` is the trainer's model; an iterable is consumed one model at a time) on
    each constraint's ``certify_dataset`` with :func:`~hf_constrained.safety.certify.certify`;
    ``None`` when no constraint has one.

    A certifiable constraint must declare the range of its per-row values
    (``Constraint.value_range`` or its ``certify_statistic``): an error names it otherwise.
    """
    certifiable = [c for c in trainer.constraints if getattr(c, "certify_dataset", None) is not None]
    if not certifiable:
        return None
    unranged = [c.name for c in certifiable if c.certification_range() is None]
    if unranged:
        raise ValueError(f"constraint(s) {unranged} have a certify_dataset but no value_range: a finite-sample bound "
                         "needs the range of the per-row values (e.g. Constraint(value_range=(0, 1)) for a rate, "
                         "(-1, 1) for a paired 0/1 change)")
    row_values = getattr(trainer, "constraint_row_values")
    candidates = [row_values(model=m, split="certify") for m in models]
    return certify(candidates, {c.name: c.certification_tolerance() for c in certifiable},
                   {c.name: c.certification_range() for c in certifiable}, delta,
                   bound={c.name: c.certification_bound() for c in certifiable}, procedure=procedure,
                   split_fingerprints=getattr(trainer, "certification_fingerprints", None),
                   ledger=CertificationLedger.for_run(trainer.args.output_dir))


def certified_statistics(trainer: ReportableTrainer, old_model: Optional[Any] = None) -> dict[str, dict[str, Any]]:
    """Per certifiable constraint, what its certificate measures (``SafetyReport.statistics``): the
    statistic's description (its unit), whether it is a proxy of the trained constraint, and the old
    model's value of it: measured on the certification rows when ``old_model`` is given (a reading
    that decides nothing, so it spends no error budget), else the value the statistic declares for
    the old model by construction (``CertifyStatistic.old_model_value``, e.g. 0 for a share forgotten)."""
    certifiable = [c for c in trainer.constraints if getattr(c, "certify_dataset", None) is not None]
    old_values: dict[str, float] = {}
    if old_model is not None and certifiable:
        old_model.to(trainer.args.device)
        rows = getattr(trainer, "constraint_row_values")(model=old_model, split="certify")
        old_values = {k: point_value(v) for k, v in rows.items()}
    out = {}
    for c in certifiable:
        stat = c.certify_statistic
        old = old_values.get(c.name)
        if old is None and stat is not None:
            old = getattr(stat, "old_model_value", None)
        out[c.name] = {"description": (stat.description if stat is not None and stat.description
                                       else CONSTRAINT_ITSELF),
                       "proxy": stat is not None, "old_value": None if old is None else float(old)}
    return out


# ---------------------------------------------------------------------- reports
def _old_values(trainer: ReportableTrainer, old_model: Any, old_model_values: Optional[Mapping[str, float]]
                ) -> Optional[dict[str, float]]:
    old = old_model_constraint_values(trainer, old_model, old_model_values)
    return old if old is not None else getattr(trainer, "reference_constraint_values", None)


def build_safety_report(
    trainer: ReportableTrainer,
    *,
    old_model: Optional[Any] = None,
    old_model_values: Optional[Mapping[str, float]] = None,
    objective_metrics: Optional[Mapping[str, float]] = None,
    checkpoint: Optional[str] = None,
    model_name: Optional[str] = None,
    confidence: float = DEFAULT_CONFIDENCE,
    safety_rule: str = DEFAULT_SAFETY_RULE,
    extra_columns: Optional[Mapping[str, Mapping[str, Any]]] = None,
    delta: float = DEFAULT_DELTA,
    certificate: Optional[Certificate] = None,
    certificate_candidate: int = 0,
    statistics: Optional[Mapping[str, Mapping[str, Any]]] = None,
) -> SafetyReport:
    """Evaluate ``trainer.model`` on held-out data and build its :class:`SafetyReport`.

    Args:
        trainer: a :class:`~hf_constrained.ConstrainedTrainer` after (or during) training.
        old_model: the model before fine-tuning; its constraint values are computed
            the same way. Alternatively pass ``old_model_values`` (name -> value) or set
            ``trainer.reference_constraint_values``.
        objective_metrics: held-out objective metrics to record. By default
            ``trainer.evaluate()`` runs once and gives both the objective metrics and the
            exact constraint values (``eval_constraint/<name>``, a full pass over each
            constraint's held-out data).
        checkpoint: recorded as the origin of the weights (``trainer.build_safety_report(
            checkpoint=...)`` evaluates a saved checkpoint).
        model_name: recorded name (default: the output directory's name).
        confidence: the level of the upper confidence bounds (from the trainer's
            ``constraint_statistics``, when it has them; data-free constraints are exact).
        safety_rule: ``"certified"`` (default: the finite-sample certificate on each
            constraint's ``certify_dataset`` decides), or the uncertified ``"point"`` (a
            constraint holds when its held-out value is within tolerance) and
            ``"upper_bound"`` (when its CLT upper confidence bound is).
        delta: the certificate's error level (with probability at least ``1 - delta`` over the
            certification sample, a certified model satisfies every constraint).
        certificate, certificate_candidate: a certificate already computed over several
            candidates, and which of them the model in the trainer is (default: certify the
            model in the trainer alone).
        extra_columns: caller-supplied per-constraint columns, ``{column: {name: value}}``
            (e.g. zero-one accuracy of the old and new model per protected class), shown in
            the table, the JSON and the card.
        statistics: what each certificate measures (:func:`certified_statistics`; computed,
            with ``old_model``, when not given).
    """
    if not trainer.constraints:
        raise ValueError("a safety report needs constraints: this trainer has none")
    check_safety_rule(safety_rule)
    extras = check_extra_columns(trainer, extra_columns)
    if objective_metrics is None:
        metrics = trainer.evaluate()
        values = {c.name: float(metrics[EVAL_CONSTRAINT_PREFIX + c.name]) for c in trainer.constraints}
        objective = objective_metrics_from(metrics)
    else:
        values = trainer.evaluate_constraints(split="eval")
        objective = {k: float(v) for k, v in objective_metrics.items()}
        training = [k for k in objective if k.startswith("train_")]
        if training:  # the report's objective metrics are held-out ones
            logger.warning("objective_metrics: %s measured on training data, not recorded as held-out metrics",
                           ", ".join(training))
            objective = {k: v for k, v in objective.items() if k not in training}
    old = _old_values(trainer, old_model, old_model_values)
    selection = None
    feasible_selection = getattr(trainer, "feasible_selection", None)
    if feasible_selection is not None:
        sel = feasible_selection()
        selection = None if sel is None else sel.to_dict()
    step = trainer.state.global_step
    weights_origin = getattr(trainer, "weights_origin", None)
    origin = weights_origin() if weights_origin is not None else None
    if checkpoint is None and origin is not None:
        # after training, load_best_model_at_end put the best checkpoint's weights in the model
        step, checkpoint = origin
    if certificate is None:
        certificate, certificate_candidate = certify_models(trainer, delta=delta), 0
    report = SafetyReport(
        certificate=None if certificate is None else certificate.to_dict(),
        certificate_candidate=certificate_candidate,
        not_certifiable=not_certifiable(trainer),
        statistics={k: dict(v) for k, v in (statistics if statistics is not None
                                            else certified_statistics(trainer, old_model)).items()},
        constraints=constraint_results(trainer, values, old, statistics=constraint_statistics(trainer, confidence),
                                       margins=constraint_margins(trainer), extra_columns=extras,
                                       confidence=confidence),
        objective_metrics=objective,
        split="eval",
        global_step=step,
        checkpoint=relative_checkpoint(trainer, checkpoint),
        selection=selection,
        method=method_settings(trainer),
        model_name=model_name or os.path.basename(os.path.normpath(trainer.args.output_dir)),
        weights_fingerprint=weights_fingerprint(trainer.model),
        safety_rule=safety_rule,
        extra_columns=list(extras),
    )
    return report  # finish_run shows it, once


def report_from_metrics(trainer: ReportableTrainer, metrics: Mapping[str, Any], *,
                        step: Optional[int] = None, checkpoint: Optional[str] = None,
                        fingerprint: Optional[str] = None) -> Optional[SafetyReport]:
    """A report from the metrics of an evaluation that already ran (no extra pass);
    ``None`` when those metrics hold no exact constraint values. ``fingerprint`` is the
    :func:`weights_fingerprint` of the weights that evaluation saw."""
    if not trainer.constraints or any(EVAL_CONSTRAINT_PREFIX + c.name not in metrics for c in trainer.constraints):
        return None
    old = getattr(trainer, "reference_constraint_values", None)
    return SafetyReport(
        constraints=constraint_results(trainer, {c.name: metrics[EVAL_CONSTRAINT_PREFIX + c.name]
                                                 for c in trainer.constraints}, old,
                                       margins=constraint_margins(trainer)),
        objective_metrics=objective_metrics_from(metrics),
        global_step=trainer.state.global_step if step is None else step,
        checkpoint=relative_checkpoint(trainer, checkpoint),
        method=method_settings(trainer),
        model_name=os.path.basename(os.path.normpath(checkpoint or trainer.args.output_dir)),
        weights_fingerprint=fingerprint,
        safety_rule=getattr(trainer, "safety_rule", DEFAULT_SAFETY_RULE),
        not_certifiable=not_certifiable(trainer),
        statistics=certified_statistics(trainer),
    )


def relative_checkpoint(trainer: ReportableTrainer, checkpoint: Optional[str]) -> Optional[str]:
    """A checkpoint as reports record it: relative to the output directory when inside it
    (``checkpoint-2``), else its name; reports and cards carry no absolute local paths."""
    if not checkpoint:
        return checkpoint
    output_dir = os.path.abspath(trainer.args.output_dir)
    path = os.path.abspath(checkpoint)
    if os.path.commonpath([output_dir, path]) == output_dir and path != output_dir:
        return os.path.relpath(path, output_dir)
    return os.path.basename(os.path.normpath(checkpoint))


def checkpoint_step(checkpoint: str) -> Optional[int]:
    """The step of a ``checkpoint-N`` directory (``None`` for another name)."""
    base = os.path.basename(os.path.normpath(checkpoint))
    prefix, _, number = base.rpartition("-")
    return int(number) if prefix == CHECKPOINT_PREFIX and number.isdigit() else None


def checkpoint_safety_report(trainer: ReportableTrainer, checkpoint: str, model: Any, *,
                             old_model: Optional[Any] = None,
                             old_model_values: Optional[Mapping[str, float]] = None,
                             confidence: float = DEFAULT_CONFIDENCE, safety_rule: str = DEFAULT_SAFETY_RULE,
                             delta: float = DEFAULT_DELTA) -> SafetyReport:
    """The report of a saved checkpoint whose weights are already loaded into ``model``
    (a copy: ``trainer.model`` is left alone). The objective metrics are those logged at
    the checkpoint's step (its ``trainer_state.json``), if any."""
    values = trainer.evaluate_constraints(model, split="eval")
    step = None
    objective: dict[str, float] = {}
    state_file = os.path.join(checkpoint, "trainer_state.json")
    if os.path.isfile(state_file):
        with open(state_file, encoding="utf-8") as f:
            state = json.load(f)
        step = state.get("global_step")
        for entry in state.get("log_history", []):
            if entry.get("step") == step and any(k.startswith("eval_") for k in entry):
                objective.update(objective_metrics_from(entry))
    else:
        step = checkpoint_step(checkpoint)
    certificate = certify_models(trainer, [model], delta=delta)
    return SafetyReport(
        certificate=None if certificate is None else certificate.to_dict(),
        not_certifiable=not_certifiable(trainer),
        statistics=certified_statistics(trainer, old_model),
        constraints=constraint_results(trainer, values, _old_values(trainer, old_model, old_model_values),
                                       statistics=constraint_statistics(trainer, confidence, model),
                                       confidence=confidence),
        objective_metrics=objective,
        global_step=step,
        checkpoint=relative_checkpoint(trainer, checkpoint),
        method=method_settings(trainer),
        model_name=os.path.basename(os.path.normpath(checkpoint)),
        weights_fingerprint=weights_fingerprint(model),
        safety_rule=check_safety_rule(safety_rule),
    )


__all__ = [
    "BOUND_METHOD",
    "DEFAULT_CONFIDENCE",
    "ReportableTrainer",
    "check_extra_columns",
    "constraint_margins",
    "constraint_statistics",
    "build_safety_report",
    "certify_models",
    "certified_statistics",
    "library_option_names",
    "checkpoint_safety_report",
    "not_certifiable",
    "checkpoint_step",
    "relative_checkpoint",
    "constraint_results",
    "method_settings",
    "old_model_constraint_values",
    "report_from_metrics",
]
