"""Building a :class:`~hf_constrained.publishing.report.SafetyReport` of a run.

Everything here reads the run through its typed view (:class:`~hf_constrained.safety.view.RunView`: the
constraints, the arguments, the engine's settings) and evaluates through the trainer's typed operations
(:class:`~hf_constrained.safety.view.SafetyHost`), so this module imports neither the trainer nor the loop:
the safety loop (:class:`~hf_constrained.safety.loop.SafetyLoop`, ``trainer.safety``) calls these functions;
the functions that take a trainer (:mod:`hf_constrained.safety.finish`) act through its loop.

The values are exact: a full pass over each constraint's held-out data (its
``eval_dataset``, falling back to its training data), not the MSVR estimate u_k of
Algorithm 1, line 6 (Yang et al., TMLR 2026).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from ..certification.certify import CONSTRAINT_ITSELF, DEFAULT_DELTA, Certificate, certify, point_value
from ..certification.ledger import CertificationLedger
from ..certification.selection import FeasibleSelection
from ..publishing.report import (
    DEFAULT_SAFETY_RULE,
    EVAL_CONSTRAINT_PREFIX,
    ConstraintResult,
    SafetyReport,
    check_safety_rule,
    objective_metrics_from,
)
from .model_fingerprint import weights_fingerprint
from .view import RunView, SafetyHost

BOUND_METHOD = "CLT"  # hf_constrained.statistics: value + z_c * s / sqrt(n), one-sided
DEFAULT_CONFIDENCE = 0.95

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR


def _check_names(view: RunView, values: Mapping[str, float], what: str) -> None:
    names = view.names
    missing = [n for n in names if n not in values]
    extra = [n for n in values if n not in names]
    if missing or extra:
        raise ValueError(f"{what} must have one value per constraint {names}; missing {missing}, unknown {extra}")


def old_model_constraint_values(view: RunView, host: SafetyHost, old_model: Optional[Any] = None,
                                old_model_values: Optional[Mapping[str, float]] = None) -> Optional[dict[str, float]]:
    """h_k(w_old) on the held-out data: given as a dict, or evaluated on ``old_model``
    exactly like the new model (``host.evaluate_constraints(old_model, split="eval")``)."""
    if old_model_values is not None:
        _check_names(view, old_model_values, "old_model_values")
        return {k: float(v) for k, v in old_model_values.items()}
    if old_model is not None:
        old_model.to(view.args.device)
        return host.evaluate_constraints(old_model, split="eval")
    return None


def _field(stat: Any, key: str) -> Any:
    """A field of a ConstraintStatistic or of its dict form."""
    return stat.get(key) if isinstance(stat, Mapping) else getattr(stat, key, None)


def check_extra_columns(view: RunView, extra_columns: Optional[Mapping[str, Mapping[str, Any]]]
                        ) -> dict[str, dict[str, Any]]:
    """``{column: {constraint name: value}}`` checked against the run's constraints."""
    if not extra_columns:
        return {}
    names = view.names
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


def constraint_results(view: RunView, values: Mapping[str, float],
                       old: Optional[Mapping[str, float]], *,
                       statistics: Optional[Mapping[str, Any]] = None,
                       margins: Optional[Mapping[str, Optional[float]]] = None,
                       extra_columns: Optional[Mapping[str, Mapping[str, Any]]] = None,
                       confidence: Optional[float] = None) -> list[ConstraintResult]:
    """One :class:`ConstraintResult` per constraint of the run, recording whether its value
    comes from held-out data (its ``eval_dataset``) or, lacking one, from its training data,
    with its upper confidence bound (from ``statistics``), margin and extra columns."""
    out = []
    for c in view.constraints:
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


# ---------------------------------------------------------------------- certification
def not_certifiable(view: RunView) -> list[str]:
    """Constraints (other than data-free ones, which are exact) without a certification split."""
    return [c.name for c in view.constraints if not c.data_free and not c.certifiable]


