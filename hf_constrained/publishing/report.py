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

from ..atomic_files import atomic_write_json
from ..certification.certify import certified_candidates
from .tables import (
    CERTIFIED,
    EXACT_FAILS,
    EXACT_HOLDS,
    FAILS,
    HOLDS,
    NO_CERTIFICATION_SPLIT,
    NOT_CERTIFIED,
    NOT_TESTED,
    ReportText,
)

logger = logging.getLogger(__name__)

SAFETY_REPORT_NAME = "safety_report.json"
# a Hugging Face token (the pattern of hf_constrained.publishable.HF_TOKEN_PATTERN: this module
# imports nothing from the package); a saved report never holds one
_HF_TOKEN = re.compile(r"hf_[A-Za-z0-9]{30,}")
# the key under which a saved report stores the digest of the rest of its content
CONTENT_DIGEST_KEY = "content_digest"
EVAL_CONSTRAINT_PREFIX = "eval_constraint/"

# how a verdict is decided: "certified" (the default: a finite-sample certificate on a certification split,
# :mod:`hf_constrained.certification.certify`), or the uncertified rules of :meth:`ConstraintResult.holds`
SAFETY_RULES = ("certified", "point", "upper_bound")
DEFAULT_SAFETY_RULE = "certified"


@dataclass(frozen=True)
class ConstraintVerdict:
    """One constraint's verdict under a report's rule: whether it passes and the word shown for it."""

    name: str
    passes: bool
    word: str


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
        """The stored fields; no verdict of its own (a report adds the one of :meth:`SafetyReport.verdicts`)."""
        return {**asdict(self), "violation": self.violation}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ConstraintResult":
        def number(key: str) -> Optional[float]:
            return None if data.get(key) is None else float(data[key])

        value = number("value")  # a non-finite value is stored as null (strict JSON)
        return cls(str(data["name"]), math.nan if value is None else value, float(data["tolerance"]),
                   number("old_value"),
                   data.get("data", "held-out"), number("upper_bound"), number("confidence"),
                   data.get("bound_method"), number("std_error"),
                   None if data.get("num_rows") is None else int(data["num_rows"]), number("margin"),
                   dict(data.get("extra") or {}))


