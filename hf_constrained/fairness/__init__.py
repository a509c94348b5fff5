"""AUC maximisation under ROC-fairness constraints (paper section 5.1).

Modules: :mod:`.data` (Adult, COMPAS, any CSV, CheXpert), :mod:`.model` (the MLP scorer as
a ``PreTrainedModel``), :mod:`.roc` (AUC loss, the constraints, exact values, trainer),
:mod:`.icppac` (the double-loop baseline), :mod:`.frvp` (the FRVP diagnostic),
:mod:`.experiment` (one run, used by ``recipes/roc_fairness.py`` and the benchmark).
"""

from .data import (
    TabularSplit,
    build_tabular_splits,
    feature_names,
    load_adult,
    load_chexpert,
    load_compas,
    load_tabular_csv,
)
from .frvp import frvp_report, min_singular_value
from .icppac import ICPPACConfig, ICPPACTrainer
from .model import MLPConfig, MLPForScoring, model_scores
from .roc import (
    DEFAULT_KAPPA,
    DEFAULT_QUANTILES,
    DEFAULT_THRESHOLDS,
    GROUP_KEY,
    AUCConstrainedTrainer,
    GroupRows,
    PairedRows,
    ROCHistoryCallback,
    SigmoidRate,
    auc_score,
    collate_pairs,
    collate_rows,
    evaluate_roc,
    objective_pairs,
    pairwise_auc_loss,
    roc_curve_gap,
    roc_fairness_constraints,
    roc_fairness_values,
    roc_row_scores,
    shift_proof_fairness,
    smallest_certified_gap,
)

__all__ = [
    "AUCConstrainedTrainer",
    "DEFAULT_KAPPA",
    "DEFAULT_QUANTILES",
    "DEFAULT_THRESHOLDS",
    "GROUP_KEY",
    "GroupRows",
    "ICPPACConfig",
    "ICPPACTrainer",
    "MLPConfig",
    "MLPForScoring",
    "PairedRows",
    "ROCHistoryCallback",
    "SigmoidRate",
    "TabularSplit",
    "auc_score",
    "build_tabular_splits",
    "collate_pairs",
    "collate_rows",
    "evaluate_roc",
    "feature_names",
    "frvp_report",
    "load_adult",
    "load_chexpert",
    "load_compas",
    "load_tabular_csv",
    "min_singular_value",
    "model_scores",
    "objective_pairs",
    "pairwise_auc_loss",
    "roc_curve_gap",
    "roc_fairness_constraints",
    "roc_fairness_values",
    "roc_row_scores",
    "shift_proof_fairness",
    "smallest_certified_gap",
]