def certify_run(view: RunView, host: SafetyHost, models: Iterable[Any] = (None,), *, delta: float = DEFAULT_DELTA,
                procedure: str = "fixed_sequence",
                fingerprints: Optional[Sequence[Optional[str]]] = None) -> Optional[Certificate]:
    """Certify candidate models (in the order given, fixed before the certification data is
    read; ``None`` is the trainer's model; an iterable is consumed one model at a time) on
    each constraint's ``certify.dataset`` with :func:`~hf_constrained.certification.certify.certify`;
    ``None`` when no constraint has one. Each call is a look at the certification splits, counted in
    the run's ledger (:mod:`hf_constrained.certification.ledger`).

    A certifiable constraint must declare the range of its per-row values
    (``Constraint.certify``'s ``value_range`` or its ``statistic``): an error names it otherwise.

    ``fingerprints``: each model's :func:`weights_fingerprint` where the caller has computed it already (entry
    ``i`` is read when model ``i`` is certified, so a list that the models' iterator fills as it yields serves),
    so that the ledger's candidate identity (:func:`candidate_identity`) does not hash the weights a second time.
    """
    certifiable = view.certifiable()
    if not certifiable:
        return None
    unranged = [c.name for c in certifiable if c.certification_range() is None]
    if unranged:
        raise ValueError(f"constraint(s) {unranged} have a certification split but no value range: a finite-sample "
                         "bound needs the range of the per-row values (e.g. Certification(dataset=..., "
                         "value_range=(0, 1)) for a rate, "
                         "(-1, 1) for a paired 0/1 change)")
    candidates, identities = [], []
    for i, m in enumerate(models):
        candidates.append(host.constraint_row_values(model=m, split="certify"))
        identities.append(candidate_identity(host.model if m is None else m,
                                             None if fingerprints is None else fingerprints[i]))
    return certify(candidates, {c.name: c.certification_tolerance() for c in certifiable},
                   {c.name: c.certification_range() for c in certifiable}, delta,
                   bound={c.name: c.certification_bound() for c in certifiable}, procedure=procedure,
                   split_fingerprints=dict(view.certification_fingerprints),
                   ledger=CertificationLedger.for_run(view.output_dir), candidate_ids=identities)


def candidate_identity(model: Any, fingerprint: Optional[str] = None) -> Optional[str]:
    """What a certified model is, for the ledger of looks: its weights' fingerprint (``fingerprint`` when the
    caller has it, else computed), so that two different models are two looks even when their per-row values on
    the certification split coincide, and the same weights certified again are the same look. ``None`` (known by
    its values alone, as before) for sharded weights, whose fingerprint differs between processes, and for a
    model whose state cannot be read."""
    state = getattr(model, "state_dict", None)
    if not callable(state):
        return None
    if any(hasattr(t, "to_local") for t in state().values()):  # FSDP2 shards: one fingerprint per process
        return None
    return fingerprint if fingerprint is not None else weights_fingerprint(model)


def certified_statistics(view: RunView, host: SafetyHost, old_model: Optional[Any] = None
                         ) -> dict[str, dict[str, Any]]:
    """Per certifiable constraint, what its certificate measures (``SafetyReport.statistics``): the
    statistic's description (its unit), whether it is a proxy of the trained constraint, and the old
    model's value of it: measured on the certification rows when ``old_model`` is given (a reading
    that decides nothing, so it spends no error budget), else the value the statistic declares for
    the old model by construction (``CertifyStatistic.old_model_value``, e.g. 0 for a share forgotten)."""
    certifiable = view.certifiable()
    old_values: dict[str, float] = {}
    if old_model is not None and certifiable:
        old_model.to(view.args.device)
        rows = host.constraint_row_values(model=old_model, split="certify")
        old_values = {k: point_value(v) for k, v in rows.items()}
    out = {}
    for c in certifiable:
        stat = c.certify.statistic
        old = old_values.get(c.name)
        if old is None and stat is not None:
            old = stat.old_model_value
        out[c.name] = {"description": (stat.description if stat is not None and stat.description
                                       else CONSTRAINT_ITSELF),
                       "proxy": stat is not None, "old_value": None if old is None else float(old)}
    return out


