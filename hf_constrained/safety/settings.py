"""The certificate's settings, in one place: :class:`CertificateSettings`, held by the safety loop.

Everything that decides what a run's certificate claims and what its end writes is one value, held by
``trainer.safety`` (:class:`~hf_constrained.safety.loop.SafetyLoop`) and replaced, never edited in place:

- **the claim**: ``delta`` (with probability at least ``1 - delta`` over the certification rows, a certified
  model satisfies every constraint on the population its split was drawn from), the ``safety_rule`` that
  decides the verdict, the ``candidates`` the certificate tests (Learn-Then-Test over the final model or every
  checkpoint, :mod:`hf_constrained.certification.certify`) and the ``confidence`` of the CLT bounds shown beside
  the values;
- **what the end of the run writes**: the figures (``plots``) and what the card says of the model and its data
  (``card``, a :class:`~hf_constrained.publishing.card.ModelCardInfo`).

:meth:`CertificateSettings.changed` is the one parser of a change (``finish_run``'s keywords use it): every
value is checked when the settings are built, so a wrong ``delta`` or rule fails before anything is evaluated.

:class:`CertificateArguments` is the certificate's part of a recipe's command line (``--delta``, its help and its
check), declared once: every recipe's argument dataclass inherits it, and
:meth:`CertificateArguments.certificate_settings` turns the parsed values into :class:`CertificateSettings`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from ..certification.bounds import check_delta
from ..certification.certify import DEFAULT_DELTA
from ..publishing.card import ModelCardInfo
from ..publishing.report import DEFAULT_SAFETY_RULE, check_safety_rule
from ..redact import redact_command
from .evaluation import DEFAULT_CONFIDENCE

CANDIDATES = ("final", "checkpoints")

CARD_KEYWORDS = {"base_model_name": "base_model", "dataset_description": "dataset_description",
                 "datasets": "datasets", "eval_dataset": "eval_dataset", "reproduce_command": "reproduce_command",
                 "license": "license", "task": "task", "population": "population"}
"""``finish_run``'s card keywords and the :class:`~hf_constrained.publishing.card.ModelCardInfo` field each sets."""


