"""The constraint-satisfaction ``evaluate`` module, loaded from a local path (no Hub)."""

from __future__ import annotations

import pytest
import torch
from safety_tiny import ThetaConfig, ThetaModel, constraints, make_trainer

from hf_constrained.metrics import CONSTRAINT_SATISFACTION_PATH, load_constraint_satisfaction


@pytest.fixture(scope="module")
def metric():
    import evaluate

    return evaluate.load(CONSTRAINT_SATISFACTION_PATH)  # a directory: no network access


def test_values_violations_and_verdict(metric):
    out = metric.compute(predictions=[0.2, 0.4, 1.0, 3.0], references=[0.0, 0.0, 0.5, 0.5],
                         constraints=["a", "a", "b", "b"], tolerance={"a": 0.5, "b": 1.0})
    assert out["constraint_values"] == pytest.approx({"a": 0.3, "b": 1.5})
    assert out["violations"] == pytest.approx({"a": -0.2, "b": 0.5})
    assert out["satisfied"] == {"a": True, "b": False}
    assert out["max_violation"] == pytest.approx(0.5) and out["all_satisfied"] is False
    # batches accumulate like any evaluate metric
    metric.add_batch(predictions=[1.0], references=[0.0], constraints=["x"])
    metric.add_batch(predictions=[2.0], references=[0.0], constraints=["x"])
    out = metric.compute(tolerance=1.5)
    assert out["constraint_values"] == {"x": 1.5} and out["all_satisfied"] is True


def test_bad_inputs_are_named(metric):
    with pytest.raises(ValueError, match=r"no tolerance given for constraints \['b'\]"):
        metric.compute(predictions=[1.0, 2.0], references=[0.0, 0.0], constraints=["a", "b"], tolerance={"a": 1.0})
    with pytest.raises(ValueError, match="not finite"):
        metric.compute(predictions=[float("nan")], references=[0.0], constraints=["a"])


def test_agrees_with_the_trainers_exact_evaluation(tmp_path):
    """Scoring a model's per-sample values with the metric gives the trainer's exact held-out
    value and verdict (the per-sample-mean constraint scaled_theta, h = mean_i x_i * theta)."""
    trainer = make_trainer(str(tmp_path / "run"), tolerance=2.0, max_steps=3, eval_strategy="no",
                           save_strategy="no", load_best_model_at_end=False, metric_for_best_model=None)
    trainer.train()
    model = trainer.model
    held_out = constraints()[1].eval_dataset
    old = ThetaModel(ThetaConfig())
    with torch.no_grad():
        new_rows = [float(x * model.theta) for x in held_out["x"]]
        old_rows = [float(x * old.theta) for x in held_out["x"]]
    out = load_constraint_satisfaction().compute(
        predictions=new_rows, references=old_rows, constraints=["scaled_theta"] * len(new_rows), tolerance=2.0)
    exact = trainer.evaluate_constraints(split="eval")["scaled_theta"]
    assert out["constraint_values"]["scaled_theta"] == pytest.approx(exact, rel=1e-6)
    assert out["satisfied"]["scaled_theta"] is (exact <= 2.0) is False
