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

import dataclasses
import datetime as _dt
import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

logger = logging.getLogger(__name__)

SAFETY_REPORT_NAME = "safety_report.json"
# a Hugging Face token (the pattern of hf_constrained.publishable.HF_TOKEN_PATTERN: this module
# imports nothing from the package); a saved report never holds one
_HF_TOKEN = re.compile(r"hf_[A-Za-z0-9]{30,}")
# the key under which a saved report stores the digest of the rest of its content
CONTENT_DIGEST_KEY = "content_digest"
EVAL_CONSTRAINT_PREFIX = "eval_constraint/"

# how a verdict is decided (see :meth:`ConstraintResult.holds`)
SAFETY_RULES = ("point", "upper_bound")
HOLDS_WITH_CONFIDENCE = "holds with confidence"
HOLDS_ON_POINT_ESTIMATE = "holds on the point estimate only"
FAILS = "fails"


def check_safety_rule(rule: str) -> str:
    """``rule`` if it is one of :data:`SAFETY_RULES`, else a ``ValueError`` naming them."""
    if rule not in SAFETY_RULES:
        raise ValueError(f"safety_rule must be one of {', '.join(SAFETY_RULES)}, got {rule!r}")
    return rule
# speed/bookkeeping keys of Trainer.evaluate that are not objective metrics
_NOT_OBJECTIVE = ("_runtime", "_samples_per_second", "_steps_per_second", "epoch", "_constraint_max_violation",
                  "_constraints_satisfied")
