"""A tiny run with a certificate, for the FSDP2 check (tests/trainer/test_fsdp.py and
tests/distributed/run_fsdp_check.py): the classifier of ``scale_tiny`` under one
non-forgetting constraint per group (per-row cross-entropy must not rise), each with a
certification split of its own rows (the share of the group's rows forgotten, at most 0.5)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from scale_tiny import NUM_GROUPS, ListDataset, TinyClassifier, make_rows, tiny_args
from torch import nn

from hf_constrained import ConstrainedTrainer
from hf_constrained.non_forgetting import NonForgettingConfig, non_forgetting_constraints


def per_row_ce(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(x=batch["x"])["logits"], batch["labels"], reduction="none")


def per_row_correct(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (model(x=batch["x"])["logits"].argmax(dim=1) == batch["labels"]).float()


def certify_rows(seed: int = 7, n: int = 160) -> dict[str, ListDataset]:
    rows, groups = make_rows(n, seed)
    return {f"group{k}": ListDataset([r for r, g in zip(rows, groups) if g == k]) for k in range(NUM_GROUPS)}


def certified_trainer(output_dir: str, **overrides: Any) -> ConstrainedTrainer:
    torch.manual_seed(1234)
    model = TinyClassifier()
    train_rows, _ = make_rows(128, 0)
    c_rows, c_groups = make_rows(96, 1)
    protected = {f"group{k}": ListDataset([r for r, g in zip(c_rows, c_groups) if g == k]) for k in range(NUM_GROUPS)}
    constraints = non_forgetting_constraints(model, per_row_ce, protected, certify_datasets=certify_rows(),
                                             correct=per_row_correct,
                                             config=NonForgettingConfig(tolerance=0.0, batch_size=16,
                                                                        forget_tolerance=0.5))
    return ConstrainedTrainer(model=model, args=tiny_args(output_dir, **overrides),
                              train_dataset=ListDataset(train_rows), constraints=constraints)
