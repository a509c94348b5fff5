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

import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Protocol, runtime_checkable

from .fingerprint import weights_fingerprint
from .report import EVAL_CONSTRAINT_PREFIX, ConstraintResult, SafetyReport, objective_metrics_from

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR


@runtime_checkable
class ReportableTrainer(Protocol):
    """What a report needs from a trainer (``hf_constrained.ConstrainedTrainer`` has it all).

    Optional, looked up with ``getattr``: ``feasible_selection()``,
    ``weights_origin()`` (the step and checkpoint the current weights come from),
    ``reference_constraint_values`` (the old model's values), ``estimator``,
    ``num_sampled``.
    """

    constraints: Sequence[Any]
    args: Any
    state: Any
    model: Any

    def evaluate(self) -> dict[str, float]: ...

    def evaluate_constraints(self, model: Any = None, split: str = "eval") -> dict[str, float]: ...

    def is_world_process_zero(self) -> bool: ...


# ---------------------------------------------------------------------- settings and values
def method_settings(trainer: ReportableTrainer) -> dict[str, Any]:
    """The method and its settings as recorded in reports and cards (Algorithm 1 and its parameters, section 4)."""
    args = trainer.args
    m = len(trainer.constraints)
    estimator = getattr(trainer, "estimator", None)
    settings: dict[str, Any] = {
        "method": "single-loop hinge exact penalty with MSVR constraint estimators (Algorithm 1)"
        if args.constraint_penalty == "hinge" else
        ("squared-hinge penalty (Li et al. 2024 baseline) with MSVR estimators"
         if args.constraint_penalty == "squared_hinge" else "no penalty (unconstrained Trainer)"),
        "constraint_penalty": args.constraint_penalty,
        "penalty_beta": args.penalty_beta,
        "num_constraints": m,
        "msvr_gamma": args.msvr_gamma,
        "msvr_gamma_prime": args.msvr_gamma_prime,
        "constraints_per_step": getattr(trainer, "num_sampled", m),
        "constraint_batch_size": args.constraint_batch_size,
        "constraint_seed": args.constraint_sampling_seed,
        "objective_msvr_gamma": args.objective_msvr_gamma,
        "objective_msvr_gamma_prime": args.objective_msvr_gamma_prime,
        "learning_rate": args.learning_rate,
        "optimizer": str(getattr(args.optim, "value", args.optim)),
        "weight_decay": args.weight_decay,
        "lr_scheduler_type": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "num_train_epochs": args.num_train_epochs,
        "max_steps": args.max_steps,
        "seed": args.seed,
    }
    if estimator is not None and settings["msvr_gamma_prime"] == "theory":
        settings["msvr_gamma_prime"] = f"theory ({estimator.gamma_prime:.6g})"
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


def constraint_results(trainer: ReportableTrainer, values: Mapping[str, float],
                       old: Optional[Mapping[str, float]]) -> list[ConstraintResult]:
    """One :class:`ConstraintResult` per constraint of ``trainer``, recording whether its value
    comes from held-out data (its ``eval_dataset``) or, lacking one, from its training data."""
    out = []
    for c in trainer.constraints:
        data = "data-free" if c.data_free else ("held-out" if c.eval_dataset is not None else "training")
        out.append(ConstraintResult(c.name, float(values[c.name]), float(c.tolerance),
                                    None if old is None or old.get(c.name) is None else float(old[c.name]), data))
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
    """
    if not trainer.constraints:
        raise ValueError("a safety report needs constraints: this trainer has none")
    if objective_metrics is None:
        metrics = trainer.evaluate()
        values = {c.name: float(metrics[EVAL_CONSTRAINT_PREFIX + c.name]) for c in trainer.constraints}
        objective = objective_metrics_from(metrics)
    else:
        values = trainer.evaluate_constraints(split="eval")
        objective = {k: float(v) for k, v in objective_metrics.items()}
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
    report = SafetyReport(
        constraints=constraint_results(trainer, values, old),
        objective_metrics=objective,
        split="eval",
        global_step=step,
        checkpoint=checkpoint,
        selection=selection,
        method=method_settings(trainer),
        model_name=model_name or os.path.basename(os.path.normpath(trainer.args.output_dir)),
        weights_fingerprint=weights_fingerprint(trainer.model),
    )
    logger.info("%s", report.summary())
    return report


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
                                                 for c in trainer.constraints}, old),
        objective_metrics=objective_metrics_from(metrics),
        global_step=trainer.state.global_step if step is None else step,
        checkpoint=checkpoint,
        method=method_settings(trainer),
        model_name=os.path.basename(os.path.normpath(checkpoint or trainer.args.output_dir)),
        weights_fingerprint=fingerprint,
    )


def checkpoint_step(checkpoint: str) -> Optional[int]:
    """The step of a ``checkpoint-N`` directory (``None`` for another name)."""
    base = os.path.basename(os.path.normpath(checkpoint))
    prefix, _, number = base.rpartition("-")
    return int(number) if prefix == CHECKPOINT_PREFIX and number.isdigit() else None


def checkpoint_safety_report(trainer: ReportableTrainer, checkpoint: str, model: Any, *,
                             old_model: Optional[Any] = None,
                             old_model_values: Optional[Mapping[str, float]] = None) -> SafetyReport:
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
    return SafetyReport(
        constraints=constraint_results(trainer, values, _old_values(trainer, old_model, old_model_values)),
        objective_metrics=objective,
        global_step=step,
        checkpoint=checkpoint,
        method=method_settings(trainer),
        model_name=os.path.basename(os.path.normpath(checkpoint)),
        weights_fingerprint=weights_fingerprint(model),
    )


__all__ = [
    "ReportableTrainer",
    "build_safety_report",
    "checkpoint_safety_report",
    "checkpoint_step",
    "constraint_results",
    "method_settings",
    "old_model_constraint_values",
    "report_from_metrics",
]
