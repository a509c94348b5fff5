"""The safety report: does a fine-tuned model satisfy its constraints on held-out data?

For every constraint h_k(w) <= tolerance_k of problem (1) (Yang et al., TMLR 2026) the
report holds the exact value on held-out data (a full pass, not the MSVR estimate u_k
of Algorithm 1, line 6), the old/base model's value on the same data, the tolerance and
whether the constraint holds, plus the held-out objective metrics. It is saved as
``safety_report.json`` in the run directory (and in each checkpoint).

A recipe ends with one call::

    report = finish_run(trainer, old_model=base_model, base_model_name="openai/clip-vit-base-patch16",
                        dataset_description="BDD100K weather", reproduce_command="accelerate launch ...")

which evaluates the final model, writes ``safety_report.json``, the model card
(``README.md``), ``trainer_state.json`` and the training-curve figures into
``trainer.args.output_dir``.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from .trainer import ConstrainedTrainer

logger = logging.getLogger(__name__)

SAFETY_REPORT_NAME = "safety_report.json"
EVAL_CONSTRAINT_PREFIX = "eval_constraint/"
# speed/bookkeeping keys of Trainer.evaluate that are not objective metrics
_NOT_OBJECTIVE = ("_runtime", "_samples_per_second", "_steps_per_second", "epoch", "_constraint_max_violation",
                  "_constraints_satisfied")


class UnsafeModelError(RuntimeError):
    """Raised instead of publishing a model whose constraints fail on held-out data."""


def format_number(value: Optional[float]) -> str:
    """How reports, tables and cards print a number (6 significant digits)."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:.6g}"


@dataclass
class ConstraintResult:
    """One constraint on held-out data: h_k(w) (exact), h_k(w_old), tolerance."""

    name: str
    value: float
    tolerance: float
    old_value: Optional[float] = None
    data: str = "held-out"  # "held-out" (eval_dataset), "training" (no eval_dataset given) or "data-free"

    @property
    def violation(self) -> float:
        """h_k(w) - tolerance_k; the constraint holds when this is <= 0."""
        return self.value - self.tolerance

    @property
    def satisfied(self) -> bool:
        return math.isfinite(self.value) and self.violation <= 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "violation": self.violation, "satisfied": self.satisfied}