@dataclass(frozen=True)
class CertificateSettings:
    """What a run's certificate claims and what the end of the run writes.

    Args:
        delta: the certificate's error level: with probability at least ``1 - delta`` over the certification
            sample, a certified model satisfies every constraint on the population the split was drawn from.
        safety_rule: what decides the verdict, at the end of the run and in every later ``push_to_hub``:
            ``"certified"`` (the finite-sample certificate on each constraint's ``certify.dataset``), or the
            uncertified ``"point"`` (each held-out value within its tolerance) and ``"upper_bound"`` (each CLT
            upper bound within its tolerance; asymptotic).
        candidates: what the certificate tests: ``"final"``, the model in the trainer; or ``"checkpoints"``,
            every complete checkpoint in training order (then the final weights), by fixed-sequence testing,
            releasing the certified one with the best selection-split objective.
        confidence: the level of the CLT upper confidence bounds shown beside the values (no verdict).
        plots: write the training-curve figures: ``True`` needs matplotlib (the ``figures`` extra), ``False``
            skips them, ``None`` writes them when matplotlib is installed.
        card: what the model card says of the model and its data (base model, datasets, license, the command
            that reproduces the run, ...).
    """

    # ------------------------------------------------------------------ the claim
    delta: float = DEFAULT_DELTA
    safety_rule: str = DEFAULT_SAFETY_RULE
    candidates: str = "final"
    confidence: float = DEFAULT_CONFIDENCE
    # ------------------------------------------------------------------ what the end of the run writes
    plots: Optional[bool] = None
    card: ModelCardInfo = field(default_factory=ModelCardInfo)

    def __post_init__(self) -> None:
        object.__setattr__(self, "delta", check_delta(self.delta, "delta"))
        check_safety_rule(self.safety_rule)
        if self.candidates not in CANDIDATES:
            raise ValueError(f"candidates must be 'final' or 'checkpoints', got {self.candidates!r}")
        confidence = float(self.confidence)
        if not 0.5 <= confidence < 1.0 or math.isnan(confidence):
            raise ValueError(f"confidence must be in [0.5, 1), got {self.confidence!r}")
        object.__setattr__(self, "confidence", confidence)
        if self.plots not in (None, True, False):
            raise ValueError(f"plots must be True, False or None, got {self.plots!r}")
        if not isinstance(self.card, ModelCardInfo):
            raise TypeError(f"card must be a ModelCardInfo, got {type(self.card).__name__}")

    def changed(self, output_dir: Optional[str] = None, **changes: Any) -> CertificateSettings:
        """A copy with ``changes`` applied, checked: any field of these settings by name, and the card's by
        ``finish_run``'s keywords (:data:`CARD_KEYWORDS`: ``base_model_name``, ``dataset_description``,
        ``datasets``, ``eval_dataset``, ``reproduce_command``, ``license``, ``task``, ``population``). ``None``
        leaves a setting as it is; a reproduce command is recorded without secrets or ``output_dir``'s path."""
        fields = {f.name for f in dataclasses.fields(self)} - {"card"}
        unknown = sorted(set(changes) - fields - set(CARD_KEYWORDS))
        if unknown:
            raise TypeError(f"unknown certificate setting(s) {unknown}: the settings are "
                            f"{sorted(fields | set(CARD_KEYWORDS))}")
        own = {k: v for k, v in changes.items() if k in fields and v is not None}
        card = {CARD_KEYWORDS[k]: v for k, v in changes.items() if k in CARD_KEYWORDS and v is not None}
        if "datasets" in card:
            card["datasets"] = list(card["datasets"])
        if "reproduce_command" in card:
            card["reproduce_command"] = redact_command(card["reproduce_command"], output_dir)  # no secret, no path
        if card:
            own["card"] = dataclasses.replace(self.card, **card)
        return dataclasses.replace(self, **own) if own else self

    def to_dict(self) -> dict[str, Any]:
        """The settings as a report records them (the card's information is in the card itself)."""
        return {"delta": self.delta, "safety_rule": self.safety_rule, "candidates": self.candidates,
                "confidence": self.confidence}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CertificateSettings:
        """Settings recorded by :meth:`to_dict` (missing keys: the defaults)."""
        known = {f.name for f in dataclasses.fields(cls)} - {"card", "plots"}
        return cls(**{k: v for k, v in data.items() if k in known})


DELTA_HELP = "The certificate's error level: it holds with probability at least 1 - delta."
"""The help of ``--delta``, the same in every recipe."""


@dataclass(kw_only=True)
class CertificateArguments:
    """The certificate's command-line settings, shared by every recipe: a recipe's argument dataclass inherits
    them (keyword-only, so a recipe's own required fields may come first), ``--delta`` is declared and checked
    here once (before anything trains: it is read only at the end of the run), and
    :meth:`certificate_settings` gives the :class:`CertificateSettings` the run's safety loop holds.

    Args:
        delta: the certificate's error level (:attr:`CertificateSettings.delta`), in (0, 1).
    """

    delta: float = field(default=DEFAULT_DELTA, metadata={"help": DELTA_HELP})

    def __post_init__(self) -> None:
        self.delta = check_delta(self.delta, "--delta")  # NaN fails too; the recipe's parser shows it in one line

    def certificate_settings(self, **changes: Any) -> CertificateSettings:
        """The :class:`CertificateSettings` of these arguments, with ``changes`` (:meth:`CertificateSettings.changed`'s
        keywords: the rule, the candidates, the card's information, ...) applied."""
        return CertificateSettings(delta=self.delta).changed(**changes)


__all__ = ["CANDIDATES", "CARD_KEYWORDS", "DELTA_HELP", "CertificateArguments", "CertificateSettings"]
