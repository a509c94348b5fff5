"""The quickstart (recipes/quickstart_digits.py) leaves its results in its output folder, tells a user in
plain words why a column shows violated constraints, and its stored results are what the command beside
them in the README produces (the command re-parses to the stored settings; the README's numbers are the
stored summary's)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from hf_constrained.recipes import quickstart_digits as qs

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
STORED = sorted((ROOT / "benchmarks" / "results").glob("quickstart_seeds*.json"))


def test_the_default_output_folder_is_outputs_quickstart_digits():
    opts, args = qs.parse_args([])
    assert args.output_dir == "outputs/quickstart_digits"


def test_another_margin_setting_replaces_the_default_margin(tmp_path):
    """The recipe trains with a margin by default; a user's calibrated or certificate-sized margin replaces it
    (they are exclusive), and giving both margins is the library's error, naming them."""
    assert qs.parse_args([])[1].constraint_margin == qs.TRAINING_DEFAULTS["constraint_margin"] > 0
    _, args = qs.parse_args(["--constraint_confidence", "0.9"])
    assert args.constraint_confidence == 0.9 and args.constraint_margin is None
    (tmp_path / "c.yaml").write_text("constraint_certificate_delta: 0.1\n")
    _, args = qs.parse_args(["--config", str(tmp_path / "c.yaml")])
    assert args.constraint_certificate_delta == 0.1 and args.constraint_margin is None
    with pytest.raises(ValueError, match="give at most one of constraint_margin, constraint_confidence"):
        qs.parse_args(["--constraint_confidence", "0.9", "--constraint_margin", "0.1"])


def test_a_run_leaves_its_results_and_certificate_in_its_output_folder(tmp_path, capsys):
    out = tmp_path / "qs"
    result = qs.main(["--compare", "false", "--num_train_epochs", "1", "--output_dir", str(out)])
    stored = json.loads((out / "results.json").read_text())
    assert stored == json.loads(json.dumps(result))
    assert stored["command"].startswith("python recipes/quickstart_digits.py --compare false --num_train_epochs 1")
    assert stored["config"]["training"]["num_train_epochs"] == 1
    (run,) = stored["runs"]
    assert run["method"] == "hinge" and set(run["test_constraint"]) == {f"digit{d}" for d in range(10)}
    assert 0.0 <= run["test_accuracy"] <= 1.0
    # the certificate the run produced, in the run's folder, is the one the results report
    certificate = json.loads((out / "hinge" / "certificate.json").read_text())
    assert certificate["upper_bounds"][0] == pytest.approx(run["certificate"]["upper_bound"])
    # one epoch is too few: the output says so instead of leaving ten violated constraints unexplained
    printed = capsys.readouterr().out
    default = qs.TRAINING_DEFAULTS["num_train_epochs"]
    assert f"too few epochs (1; the recipe's default is {default})" in printed and "--num_train_epochs" in printed


def _record(train: float, test: float) -> dict:
    return {"train_constraint": {f"digit{d}": train for d in range(10)},
            "test_constraint": {f"digit{d}": test for d in range(10)}}


def test_the_verdict_names_what_a_column_shows():
    assert "too few epochs" in qs.verdict("hinge", _record(0.9, 0.9), 0.4, 2)
    long_run = qs.verdict("hinge", _record(0.9, 0.9), 0.4, 40)
    assert "too few epochs" not in long_run and "--penalty_beta" in long_run
    assert "digit3 exceeds 0.4" in qs.verdict("hinge", {**_record(0.3, 0.3), "test_constraint": {
        **_record(0.3, 0.3)["test_constraint"], "digit3": 0.5}}, 0.4, 20)
    assert "digit3, digit4 exceed 0.4" in qs.verdict("hinge", {**_record(0.3, 0.3), "test_constraint": {
        **_record(0.3, 0.3)["test_constraint"], "digit3": 0.5, "digit4": 0.6}}, 0.4, 20)
    assert "holds on its training rows and on unseen test images" in qs.verdict("hinge", _record(0.3, 0.3), 0.4, 20)
    assert "baseline" in qs.verdict("none", _record(0.9, 0.9), 0.4, 20)


@pytest.mark.slow
def test_the_readme_quickstart_command_runs_the_method_to_its_bounds(tmp_path, capsys):
    """The README's command line for the quickstart shows the method working: the hinge ends with every
    constraint met on its training rows, and the output says what holds on unseen images."""
    commands = re.findall(r"^hf-constrained quickstart([^\n#]*)", README.read_text(), flags=re.M)
    assert len(commands) == 1
    argv = shlex.split(commands[0])
    result = qs.main(argv + ["--output_dir", str(tmp_path)])
    (run,) = [r for r in result["runs"] if r["method"] == "hinge"]
    assert run["hold_train"]
    assert "hinge: every constraint holds on its training rows" in capsys.readouterr().out


@pytest.mark.parametrize("path", STORED, ids=lambda p: p.name)
def test_stored_results_come_from_their_command(path):
    """Each stored result's command, parsed by the recipe's own parser, gives the stored settings."""
    data = json.loads(path.read_text())
    program, *argv = shlex.split(data["command"])[1:]
    assert program == "recipes/quickstart_digits.py"
    opts, args = qs.parse_args(argv)
    assert qs.settings(opts, args) == data["config"]
    assert opts.json == str(path.relative_to(ROOT))  # the file is the one the command writes
    assert [r["seed"] for r in data["runs"] if r["method"] == data["runs"][0]["method"]] == data["seeds"]


def test_the_stored_quickstart_results_are_the_ones_the_readme_cites():
    assert STORED, "no benchmarks/results/quickstart_seeds*.json"
    text = (ROOT / "docs" / "benchmarks.md").read_text()  # every measurement, with its command
    start = text.index("## The quick start")
    section = text[start:text.index("\n## ", start + 1)]
    for path in STORED:
        data = json.loads(path.read_text())
        assert f"`{data['command']}`" in section or data["command"] in section, path.name
        for method, s in data["summary"].items():
            n = s["runs"]
            cells = (f"{s['hold_test']}/{n}",
                     f"{s['test_max_violation_median']:+.3f} ({s['test_max_violation_worst']:+.3f})",
                     f"{s['test_accuracy_median']:.3f} ({s['test_accuracy_worst']:.3f})")
            for cell in cells:
                assert cell in section, f"{path.name} {method}: {cell} not in the README's quick start"



def test_label_smoothing_is_a_flag_the_recipe_honours(tmp_path):
    """``--label_smoothing_factor`` (a Trainer flag) works with the recipe's model and changes the training."""
    common = ["--compare", "false", "--max_steps", "3", "--certify_fraction", "0"]
    plain = qs.main(common + ["--output_dir", str(tmp_path / "plain")])["runs"][0]
    smooth = qs.main(common + ["--label_smoothing_factor", "0.5", "--output_dir", str(tmp_path / "smooth")])["runs"][0]
    assert smooth["train_constraint"] != plain["train_constraint"]  # another objective, another model
