"""AUC maximisation under ROC-fairness constraints (paper section 5.1).

Modules: :mod:`.data` (Adult, COMPAS, any CSV, CheXpert), :mod:`.model` (the MLP scorer as
a ``PreTrainedModel``), :mod:`.roc` (AUC loss, the constraints, exact values, trainer),
:mod:`.evaluation` (AUC, the shift-proof measures, the per-epoch history), :mod:`.icppac` (the
double-loop baseline), :mod:`.frvp` (the FRVP diagnostic), :mod:`.experiment` (one run, used by
``recipes/roc_fairness.py`` and the benchmark).

Names are imported on first use: the model (``hf_constrained.fairness.model``, what a
published ROC model's card imports) needs no optional package; the data, the AUC and the
experiment need scikit-learn (the ``fairness`` extra), and without it name the extra.
"""
from __future__ import annotations

from ..lazy_import import lazy_attributes

# public name -> the module that defines it
_LAZY = {
    "AUCConstrainedTrainer": ".roc",
    "DEFAULT_KAPPA": ".roc",
    "DEFAULT_QUANTILES": ".evaluation",
    "DEFAULT_THRESHOLDS": ".roc",
    "GROUP_KEY": ".roc",
    "GroupRows": ".roc",
    "ICPPACConfig": ".icppac",
    "ICPPACTrainer": ".icppac",
    "MLPConfig": ".model",
    "MLPForScoring": ".model",
    "PairedRows": ".roc",
    "ROCHistoryCallback": ".evaluation",
    "SigmoidRate": ".roc",
    "TabularSplit": ".data",
    "auc_score": ".evaluation",
    "build_tabular_splits": ".data",
    "collate_pairs": ".roc",
    "collate_rows": ".roc",
    "evaluate_roc": ".evaluation",
    "feature_names": ".data",
    "frvp_report": ".frvp",
    "load_adult": ".data",
    "load_chexpert": ".data",
    "load_compas": ".data",
    "load_tabular_csv": ".data",
    "TabularColumns": ".data",
    "min_singular_value": ".frvp",
    "model_scores": ".model",
    "objective_pairs": ".roc",
    "pairwise_auc_loss": ".roc",
    "roc_curve_gap": ".evaluation",
    "roc_fairness_constraints": ".roc",
    "roc_fairness_values": ".roc",
    "roc_row_scores": ".roc",
    "shift_proof_fairness": ".evaluation",
    "smallest_certified_gap": ".roc",
}


__getattr__ = lazy_attributes(__name__, _LAZY, globals())


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = sorted(_LAZY)
