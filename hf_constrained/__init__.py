"""hf_constrained: fine-tune Hugging Face models under constraints.

The single-loop hinge exact penalty with MSVR constraint estimators (Yang et al., TMLR 2026):
declare :class:`Constraint` s, train with :class:`ConstrainedTrainer` and
:class:`ConstrainedTrainingArguments`, end with :func:`finish_run` (the
:class:`SafetyReport` on held-out data, the model card and figures); ``push_to_hub``
refuses a model whose constraints fail (:class:`UnsafeModelError`).

Names are imported on first use, so ``import hf_constrained`` (and the ``hf-constrained``
command line) does not load torch or transformers until a name that needs them is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy_import import lazy_attributes

if TYPE_CHECKING:  # pragma: no cover
    from .config import ConstrainedTrainingArguments
    from .batches import collate_examples
    from .constraint import Constraint, constraints_per_value
    from .method.estimators import MSVREstimator, resolve_gamma_prime, theory_gamma_prime
    from .method.penalties import HingePenalty, NoPenalty, Penalty, SquaredHingePenalty, make_penalty
    from .safety.evaluation import build_safety_report
    from .safety.finish import finish_run
    from .safety.report import SafetyReport, UnsafeModelError
    from .method.sampling import ConstraintBatchStream, ConstraintSampler
    from .trainer import CONSTRAINT_STATE_NAME, ConstrainedTrainer, ConstraintValueError

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "ConstrainedTrainingArguments": ".config",
    "Constraint": ".constraint",
    "collate_examples": ".batches",
    "constraints_per_value": ".constraint",
    "MSVREstimator": ".method.estimators",
    "resolve_gamma_prime": ".method.estimators",
    "theory_gamma_prime": ".method.estimators",
    "HingePenalty": ".method.penalties",
    "NoPenalty": ".method.penalties",
    "Penalty": ".method.penalties",
    "SquaredHingePenalty": ".method.penalties",
    "make_penalty": ".method.penalties",
    "build_safety_report": ".safety.evaluation",
    "finish_run": ".safety.finish",
    "SafetyReport": ".safety.report",
    "UnsafeModelError": ".safety.report",
    "ConstraintBatchStream": ".method.sampling",
    "ConstraintSampler": ".method.sampling",
    "CONSTRAINT_STATE_NAME": ".trainer",
    "ConstrainedTrainer": ".trainer",
    "ConstraintValueError": ".constraint",
}


__getattr__ = lazy_attributes(__name__, _LAZY, globals())


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = sorted(_LAZY)