# ---------------------------------------------------------------------- reports
@dataclass(frozen=True)
class ReportRequest:
    """What a caller asks of the report of the weights in the model: the keyword arguments of
    :meth:`SafetyLoop.build_report <hf_constrained.safety.loop.SafetyLoop.build_report>` and ``new_report``.

    Args:
        old_model: the model before fine-tuning; its constraint values are computed the same way (the "old
            model" column). Alternatively ``old_model_values`` (name -> value).
        objective_metrics: held-out objective metrics to record. By default ``host.evaluate()`` runs once and
            gives both the objective metrics and the exact constraint values (``eval_constraint/<name>``, a full
            pass over each constraint's held-out data).
        extra_columns: caller-supplied per-constraint columns, ``{column: {name: value}}`` (e.g. zero-one
            accuracy of the old and new model per protected class), shown in the table, the JSON and the card.
        checkpoint: recorded as the origin of the weights.
        model_name: recorded name (default: the output directory's name).
        confidence: the level of the upper confidence bounds (from ``host.constraint_statistics``; data-free
            constraints are exact).
        safety_rule: ``"certified"`` (the finite-sample certificate on each constraint's ``certify.dataset``
            decides), or the uncertified ``"point"`` (a constraint holds when its held-out value is within
            tolerance) and ``"upper_bound"`` (when its CLT upper confidence bound is).
        delta: the certificate's error level (with probability at least ``1 - delta`` over the certification
            sample, a certified model satisfies every constraint).
        certificate, certificate_candidate: a certificate already computed over several candidates, and which
            of them the model in the trainer is (default: certify the model in the trainer alone).
        statistics: what each certificate measures (:func:`certified_statistics`; computed, with ``old_model``,
            when not given).
        fingerprint: the :func:`weights_fingerprint` of the weights now in the model, where the caller has hashed
            them already (default: hashed here).
    """

    # ------------------------------------------------------------------ what the report compares and shows
    old_model: Optional[Any] = None
    old_model_values: Optional[Mapping[str, float]] = None
    objective_metrics: Optional[Mapping[str, float]] = None
    extra_columns: Optional[Mapping[str, Mapping[str, Any]]] = None
    checkpoint: Optional[str] = None
    model_name: Optional[str] = None
    # ------------------------------------------------------------------ how it judges
    confidence: float = DEFAULT_CONFIDENCE
    safety_rule: str = DEFAULT_SAFETY_RULE
    delta: float = DEFAULT_DELTA
    # ------------------------------------------------------------------ what the caller computed already
    certificate: Optional[Certificate] = None
    certificate_candidate: int = 0
    statistics: Optional[Mapping[str, Mapping[str, Any]]] = None
    fingerprint: Optional[str] = None


@dataclass(frozen=True)
class RunContext:
    """What the safety loop knows of the run beyond its view: the old model's values when the request gives none
    (``reference_values``), the run's feasible-checkpoint selection (recorded in the report) and the (step,
    checkpoint) the weights in the model were loaded from, if not the last step's (``weights_origin``)."""

    reference_values: Optional[Mapping[str, float]] = None
    selection: Optional[FeasibleSelection] = None
    weights_origin: Optional[tuple[int, Optional[str]]] = None


