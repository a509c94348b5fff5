"""Constraint-only periodic evaluation, callbacks that keep the Trainer's logs, bounded logs
at large m, and the gradient-clipping diagnostics."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from conftest import TinyNet, class_loss
from conftest import tiny_args as make_args
from conftest import tiny_rows as make_data
from transformers import TrainerCallback

from hf_constrained import ConstrainedTrainer, Constraint
from hf_constrained.callbacks import PenaltyGradientNormCallback, PeriodicMetricsCallback, penalty_gradient_norm


def _trainer(tmp_path, constraints=None, **kw):
    data = make_data(32)
    cons = constraints or [Constraint("c0", class_loss, dataset=data, tolerance=0.1)]
    return ConstrainedTrainer(model=TinyNet(), args=make_args(tmp_path, **kw), train_dataset=data, constraints=cons)


def test_periodic_constraint_only_evaluation_selects_a_checkpoint(tmp_path):
    """eval_strategy="steps" without an objective eval_dataset: the constraints are evaluated
    every eval_steps and feasible-checkpoint selection runs on them."""
    trainer = _trainer(tmp_path, max_steps=6, eval_strategy="steps", eval_steps=2, save_strategy="steps",
                       save_steps=2, load_best_model_at_end=True, metric_for_best_model="constraint_max_violation",
                       greater_is_better=False)
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_constraint_max_violation" in h]
    assert [h["step"] for h in evals] == [2, 4, 6]
    assert all("eval_constraint/c0" in h for h in evals)
    best = min(evals, key=lambda h: h["eval_constraint_max_violation"])
    assert trainer.state.best_model_checkpoint.endswith(f"checkpoint-{best['step']}")
    assert trainer.last_constraint_values_step == 6 and set(trainer.last_constraint_values) == {"c0"}


class _NaiveLogger(TrainerCallback):
    """The pattern that loses the Trainer's log: trainer.log from on_step_end."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % 3 == 0:
            self.trainer.log({"extra": 1.0})


def test_periodic_metrics_keep_the_trainers_log_entries(tmp_path):
    naive = _trainer(tmp_path / "naive", max_steps=6, logging_steps=1)
    naive.add_callback(_NaiveLogger(naive))
    naive.train()
    assert [h["step"] for h in naive.state.log_history if "loss" in h] == [1, 2, 4, 5]  # steps 3 and 6 lost

    trainer = _trainer(tmp_path / "ok", max_steps=6, logging_steps=2)
    trainer.add_callback(PeriodicMetricsCallback(trainer, every=3,
                                                 compute=lambda t: {"extra": float(t.state.global_step)}))
    trainer.train()
    entries = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in entries] == [2, 3, 4, 6]  # every logging step kept, plus step 3
    extra = {h["step"]: h["extra"] for h in entries if "extra" in h}
    assert extra == {3: 3.0, 6: 6.0}
    assert all("constraint/max_estimate" in h for h in entries)  # the constraint estimates are in the same entries


def test_logs_bounded_at_large_m_full_table_kept(tmp_path):
    data = make_data(32)
    cons = [Constraint(f"c{k}", class_loss, dataset=data.select(range(k % 8, 32, 8)), tolerance=0.1)
            for k in range(40)]
    trainer = _trainer(tmp_path, constraints=cons, max_steps=2, constraints_per_step=4, eval_strategy="steps",
                       eval_steps=1, save_strategy="steps", save_steps=2, log_constraint_estimates_max=10)
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_constraint_max_violation" in h]
    assert len(evals) == 2
    assert not any(k.startswith(("eval_constraint/", "constraint/c")) for h in trainer.state.log_history for k in h)
    assert len(trainer.last_constraint_values) == 40
    metrics = trainer.evaluate()  # the returned metrics are complete (the safety report reads them)
    assert sum(k.startswith("eval_constraint/") for k in metrics) == 40
    worst = max(v - 0.1 for v in trainer.last_constraint_values.values())
    assert metrics["eval_constraint_max_violation"] == pytest.approx(worst)
    with open(os.path.join(tmp_path, "out", "checkpoint-2", "trainer_state.json")) as f:
        assert "eval_constraint/" not in f.read()


def test_clipping_diagnostics_and_single_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_constrained.clipping"):
        trainer = _trainer(tmp_path / "clip", max_steps=8, logging_steps=1, max_grad_norm=1e-3, penalty_beta=50.0)
        trainer.add_callback(PenaltyGradientNormCallback(trainer, every=2))
        trainer.train()
    entries = [h for h in trainer.state.log_history if "loss" in h]
    assert all(h["clip/clipped_fraction"] == 1.0 for h in entries)
    assert all(h["clip/scale"] == pytest.approx(1e-3 / h["grad_norm"]) for h in entries)
    shares = [h for h in entries if "clip/penalty_share" in h]
    assert [h["step"] for h in shares] == [2, 4, 6, 8]
    assert caplog.text.count("gradient clipping (max_grad_norm=0.001) shrank") == 1
    off = _trainer(tmp_path / "off", max_steps=3, logging_steps=1, max_grad_norm=0.0)
    off.train()
    assert not any(k.startswith("clip/") for h in off.state.log_history for k in h)


def test_penalty_gradient_norm_matches_an_independent_computation(tmp_path):
    data = make_data(32)
    cons = [Constraint("a", class_loss, dataset=data, tolerance=0.0), Constraint("b", class_loss, dataset=data,
                                                                              tolerance=100.0)]
    trainer = _trainer(tmp_path, constraints=cons, max_steps=2, penalty_beta=7.0, constraint_batch_size=5)
    trainer.train()
    model = trainer.model
    rows = data.select(range(5))
    batch = {"x": torch.tensor(rows["x"]), "labels": torch.tensor(rows["labels"])}
    # "a" is violated (cross-entropy > 0), "b" holds: G_2 = beta * grad h_a / m with m = 2
    grads = torch.autograd.grad(7.0 * class_loss(model, batch) / 2, [p for p in model.parameters()])
    expected = torch.sqrt(sum((g ** 2).sum() for g in grads)).item()
    assert penalty_gradient_norm(trainer) == pytest.approx(expected, rel=1e-5)
