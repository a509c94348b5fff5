"""Constraint values are measured the way the old model's references and the certificate are:
with dropout off. A dropout model whose weights do not change shows no violation."""

import copy

import torch
from conftest import TinyNet, tiny_args, tiny_rows
from torch import nn

from hf_constrained import ConstrainedTrainer
from hf_constrained.non_forgetting import NonForgettingConfig, non_forgetting_constraints


def per_row_ce(model, batch):
    return nn.functional.cross_entropy(model(batch["x"])["logits"], batch["labels"], reduction="none")


def test_an_unchanged_dropout_model_shows_zero_violation(tmp_path):
    model = TinyNet(dropout=0.5)
    data = tiny_rows(64, seed=1)
    rows = data[:64]
    batch = {"x": torch.tensor(rows["x"]), "labels": torch.tensor(rows["labels"])}
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)  # the "old" model: fitted, so dropout hurts it
    torch.manual_seed(1)
    for _ in range(200):
        optimizer.zero_grad()
        per_row_ce(model, batch).mean().backward()
        optimizer.step()
    constraints = non_forgetting_constraints(copy.deepcopy(model), per_row_ce, {"old": data},
                                             config=NonForgettingConfig(tolerance=0.0))
    # in training mode the same weights lose more on the same rows: the bias the measurement must not have
    torch.manual_seed(0)
    with torch.no_grad():
        model.train()
        noisy = torch.stack([per_row_ce(model, batch).mean() for _ in range(200)]).mean()
        model.eval()
        clean = per_row_ce(model, batch).mean()
    assert float(noisy - clean) > 0.02

    modes = []
    model.drop.register_forward_pre_hook(lambda module, args: modes.append(module.training))
    args = tiny_args(tmp_path, learning_rate=0.0, max_steps=4, logging_steps=1, constraint_penalty="hinge",
                     constraint_batch_size=16, per_device_train_batch_size=16)
    trainer = ConstrainedTrainer(model=model, args=args, train_dataset=data, constraints=constraints)
    trainer.train()
    key = "constraint/max_estimate"
    estimates = [log[key] for log in trainer.state.log_history if key in log]
    assert len(estimates) == 4
    assert max(abs(e) for e in estimates) < 1e-5  # no violation at tolerance 0 where nothing changed
    assert trainer.engine.estimates()["non_forgetting/old"] <= 1e-5
    # the objective kept its dropout; the constraint passes ran without it, and the model's mode is restored
    assert True in modes and False in modes and model.training
