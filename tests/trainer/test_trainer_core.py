"""ConstrainedTrainer: Algorithm 1 end to end, plain-Trainer equivalence, validation, logging, evaluation."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import TinyNet, class_loss
from conftest import tiny_args as make_args
from conftest import tiny_rows as make_data
from torch import nn
from transformers import Trainer, TrainingArguments

from hf_constrained import (
    ConstrainedTrainer,
    ConstrainedTrainingArguments,
    Constraint,
    ConstraintValueError,
    constraints_per_value,
)
from hf_constrained.method.sampling import ConstraintBatchStream


# ---------------------------------------------------------------------------- Algorithm 1, independently
def test_step_matches_independent_algorithm_1(tmp_path):
    """Parameters and estimators after 5 steps equal a from-scratch implementation of Algorithm 1
    (MSVR with the previous iterate on the current batch, weights from u^t, SGD on G1 + G2)."""
    data = make_data(32)
    cons = constraints_per_value(data, "labels", lambda v: (lambda m, b: class_loss(m, b) - 0.3), per_value_fn=True)
    gamma, gamma_prime, beta, lr, steps, bk = 0.8, 0.5, 4.0, 0.2, 5, 4
    args = make_args(tmp_path, per_device_train_batch_size=32, max_steps=steps, learning_rate=lr,
                     penalty_beta=beta, msvr_gamma=gamma, msvr_gamma_prime=gamma_prime, constraint_batch_size=bk)
    model = TinyNet()
    trainer = ConstrainedTrainer(model=model, args=args, train_dataset=data, constraints=cons)
    trainer.train()

    ref = TinyNet()
    streams = [ConstraintBatchStream(len(c.dataset), args.constraint_sampling_seed, k) for k, c in enumerate(cons)]
    full = {"x": torch.tensor(data["x"]), "labels": torch.tensor(data["labels"])}
    u = torch.zeros(len(cons))
    prev_params = None
    for t in range(steps):
        batches = []
        for k, c in enumerate(cons):
            rows = streams[k].next_indices(bk)
            batches.append({"x": torch.tensor([c.dataset[i]["x"] for i in rows]),
                            "labels": torch.tensor([c.dataset[i]["labels"] for i in rows])})
        h = torch.stack([class_loss(ref, b) - 0.3 for b in batches])
        if prev_params is None:
            u_t = h.detach().clone()
            u_next = h.detach().clone()
        else:
            previous_model = TinyNet()
            with torch.no_grad():
                for p, q in zip(previous_model.parameters(), prev_params):
                    p.copy_(q)
                h_prev = torch.stack([class_loss(previous_model, b) - 0.3 for b in batches])
            u_t = u.clone()
            u_next = (1 - gamma) * u + gamma * h.detach() + gamma_prime * (h.detach() - h_prev)
        g2 = beta * (u_t > 0).float()
        loss = class_loss(ref, full) + (g2 * h).sum() / len(cons)
        ref.zero_grad()
        loss.backward()
        prev_params = [p.detach().clone() for p in ref.parameters()]
        with torch.no_grad():
            for p in ref.parameters():
                p -= lr * p.grad
        u = u_next

    assert torch.allclose(trainer.engine.estimator.values, u, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-5)


def test_penalty_none_is_exactly_the_plain_trainer(tmp_path):
    data = make_data(64)
    cons = constraints_per_value(data, "labels", class_loss)
    common = dict(output_dir=str(tmp_path / "a"), per_device_train_batch_size=8, max_steps=12, report_to=[],
                  save_strategy="no", disable_tqdm=True, use_cpu=True, seed=7, learning_rate=0.05)
    plain_model, ours_model = TinyNet(dropout=0.3), TinyNet(dropout=0.3)
    Trainer(model=plain_model, args=TrainingArguments(**common), train_dataset=data).train()
    common["output_dir"] = str(tmp_path / "b")
    ConstrainedTrainer(model=ours_model, args=ConstrainedTrainingArguments(constraint_penalty="none", **common),
                       train_dataset=data, constraints=cons).train()
    for p, q in zip(plain_model.parameters(), ours_model.parameters()):
        assert torch.equal(p, q)


def test_hinge_changes_training_and_reduces_violation(tmp_path):
    """Sanity check of direction: a tight constraint on class 1 lowers its loss relative to no penalty."""
    data = make_data(64)
    cons = [Constraint("class1", lambda m, b: class_loss(m, b) - 0.2, dataset=data.filter(lambda r: r["labels"] == 1))]
    results = {}
    for penalty in ("none", "hinge"):
        model = TinyNet()
        args = make_args(tmp_path / penalty, max_steps=30, constraint_penalty=penalty, penalty_beta=5.0)
        trainer = ConstrainedTrainer(model=model, args=args, train_dataset=data, constraints=cons)
        trainer.train()
        results[penalty] = trainer.evaluate_constraints()["class1"]
    assert results["hinge"] < results["none"] - 0.05


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize("kw,match", [
    (dict(penalty_beta=0.0), "penalty_beta must be > 0"),
    (dict(penalty_beta=-1.0, constraint_penalty="squared_hinge"), "penalty_beta must be > 0"),
    (dict(msvr_gamma=0.0), r"msvr_gamma must be in \(0, 1\]"),
    (dict(msvr_gamma=1.2), r"msvr_gamma must be in \(0, 1\]"),
    (dict(msvr_gamma_prime=-0.1), "msvr_gamma_prime must be >= 0"),
    (dict(msvr_gamma_prime="fast"), "msvr_gamma_prime must be a number"),
    (dict(constraints_per_step=0), "constraints_per_step must be >= 1"),
    (dict(constraint_batch_size=0), "constraint_batch_size must be >= 1"),
    (dict(constraint_penalty="l2"), "constraint_penalty must be one of"),
])
def test_bad_arguments_are_rejected(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        make_args(tmp_path, **kw)


def test_bad_constraints_are_rejected_before_training(tmp_path):
    data = make_data(16)
    ok = Constraint("a", class_loss, dataset=data)
    with pytest.raises(ValueError, match=r"constraints_per_step must be in \[1, 1\]"):
        ConstrainedTrainer(model=TinyNet(), args=make_args(tmp_path, constraints_per_step=2), train_dataset=data,
                           constraints=[ok])
    with pytest.raises(ValueError, match="duplicate constraint names: \\['a'\\]"):
        ConstrainedTrainer(model=TinyNet(), args=make_args(tmp_path), train_dataset=data, constraints=[ok, ok])
    with pytest.raises(ValueError, match="needs at least one constraint"):
        ConstrainedTrainer(model=TinyNet(), args=make_args(tmp_path), train_dataset=data, constraints=[])
    with pytest.raises(ValueError, match="'empty': dataset is empty"):
        Constraint("empty", class_loss, dataset=data.select([]))
    with pytest.raises(ValueError, match="no rows with labels == 5"):
        constraints_per_value(data, "labels", class_loss, values=[0, 5])


@pytest.mark.parametrize("fn,match", [
    (lambda m, b: m(b["x"])["logits"].mean(0), r"shape \(2,\), expected a scalar"),
    (lambda m, b: class_loss(m, b).detach(), "without grad"),
    (lambda m, b: torch.tensor(float("nan"), requires_grad=True) + class_loss(m, b), "is nan before training"),
    (lambda m, b: 1.0, "returned float"),
])
def test_bad_constraint_values_fail_before_the_first_step(tmp_path, fn, match):
    data = make_data(16)
    model = TinyNet()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = ConstrainedTrainer(model=model, args=make_args(tmp_path, max_steps=3), train_dataset=data,
                                 constraints=[Constraint("bad", fn, dataset=data)])
    with pytest.raises(ConstraintValueError, match=match):
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_nan_during_training_names_constraint_and_step_and_keeps_checkpoint(tmp_path):
    data = make_data(32)
    calls = {"n": 0}

    def explodes(model, batch):
        calls["n"] += 1
        value = class_loss(model, batch)
        return value * float("inf") if calls["n"] > 8 else value  # preflight = call 1, then 2 calls per step

    args = make_args(tmp_path, max_steps=20, save_strategy="steps", save_steps=2)
    trainer = ConstrainedTrainer(model=TinyNet(), args=args, train_dataset=data,
                                 constraints=[Constraint("fragile", explodes, dataset=data)])
    with pytest.raises(ConstraintValueError, match=r"constraint 'fragile' is (inf|nan) .* at step 4"):
        trainer.train()
    ckpt = os.path.join(args.output_dir, "checkpoint-4")
    assert os.path.isdir(ckpt)
    reloaded = TinyNet()
    from safetensors.torch import load_file
    state = load_file(os.path.join(ckpt, "model.safetensors"))
    reloaded.load_state_dict(state)
    assert all(torch.isfinite(p).all() for p in reloaded.parameters())
    saved = torch.load(os.path.join(ckpt, "constraint_state.pt"), weights_only=False)
    assert torch.isfinite(saved["estimator"]["values"]).all()


# ---------------------------------------------------------------------------- logging and evaluation
def test_logs_estimates_active_fraction_and_penalty(tmp_path):
    data = make_data(32)
    cons = constraints_per_value(data, "labels", lambda m, b: class_loss(m, b) - 0.1, name="class{value}")
    args = make_args(tmp_path, max_steps=4, logging_steps=2, constraints_per_step=1)
    trainer = ConstrainedTrainer(model=TinyNet(), args=args, train_dataset=data, constraints=cons)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    last = logs[-1]
    for key in ("constraint/max_estimate", "constraint/active_fraction", "constraint/penalty",
                "constraint/penalty_loss", "constraint/sampled_active_fraction"):
        assert key in last
    estimates = trainer.constraint_estimates()
    for name, value in estimates.items():
        assert last[f"constraint/{name}"] == pytest.approx(value)
    assert last["constraint/max_estimate"] == pytest.approx(max(estimates.values()))
    assert last["constraint/active_fraction"] == pytest.approx(sum(v > 0 for v in estimates.values()) / len(estimates))
    assert last["constraint/penalty"] == pytest.approx(10.0 * sum(max(v, 0) for v in estimates.values()) / 2)


def test_exact_evaluation_is_a_full_pass(tmp_path):
    data = make_data(40)
    held_out = make_data(23, seed=1)
    cons = constraints_per_value(data, "labels", class_loss, eval_dataset=held_out, name="class{value}", tolerance=0.5)
    args = make_args(tmp_path, per_device_eval_batch_size=5)  # 23 rows: uneven last batch
    model = TinyNet()
    trainer = ConstrainedTrainer(model=model, args=args, train_dataset=data, constraints=cons)
    metrics = trainer.evaluate()
    x, y = torch.tensor(held_out["x"]), torch.tensor(held_out["labels"])
    with torch.no_grad():
        per_sample = nn.functional.cross_entropy(model(x)["logits"], y, reduction="none")
    direct = {v: per_sample[y == v].mean().item() for v in (0, 1)}
    for v in (0, 1):
        assert metrics[f"eval_constraint/class{v}"] == pytest.approx(direct[v], abs=1e-5)
    worst = max(direct.values()) - 0.5
    assert metrics["eval_constraint_max_violation"] == pytest.approx(worst, abs=1e-5)
    assert metrics["eval_constraints_satisfied"] == float(worst <= 0)
    assert any("eval_constraint/class0" in h for h in trainer.state.log_history)


def test_compositional_outer_chains_the_weight(tmp_path):
    """outer = |x| - kappa: weight beta * 1[|u| - kappa > 0] * sign(u) (the compositional ROC constraint)."""
    data = make_data(16)
    kappa = 0.1
    cons = [Constraint(f"c{i}", class_loss, dataset=data, outer=lambda z: z.abs() - kappa) for i in range(3)]
    trainer = ConstrainedTrainer(model=TinyNet(), args=make_args(tmp_path), train_dataset=data, constraints=cons)
    h, slope = trainer.engine.violations(torch.arange(3), torch.tensor([-0.5, 0.05, 0.3]))
    assert h.tolist() == pytest.approx([0.4, -0.05, 0.2])
    assert slope.tolist() == [-1.0, 1.0, 1.0]
    weights = trainer.penalty.weight(h) * slope
    assert weights.tolist() == [-10.0, 0.0, 10.0]