@dataclass
class SafetyReport(ReportText):
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
        weights_fingerprint: :func:`~hf_constrained.safety.model_fingerprint.weights_fingerprint`
            of the evaluated weights; the gate re-evaluates when the weights no longer match.
        safety_rule: what decides the verdict: ``"certified"`` (default: the
            :attr:`certificate` certifies these weights, see :attr:`certified`), or the
            uncertified rules ``"point"`` (every held-out value within tolerance) and
            ``"upper_bound"`` (every CLT upper bound within tolerance).
        extra_columns: the names of the caller-supplied columns (``ConstraintResult.extra``),
            in display order.
        certificate: :meth:`Certificate.to_dict() <hf_constrained.certification.certify.Certificate.to_dict>`
            of the certification of these weights (``None`` without a certification split).
        certificate_candidate: which candidate of the certificate these weights are.
        not_certifiable: constraints without a certification split (``certify.dataset``): a
            run with any is not certified.
        settings: the certificate's settings the run ended with (``delta``, ``safety_rule``, ``candidates``,
            ``confidence``: :meth:`CertificateSettings.to_dict
            <hf_constrained.safety.settings.CertificateSettings.to_dict>`); empty for a report made otherwise.
        statistics: per certifiable constraint, what the certificate measures: ``description``
            (the statistic and its unit, e.g. "share of the task's examples forgotten"), ``proxy``
            (whether it differs from the trained constraint) and ``old_value`` (the old model's
            value of the statistic, when known).
        weights_files_fingerprint: when the report is saved next to the evaluated weights (or names their
            folder, ``weights_folder``),
            :func:`~hf_constrained.certification.fingerprint.weights_files_fingerprint` of those files
            (``hf-constrained report --check`` compares it with the files); ``None`` otherwise.
        weights_folder: where the evaluated weights are when they are not beside the report (``hf-constrained
            certify`` of a model folder into another output folder): relative to the report's folder, or
            absolute; ``--check`` fingerprints that folder and ``push`` uploads its weights. ``None``: beside it.
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
    safety_rule: str = DEFAULT_SAFETY_RULE
    extra_columns: list[str] = field(default_factory=list)
    certificate: Optional[dict[str, Any]] = None
    certificate_candidate: int = 0
    not_certifiable: list[str] = field(default_factory=list)
    weights_files_fingerprint: Optional[str] = None
    statistics: dict[str, dict[str, Any]] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    weights_folder: Optional[str] = None
    created_at: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))

    # ------------------------------------------------------------------ verdict
    def __post_init__(self) -> None:
        check_safety_rule(self.safety_rule)

    def verdicts(self) -> list["ConstraintVerdict"]:
        """THE verdict loop: one :class:`ConstraintVerdict` per constraint under :attr:`safety_rule`.

        Every verdict the report shows (its JSON, tables, card, ``report --check``, the gate)
        comes from here. Under ``"certified"`` a constraint passes when the certificate tested
        these weights and its certified bound is within the certified tolerance (a data-free
        constraint, which has no sampling error, when its exact value is within tolerance);
        under the uncertified rules, by :meth:`ConstraintResult.holds`.
        """
        if self.safety_rule != "certified":
            return [ConstraintVerdict(c.name, c.holds(self.safety_rule),
                                      HOLDS if c.holds(self.safety_rule) else FAILS) for c in self.constraints]
        cert = self.certificate
        bounds = self.certified_bounds()
        tolerance = (cert or {}).get("tolerance", {})
        out = []
        for c in self.constraints:
            if c.data == "data-free":
                out.append(ConstraintVerdict(c.name, c.satisfied, EXACT_HOLDS if c.satisfied else EXACT_FAILS))
            elif (c.name in self.not_certifiable or (cert is None and c.name not in self.statistics)
                  or (cert is not None and c.name not in tolerance)):
                out.append(ConstraintVerdict(c.name, False, NO_CERTIFICATION_SPLIT))
            elif c.name not in bounds:  # certifiable, but these weights were not tested (yet)
                out.append(ConstraintVerdict(c.name, False, NOT_TESTED))
            else:
                ok = bounds[c.name] is not None and bounds[c.name] <= tolerance[c.name]
                out.append(ConstraintVerdict(c.name, ok, CERTIFIED if ok else NOT_CERTIFIED))
        return out

    @property
    def certified(self) -> bool:
        """Certified at the certificate's delta: every constraint has a certification split,
        these weights are among the certified candidates (recomputed from the stored bounds) and
        data-free constraints, which have no sampling error, hold exactly."""
        if not self.constraints or self.certificate is None or self.not_certifiable:
            return False
        passes = all(v.passes for v in self.with_rule("certified").verdicts())
        return passes and self.certificate_candidate in certified_candidates(self.certificate)

    def certified_bounds(self) -> dict[str, float]:
        """Constraint name -> the certificate's upper bound for these weights (empty when untested)."""
        cert = self.certificate
        if cert is None or self.certificate_candidate >= len(cert.get("upper_bounds", [])):
            return {}
        return dict(cert["upper_bounds"][self.certificate_candidate])

    def certified_values(self) -> dict[str, float]:
        """Constraint name -> the certified statistic's sample value on the certification rows for
        these weights (empty when untested)."""
        cert = self.certificate
        values = (cert or {}).get("values") or []
        if self.certificate_candidate >= len(values):
            return {}
        return {k: v for k, v in values[self.certificate_candidate].items() if v is not None}

    @property
    def all_satisfied(self) -> bool:
        """True when the verdict under :attr:`safety_rule` passes: certified (the default rule),
        or every constraint holds by the uncertified ``"point"`` / ``"upper_bound"`` rule
        (vacuously true with no constraints: see :attr:`checked`)."""
        if self.safety_rule == "certified":
            return self.certified
        return all(v.passes for v in self.verdicts())

    @property
    def checked(self) -> bool:
        """False for a report without constraints: it proves nothing."""
        return bool(self.constraints)

    @property
    def failed(self) -> list[str]:
        """Constraints that do not pass under :attr:`safety_rule` (see :meth:`verdicts`)."""
        return [v.name for v in self.verdicts() if not v.passes]

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
            **({"weights_folder": self.weights_folder} if self.weights_folder is not None else {}),
            "extra_columns": list(self.extra_columns),
            "certified": self.certified,
            "certificate": self.certificate,
            "certificate_candidate": self.certificate_candidate,
            "not_certifiable": list(self.not_certifiable),
            "created_at": self.created_at,
            "statistics": {k: dict(v) for k, v in self.statistics.items()},
            "settings": dict(self.settings),
            "constraints": [{**c.to_dict(), "verdict": v.word, "passes": v.passes}
                            for c, v in zip(self.constraints, self.verdicts())],
            "objective_metrics": dict(self.objective_metrics),
            "selection": self.selection,
            "method": dict(self.method),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SafetyReport":
        try:
            constraints = [ConstraintResult.from_dict(c) for c in data["constraints"]]
            rule = check_safety_rule(data.get("safety_rule", DEFAULT_SAFETY_RULE))
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
            certificate=data.get("certificate"),
            certificate_candidate=int(data.get("certificate_candidate") or 0),
            not_certifiable=list(data.get("not_certifiable") or []),
            statistics={k: dict(v) for k, v in (data.get("statistics") or {}).items()},
            settings=dict(data.get("settings") or {}),
            weights_folder=data.get("weights_folder"),
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
        data = _strict_json(self.to_dict())  # strict JSON: a NaN would make the file unreadable to strict parsers
        text = json.dumps(data, allow_nan=False)
        if _HF_TOKEN.search(text):  # a token pasted into a name or a setting is never written
            logger.warning("the safety report for %s contained a Hugging Face token: it was replaced by <redacted>",
                           path)
            data = json.loads(_HF_TOKEN.sub("<redacted>", text))
        data[CONTENT_DIGEST_KEY] = report_content_digest(data)
        return atomic_write_json(path, data, indent=2, allow_nan=False, newline=True)

    @classmethod
    def load(cls, directory_or_file: str) -> "SafetyReport":
        path = directory_or_file
        if os.path.isdir(path):
            path = os.path.join(path, SAFETY_REPORT_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"no safety report at {path}: hf_constrained.finish_run(trainer, ...) writes one into the output "
                "directory after training, trainer.safety.build_report(checkpoint=DIR) into a checkpoint, and "
                "every checkpoint evaluated during training (eval_strategy) gets its own"
            )
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

def _strict_json(value: Any) -> Any:
    """``value`` with every non-finite float as ``None``: reports are strict JSON (a NaN would
    make ``safety_report.json`` unreadable to strict parsers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value
def report_content_digest(data: Mapping[str, Any]) -> str:
    """``sha256:<hex>`` of a report's JSON content without its ``content_digest`` key, in a
    canonical form (sorted keys, no whitespace), so that it survives a save and a load. It
    shows that a file was edited after it was written; it is no signature (whoever edits the
    file can recompute it)."""
    content = {k: v for k, v in data.items() if k != CONTENT_DIGEST_KEY}
    content = json.loads(json.dumps(content, allow_nan=True))  # as the file holds it: keys are strings
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=True, ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode("ascii")).hexdigest()


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
    "DEFAULT_SAFETY_RULE",
    "EVAL_CONSTRAINT_PREFIX",
    "SAFETY_REPORT_NAME",
    "SAFETY_RULES",
    "ConstraintResult",
    "ConstraintVerdict",
    "SafetyReport",
    "UnsafeModelError",
    "check_safety_rule",
    "objective_metrics_from",
    "report_content_digest",
]
