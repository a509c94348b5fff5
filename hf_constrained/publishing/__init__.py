"""Publishing a run: the safety report, the model card, the figures, the check of a run folder and the push.

What a run leaves for others to read, written from a :class:`SafetyReport` (plain data) and never from the
trainer: the safety loop (:mod:`hf_constrained.safety`) builds the report and calls these modules; the
command line (``hf-constrained report``, ``plot``, ``push``) reads the files back without torch.

- :mod:`~hf_constrained.publishing.report`: :class:`SafetyReport` (exact held-out constraint values, the
  old model's values, tolerances, the certificate, the verdict) and its JSON file ``safety_report.json``;
- :mod:`~hf_constrained.publishing.tables`: the report as text and Markdown tables, its verdict in words;
- :mod:`~hf_constrained.publishing.verify`: ``check_run_dir``, the verification behind
  ``hf-constrained report --check`` (exit 0 certified, 1 not, 2 stale or unreadable);
- :mod:`~hf_constrained.publishing.card`: the model card of a report (``huggingface_hub.ModelCard``);
- :mod:`~hf_constrained.publishing.figures`: training-curve figures of a log history and report;
- :mod:`~hf_constrained.publishing.push`: the Hub access check before training and ``hf-constrained push``.

The report names are imported eagerly (plain data, no torch); the card on first use (it loads
``huggingface_hub``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy_import import lazy_attributes
from .report import SAFETY_REPORT_NAME, ConstraintResult, SafetyReport, UnsafeModelError
from .tables import format_number

if TYPE_CHECKING:  # pragma: no cover
    from .card import ModelCardInfo

_LAZY = {"ModelCardInfo": ".card"}

__getattr__ = lazy_attributes(__name__, _LAZY, globals())

__all__ = [
    "SAFETY_REPORT_NAME",
    "ConstraintResult",
    "ModelCardInfo",
    "SafetyReport",
    "UnsafeModelError",
    "format_number",
]