# what the Trainer logs while training (not evaluation results)
_TRAINING_LOG_KEYS = frozenset({"loss", "learning_rate", "grad_norm", "epoch", "total_flos", "step",
                                "num_input_tokens_seen"})


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
    """One constraint on held-out data: h_k(w) (exact), its upper confidence bound,
    h_k(w_old), the tolerance and the verdict.

    Args:
        name, value, tolerance: the constraint h_k(w) <= tolerance_k and its exact value.
        old_value: the old model's value on the same data.
        data: ``"held-out"`` (its ``eval_dataset``), ``"training"`` (no ``eval_dataset``) or
            ``"data-free"``.
        upper_bound: a one-sided upper confidence bound of the value on the population the
            held-out rows were drawn from (``None`` when the constraint gives no per-row
            values); a data-free constraint has no sampling error: its bound is its value.
        confidence: the bound's confidence level (e.g. 0.95).
        bound_method: how the bound was computed (``"CLT"``: value + z_c * s / sqrt(n), see
            :mod:`hf_constrained.statistics`; ``"exact"`` for a data-free constraint).
        std_error, num_rows: the standard error of the (inner) value and the rows behind it.
        margin: the margin in force during training (the constraint was trained to
            ``tolerance - margin``), when calibrated constraints were used.
        extra: caller-supplied columns (e.g. ``{"old accuracy": 0.91, "new accuracy": 0.9}``).
    """

    name: str
    value: float
    tolerance: float
    old_value: Optional[float] = None
    data: str = "held-out"
    upper_bound: Optional[float] = None
    confidence: Optional[float] = None
    bound_method: Optional[str] = None
    std_error: Optional[float] = None
    num_rows: Optional[int] = None
    margin: Optional[float] = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def violation(self) -> float:
        """h_k(w) - tolerance_k; the constraint holds when this is <= 0."""
        return self.value - self.tolerance

    @property
    def satisfied(self) -> bool:
        """The point estimate is within tolerance."""
        return math.isfinite(self.value) and self.violation <= 0.0

    @property
    def bound_satisfied(self) -> Optional[bool]:
        """The upper confidence bound is within tolerance (``None`` without a bound)."""
        if self.upper_bound is None:
            return None
        return math.isfinite(self.upper_bound) and self.upper_bound <= self.tolerance

    @property
    def verdict(self) -> str:
        """``"holds with confidence"`` (the upper bound is within tolerance), ``"holds on the
        point estimate only"`` (the value is, the bound is not or there is none) or ``"fails"``."""
        if not self.satisfied:
            return FAILS
        return HOLDS_WITH_CONFIDENCE if self.bound_satisfied else HOLDS_ON_POINT_ESTIMATE

    def holds(self, rule: str = "point") -> bool:
        """Whether the constraint passes under ``rule``: ``"point"``, the value is within
        tolerance; ``"upper_bound"``, the upper confidence bound is (a constraint without a
        bound is judged on its value, and reports list it, see
        :attr:`SafetyReport.without_bound`)."""
        check_safety_rule(rule)
        if rule == "upper_bound" and self.upper_bound is not None:
            return bool(self.bound_satisfied)
        return self.satisfied

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "violation": self.violation, "satisfied": self.satisfied, "verdict": self.verdict}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ConstraintResult":
        def number(key: str) -> Optional[float]:
            return None if data.get(key) is None else float(data[key])

        return cls(str(data["name"]), float(data["value"]), float(data["tolerance"]), number("old_value"),
                   data.get("data", "held-out"), number("upper_bound"), number("confidence"),
                   data.get("bound_method"), number("std_error"),
                   None if data.get("num_rows") is None else int(data["num_rows"]), number("margin"),
                   dict(data.get("extra") or {}))


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
        safety_rule: what decides SAFE/UNSAFE: ``"point"`` (default: every value within
            tolerance) or ``"upper_bound"`` (every upper confidence bound within tolerance).
        extra_columns: the names of the caller-supplied columns (``ConstraintResult.extra``),
            in display order.
        weights_files_fingerprint: when the report is saved next to the evaluated weights,
            :func:`~hf_constrained.safety.fingerprint.weights_files_fingerprint` of those files
            (``hf-constrained report --check`` compares it with the files); ``None`` otherwise.
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
    safety_rule: str = "point"
    extra_columns: list[str] = field(default_factory=list)
    weights_files_fingerprint: Optional[str] = None
    created_at: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))

    # ------------------------------------------------------------------ verdict
    def __post_init__(self) -> None:
        check_safety_rule(self.safety_rule)

    @property
    def all_satisfied(self) -> bool:
        """True when every constraint holds on the held-out data under :attr:`safety_rule`
        (vacuously true with none: see :attr:`checked`)."""
        return all(c.holds(self.safety_rule) for c in self.constraints)

    @property
    def checked(self) -> bool:
        """False for a report without constraints: it proves nothing."""
        return bool(self.constraints)

    @property
    def failed(self) -> list[str]:
        """Constraints that do not hold under :attr:`safety_rule`."""
        return [c.name for c in self.constraints if not c.holds(self.safety_rule)]

    @property
    def without_bound(self) -> list[str]:
        """Constraints with no upper confidence bound (no per-row values)."""
        return [c.name for c in self.constraints if c.upper_bound is None]

    def with_rule(self, rule: str) -> "SafetyReport":
        """The same report judged by another rule (``"point"`` or ``"upper_bound"``)."""
        return dataclasses.replace(self, safety_rule=check_safety_rule(rule))

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
            "safety_rule": self.safety_rule,
            "failed": self.failed,
            "max_violation": self.max_violation,
            "not_held_out": self.not_held_out,
            "split": self.split,
            "global_step": self.global_step,
            "checkpoint": self.checkpoint,
            "model_name": self.model_name,
            "weights_fingerprint": self.weights_fingerprint,
            "weights_files_fingerprint": self.weights_files_fingerprint,
            "extra_columns": list(self.extra_columns),
            "created_at": self.created_at,
            "constraints": [c.to_dict() for c in self.constraints],
            "objective_metrics": dict(self.objective_metrics),
            "selection": self.selection,
            "method": dict(self.method),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SafetyReport":
        try:
            constraints = [ConstraintResult.from_dict(c) for c in data["constraints"]]
            rule = check_safety_rule(data.get("safety_rule", "point"))
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
            weights_files_fingerprint=data.get("weights_files_fingerprint"),
            safety_rule=rule,
            extra_columns=list(data.get("extra_columns") or []),
            created_at=data.get("created_at", ""),
        )

    def save(self, directory_or_file: str) -> str:
        """Write the report as JSON (to ``<dir>/safety_report.json`` for a directory).

        Written to a temporary file and moved into place, so a crash never leaves a
        half-written report. The file ends with ``content_digest``, the
        :func:`report_content_digest` of everything else in it, so that a later edit shows.
        Returns the path.
        """
        path = directory_or_file
        if os.path.isdir(path) or not path.endswith(".json"):
            os.makedirs(path, exist_ok=True)
            path = os.path.join(path, SAFETY_REPORT_NAME)
        tmp = f"{path}.tmp.{os.getpid()}"
        data = self.to_dict()
        text = json.dumps(data, allow_nan=True)
        if _HF_TOKEN.search(text):  # a token pasted into a name or a setting is never written
            logger.warning("the safety report for %s contained a Hugging Face token: it was replaced by <redacted>",
                           path)
            data = json.loads(_HF_TOKEN.sub("<redacted>", text))
        data[CONTENT_DIGEST_KEY] = report_content_digest(data)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, allow_nan=True)
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
    def bound_header(self) -> str:
        """``upper bound (95% CLT)`` when every bound shares its level and method."""
        levels = {(c.confidence, c.bound_method) for c in self.constraints
                  if c.upper_bound is not None and c.bound_method != "exact"}
        if len(levels) == 1:
            confidence, method = next(iter(levels))
            if confidence is not None:
                return f"upper bound ({100 * confidence:.4g}%{' ' + method if method else ''})"
        return "upper bound"

    def table_rows(self) -> list[list[str]]:
        """Header + one row per constraint: name, held-out value, upper confidence bound (when
        any), old value, tolerance, margin (when any), violation, verdict, extra columns."""
        show_bound = any(c.upper_bound is not None for c in self.constraints)
        show_margin = any(c.margin is not None for c in self.constraints)
        header = ["constraint", "held-out value"] + ([self.bound_header()] if show_bound else [])
        header += ["old model", "tolerance"] + (["margin"] if show_margin else []) + ["violation", "verdict"]
        rows = [header + list(self.extra_columns)]
        for c in self.constraints:
            name = c.name + (" (training data)" if c.data == "training" else "")
            row = [name, format_number(c.value)] + ([format_number(c.upper_bound)] if show_bound else [])
            row += [format_number(c.old_value), format_number(c.tolerance)]
            row += [format_number(c.margin)] if show_margin else []
            verdict = c.verdict if c.verdict != FAILS else "FAILS"
            row += [format_number(c.violation), verdict]
            row += [_cell(c.extra.get(col)) for col in self.extra_columns]
            rows.append(row)
        return rows

    def format_table(self, markdown: bool = False) -> str:
        """The constraint table as aligned plain text, or as a Markdown table."""
        rows = self.table_rows()
        if markdown:
            align = ["---"] + ["---:" if h != "verdict" else ":---" for h in rows[0][1:]]
            lines = ["| " + " | ".join(rows[0]) + " |", "|" + "|".join(align) + "|"]
            lines += ["| " + " | ".join(_escape_md(x) for x in r) + " |" for r in rows[1:]]
            return "\n".join(lines)
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        left = {0, rows[0].index("verdict")}  # text columns; numbers align right
        fmt = "  ".join(("{:<%d}" if i in left else "{:>%d}") % w for i, w in enumerate(widths))
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
        if self.safety_rule == "upper_bound":
            judged = "their upper confidence bounds"
            if self.without_bound:
                caveat += (f"; {len(self.without_bound)} constraint(s) have no confidence bound and were judged on "
                           f"their value: {', '.join(self.without_bound)}")
        else:
            judged = "the point estimate"
            uncertain = [c.name for c in self.constraints if c.verdict == HOLDS_ON_POINT_ESTIMATE
                         and c.upper_bound is not None]
            if uncertain:
                caveat += f"; {len(uncertain)} hold on the point estimate only: {', '.join(uncertain)}"
        if self.all_satisfied:
            return (f"SAFE: all {n} constraints hold on held-out data, judged by {judged} "
                    f"(max violation {format_number(self.max_violation)}){caveat}")
        return (f"UNSAFE: {len(self.failed)} of {n} constraints fail on held-out data, judged by {judged} "
                f"(max violation {format_number(self.max_violation)}): {', '.join(self.failed)}{caveat}")


