"""Feasible-checkpoint selection: load_best_model_at_end keeps the best FEASIBLE checkpoint."""

from __future__ import annotations

import logging
import math
import os

import pytest
from safety_tiny import make_trainer, theta_at

from hf_constrained.certification.selection import (
    EvaluationRecord,
    constraint_feasibility,
    evaluation_records,
    is_better,
    select_best,
    summarize_selection,
)
from hf_constrained.safety.finish import finish_run


def eval_entry(step, loss, satisfied, violation):
    return {"step": step, "eval_loss": loss, "eval_constraints_satisfied": float(satisfied),
            "eval_constraint_max_violation": violation}


# ---------------------------------------------------------------------------- the order, as pure functions
def test_lexicographic_order():
    feasible_bad = EvaluationRecord(1, 5.0, True, -0.1)
    feasible_good = EvaluationRecord(2, 1.0, True, -0.1)
    infeasible_best_objective = EvaluationRecord(3, 0.1, False, 0.5)
    infeasible_small_violation = EvaluationRecord(4, 9.0, False, 0.01)
    assert is_better(feasible_bad, infeasible_best_objective, greater_is_better=False)
    assert not is_better(infeasible_best_objective, feasible_bad, greater_is_better=False)
    assert is_better(feasible_good, feasible_bad, greater_is_better=False)
    assert not is_better(feasible_good, feasible_bad, greater_is_better=True)
    assert is_better(infeasible_small_violation, infeasible_best_objective, greater_is_better=False)
    assert not is_better(EvaluationRecord(5, 1.0, True, -0.2), feasible_good, False)  # ties keep the earlier
    records = [feasible_bad, feasible_good, infeasible_best_objective, infeasible_small_violation]
    assert select_best(records, greater_is_better=False) == feasible_good
    assert select_best(records[2:], greater_is_better=False) == infeasible_small_violation


def test_records_from_log_history_merge_steps_and_skip_training_logs():
    history = [
        {"step": 1, "loss": 3.0},
        {"step": 1, "eval_loss": 2.0, "eval_constraints_satisfied": 1.0},
        {"step": 1, "eval_constraint_max_violation": -0.5},  # a second entry of the same evaluation
        eval_entry(2, 1.0, False, 0.3),
        {"step": 3, "eval_loss": 0.5},  # no constraint evaluation: not a candidate
    ]
    records = evaluation_records(history, "loss")
    assert records == [EvaluationRecord(1, 2.0, True, -0.5), EvaluationRecord(2, 1.0, False, 0.3)]
    assert constraint_feasibility({"eval_loss": 1.0}) is None
    # several eval datasets: all must be satisfied
    assert constraint_feasibility({"eval_a_constraints_satisfied": 1.0, "eval_b_constraints_satisfied": 0.0,
                                   "eval_a_constraint_max_violation": -1.0,
                                   "eval_b_constraint_max_violation": 0.2}) == (False, 0.2)
    sel = summarize_selection(history, "eval_loss", greater_is_better=False)
    assert (sel.best_step, sel.num_feasible, sel.num_evaluations, sel.any_feasible) == (1, 1, 2, True)


# ---------------------------------------------------------------------------- through the Trainer
@pytest.fixture(scope="module")
def feasible_run(tmp_path_factory):
    trainer = make_trainer(str(tmp_path_factory.mktemp("sel") / "run"), tolerance=2.0)
    trainer.train()
    return trainer


def test_load_best_keeps_best_feasible_checkpoint(feasible_run):
    """theta_t = 1.0, 1.8, 2.44, ...; tolerance 2: the objective keeps improving to step 6 but
    only steps 1-2 are feasible, so the loaded model is step 2's."""
    trainer = feasible_run
    losses = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    assert min(losses, key=losses.get) == 6  # the stock rule would load step 6 (infeasible)
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    assert trainer.state.best_global_step == 2
    assert math.isclose(float(trainer.model.theta.detach()), theta_at(2), rel_tol=1e-5)
    assert trainer.state.best_metric == pytest.approx(losses[2])
    selection = trainer.safety.feasible_selection()
    assert selection.any_feasible and selection.num_feasible == 2 and selection.num_evaluations == 6
    # the report of the loaded model records where the weights come from
    report = trainer.safety.current_report()
    assert report.global_step == 2 and report.checkpoint.endswith("checkpoint-2") and report.all_satisfied


def test_save_total_limit_keeps_the_feasible_best(tmp_path):
    """Checkpoint rotation protects the feasible best (the Trainer's best_model_checkpoint)."""
    trainer = make_trainer(str(tmp_path / "run"), tolerance=2.0, max_steps=5, save_total_limit=2)
    trainer.train()
    kept = sorted(os.listdir(tmp_path / "run"))
    assert "checkpoint-2" in kept and "checkpoint-5" in kept and "checkpoint-4" not in kept
    assert math.isclose(float(trainer.model.theta.detach()), theta_at(2), rel_tol=1e-5)


def test_no_feasible_checkpoint_is_said_clearly(tmp_path, caplog):
    """Tolerance -1: nothing is feasible; the least-violating checkpoint (step 1) is loaded,
    training warns, and the report records it."""
    trainer = make_trainer(str(tmp_path / "run"), tolerance=-1.0, max_steps=4)
    with caplog.at_level(logging.WARNING, logger="hf_constrained.safety.loop"):
        trainer.train()
    assert any("no feasible checkpoint" in r.getMessage() for r in caplog.records)
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-1")
    assert math.isclose(float(trainer.model.theta.detach()), theta_at(1), rel_tol=1e-5)
    report = finish_run(trainer, plots=False)
    assert not report.all_satisfied and report.selection["any_feasible"] is False
    assert report.selection["best_step"] == 1 and report.global_step == 1
    assert report.constraints[0].value == pytest.approx(theta_at(1))


