"""``--config x.yaml`` for every recipe (the convention of TRL's scripts): the file sets flags,
the command line overrides it, unknown keys and missing files are errors naming the file."""

import pytest
import yaml

from hf_constrained import ConstrainedTrainingArguments
from hf_constrained.fairness.experiment import ROCFairnessArguments
from hf_constrained.recipe_args import RecipeConfigError, parse_recipe_args

TYPES = [ROCFairnessArguments, ConstrainedTrainingArguments]


def test_file_sets_flags_and_the_command_line_wins(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"dataset": "compas", "penalty_beta": 3.0, "msvr_gamma_prime": "theory",
                                      "output_dir": str(tmp_path / "o"), "num_train_epochs": 7}))
    script, args = parse_recipe_args(TYPES, ["--config", str(config), "--num_train_epochs", "2"],
                                     defaults={"learning_rate": 1e-3, "penalty_beta": 9.0})
    assert script.dataset == "compas"
    assert args.penalty_beta == 3.0          # the file beats the recipe's default
    assert args.learning_rate == 1e-3        # the recipe's default where the file is silent
    assert args.num_train_epochs == 2        # the command line beats the file
    assert args.msvr_gamma_prime == "theory"


def test_without_a_file_flags_and_defaults_apply(tmp_path):
    _, args = parse_recipe_args(TYPES, ["--output_dir", str(tmp_path), "--msvr_gamma_prime", "theory"],
                                defaults={"penalty_beta": 9.0})
    assert args.penalty_beta == 9.0 and args.msvr_gamma_prime == "theory"


def test_unknown_keys_and_missing_files_are_errors_naming_the_file(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({"penalti_beta": 2.0}))
    with pytest.raises(RecipeConfigError, match=r"bad.yaml: unknown keys \['penalti_beta'\]"):
        parse_recipe_args(TYPES, ["--config", str(config), "--output_dir", str(tmp_path)])
    with pytest.raises(RecipeConfigError, match="nope.yaml: no such file"):
        parse_recipe_args(TYPES, ["--config", str(tmp_path / "nope.yaml")])
    config.write_text("- a\n- b\n")
    with pytest.raises(RecipeConfigError, match="expected a mapping"):
        parse_recipe_args(TYPES, ["--config", str(config)])


def test_roc_recipe_refuses_flags_it_cannot_honour(tmp_path):
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "recipes", "roc_fairness.py")
    spec = importlib.util.spec_from_file_location("roc_fairness_recipe", path)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    for flags, what in ((["--method", "hinge", "--constraint_penalty", "squared_hinge"], "contradicts --method"),
                        (["--lr_scheduler_type", "cosine"], "--lr_scheduler_type cosine is not used"),
                        (["--optim", "sgd"], "--optim sgd is not used")):
        with pytest.raises(ValueError, match=what):
            recipe.main(flags + ["--output_dir", str(tmp_path), "--num_train_epochs", "1"])


def test_the_readmes_launch_commands_find_their_configs_from_any_folder(tmp_path, monkeypatch):
    """The README's `accelerate launch -m hf_constrained.recipes...` commands run from an install:
    their --config is found whatever the current folder (a shipped config named by its file name)."""
    import shlex
    from pathlib import Path

    from hf_constrained.recipe_args import load_config_file

    lines = (Path(__file__).resolve().parents[2] / "README.md").read_text().splitlines()
    commands, current = [], None
    for line in lines:  # shell lines, a trailing backslash continuing them
        if current is None and line.startswith("accelerate launch -m "):
            current = ""
        if current is not None:
            current += " " + line.rstrip("\\ ")
            if not line.rstrip().endswith("\\"):
                commands.append(current.split("#")[0])
                current = None
    assert commands
    monkeypatch.chdir(tmp_path)  # not the repository: as after pip install
    configs = 0
    for command in commands:
        argv = shlex.split(command)
        if "--config" in argv:
            config = load_config_file(argv[argv.index("--config") + 1])
            assert isinstance(config, dict) and config
            configs += 1
    assert configs >= 1


def test_a_usage_error_prints_the_short_usage_and_the_error(capsys, tmp_path):
    """Every recipe: a bad flag prints two lines (the usage line and the error), not every flag."""
    with pytest.raises(SystemExit) as exit_:
        parse_recipe_args(TYPES, ["--output_dir", str(tmp_path), "--penalti_beta", "2"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err
    assert err[0].startswith("usage: ") and "[--config FILE.yaml]" in err[0]
    assert "unrecognized arguments: --penalti_beta 2" in err[1]


def test_a_replaced_flag_names_its_replacement(capsys, tmp_path):
    replaced = {"beta": "use --penalty_beta"}
    with pytest.raises(SystemExit):
        parse_recipe_args(TYPES, ["--output_dir", str(tmp_path), "--beta", "2"], replaced_flags=replaced)
    assert "--beta was replaced: use --penalty_beta" in capsys.readouterr().err
    config = tmp_path / "old.yaml"
    config.write_text(yaml.safe_dump({"beta": 2}))
    with pytest.raises(RecipeConfigError, match="key 'beta' was replaced: use --penalty_beta"):
        parse_recipe_args(TYPES, ["--config", str(config), "--output_dir", str(tmp_path)], replaced_flags=replaced)
