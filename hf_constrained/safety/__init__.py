"""The safety loop: the component a trainer holds (``trainer.safety``) that answers "is the fine-tuned model
safe to publish?" for the weights in the model, and ends a run.

It joins a run to the certification package (:mod:`hf_constrained.certification`: the statistics, which know
nothing of models) and the publishing package (:mod:`hf_constrained.publishing`: the report, the card, the
figures, the push). Modules, each importing only those above it; nothing here imports the trainer (the
trainer imports :mod:`~hf_constrained.safety.loop`, never the other way round):

- :mod:`~hf_constrained.safety.view`: :class:`RunView`, the run as the loop reads it (constraints,
  arguments, the engine's settings), and the trainer operations it uses (:class:`SafetyHost`);
- :mod:`~hf_constrained.safety.model_fingerprint`: the fingerprint of the weights in memory;
- :mod:`~hf_constrained.safety.split_checks`: a run's certification splits checked against its other data;
- :mod:`~hf_constrained.safety.in_memory_selection`: feasible selection without checkpoints on disk
  (:class:`InMemoryFeasibleSelection`, a callback that keeps the best weights in memory);
- :mod:`~hf_constrained.safety.tensorboard`: TensorBoard with the constraint scalars grouped;
- :mod:`~hf_constrained.safety.trainer_state`: ``trainer_state.json`` kept consistent with the weights;
- :mod:`~hf_constrained.safety.evaluation`: building a report from a run's view;
- :mod:`~hf_constrained.safety.loop`: :class:`SafetyLoop`, the component the trainer holds
  (selection, reports, cards next to every checkpoint, the gated push), driven by
  :class:`~hf_constrained.safety.loop.SafetyLoopCallback`;
- :mod:`~hf_constrained.safety.finish`: :func:`finish_run`, report + card + figures in one call.

Names are imported on first use: importing this package loads neither torch nor transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy_import import lazy_attributes

if TYPE_CHECKING:  # pragma: no cover
    from .finish import build_safety_report, finish_run
    from .in_memory_selection import InMemoryFeasibleSelection
    from .loop import SafetyLoop
    from .view import RunView

_LAZY = {
    "build_safety_report": ".finish",
    "finish_run": ".finish",
    "InMemoryFeasibleSelection": ".in_memory_selection",
    "SafetyLoop": ".loop",
    "RunView": ".view",
}


# heavy names (they import transformers / huggingface_hub) on first access
__getattr__ = lazy_attributes(__name__, _LAZY, globals())

__all__ = [
    "InMemoryFeasibleSelection",
    "RunView",
    "SafetyLoop",
    "build_safety_report",
    "finish_run",
]
