"""hf_constrained: fine-tune Hugging Face models under constraints.

The single-loop hinge exact penalty with MSVR constraint estimators (Yang et al., TMLR 2026):
declare :class:`Constraint` s (one per value of a column with :func:`constraints_per_value`,
or "do not forget" constraints with :func:`non_forgetting_constraints`), train with
:class:`ConstrainedTrainer` and :class:`ConstrainedTrainingArguments` (for a contrastive CLIP
objective, :class:`ContrastiveConstrainedTrainer`), end with :func:`finish_run` (the
:class:`SafetyReport` on held-out data, the model card and figures); ``push_to_hub``
refuses a model whose constraints fail (:class:`UnsafeModelError`). A model fine-tuned with any
other tool is certified against its base by :func:`certify_model` (``hf-constrained certify``).

The algorithm itself, usable without the Trainer, is in :mod:`hf_constrained.method`.

Names are imported on first use, so ``import hf_constrained`` (and the ``hf-constrained``
command line) does not load torch or transformers until a name that needs them is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy_import import lazy_attributes

if TYPE_CHECKING:  # pragma: no cover
    from .certification.certify import Certificate, certify
    from .clip.contrastive import ContrastiveConstrainedTrainer
    from .config import ConstrainedTrainingArguments
    from .constraint import (
        Certification,
        CertifyStatistic,
        Constraint,
        ConstraintValueError,
        constraints_per_value,
    )
    from .margin import CalibratedMargin, CertificateMargin, FixedMargin
    from .non_forgetting import NonForgettingConfig, non_forgetting_constraints
    from .publishing.report import SafetyReport, UnsafeModelError
    from .safety.certify_claims import CertifySettings
    from .safety.certify_model import certify_model
    from .safety.finish import build_safety_report, finish_run
    from .trainer import ConstrainedTrainer

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "ConstrainedTrainer": ".trainer",
    "ConstrainedTrainingArguments": ".config",
    "Constraint": ".constraint",
    "Certification": ".constraint",
    "CertifyStatistic": ".constraint",
    "Certificate": ".certification.certify",
    "certify": ".certification.certify",
    "constraints_per_value": ".constraint",
    "non_forgetting_constraints": ".non_forgetting",
    "NonForgettingConfig": ".non_forgetting",
    "ContrastiveConstrainedTrainer": ".clip.contrastive",
    "finish_run": ".safety.finish",
    "build_safety_report": ".safety.finish",
    "certify_model": ".safety.certify_model",
    "CertifySettings": ".safety.certify_claims",
    "SafetyReport": ".publishing.report",
    "UnsafeModelError": ".publishing.report",
    "ConstraintValueError": ".constraint",
    "FixedMargin": ".margin",
    "CalibratedMargin": ".margin",
    "CertificateMargin": ".margin",
}


__getattr__ = lazy_attributes(__name__, _LAZY, globals())


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


# a literal list (kept equal to the keys of ``_LAZY``, tested in tests/safety/test_safety_layout.py) so that
# linters and type checkers see the names of the TYPE_CHECKING block above as re-exports
__all__ = [
    "CalibratedMargin",
    "Certificate",
    "CertificateMargin",
    "Certification",
    "CertifySettings",
    "CertifyStatistic",
    "ConstrainedTrainer",
    "ConstrainedTrainingArguments",
    "Constraint",
    "ConstraintValueError",
    "ContrastiveConstrainedTrainer",
    "FixedMargin",
    "NonForgettingConfig",
    "SafetyReport",
    "UnsafeModelError",
    "build_safety_report",
    "certify",
    "certify_model",
    "constraints_per_value",
    "finish_run",
    "non_forgetting_constraints",
]
