"""The certificate's settings have one owner: a checked, frozen :class:`CertificateSettings` held by the safety
loop, replaced (``configure``, ``finish``) and never edited in place, and ``finish_run`` a thin wrapper."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from safety_tiny import make_trainer

from hf_constrained import finish_run
from hf_constrained.publishing.card import ModelCardInfo
from hf_constrained.publishing.report import SafetyReport
from hf_constrained.safety.settings import CertificateSettings


@pytest.mark.parametrize("change, words", [
    ({"delta": 0.0}, "delta must be in (0, 1)"),
    ({"delta": float("nan")}, "delta must be in (0, 1)"),
    ({"safety_rule": "vibes"}, "safety_rule must be one of"),
    ({"candidates": "all"}, "candidates must be 'final' or 'checkpoints'"),
    ({"confidence": 1.0}, "confidence must be in [0.5, 1)"),
    ({"plots": "yes"}, "plots must be True, False or None"),
])
def test_each_setting_is_checked_where_it_is_defined(change, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        CertificateSettings(**change)
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        CertificateSettings().changed(**change)


def test_changes_make_a_new_value_and_leave_the_old_one_alone():
    base = CertificateSettings()
    changed = base.changed("/tmp/run", delta=0.01, safety_rule="point", base_model_name="org/base",
                           reproduce_command="python train.py --hub_token hf_" + "a" * 34 + " --output_dir /tmp/run")
    assert (base.delta, base.safety_rule, base.card.base_model) == (0.05, "certified", None)
    assert (changed.delta, changed.safety_rule, changed.card.base_model) == (0.01, "point", "org/base")
    assert "hf_" + "a" * 34 not in changed.card.reproduce_command and "/tmp/run" not in changed.card.reproduce_command
    assert base.changed(delta=None) is base  # None: as it is
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.delta = 0.1  # type: ignore[misc]
    with pytest.raises(TypeError, match="unknown certificate setting"):
        base.changed(dleta=0.1)
    assert CertificateSettings.from_dict(changed.to_dict()) == dataclasses.replace(changed, card=ModelCardInfo())


def test_finish_run_replaces_the_loops_settings_and_the_pushes_after_it_use_them(tmp_path):
    trainer = make_trainer(str(tmp_path / "run"), max_steps=2)
    loop = trainer.safety
    before = loop.settings
    report = finish_run(trainer, plots=False, safety_rule="upper_bound", delta=0.02, license="apache-2.0")
    assert before.delta == 0.05 and before.safety_rule == "point"  # the value it held is not edited
    assert loop.settings is not before
    assert (loop.rule, loop.delta, loop.settings.card.license) == ("upper_bound", 0.02, "apache-2.0")
    assert report.safety_rule == "upper_bound"
    saved = SafetyReport.load(str(tmp_path / "run"))  # saved with the run
    assert saved.settings == {"delta": 0.02, "safety_rule": "upper_bound", "candidates": "final", "confidence": 0.95}
    assert loop.check_safe_to_push(allow_unsafe=True).safety_rule == "upper_bound"
    with pytest.raises(TypeError, match="unknown certificate setting"):
        finish_run(trainer, dleta=0.1)


def test_the_settings_are_shown_in_the_printed_report_and_by_hf_constrained_report(tmp_path, capsys):
    from hf_constrained.cli import main

    trainer = make_trainer(str(tmp_path / "run"), max_steps=2)
    report = finish_run(trainer, plots=False, safety_rule="upper_bound", delta=0.02, show=False)
    line = ("Certificate settings: delta 0.02, safety rule upper_bound, candidates: the final model, "
            "CLT bounds at 95%")
    assert report.render().endswith(line)
    assert main(["report", str(tmp_path / "run")]) == 0
    assert line in capsys.readouterr().out
    assert main(["report", str(tmp_path / "run"), "--rule", "point"]) == 0
    assert "safety rule upper_bound (shown here by point)" in capsys.readouterr().out
    assert SafetyReport(constraints=[]).settings_line() == ""  # a report not made by the end of a run


def test_ending_a_run_is_one_method_of_the_loop_and_no_public_function_takes_more_than_ten_parameters():
    import hf_constrained.safety.finish as finish

    assert "loop.finish(" in inspect.getsource(finish.finish_run)
    for module in (finish,):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isfunction(obj):
                assert len(inspect.signature(obj).parameters) <= 10, name


def test_the_certificates_flags_are_declared_once_and_every_recipe_inherits_them():
    """``--delta`` is one field of :class:`CertificateArguments` (its help, its check): every recipe's argument
    dataclass inherits it and none declares its own; the parsed value becomes :class:`CertificateSettings`."""
    import ast
    import os

    from hf_constrained.fairness.experiment import ROCFairnessArguments
    from hf_constrained.recipe_args import CertificateArguments
    from hf_constrained.recipes import demo_clip_digits, quickstart_digits, safe_release_digits
    from hf_constrained.safety.settings import DELTA_HELP

    for arguments in (ROCFairnessArguments, demo_clip_digits.DemoConfig, quickstart_digits.QuickstartArguments,
                      safe_release_digits.ReleaseArguments):
        assert issubclass(arguments, CertificateArguments), arguments
    assert dataclasses.fields(CertificateArguments)[0].metadata["help"] == DELTA_HELP
    with pytest.raises(ValueError, match=r"--delta must be in \(0, 1\), got 2.0"):
        quickstart_digits.QuickstartArguments(delta=2.0)
    settings = quickstart_digits.QuickstartArguments(delta=0.01).certificate_settings(safety_rule="point")
    assert (settings.delta, settings.safety_rule) == (0.01, "point")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    files = [os.path.join(root, "recipes", f) for f in os.listdir(os.path.join(root, "recipes")) if f.endswith(".py")]
    for path in [*files, os.path.join(root, "hf_constrained", "fairness", "experiment.py")]:
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                own = [s.target.id for s in node.body
                       if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
                assert "delta" not in own, f"{path}: {node.name} declares its own delta"
