"""A recipe's ``--help`` fits a screen with the recipe's own flags first, ``--help-all`` still lists the
Trainer's, a cached help needs no recipe import, and the demo takes ``--config`` (issue 32, item 3)."""

from __future__ import annotations

import argparse

import pytest

from hf_constrained import cli
from hf_constrained.recipe_registry import RECIPES

# a flag of each recipe's own dataclass, shown first
OWN_FLAG = {"quickstart": "--bound", "llm": "--protected_datasets", "llm-example": "--old_steps",
            "clip": "--target_class", "fairness": "--kappa", "safe-release": "--tolerance"}


def _help(capsys, command: str, flag: str) -> str:
    with pytest.raises(SystemExit) as done:
        cli.run_recipe(next(r for r in RECIPES if r.command == command), [flag])
    assert done.value.code in (0, None)
    return capsys.readouterr().out


@pytest.mark.parametrize("command", sorted(OWN_FLAG))
def test_help_is_short_and_help_all_keeps_the_trainers_flags(capsys, command):
    short = _help(capsys, command, "--help")
    assert len(short.splitlines()) < 150, f"{command} --help: {len(short.splitlines())} lines"
    assert OWN_FLAG[command] in short and "--config" in short and "--help-all" in short
    full = _help(capsys, command, "--help-all")
    if command != "llm-example":  # the example has no TrainingArguments of its own
        assert "--gradient_accumulation_steps" in full and "--gradient_accumulation_steps" not in short
        assert "--lr_scheduler_type" in full
        assert short.index(OWN_FLAG[command]) < short.index("--output_dir")  # the recipe's flags first
    assert len(full.splitlines()) > len(short.splitlines())
    assert "\n0 more flags" not in short  # llm-example hides none: its epilog does not count them