def held_out_values(view: RunView, host: SafetyHost, objective_metrics: Optional[Mapping[str, float]]
                    ) -> tuple[dict[str, float], dict[str, float]]:
    """(each constraint's exact held-out value, the held-out objective metrics): one ``host.evaluate()`` when
    the caller gives no ``objective_metrics``, else the constraints alone; metrics measured on training data
    are not recorded as held-out ones (a warning names them)."""
    if objective_metrics is None:
        metrics = host.evaluate()
        return ({c.name: float(metrics[EVAL_CONSTRAINT_PREFIX + c.name]) for c in view.constraints},
                objective_metrics_from(metrics))
    values = host.evaluate_constraints(split="eval")
    objective = {k: float(v) for k, v in objective_metrics.items()}
    training = [k for k in objective if k.startswith("train_")]
    if training:  # the report's objective metrics are held-out ones
        logger.warning("objective_metrics: %s measured on training data, not recorded as held-out metrics",
                       ", ".join(training))
    return values, {k: v for k, v in objective.items() if k not in training}


def evaluate_report(view: RunView, host: SafetyHost, request: ReportRequest = ReportRequest(),
                    context: RunContext = RunContext()) -> SafetyReport:
    """Evaluate the model in the run on held-out data and build its :class:`SafetyReport`: the exact
    constraint values and objective metrics (:func:`held_out_values`), the old model's values, and the
    certificate of these weights (one look at the certification splits, unless ``request`` brings one).

    Args:
        view, host: the run (:class:`~hf_constrained.safety.view.RunView`) and its evaluations.
        request: what the caller asks of the report (:class:`ReportRequest`).
        context: what the safety loop knows of the run (:class:`RunContext`).
    """
    if not view.constraints:
        raise ValueError("a safety report needs constraints: this trainer has none")
    r = request
    check_safety_rule(r.safety_rule)
    extras = check_extra_columns(view, r.extra_columns)
    values, objective = held_out_values(view, host, r.objective_metrics)
    old = old_model_constraint_values(view, host, r.old_model, r.old_model_values)
    old = old if old is not None else context.reference_values
    step, checkpoint = host.state.global_step, r.checkpoint
    if checkpoint is None and context.weights_origin is not None:
        # after training, load_best_model_at_end put the best checkpoint's weights in the model
        step, checkpoint = context.weights_origin
    # hashed once: the ledger's candidate identity and the report's
    fingerprint = r.fingerprint if r.fingerprint is not None else weights_fingerprint(host.model)
    certificate, candidate = r.certificate, r.certificate_candidate
    if certificate is None:
        certificate, candidate = certify_run(view, host, delta=r.delta, fingerprints=[fingerprint]), 0
    statistics = r.statistics if r.statistics is not None else certified_statistics(view, host, r.old_model)
    return SafetyReport(
        certificate=None if certificate is None else certificate.to_dict(),
        certificate_candidate=candidate,
        not_certifiable=not_certifiable(view),
        statistics={k: dict(v) for k, v in statistics.items()},
        constraints=constraint_results(view, values, old,
                                       statistics=host.constraint_statistics(split="eval", confidence=r.confidence),
                                       margins=host.constraint_margins(), extra_columns=extras,
                                       confidence=r.confidence),
        objective_metrics=objective,
        split="eval",
        global_step=step,
        checkpoint=relative_checkpoint(view.output_dir, checkpoint),
        selection=None if context.selection is None else context.selection.to_dict(),
        method=view.method_settings(),
        model_name=r.model_name or os.path.basename(os.path.normpath(view.output_dir)),
        weights_fingerprint=fingerprint,
        safety_rule=r.safety_rule,
        extra_columns=list(extras),
    )  # finish_run shows it, once


