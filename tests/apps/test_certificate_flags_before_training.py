"""A certificate setting a recipe cannot use (``--delta 2``, a share above 1, an audit share of 1) and a
combination the Trainer's own arguments refuse are one-line errors naming the flag, before anything trains:
these values are read only at the end of a run, so a late check costs the user the whole training."""

from __future__ import annotations

import pytest

from hf_constrained import ConstrainedTrainer
from hf_constrained.cli import main


def _no_training(*args, **kwargs):
    raise AssertionError("the recipe trained before refusing a flag")


@pytest.mark.parametrize("command, flags, message", [
    ("safe-release", ["--delta", "2"], "--delta must be in (0, 1), got 2.0"),
    ("safe-release", ["--forget_tolerance", "1.5"], "--forget_tolerance is a share of each old digit's images"),
    ("safe-release", ["--audit_fraction", "1"], "--audit_fraction must be in [0, 1), got 1.0"),
    ("safe-release", ["--eval_strategy", "no", "--load_best_model_at_end", "true"],
     "--load_best_model_at_end requires the save and eval strategy to match"),
    ("quickstart", ["--delta", "0"], "--delta must be in (0, 1), got 0.0"),
    ("quickstart", ["--certify_fraction", "1"], "--certify_fraction must be in [0, 1)"),
    ("fairness", ["--delta", "1.5"], "--delta must be in (0, 1), got 1.5"),
    ("fairness", ["--dataset", "csv"], "--dataset csv needs --csv_path, --label_column and --group_column"),
])
def test_a_certificate_setting_is_refused_in_one_line_before_training(command, flags, message, tmp_path, capsys,
                                                                      monkeypatch):
    monkeypatch.setattr(ConstrainedTrainer, "train", _no_training)
    out = tmp_path / "out"
    code = main([command, *flags, "--output_dir", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith(f"hf-constrained {command}: error: ") and len(err.splitlines()) == 1
    assert message in err and "Traceback" not in err
    assert not out.exists()  # nothing written: no checkpoint, no report


@pytest.mark.parametrize("flags, message", [
    (["--delta", "2"], "--delta must be in (0, 1), got 2.0"),
    (["--forget_tolerance", "15"], "--forget_tolerance is a share of each protected class's images forgotten"),
])
def test_the_demo_refuses_a_certificate_setting_before_stage_1(flags, message, tmp_path, capsys, monkeypatch):
    from hf_constrained.recipes import demo_clip_digits as demo

    monkeypatch.setattr(demo, "run_seed", _no_training)
    assert main(["demo", *flags, "--cache_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("command, flags, message", [
    ("fairness", ["--dataset", "csv", "--csv_path", "{tmp}/nope.csv", "--label_column", "y", "--group_column", "g"],
     "CSV file '{tmp}/nope.csv' (--csv_path) does not exist"),
    ("llm", ["--dataset_name", "{tmp}/t.json", "--protected_datasets", "{tmp}/p.json",
             "--model_name_or_path", "{tmp}/no-model"],
     "--model_name_or_path='{tmp}/no-model': the local path does not exist"),
    ("clip", ["--model_name_or_path", "{tmp}/no-model", "--data", "csv", "--target_class", "cat",
              "--protected_classes", "dog", "--prompt_template", "a {{}}", "--target_csv", "t.csv",
              "--protected_csv", "p.csv"],
     "--model_name_or_path='{tmp}/no-model': the local path does not exist"),
])
def test_a_missing_input_file_is_one_line_naming_it(command, flags, message, tmp_path, capsys, monkeypatch):
    """From ``hf-constrained <recipe>``: the recipe's own message (the file and its flag), without a traceback;
    ``HF_CONSTRAINED_DEBUG=1`` gives the traceback back."""
    monkeypatch.setattr(ConstrainedTrainer, "train", _no_training)
    monkeypatch.delenv("HF_CONSTRAINED_DEBUG", raising=False)
    argv = [command, *(f.format(tmp=tmp_path) for f in flags), "--output_dir", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hf-constrained {command}: error: ") and len(err.splitlines()) == 1
    assert message.format(tmp=tmp_path) in err and "Traceback" not in err
    monkeypatch.setenv("HF_CONSTRAINED_DEBUG", "1")
    with pytest.raises(FileNotFoundError):
        main(argv)


def test_a_file_the_operating_system_could_not_open_keeps_its_traceback(monkeypatch):
    """A raw ``[Errno 2]`` (an ``open()`` of a path the code built, e.g. a file a run should have written) names
    no flag: it is not shown as the user's mistake in one line, but raised with its traceback."""
    from hf_constrained import cli

    def lost_file(recipe, argv):
        open("/nonexistent-hf-constrained/trainer_state.json", encoding="utf-8")

    monkeypatch.delenv("HF_CONSTRAINED_DEBUG", raising=False)
    monkeypatch.setattr(cli, "run_recipe", lost_file)
    with pytest.raises(FileNotFoundError, match="trainer_state.json"):
        main(["quickstart"])


@pytest.mark.parametrize("command, flags, message", [
    ("llm", ["--delta", "2"], "--delta must be in (0, 1), got 2.0"),
    ("llm", ["--forget_tolerance", "3"], "--forget_tolerance is a share of examples, in [0, 1]; got 3.0"),
    ("clip", ["--model_name_or_path", "{tmp}", "--data", "csv"], "--data csv needs --target_class"),
    ("llm", ["--model_name_or_path", "bad id!!"], "is neither a local model directory nor a hub id"),
])
def test_the_llm_and_clip_recipes_refuse_a_setting_in_one_line(command, flags, message, tmp_path, capsys):
    extra = ["--dataset_name", "t.json", "--protected_datasets", "p.json", "--model_name_or_path", "m"] \
        if command == "llm" else []
    flags = [f.format(tmp=tmp_path) for f in flags]
    assert main([command, *extra, *flags, "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err