def report_content_digest(data: Mapping[str, Any]) -> str:
    """``sha256:<hex>`` of a report's JSON content without its ``content_digest`` key, in a
    canonical form (sorted keys, no whitespace), so that it survives a save and a load. It
    shows that a file was edited after it was written; it is no signature (whoever edits the
    file can recompute it)."""
    content = {k: v for k, v in data.items() if k != CONTENT_DIGEST_KEY}
    content = json.loads(json.dumps(content, allow_nan=True))  # as the file holds it: keys are strings
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=True, ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode("ascii")).hexdigest()


def _cell(value: Any) -> str:
    return format_number(value) if value is None or isinstance(value, (int, float)) else str(value)


def _escape_md(text: str) -> str:
    return text.replace("|", "\\|")


def objective_metrics_from(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The held-out objective part of ``Trainer.evaluate`` metrics (``<prefix>_<metric>``, e.g.
    ``eval_loss``): no constraint, speed or epoch keys, and nothing from training (``train_*``,
    or keys without a prefix such as ``loss`` and ``learning_rate``)."""
    out = {}
    for key, value in metrics.items():
        if ("_" not in key or key.startswith("train_") or key in _TRAINING_LOG_KEYS or "constraint/" in key
                or key.endswith(_NOT_OBJECTIVE) or isinstance(value, bool) or not isinstance(value, (int, float))):
            continue
        out[key] = float(value)
    return out


__all__ = [
    "CONTENT_DIGEST_KEY",
    "EVAL_CONSTRAINT_PREFIX",
    "FAILS",
    "HOLDS_ON_POINT_ESTIMATE",
    "HOLDS_WITH_CONFIDENCE",
    "SAFETY_REPORT_NAME",
    "SAFETY_RULES",
    "check_safety_rule",
    "ConstraintResult",
    "SafetyReport",
    "UnsafeModelError",
    "format_number",
    "objective_metrics_from",
    "report_content_digest",
]
