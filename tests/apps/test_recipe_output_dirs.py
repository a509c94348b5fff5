"""One output-folder convention: a recipe writes into ``outputs/<module>`` unless ``--output_dir``
names another folder. Read from each recipe's own ``--help-all`` (the parser's default, shown with
every flag's full help), so the test sees what a user gets."""

from __future__ import annotations

import re

import pytest

from hf_constrained.cli import main
from hf_constrained.recipe_registry import RECIPES

# the recipes that follow the convention (the others keep theirs until their owners move them)
FOLLOWING = ("roc_fairness", "clip_non_forgetting", "safe_release_digits", "llm_non_forgetting")


def default_output_dir(command: str, capsys: pytest.CaptureFixture) -> str:
    """The default of ``--output_dir`` as ``hf-constrained <command> --help-all`` prints it."""
    assert main([command, "--help-all"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    option = "--output_dir OUTPUT_DIR, --output-dir OUTPUT_DIR"  # the option's entry, not the usage line
    assert option in text, f"{command}: no --output_dir"
    help_ = text.split(option, 1)[1].split(" --", 1)[0]
    match = re.search(r"\(default: (\S+?)\)", help_)
    assert match, f"{command}: --output_dir shows no default"
    return match.group(1)


@pytest.mark.parametrize("module", FOLLOWING)
def test_default_output_dir_is_outputs_slash_module(module, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_CONSTRAINED_CACHE", str(tmp_path))  # rendered now, not read from an earlier run
    command = next(r.command for r in RECIPES if r.module == module)
    assert default_output_dir(command, capsys) == f"outputs/{module}"


def test_the_examples_write_into_outputs_slash_module_too():
    """The demo (its folder of old models and results) and the offline LLM example (its results JSON)
    follow the same convention, read from their own parsers."""
    import argparse

    from hf_constrained.recipes import demo_clip_digits, llm_tiny_example

    parser = argparse.ArgumentParser()
    demo_clip_digits.add_demo_arguments(parser)
    assert parser.parse_args([]).cache_dir == "outputs/demo_clip_digits"
    assert llm_tiny_example.parse([]).json == "outputs/llm_tiny_example/results.json"