def test_selection_survives_resume(tmp_path):
    """The incumbent is recomputed from the restored log history: a run resumed at step 3
    still loads step 2 at the end."""
    out = str(tmp_path / "run")
    first = make_trainer(out, tolerance=2.0, max_steps=3)
    first.train()
    second = make_trainer(out, tolerance=2.0, max_steps=5)
    second.train(resume_from_checkpoint=os.path.join(out, "checkpoint-3"))
    assert second.state.best_model_checkpoint.endswith("checkpoint-2")
    assert math.isclose(float(second.model.theta.detach()), theta_at(2), rel_tol=1e-5)


def test_evaluations_after_training_are_not_candidates():
    """The safety report's evaluation (logged after train() at the last step, of the selected
    weights) must not be merged into that step's record."""
    history = [eval_entry(1, 2.0, True, -0.1), eval_entry(2, 1.0, False, 0.4),
               {"step": 2, "train_runtime": 1.0, "train_loss": 1.5},
               eval_entry(2, 2.0, True, -0.1)]  # the selected step-1 weights, evaluated at the end
    records = evaluation_records(history, "loss")
    assert records == [EvaluationRecord(1, 2.0, True, -0.1), EvaluationRecord(2, 1.0, False, 0.4)]
    # a later train() call logs at larger steps again: those are candidates
    records = evaluation_records(history + [eval_entry(3, 0.5, True, -0.2)], "loss")
    assert [r.step for r in records] == [1, 2, 3]


# ---------------------------------------------------------------------------- in memory, without checkpoints
def _in_memory_run(tmp_path, violation_of, every=1, max_steps=6, tolerance=2.0):
    """The tiny run without evaluations or checkpoints on disk, the in-memory selection given by
    ``violation_of(trainer)``; objective: the held-out loss (theta - 5)^2, which falls at every step."""
    from hf_constrained.safety.in_memory_selection import InMemoryFeasibleSelection

    trainer = make_trainer(str(tmp_path / "run"), tolerance=tolerance, max_steps=max_steps, eval_strategy="no",
                           save_strategy="no", load_best_model_at_end=False)
    selection = InMemoryFeasibleSelection(every, lambda m: (float(m.theta.detach()) - 5.0) ** 2,
                                          violation_of(trainer), metric="loss")
    trainer.add_callback(selection)
    trainer.train()
    return trainer, selection


def test_in_memory_selection_keeps_the_feasible_best_as_load_best_does(tmp_path):
    """Tolerance 2: steps 1-2 are feasible, the objective improves to step 6; the in-memory selection keeps
    step 2's weights (as load_best_model_at_end does from checkpoints) and puts them back, writing no checkpoint."""
    from hf_constrained.safety.in_memory_selection import largest_constraint_violation

    trainer, sel = _in_memory_run(tmp_path, largest_constraint_violation)
    assert [r.step for r in sel.records] == [1, 2, 3, 4, 5, 6]
    assert [r.feasible for r in sel.records] == [True, True, False, False, False, False]
    # the largest violation is max_k h_k - tol_k = theta - 2, of the weights at that step
    assert [r.max_violation for r in sel.records] == pytest.approx([theta_at(s) - 2.0 for s in range(1, 7)],
                                                                   rel=1e-5)
    assert math.isclose(float(trainer.model.theta.detach()), theta_at(6), rel_tol=1e-5)  # training ends at step 6
    best = sel.restore(trainer.model)
    assert best.step == 2 and math.isclose(float(trainer.model.theta.detach()), theta_at(2), rel_tol=1e-5)
    assert not [f for f in os.listdir(tmp_path / "run") if f.startswith("checkpoint-")]
    summary = sel.summary()
    assert (summary.best_step, summary.num_feasible, summary.num_evaluations) == (2, 2, 6)
    assert "feasible best: step 2" in summary.message()


def test_in_memory_selection_requirement_infeasible_fallback_and_unconstrained(tmp_path):
    """One requirement for all constraints (theta <= 2.5: steps 1-3); none feasible: the least violating (step 1);
    no violation: the objective alone (step 6); ``every`` 4 of 6 steps: steps 4 and 6 (the last) only."""
    from hf_constrained.safety.in_memory_selection import largest_constraint_violation

    _, sel = _in_memory_run(tmp_path / "a", lambda t: largest_constraint_violation(t, requirement=2.5))
    assert sel.best.step == 3 and sel.best.feasible
    trainer, sel = _in_memory_run(tmp_path / "b", largest_constraint_violation, tolerance=-1.0, max_steps=4)
    assert sel.restore(trainer.model).step == 1 and not sel.best.feasible
    assert math.isclose(float(trainer.model.theta.detach()), theta_at(1), rel_tol=1e-5)
    _, sel = _in_memory_run(tmp_path / "c", lambda t: None)
    assert sel.best.step == 6 and all(r.feasible and r.max_violation == 0.0 for r in sel.records)
    trainer, sel = _in_memory_run(tmp_path / "d", largest_constraint_violation, every=4)
    assert [r.step for r in sel.records] == [4, 6] and sel.best.step == 4  # both infeasible: the smaller violation
    with pytest.raises(ValueError, match="every"):
        from hf_constrained.safety.in_memory_selection import InMemoryFeasibleSelection

        InMemoryFeasibleSelection(0, lambda m: 0.0)
