"""The safety loop: is the fine-tuned model safe to publish?

Modules, each importing only those above it (no trainer import anywhere here: the
trainer imports :mod:`~hf_constrained.safety.loop`, never the other way round):

- :mod:`~hf_constrained.safety.report`: :class:`SafetyReport` (exact held-out constraint
  values, old model's values, tolerances, verdict), its JSON file and text/Markdown tables;
- :mod:`~hf_constrained.safety.in_memory_selection`: the same selection without checkpoints on disk
  (:class:`InMemoryFeasibleSelection`, a callback that keeps the best weights in memory);
- :mod:`~hf_constrained.safety.model_fingerprint`: the fingerprint of the weights in memory;
- :mod:`~hf_constrained.safety.split_checks`: a run's certification splits checked against its other data;
- :mod:`~hf_constrained.safety.verify`: ``check_run_dir``, the verification behind
  ``hf-constrained report --check`` (exit 0 certified, 1 not, 2 stale or unreadable);
- :mod:`~hf_constrained.safety.card`: the model card of a report (``huggingface_hub.ModelCard``);
- :mod:`~hf_constrained.safety.figures`: training-curve figures of a log history and report;
- :mod:`~hf_constrained.safety.tensorboard`: TensorBoard with the constraint scalars grouped;
- :mod:`~hf_constrained.safety.view`: :class:`RunView`, the run as the loop reads it (constraints,
  arguments, the engine's settings), and the trainer operations it uses (:class:`SafetyHost`);
- :mod:`~hf_constrained.safety.evaluation`: building a report from a run's view;
- :mod:`~hf_constrained.safety.loop`: :class:`SafetyLoop`, the component the trainer holds
  (``trainer.safety``: selection, reports, cards next to every checkpoint, the gated push),
  driven by :class:`~hf_constrained.safety.loop.SafetyLoopCallback`;
- :mod:`~hf_constrained.safety.finish`: :func:`finish_run`, report + card + figures in one call.

The report names are imported eagerly (plain data, no torch); the rest on first use, so
``hf-constrained report`` starts without loading transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy_import import lazy_attributes
from .report import SAFETY_REPORT_NAME, ConstraintResult, SafetyReport, UnsafeModelError, format_number

if TYPE_CHECKING:  # pragma: no cover
    from .card import ModelCardInfo
    from .evaluation import build_safety_report
    from .finish import finish_run
    from .in_memory_selection import InMemoryFeasibleSelection
    from .loop import SafetyLoop
    from .view import RunView

_LAZY = {
    "ModelCardInfo": ".card",
    "build_safety_report": ".evaluation",
    "finish_run": ".finish",
    "InMemoryFeasibleSelection": ".in_memory_selection",
    "SafetyLoop": ".loop",
    "RunView": ".view",
}


# heavy names (they import transformers / huggingface_hub) on first access
__getattr__ = lazy_attributes(__name__, _LAZY, globals())

__all__ = [
    "SAFETY_REPORT_NAME",
    "ConstraintResult",
    "InMemoryFeasibleSelection",
    "ModelCardInfo",
    "RunView",
    "SafetyLoop",
    "SafetyReport",
    "UnsafeModelError",
    "build_safety_report",
    "finish_run",
    "format_number",
]