def metrics_report(view: RunView, host: SafetyHost, metrics: Mapping[str, Any], *,
                   reference_values: Optional[Mapping[str, float]] = None, safety_rule: str = DEFAULT_SAFETY_RULE,
                   step: Optional[int] = None, checkpoint: Optional[str] = None,
                   fingerprint: Optional[str] = None) -> Optional[SafetyReport]:
    """A report from the metrics of an evaluation that already ran (no extra pass);
    ``None`` when those metrics hold no exact constraint values. ``fingerprint`` is the
    :func:`weights_fingerprint` of the weights that evaluation saw."""
    if not view.constraints or any(EVAL_CONSTRAINT_PREFIX + c.name not in metrics for c in view.constraints):
        return None
    return SafetyReport(
        constraints=constraint_results(view, {c.name: metrics[EVAL_CONSTRAINT_PREFIX + c.name]
                                              for c in view.constraints}, reference_values,
                                       margins=host.constraint_margins()),
        objective_metrics=objective_metrics_from(metrics),
        global_step=host.state.global_step if step is None else step,
        checkpoint=relative_checkpoint(view.output_dir, checkpoint),
        method=view.method_settings(),
        model_name=os.path.basename(os.path.normpath(checkpoint or view.output_dir)),
        weights_fingerprint=fingerprint,
        safety_rule=safety_rule,
        not_certifiable=not_certifiable(view),
        statistics=certified_statistics(view, host),
    )


def relative_checkpoint(output_dir: str, checkpoint: Optional[str]) -> Optional[str]:
    """A checkpoint as reports record it: relative to the output directory when inside it
    (``checkpoint-2``), else its name; reports and cards carry no absolute local paths."""
    if not checkpoint:
        return checkpoint
    output_dir = os.path.abspath(output_dir)
    path = os.path.abspath(checkpoint)
    if os.path.commonpath([output_dir, path]) == output_dir and path != output_dir:
        return os.path.relpath(path, output_dir)
    return os.path.basename(os.path.normpath(checkpoint))


def checkpoint_step(checkpoint: str) -> Optional[int]:
    """The step of a ``checkpoint-N`` directory (``None`` for another name)."""
    base = os.path.basename(os.path.normpath(checkpoint))
    prefix, _, number = base.rpartition("-")
    return int(number) if prefix == CHECKPOINT_PREFIX and number.isdigit() else None


def checkpoint_report(view: RunView, host: SafetyHost, checkpoint: str, model: Any, *,
                      reference_values: Optional[Mapping[str, float]] = None,
                      old_model: Optional[Any] = None,
                      old_model_values: Optional[Mapping[str, float]] = None,
                      confidence: float = DEFAULT_CONFIDENCE, safety_rule: str = DEFAULT_SAFETY_RULE,
                      delta: float = DEFAULT_DELTA) -> SafetyReport:
    """The report of a saved checkpoint whose weights are already loaded into ``model``
    (a copy: the trainer's model is left alone). The objective metrics are those logged at
    the checkpoint's step (its ``trainer_state.json``), if any."""
    values = host.evaluate_constraints(model, split="eval")
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
    fingerprint = weights_fingerprint(model)  # hashed once: the ledger's candidate identity and the report's
    certificate = certify_run(view, host, [model], delta=delta, fingerprints=[fingerprint])
    old = old_model_constraint_values(view, host, old_model, old_model_values)
    return SafetyReport(
        certificate=None if certificate is None else certificate.to_dict(),
        not_certifiable=not_certifiable(view),
        statistics=certified_statistics(view, host, old_model),
        constraints=constraint_results(view, values, old if old is not None else reference_values,
                                       statistics=host.constraint_statistics(model=model, split="eval",
                                                                             confidence=confidence),
                                       confidence=confidence),
        objective_metrics=objective,
        global_step=step,
        checkpoint=relative_checkpoint(view.output_dir, checkpoint),
        method=view.method_settings(),
        model_name=os.path.basename(os.path.normpath(checkpoint)),
        weights_fingerprint=fingerprint,
        safety_rule=check_safety_rule(safety_rule),
    )


__all__ = [
    "BOUND_METHOD",
    "DEFAULT_CONFIDENCE",
    "ReportRequest",
    "RunContext",
    "certified_statistics",
    "certify_run",
    "check_extra_columns",
    "checkpoint_report",
    "checkpoint_step",
    "constraint_results",
    "evaluate_report",
    "held_out_values",
    "metrics_report",
    "not_certifiable",
    "old_model_constraint_values",
    "relative_checkpoint",
]
