"""A tiny biased tabular data set for the ROC-fairness tests (shared by the recipe and certificate tests)."""

from __future__ import annotations

import numpy as np

from hf_constrained.fairness import TabularSplit


def biased_split(n: int, seed: int) -> TabularSplit:
    """Group p has more positives and a shifted informative feature, so an unconstrained
    scorer has large TPR/FPR gaps; feature 2 is the group itself (the model can undo it)."""
    rng = np.random.default_rng(seed)
    group = (rng.random(n) < 0.5).astype(np.int64)
    label = (rng.random(n) < np.where(group == 1, 0.6, 0.3)).astype(np.int64)
    x0 = label * 1.5 + group * 1.0 + rng.normal(size=n)
    x1 = rng.normal(size=n)
    feats = np.stack([x0, x1, group * 2.0 - 1.0, rng.normal(size=n)], axis=1).astype(np.float32)
    return TabularSplit(feats, label, group)
