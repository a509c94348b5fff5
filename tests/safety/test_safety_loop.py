"""The safety loop is a component the trainer holds (``trainer.safety``), not a base class of the trainer.

The trainer's public surface is the Trainer's plus the constrained training's own names; the safety side
(reports, certificates, cards, the gate) is reached through ``trainer.safety``, and the loop reads the run
through its typed view, never through attribute names looked up on the trainer.
"""

from __future__ import annotations

import ast
import os

import transformers
from safety_tiny import make_trainer

import hf_constrained
from hf_constrained import ConstrainedTrainer
from hf_constrained.safety.loop import SafetyLoop, SafetyLoopCallback
from hf_constrained.safety.view import RunView

# what ConstrainedTrainer adds to the Trainer's public names: training under constraints, their exact evaluation,
# their state in checkpoints, and the public hooks of TrainerInternals. Nothing of the safety loop.
CONSTRAINED_TRAINING = {
    "add_metrics_to_next_log", "compute_objective_loss", "constraint_estimates", "constraint_margins",
    "constraint_metrics", "constraint_noise", "constraint_row_values", "constraint_state_dict",
    "constraint_part_runs", "constraint_statistics", "evaluate_constraints", "load_constraint_state_dict",
    "objective_forward_shareable", "preflight_constraints", "shared_objective_forward",
    # TrainerInternals' hooks (tests/trainer/test_layout_private_members.py)
    "collator_without_unused_columns", "drop_unused_columns", "is_new_best", "push_checkpoint", "save_checkpoint",
    "train_sampler",
}
# the safety mixin's names, now the loop's (or gone): none may come back onto the trainer
SAFETY_INTERNALS = {
    "build_safety_report", "check_safe_to_push", "checkpoint_model", "current_safety_report",
    "current_weights_fingerprint", "feasible_selection", "model_card_info", "publish_checkpoint_state",
    "reference_constraint_values", "safety_confidence", "safety_delta", "safety_report", "safety_rule",
    "save_safety_report", "set_safety_report", "weights_origin", "write_model_card",
}


def public_names(obj) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


def test_the_trainers_public_names_hold_no_safety_internals(tmp_path):
    added = public_names(ConstrainedTrainer) - public_names(transformers.Trainer)
    assert added == CONSTRAINED_TRAINING, "a public name added to (or gone from) the trainer: is it constrained " \
        "training's own, or the safety loop's (then on trainer.safety)?"
    assert not SAFETY_INTERNALS & public_names(ConstrainedTrainer)
    trainer = make_trainer(str(tmp_path / "run"), max_steps=1)
    # nor as instance attributes, public or private (the mixin's state lived on the trainer)
    attributes = set(vars(trainer))
    assert not SAFETY_INTERNALS & attributes
    assert not {a for a in attributes if a.lstrip("_") in {"weights_eval", "saved_weights", "stale_note",
                                                            "push_allow_unsafe", "defer_hub_repo"}}
    assert isinstance(trainer.safety, SafetyLoop) and isinstance(trainer.safety.view, RunView)
    # what users reach through trainer.safety instead
    assert {"build_report", "check_safe_to_push", "checkpoint_model", "confidence", "configure", "current_report",
            "delta", "feasible_selection", "finish", "reference_values", "report", "rule", "save_report", "settings",
            "set_report", "weights_fingerprint", "weights_origin", "write_model_card"} <= public_names(trainer.safety)


def test_the_loop_sees_the_run_through_its_view(tmp_path):
    """The view is the trainer's run: its constraints in order, its arguments object, its engine's settings."""
    trainer = make_trainer(str(tmp_path / "run"), max_steps=1)
    view = trainer.safety.view
    assert view.constraints == tuple(trainer.constraints) and view.args is trainer.args
    assert view.output_dir == trainer.args.output_dir
    settings = view.method_settings()
    for name, value in trainer.engine.settings().to_dict().items():
        assert settings[name] == value, name
    try:
        view.args = None  # frozen: the loop cannot be pointed at another run
    except AttributeError:
        pass
    else:
        raise AssertionError("RunView is not frozen")


def test_the_callback_drives_the_loop(tmp_path):
    """The loop learns of evaluations and of training from its callback: an evaluation's exact values become
    the current weights' report; training moves the weights, and the report no longer describes them."""
    trainer = make_trainer(str(tmp_path / "run"), max_steps=2, eval_strategy="no", save_strategy="no",
                           load_best_model_at_end=False, metric_for_best_model=None)
    assert trainer.safety.current_report() is None
    trainer.evaluate()
    report = trainer.safety.current_report()
    assert report is not None and report.weights_fingerprint == trainer.safety.weights_fingerprint()
    trainer.train()
    assert trainer.safety.current_report() is None  # the weights it described are gone

    unplugged = make_trainer(str(tmp_path / "unplugged"), max_steps=2, eval_strategy="no", save_strategy="no",
                             load_best_model_at_end=False, metric_for_best_model=None)
    unplugged.remove_callback(SafetyLoopCallback)
    unplugged.evaluate()
    assert unplugged.safety.current_report() is None  # without its callback the loop hears of no evaluation


def test_no_safety_module_reads_a_trainer_by_attribute_name():
    """No ``getattr``/``hasattr``/``setattr`` on a trainer (or the loop's host) anywhere in the safety, publishing
    or certification packages: the loop reads the run through :class:`RunView` and calls the typed
    :class:`SafetyHost` operations."""
    package = os.path.dirname(os.path.dirname(hf_constrained.safety.__file__))
    found = []
    names = [os.path.join(sub, n) for sub in ("safety", "publishing", "certification")
             for n in sorted(os.listdir(os.path.join(package, sub)))]
    assert len([n for n in names if n.endswith(".py")]) > 20
    for name in names:
        if not name.endswith(".py"):
            continue
        with open(os.path.join(package, name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr", "setattr") and node.args):
                target = ast.unparse(node.args[0])
                if target in ("trainer", "host", "self.host", "self", "loop", "self.loop"):  # the model's config is not
                    found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_a_resumed_runs_report_records_the_seed_it_continued(tmp_path):
    """The view reads the engine's settings when a report is built, not when the trainer was built: a run that
    resumed a checkpoint continues that checkpoint's sampling seed, and its report says so."""
    first = make_trainer(str(tmp_path / "first"), max_steps=1, constraint_seed=11)
    resumed = make_trainer(str(tmp_path / "resumed"), max_steps=1, constraint_seed=22)
    assert resumed.safety.view.method_settings()["constraint_seed"] == 22
    resumed.load_constraint_state_dict(first.constraint_state_dict())
    report = resumed.safety.build_report(objective_metrics={})
    assert report.method["constraint_seed"] == resumed.engine.settings().constraint_seed == 11
