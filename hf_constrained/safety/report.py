"""The safety report: the data, its JSON file and its text/Markdown rendering.

For every constraint h_k(w) <= tolerance_k of problem (1) (Yang et al., TMLR 2026) a
:class:`SafetyReport` holds the exact value on held-out data (a full pass, not the MSVR
estimate u_k of Algorithm 1, line 6), the old/base model's value on the same data, the
tolerance and whether the constraint holds, plus the held-out objective metrics. It is
saved as ``safety_report.json`` in the run directory (and in each checkpoint).

This module is the bottom of :mod:`hf_constrained.safety`: plain data, no trainer, no
torch, so ``hf-constrained report`` reads reports without loading a model library.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

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
        weights_fingerprint: :func:`~hf_constrained.safety.fingerprint.weights_fingerprint`
            of the evaluated weights; the gate re-evaluates when the weights no longer match.
    """

    constraints: list[ConstraintResult]
    objective_metrics: dict[str, float] = field(default_factory=dict)
    split: str = "eval"
    global_step: Optional[int] = None
    checkpoint: Optional[str] = None
    selection: Optional[dict[str, Any]] = None
    method: dict[str, Any] = field(default_factory=dict)
    model_name: Optional[str] = None
    weights_fingerprint: Optional[str] = None
    created_at: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))

    # ------------------------------------------------------------------ verdict
    @property
    def all_satisfied(self) -> bool:
        """True when every constraint holds on the held-out data (vacuously true with none:
        see :attr:`checked`)."""
        return all(c.satisfied for c in self.constraints)

    @property
    def checked(self) -> bool:
        """False for a report without constraints: it proves nothing."""
        return bool(self.constraints)

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
            "weights_fingerprint": self.weights_fingerprint,
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
            weights_fingerprint=data.get("weights_fingerprint"),
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
                f"no safety report at {path}: hf_constrained.finish_run(trainer, ...) writes one into the output "
                "directory after training, trainer.build_safety_report(checkpoint=DIR) into a checkpoint, and "
                "every checkpoint evaluated during training (eval_strategy) gets its own"
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
        if not n:
            return "NOT CHECKED: the report has no constraints, so it shows nothing about the model's safety"
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


def objective_metrics_from(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The objective part of ``Trainer.evaluate`` metrics: no constraint, speed or epoch keys."""
    out = {}
    for key, value in metrics.items():
        if (key in ("step", "total_flos") or "constraint/" in key or key.endswith(_NOT_OBJECTIVE)
                or isinstance(value, bool) or not isinstance(value, (int, float))):
            continue
        out[key] = float(value)
    return out


__all__ = [
    "EVAL_CONSTRAINT_PREFIX",
    "SAFETY_REPORT_NAME",
    "ConstraintResult",
    "SafetyReport",
    "UnsafeModelError",
    "format_number",
    "objective_metrics_from",
]
