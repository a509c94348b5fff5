"""The table of the runnable recipes: each one's command-line name, its module and a one-line summary.

Plain data, below every other module: the command line lists it (``hf-constrained --help``), the model card
names the importable module of a recipe that ran as a script, and :mod:`hf_constrained.recipes` finds the
recipes' files with it. It imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

RECIPES_PACKAGE = "hf_constrained.recipes"
"""The package the recipes import as (``hf_constrained.recipes.<module>``)."""


@dataclass(frozen=True)
class Recipe:
    """A recipe's command-line name, its module (in this package) and a one-line summary."""

    command: str
    module: str
    summary: str

    @property
    def module_name(self) -> str:
        """The importable name, e.g. ``hf_constrained.recipes.clip_non_forgetting``."""
        return f"{RECIPES_PACKAGE}.{self.module}"


RECIPES: tuple[Recipe, ...] = (
    Recipe("quickstart", "quickstart_digits", "per-class loss bounds on scikit-learn digits (the quick start)"),
    Recipe("llm", "llm_non_forgetting", "SFT of a causal LM (full or LoRA) under non-forgetting constraints"),
    Recipe("llm-example", "llm_tiny_example", "a tiny GPT-2 learns a new string task and keeps its old ones (offline)"),
    Recipe("llm-many-tasks", "llm_many_tasks_example",
           "the offline LLM example with 24 old tasks, 4 constraints sampled per step, every task certified"),
    Recipe("shapes-example", "shapes_clip_example",
           "the demo's CLIP pipeline on generated shapes, certified at 3 points lost per class (offline)"),
    Recipe("shapes-many-classes", "shapes_many_classes_example",
           "the shapes example with 31 old classes, 6 constraints sampled per step, 3 points claimed per class"),
    Recipe("clip", "clip_non_forgetting", "CLIP on a target class without forgetting the protected classes"),
    Recipe("fairness", "roc_fairness", "AUC maximisation under ROC-fairness (TPR/FPR-gap) constraints"),
    Recipe("safe-release", "safe_release_digits", "the safety loop: feasible checkpoint, report, card, gated push"),
)

DEMO_MODULE = "demo_clip_digits"
"""The digits demo's module (``hf-constrained demo``, ``make demo``), shipped with the recipes."""

HELPER_MODULES = ("tiny_lm",)
"""Modules shipped with the recipes that are no recipe of their own (the tiny LM of the offline examples)."""


__all__ = ["DEMO_MODULE", "HELPER_MODULES", "RECIPES", "RECIPES_PACKAGE", "Recipe"]