@dataclass
class SafetyReport:
    """Exact held-out constraint values of one model, next to the old model's.

    Args:
        constraints: one :class:`ConstraintResult` per constraint, in the trainer's order.
        objective_metrics: held-out objective metrics (e.g. ``eval_loss``, ``eval_auc``).
        split: which constraint data was used (``"eval"``: each constraint's
            ``eval_dataset``, falling back to its training data).
        global_step: the optimizer step the evaluated weights come from.
        checkpoint: the checkpoint directory the evaluated weights were loaded from, if any.
        selection: the feasible-checkpoint selection summary (see
            :mod:`hf_constrained.selection`), when there was one.
        method: the method and its settings (penalty, beta, gammas, sampling).
        model_name: what the report is about (run or model name).
    """

    constraints: list[ConstraintResult]
    objective_metrics: dict[str, float] = field(default_factory=dict)
    split: str = "eval"
    global_step: Optional[int] = None
    checkpoint: Optional[str] = None
    selection: Optional[dict[str, Any]] = None
    method: dict[str, Any] = field(default_factory=dict)
    model_name: Optional[str] = None
    created_at: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))

    # ------------------------------------------------------------------ verdict
    @property
    def all_satisfied(self) -> bool:
        """True when every constraint holds on the held-out data (vacuously true with none)."""
        return all(c.satisfied for c in self.constraints)

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.constraints if not c.satisfied]

    @property
    def not_held_out(self) -> list[str]:
        """Constraints checked on their training data because they have no ``eval_dataset``."""
        return [c.name for c in self.constraints if c.data == "training"]

    @property
    def max_violation(self) -> Optional[float]:
        return max((c.violation for c in self.constraints), default=None)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return {
            "all_satisfied": self.all_satisfied,
            "failed": self.failed,
            "max_violation": self.max_violation,
            "not_held_out": self.not_held_out,
            "split": self.split,
            "global_step": self.global_step,
            "checkpoint": self.checkpoint,
            "model_name": self.model_name,
            "created_at": self.created_at,
            "constraints": [c.to_dict() for c in self.constraints],
            "objective_metrics": dict(self.objective_metrics),
            "selection": self.selection,
            "method": dict(self.method),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SafetyReport":
        try:
            constraints = [
                ConstraintResult(c["name"], float(c["value"]), float(c["tolerance"]),
                                 None if c.get("old_value") is None else float(c["old_value"]),
                                 c.get("data", "held-out"))
                for c in data["constraints"]
            ]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a safety report: {exc!r}") from exc
        return cls(
            constraints=constraints,
            objective_metrics=dict(data.get("objective_metrics") or {}),
            split=data.get("split", "eval"),
            global_step=data.get("global_step"),
            checkpoint=data.get("checkpoint"),
            selection=data.get("selection"),
            method=dict(data.get("method") or {}),
            model_name=data.get("model_name"),
            created_at=data.get("created_at", ""),
        )

    def save(self, directory_or_file: str) -> str:
        """Write the report as JSON (to ``<dir>/safety_report.json`` for a directory).

        Written to a temporary file and moved into place, so a crash never leaves a
        half-written report. Returns the path.
        """
        path = directory_or_file
        if os.path.isdir(path) or not path.endswith(".json"):
            os.makedirs(path, exist_ok=True)
            path = os.path.join(path, SAFETY_REPORT_NAME)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, allow_nan=True)
            f.write("\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, directory_or_file: str) -> "SafetyReport":
        path = directory_or_file
        if os.path.isdir(path):
            path = os.path.join(path, SAFETY_REPORT_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"no safety report at {path}: it is written by hf_constrained.safety.finish_run(trainer, ...) "
                "or trainer.safety_report() after training"
            )
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    # ------------------------------------------------------------------ display
    def table_rows(self) -> list[list[str]]:
        """Header + one row per constraint: name, value, old value, tolerance, violation, status."""
        rows = [["constraint", "held-out value", "old model", "tolerance", "violation", "satisfied"]]
        for c in self.constraints:
            name = c.name + (" (training data)" if c.data == "training" else "")
            rows.append([name, format_number(c.value), format_number(c.old_value), format_number(c.tolerance),
                         format_number(c.violation), "yes" if c.satisfied else "NO"])
        return rows

    def format_table(self, markdown: bool = False) -> str:
        """The constraint table as aligned plain text, or as a Markdown table."""
        rows = self.table_rows()
        if markdown:
            lines = ["| " + " | ".join(rows[0]) + " |", "|" + "|".join(["---"] + ["---:"] * 4 + [":---:"]) + "|"]
            lines += ["| " + " | ".join(_escape_md(x) for x in r) + " |" for r in rows[1:]]
            return "\n".join(lines)
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        fmt = "  ".join("{:<%d}" % widths[0] if i == 0 else "{:>%d}" % w for i, w in enumerate(widths))
        lines = [fmt.format(*rows[0]), "  ".join("-" * w for w in widths)]
        lines += [fmt.format(*r) for r in rows[1:]]
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: SAFE/UNSAFE, how many constraints fail, the largest violation."""
        n = len(self.constraints)
        caveat = ""
        if self.not_held_out:
            caveat = (f"; {len(self.not_held_out)} constraint(s) have no held-out data and were checked on their "
                      f"training data: {', '.join(self.not_held_out)}")
        if self.all_satisfied:
            return (f"SAFE: all {n} constraints hold on held-out data "
                    f"(max violation {format_number(self.max_violation)}){caveat}")
        return (f"UNSAFE: {len(self.failed)} of {n} constraints fail on held-out data "
                f"(max violation {format_number(self.max_violation)}): {', '.join(self.failed)}{caveat}")


def _escape_md(text: str) -> str:
    return text.replace("|", "\\|")


# ---------------------------------------------------------------------- building a report
def method_settings(trainer: "ConstrainedTrainer") -> dict[str, Any]:
    """The method and its settings as recorded in reports and cards (REFERENCE section 2)."""
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


def objective_metrics_from(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The objective part of ``Trainer.evaluate`` metrics: no constraint, speed or epoch keys."""
    out = {}
    for key, value in metrics.items():
        if (key in ("step", "total_flos") or "constraint/" in key or key.endswith(_NOT_OBJECTIVE)
                or isinstance(value, bool) or not isinstance(value, (int, float))):
            continue
        out[key] = float(value)
    return out


def _check_names(trainer: "ConstrainedTrainer", values: Mapping[str, float], what: str) -> None:
    names = [c.name for c in trainer.constraints]
    missing = [n for n in names if n not in values]
    extra = [n for n in values if n not in names]
    if missing or extra:
        raise ValueError(f"{what} must have one value per constraint {names}; missing {missing}, unknown {extra}")


def old_model_constraint_values(trainer: "ConstrainedTrainer", old_model: Optional["nn.Module"] = None,
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


def constraint_results(trainer: "ConstrainedTrainer", values: Mapping[str, float],
                       old: Optional[Mapping[str, float]]) -> list[ConstraintResult]:
    """One :class:`ConstraintResult` per constraint of ``trainer``, recording whether its value
    comes from held-out data (its ``eval_dataset``) or, lacking one, from its training data."""
    out = []
    for c in trainer.constraints:
        data = "data-free" if c.data_free else ("held-out" if c.eval_dataset is not None else "training")
        out.append(ConstraintResult(c.name, float(values[c.name]), float(c.tolerance),
                                    None if old is None or old.get(c.name) is None else float(old[c.name]), data))
    return out


def build_safety_report(
    trainer: "ConstrainedTrainer",
    *,
    old_model: Optional["nn.Module"] = None,
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
        checkpoint: recorded as the origin of the weights (see
            :func:`build_checkpoint_safety_report` to evaluate a saved checkpoint).
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
    old = old_model_constraint_values(trainer, old_model, old_model_values)
    if old is None:
        old = getattr(trainer, "reference_constraint_values", None)
    selection = None
    step = trainer.state.global_step
    if hasattr(trainer, "feasible_selection"):
        sel = trainer.feasible_selection()
        selection = None if sel is None else sel.to_dict()
    weights = getattr(trainer, "_weights_eval", None)
    if checkpoint is None and weights is not None and weights[0] == step and weights[3] is not None:
        # after training, load_best_model_at_end put the best checkpoint's weights in the model
        step, checkpoint = weights[2], weights[3]
    report = SafetyReport(
        constraints=constraint_results(trainer, values, old),
        objective_metrics=objective,
        split="eval",
        global_step=step,
        checkpoint=checkpoint,
        selection=selection,
        method=method_settings(trainer),
        model_name=model_name or os.path.basename(os.path.normpath(trainer.args.output_dir)),
    )
    logger.info("%s", report.summary())
    return report


def report_from_metrics(trainer: "ConstrainedTrainer", metrics: Mapping[str, Any], *,
                        step: Optional[int] = None, checkpoint: Optional[str] = None) -> Optional[SafetyReport]:
    """A report from the metrics of an evaluation that already ran (no extra pass);
    ``None`` when those metrics hold no exact constraint values."""
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
    )


def build_checkpoint_safety_report(trainer: "ConstrainedTrainer", checkpoint: str, *,
                                   old_model: Optional["nn.Module"] = None,
                                   old_model_values: Optional[Mapping[str, float]] = None,
                                   save: bool = True) -> SafetyReport:
    """On-demand report for a saved checkpoint, leaving ``trainer.model`` untouched.

    The checkpoint's weights are loaded into a copy of the trainer's model and its
    constraints evaluated exactly on held-out data; the objective metrics are those
    logged at the checkpoint's step (``trainer_state.json``), if any. With ``save`` the
    report is written into the checkpoint directory.
    """
    import copy

    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    if not os.path.isdir(checkpoint):
        raise FileNotFoundError(f"checkpoint directory {checkpoint} does not exist")
    model = copy.deepcopy(trainer.accelerator.unwrap_model(trainer.model))
    trainer._load_from_checkpoint(checkpoint, model=model)
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
    elif os.path.basename(os.path.normpath(checkpoint)).startswith(PREFIX_CHECKPOINT_DIR + "-"):
        step = int(os.path.basename(os.path.normpath(checkpoint)).rsplit("-", 1)[1])
    old = old_model_constraint_values(trainer, old_model, old_model_values)
    if old is None:
        old = getattr(trainer, "reference_constraint_values", None)
    report = SafetyReport(
        constraints=constraint_results(trainer, values, old),
        objective_metrics=objective,
        global_step=step,
        checkpoint=checkpoint,
        method=method_settings(trainer),
        model_name=os.path.basename(os.path.normpath(checkpoint)),
    )
    if save and trainer.is_world_process_zero():
        report.save(checkpoint)
    return report


def finish_run(
    trainer: "ConstrainedTrainer",
    *,
    old_model: Optional["nn.Module"] = None,
    old_model_values: Optional[Mapping[str, float]] = None,
    base_model_name: Optional[str] = None,
    dataset_description: Optional[str] = None,
    datasets: Optional[list[str]] = None,
    reproduce_command: Optional[str] = None,
    objective_metrics: Optional[Mapping[str, float]] = None,
    plots: bool = True,
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
    """
    from .model_card import ModelCardInfo

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
    report = build_safety_report(trainer, objective_metrics=objective_metrics)
    trainer.set_safety_report(report)
    if trainer.is_world_process_zero():
        out = trainer.args.output_dir
        os.makedirs(out, exist_ok=True)
        report.save(out)
        trainer.write_model_card(out, report=report)
        trainer.save_state()
        if plots:
            from .plotting import plot_log_history

            try:
                plot_log_history(trainer.state.log_history, os.path.join(out, "figures"), report=report,
                                 title=report.model_name)
            except ValueError as exc:  # nothing to plot must not lose the report written above
                logger.warning("no training-curve figures: %s", exc)
        (logger.info if report.all_satisfied else logger.warning)("%s\n%s", report.summary(), report.format_table())
    return report


__all__ = [
    "SAFETY_REPORT_NAME",
    "ConstraintResult",
    "SafetyReport",
    "UnsafeModelError",
    "build_checkpoint_safety_report",
    "build_safety_report",
    "constraint_results",
    "finish_run",
    "format_number",
    "method_settings",
    "report_from_metrics",
]