def test_a_recipes_help_is_printed_from_the_cache_without_importing_it(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_CONSTRAINED_CACHE", str(tmp_path))
    assert cli.main(["quickstart", "--help"]) == 0
    first = capsys.readouterr().out
    assert "--bound" in first

    def no_import(*args, **kwargs):
        raise AssertionError("the recipe was imported")

    monkeypatch.setattr(cli, "run_recipe", no_import)
    assert cli.main(["quickstart", "--help"]) == 0
    assert capsys.readouterr().out == first
    with pytest.raises(AssertionError, match="imported"):  # another kind of help is rendered afresh
        cli.main(["quickstart", "--help-all"])


def test_the_shipped_help_is_each_recipes_help_rendered_now(monkeypatch):
    """The short help texts shipped with the package (printed without importing a recipe) are what the
    recipes render now: a flag added to a recipe without `python -m hf_constrained.cli --write-shipped-help` fails."""
    import json

    from hf_constrained import help_cache

    with open(help_cache.SHIPPED, encoding="utf-8") as f:
        shipped = json.load(f)
    if shipped["versions"] != help_cache.versions():
        # rendered with other transformers/trl versions: never printed here, every help is rendered afresh
        assert all(help_cache.shipped_help(r.command, "help") is None for r in RECIPES)
        return
    monkeypatch.setenv("COLUMNS", "100")
    assert sorted(shipped["texts"]) == sorted([r.command for r in RECIPES] + ["demo"])
    for recipe in RECIPES:
        code, text = help_cache.render_help(lambda recipe=recipe: cli.run_recipe(recipe, ["--help"]))
        assert code == 0 and text == shipped["texts"][recipe.command], recipe.command
    code, text = help_cache.render_help(cli._render_demo_help)
    assert code == 0 and text == shipped["texts"]["demo"]


def test_the_demos_help_is_printed_without_importing_the_demo(capsys, monkeypatch, tmp_path):
    """``hf-constrained demo --help`` took 6 s (torch's import); now it is the shipped (or cached) text."""
    from hf_constrained import help_cache

    monkeypatch.setenv("HF_CONSTRAINED_CACHE", str(tmp_path))
    assert cli.main(["demo", "--help"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("usage: hf-constrained demo") and "--penalty_beta" in first and "--config" in first

    def no_import(*args, **kwargs):
        raise AssertionError("the demo was imported")

    monkeypatch.setattr(cli, "import_recipe", no_import)
    assert cli.main(["demo", "-h"]) == 0
    assert capsys.readouterr().out == first
    monkeypatch.setattr(help_cache, "shipped_help", lambda command, kind: f"shipped help of {command}\n")
    assert cli.main(["demo", "--help"]) == 0
    assert capsys.readouterr().out == "shipped help of demo\n"


def test_the_demos_help_imports_neither_torch_nor_transformers(tmp_path):
    """From the shipped text where the installed versions are the shipped ones, else from the cache the first
    call fills (that call may import both): the second call never imports them."""
    import os
    import subprocess
    import sys

    code = ("import contextlib, io, sys\nfrom hf_constrained import cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    cli.main(['demo', '--help'])\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root, "HF_CONSTRAINED_CACHE": str(tmp_path)}
    subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)  # fills the cache
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_shipped_help_is_printed_without_importing_the_recipe(capsys, monkeypatch, tmp_path):
    from hf_constrained import help_cache

    monkeypatch.setenv("HF_CONSTRAINED_CACHE", str(tmp_path))  # an empty cache: the first call
    monkeypatch.setattr(help_cache, "shipped_help", lambda command, kind: f"shipped help of {command}\n")

    def no_import(*args, **kwargs):
        raise AssertionError("the recipe was imported")

    monkeypatch.setattr(cli, "run_recipe", no_import)
    assert cli.main(["llm", "--help"]) == 0
    assert capsys.readouterr().out == "shipped help of llm\n"


def test_the_demo_takes_a_config_file(tmp_path):
    from hf_constrained.recipe_args import parse_with_config
    from hf_constrained.recipes import demo_clip_digits as demo

    parser = argparse.ArgumentParser(prog="hf-constrained demo")
    parser.add_argument("--config", default=None)
    demo.add_demo_arguments(parser)
    config = tmp_path / "demo.yaml"
    config.write_text("seed: 7\ncertify_fraction: 0.3\n")
    options = parse_with_config(parser, ["--config", str(config), "--certify_fraction", "0.25"])
    assert options.seed == 7 and options.certify_fraction == 0.25  # the command line wins over the file
    config.write_text("not_an_option: 1\n")
    with pytest.raises(SystemExit):
        parse_with_config(parser, ["--config", str(config)])


def test_a_demo_config_file_takes_the_option_names_its_help_shows(tmp_path):
    """``--penalty_beta BETA`` in the demo's help is stored as ``beta``: a file says ``penalty_beta: 3`` (the
    name the help shows, the recipes' spelling) or ``beta: 3``; a misspelt key is still an error."""
    from hf_constrained.recipe_args import parse_with_config
    from hf_constrained.recipes import demo_clip_digits as demo

    parser = argparse.ArgumentParser(prog="hf-constrained demo")
    parser.add_argument("--config", default=None)
    demo.add_demo_arguments(parser)
    config = tmp_path / "demo.yaml"
    config.write_text("penalty_beta: 3.5\nmax_steps: 12\nconstraint_penalty: none\nlearning-rate: 0.01\n")
    options = parse_with_config(parser, ["--config", str(config)])
    assert (options.beta, options.steps, options.penalties, options.lr) == (3.5, 12, "none", 0.01)
    config.write_text("beta: 2.5\n")
    assert parse_with_config(parser, ["--config", str(config), "--max_steps", "4"]).beta == 2.5
    config.write_text("penalty_bta: 3\n")
    with pytest.raises(SystemExit):
        parse_with_config(parser, ["--config", str(config)])


def test_every_demo_option_has_a_help_line():
    from hf_constrained.recipes import demo_clip_digits as demo

    parser = argparse.ArgumentParser()
    demo.add_demo_arguments(parser)
    bare = [a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help" and not a.help]
    assert bare == []
    assert set(demo.OPTION_HELP) == {f.name for f in demo.fields(demo.DemoConfig)}  # none stale, none missing


def test_a_mistyped_demo_option_prints_one_usage_line_and_the_error(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["demo", "--penalty_bta", "5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and len(err) == 2
    assert err[0].startswith("usage: hf-constrained demo [--config FILE.yaml]")
    assert err[1] == "hf-constrained demo: error: unrecognized arguments: --penalty_bta 5"


def test_the_demo_module_takes_a_config_file_too(tmp_path, capsys):
    """``python -m hf_constrained.recipes.demo_clip_digits`` (what ``make demo`` runs) reads ``--config``."""
    from hf_constrained.recipes import demo_clip_digits as demo

    with pytest.raises(SystemExit) as done:
        demo.main(["--help"])
    assert done.value.code == 0 and "--config" in capsys.readouterr().out
    config = tmp_path / "demo.yaml"
    config.write_text("seeds: '5'\nbogus: 1\n")
    with pytest.raises(SystemExit) as done:
        demo.main(["--config", str(config)])  # the file is read: its unknown key stops the demo before it runs
    assert done.value.code == 2 and "unknown keys ['bogus']" in capsys.readouterr().err


def test_a_demo_config_that_sets_one_option_twice_is_refused(tmp_path, capsys):
    """``beta:`` and ``penalty_beta:`` name one option: a file with both stops before anything runs (one would
    silently win)."""
    from hf_constrained.recipes import demo_clip_digits as demo

    config = tmp_path / "demo.yaml"
    config.write_text("beta: 5\npenalty_beta: 2\n")
    with pytest.raises(SystemExit) as done:
        demo.main(["--config", str(config)])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "keys ['beta', 'penalty_beta'] set the same option" in err
