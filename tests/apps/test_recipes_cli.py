"""The recipes after ``pip install``: ``hf-constrained <recipe> ...`` and
``hf_constrained.recipes.<module>`` resolve to the same files as ``python recipes/x.py`` in a
checkout, and to the copies a wheel ships; one set of flag names (``--constraint_penalty``,
``--penalty_beta``, ``--config``) across the recipes, old names refused."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch
import yaml
from recipe_outputs import assert_report_checks, run_card_snippet
from safetensors.torch import load_file

from hf_constrained.cli import main
from hf_constrained.recipe_registry import DEMO_MODULE, HELPER_MODULES, RECIPES
from hf_constrained.recipes import recipe_file, shipped_recipe_files

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
       "HF_CONSTRAINED_CACHE": tempfile.mkdtemp(prefix="hf_constrained_help_")}  # help rendered afresh


def _console() -> list[str]:
    """The installed console script when this interpreter has one, else the same entry point by module."""
    exe = os.path.join(os.path.dirname(sys.executable), "hf-constrained")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "hf_constrained.cli"]


def test_every_recipe_file_has_a_command_and_its_module_is_that_file():
    scripts = sorted(p.stem for p in (ROOT / "recipes").glob("*.py"))
    # no recipe left without a command (the demo has its own, ``hf-constrained demo``)
    assert sorted([r.module for r in RECIPES] + [DEMO_MODULE, *HELPER_MODULES]) == scripts
    for recipe in RECIPES:
        spec = importlib.util.find_spec(recipe.module_name)
        assert spec is not None and os.path.samefile(spec.origin, ROOT / "recipes" / f"{recipe.module}.py")
    assert os.path.samefile(recipe_file("configs/llm_non_forgetting_lora.yaml"),
                            ROOT / "recipes" / "configs" / "llm_non_forgetting_lora.yaml")
    assert [Path(p) for p in shipped_recipe_files()] == [ROOT / "recipes" / sub / p.name for sub in
                                                          ("configs", "accelerate_configs")
                                                          for p in sorted((ROOT / "recipes" / sub).glob("*.yaml"))]
    with pytest.raises(FileNotFoundError, match="no recipe file 'configs/nope.yaml'"):
        recipe_file("configs/nope.yaml")


def test_wheel_build_ships_the_recipes_and_their_configs(tmp_path):
    """What ``pip install .`` installs: setup.py copies recipes/ into hf_constrained/recipes/, where
    the modules and configs are found with no checkout around (run from another folder)."""
    lib = tmp_path / "lib"
    result = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(lib)],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    shipped = lib / "hf_constrained" / "recipes"
    for recipe in RECIPES:
        assert (shipped / f"{recipe.module}.py").read_text() == (ROOT / "recipes" / f"{recipe.module}.py").read_text()
    expected = sorted(str(p.relative_to(ROOT / "recipes")) for p in (ROOT / "recipes").glob("*/*.yaml"))
    assert sorted(str(p.relative_to(shipped)) for p in shipped.glob("*/*.yaml")) == expected
    code = ("import importlib.util, json, hf_constrained.recipes as r\n"
            "from hf_constrained.recipe_registry import RECIPES\n"
            "print(json.dumps({'modules': [importlib.util.find_spec(x.module_name).origin for x in RECIPES],"
            " 'files': r.shipped_recipe_files(), 'path': list(r.__path__)}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(lib)})
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    assert found["path"] == [str(shipped)]  # the wheel's copy only, no checkout
    assert [Path(m) for m in found["modules"]] == [shipped / f"{r.module}.py" for r in RECIPES]
    assert sorted(str(Path(f).relative_to(shipped)) for f in found["files"]) == expected


@pytest.mark.slow
def test_pip_wheel_holds_the_recipes_configs_and_the_console_script(tmp_path):
    """The real build (``pip wheel``, PEP 517, no build isolation: offline) of a copy of the
    source tree holds every recipe, every shipped YAML and the ``hf-constrained`` entry point."""
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "runs", "outputs", "__pycache__", ".pytest_cache", ".cache"))
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                             "-q", "-w", str(tmp_path / "wheel")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    (wheel,) = (tmp_path / "wheel").glob("hf_constrained-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for recipe in RECIPES:
        assert f"hf_constrained/recipes/{recipe.module}.py" in names
    for path in (ROOT / "recipes").glob("*/*.yaml"):
        assert f"hf_constrained/recipes/{path.parent.name}/{path.name}" in names
    assert "hf_constrained/recipes/__init__.py" in names and "hf_constrained/cli.py" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "hf-constrained = hf_constrained.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_help_lists_the_recipes():
    # speed: tests/safety/test_safety_layout.py checks that the command line imports no torch
    result = subprocess.run(_console() + ["--help"], capture_output=True, text=True, env=ENV, timeout=60)
    assert result.returncode == 0, result.stderr
    for recipe in RECIPES:
        assert recipe.command in result.stdout


@pytest.mark.slow
def test_recipe_help_through_the_console_entry_point():
    result = subprocess.run(_console() + ["fairness", "--help"], capture_output=True, text=True, env=ENV,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: hf-constrained fairness")
    for flag in ("--method", "--constraint_penalty", "--penalty_beta", "--config", "--help-all"):
        assert flag in result.stdout
    full = subprocess.run(_console() + ["fairness", "--help-all"], capture_output=True, text=True, env=ENV,
                          timeout=120)
    assert full.returncode == 0 and "--msvr_gamma_prime" in full.stdout  # the method's advanced settings


@pytest.mark.parametrize("command", [r.command for r in RECIPES])
def test_every_recipe_answers_help_with_the_shared_flag_names(command, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_CONSTRAINED_CACHE", str(tmp_path))  # rendered afresh, as the first --help is
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: hf-constrained {command}")
    for flag in ("--constraint_penalty", "--penalty_beta", "--config"):
        assert flag in out, f"{command}: no {flag}"


@pytest.mark.parametrize("command, flags", [
    ("llm-example", ["--beta", "5"]), ("llm-example", ["--steps", "4"]), ("llm-example", ["--schedule", "constant"]),
    ("safe-release", ["--penalty", "none"]), ("safe-release", ["--beta", "50"]), ("safe-release", ["--steps", "9"]),
    ("llm-example", ["--seed", "1"]), ("quickstart", ["--penalty_b", "3"]),  # no abbreviations of other flags
])
def test_old_flag_names_are_errors_not_ignored(command, flags, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, *flags])
    assert exit_.value.code == 2
    assert f"unrecognized arguments: {' '.join(flags)}" in capsys.readouterr().err


def test_llm_example_config_file_and_command_line(tmp_path):
    from hf_constrained.recipes import llm_tiny_example

    config = tmp_path / "example.yaml"
    config.write_text(yaml.safe_dump({"penalty_beta": 7.5, "max_steps": 30, "seeds": [3, 4],
                                      "constraint_penalty": "squared_hinge", "constraint_confidence": 0.9}))
    with pytest.raises(Exception, match=r"unknown keys \['constraint_confidence'\]"):  # not a flag of this example
        llm_tiny_example.parse(["--config", str(config)])
    config.write_text(yaml.safe_dump({"penalty_beta": 7.5, "max_steps": 30, "seeds": [3, 4],
                                      "constraint_penalty": "squared_hinge"}))
    cfg = llm_tiny_example.parse(["--config", str(config), "--max_steps", "12"])
    assert (cfg.penalty_beta, cfg.max_steps, cfg.seeds, cfg.constraint_penalty) == (7.5, 12, [3, 4], "squared_hinge")
    with pytest.raises(ValueError, match="--penalty_beta must be a positive number"):
        llm_tiny_example.parse(["--penalty_beta", "0"])
    assert llm_tiny_example.parse(["--constraints_per_step", "2"]).constraints_per_step == 2
    with pytest.raises(ValueError, match=r"--constraints_per_step must be in \[1, 3\], got 4"):
        llm_tiny_example.parse(["--constraints_per_step", "4"])  # three old tasks


def test_safe_release_through_the_cli_with_a_config_file(tmp_path, capsys):
    """The recipe's training arguments come from --config and the command line (the command line
    wins), and reach the trainer: the saved training_args.bin holds them."""
    out = tmp_path / "run"
    config = tmp_path / "release.yaml"
    config.write_text(yaml.safe_dump({"constraint_penalty": "squared_hinge", "penalty_beta": 3.0, "max_steps": 10,
                                      "eval_steps": 5, "save_steps": 5, "output_dir": str(out), "tolerance": 0.2}))
    assert main(["safe-release", "--config", str(config), "--penalty_beta", "7"]) == 0
    printed = capsys.readouterr().out
    assert "push gate:" in printed and "forget_digit_7" in printed
    args = torch.load(out / "checkpoint-10" / "training_args.bin", weights_only=False)
    assert (args.constraint_penalty, args.penalty_beta, args.max_steps) == ("squared_hinge", 7.0, 10)
    report = json.loads((out / "safety_report.json").read_text())
    assert {c["tolerance"] for c in report["constraints"]} == {0.2}
    # run through the command line, the card's usage snippet imports the model class from the
    # installed recipe module, which exists after pip install
    assert "from hf_constrained.recipes.safe_release_digits import DigitMLP" in (out / "README.md").read_text()
    # the verdict is printed once, and the recipe's own output passes `report --check`; the card's snippet
    # loads the saved weights as written (its repo id with an owner)
    report = assert_report_checks(out)
    assert printed.count(report.summary()) == 1
    loaded = run_card_snippet(out)
    saved = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(loaded["model"].state_dict()[k], v) for k, v in saved.items())


@pytest.mark.parametrize("command, flags, message", [
    ("quickstart", ["--constraint_penalty", "squared_hinge"], "not used with --compare true"),
    ("quickstart", ["--seeds", "0,1", "--seed", "3"], "--seed 3 is not used with --seeds 0,1"),
    ("quickstart", ["--seeds", "0;1"], "expected comma-separated integers"),
    ("clip", ["--model_name_or_path", "x", "--remove_unused_columns", "true"], "--remove_unused_columns true is not"),
    ("fairness", ["--method", "none", "--constraint_penalty", "squared_hinge"], "contradicts --method none"),
    # the default of either flag, given, is a choice too
    ("fairness", ["--method", "squared_hinge", "--constraint_penalty", "hinge"],
     "--constraint_penalty hinge contradicts --method squared_hinge"),
    ("fairness", ["--method", "icppac", "--constraint_penalty", "hinge"], "contradicts --method icppac"),
])
def test_flags_a_recipe_cannot_honour_are_errors(command, flags, message, tmp_path, capsys):
    try:  # a usage error (SystemExit), a recipe's ValueError, or a one-line error with status 2 (RecipeConfigError)
        code = main([command, *flags, "--output_dir", str(tmp_path)])
    except (ValueError, SystemExit) as error:
        text = str(error) if isinstance(error, ValueError) else capsys.readouterr().err
    else:
        assert code == 2
        text = capsys.readouterr().err
    assert message in text


@pytest.mark.parametrize("flags, method", [
    ([], "hinge"),
    (["--constraint_penalty", "squared_hinge"], "squared_hinge"),
    (["--constraint-penalty=none"], "none"),
    (["--constraint_penalty", "hinge"], "hinge"),
    (["--method", "squared_hinge"], "squared_hinge"),
    (["--method", "icppac"], "icppac"),
    (["--method", "squared_hinge", "--constraint_penalty", "squared_hinge"], "squared_hinge"),
])
def test_fairness_method_from_method_or_constraint_penalty(flags, method, tmp_path, monkeypatch):
    """``--constraint_penalty`` (listed in the fairness recipe's --help) chooses its penalty
    method when ``--method`` is not given; the run gets that method."""
    module = importlib.import_module("hf_constrained.recipes.roc_fairness")
    runs = []
    monkeypatch.setattr(module, "run_roc_fairness", lambda script, training, argv=None: runs.append(script) or {})
    monkeypatch.setattr(module.ConstrainedTrainingArguments, "should_save", property(lambda self: False))
    main(["fairness", *flags, "--output_dir", str(tmp_path)])
    assert [r.method for r in runs] == [method]


def test_fairness_method_from_a_config_file(tmp_path, monkeypatch):
    module = importlib.import_module("hf_constrained.recipes.roc_fairness")
    runs = []
    monkeypatch.setattr(module, "run_roc_fairness", lambda script, training, argv=None: runs.append(script) or {})
    monkeypatch.setattr(module.ConstrainedTrainingArguments, "should_save", property(lambda self: False))
    config = tmp_path / "fair.yaml"
    config.write_text(yaml.safe_dump({"constraint_penalty": "squared_hinge"}))
    main(["fairness", "--config", str(config), "--output_dir", str(tmp_path)])
    assert runs[-1].method == "squared_hinge"
    config.write_text(yaml.safe_dump({"constraint_penalty": "none", "method": "hinge"}))
    with pytest.raises(ValueError, match="--constraint_penalty none contradicts --method hinge"):
        main(["fairness", "--config", str(config), "--output_dir", str(tmp_path)])


def test_the_recipe_list_keeps_every_summary_in_one_column(capsys):
    """``hf-constrained recipes``: the longest command (shapes-example) no longer pushes its summary out of line."""
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if any(line.startswith(f"  {r.command} ") for r in RECIPES)]
    assert len(rows) == len(RECIPES)
    summary_at = {next(line.index(r.summary) for r in RECIPES if line.startswith(f"  {r.command} ")) for line in rows}
    assert len(summary_at) == 1
