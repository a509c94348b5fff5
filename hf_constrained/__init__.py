"""hf_constrained: fine-tune Hugging Face models under constraints.

The single-loop hinge exact penalty with MSVR constraint estimators (Yang et al., TMLR 2026).
"""

from .config import ConstrainedTrainingArguments
from .constraint import Constraint, collate_examples, constraints_per_value
from .estimators import MSVREstimator, resolve_gamma_prime, theory_gamma_prime
from .penalties import HingePenalty, NoPenalty, Penalty, SquaredHingePenalty, make_penalty
from .safety import SafetyReport, UnsafeModelError, build_safety_report, finish_run
from .sampling import ConstraintBatchStream, ConstraintSampler
from .trainer import CONSTRAINT_STATE_NAME, ConstrainedTrainer, ConstraintValueError

__version__ = "0.1.0"

__all__ = [
    "CONSTRAINT_STATE_NAME",
    "ConstrainedTrainer",
    "ConstrainedTrainingArguments",
    "Constraint",
    "ConstraintBatchStream",
    "ConstraintSampler",
    "ConstraintValueError",
    "HingePenalty",
    "MSVREstimator",
    "NoPenalty",
    "Penalty",
    "SafetyReport",
    "SquaredHingePenalty",
    "UnsafeModelError",
    "build_safety_report",
    "collate_examples",
    "constraints_per_value",
    "finish_run",
    "make_penalty",
    "resolve_gamma_prime",
    "theory_gamma_prime",
]
