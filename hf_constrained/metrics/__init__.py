"""``evaluate`` modules shipped with hf_constrained, loadable from a local path (no Hub)."""

from __future__ import annotations

import os

CONSTRAINT_SATISFACTION_PATH: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "constraint_satisfaction")
"""Directory of the constraint-satisfaction module: ``evaluate.load(CONSTRAINT_SATISFACTION_PATH)``."""


def load_constraint_satisfaction(**kwargs):  # -> evaluate.EvaluationModule
    """``evaluate.load`` of the local constraint-satisfaction module (no network access)."""
    import evaluate

    return evaluate.load(CONSTRAINT_SATISFACTION_PATH, **kwargs)


__all__ = ["CONSTRAINT_SATISFACTION_PATH", "load_constraint_satisfaction"]
