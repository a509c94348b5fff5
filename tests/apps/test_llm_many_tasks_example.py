"""The many-task offline LLM example (recipes/llm_many_tasks_example.py, ``hf-constrained llm-many-tasks``): 24 old
string tasks from generated families, constraints sampled (|B_c| < m), a certificate of every task, and per run the
new task, the worst and mean change, the share of tasks over the tolerance, seconds and rows per step; the
forgetting benchmark and the step-cost benchmark run on it (``--example many_tasks``)."""

from __future__ import annotations

import json
import random

import pytest
from conftest import import_script

from hf_constrained.cli import main
from hf_constrained.recipes import llm_many_tasks_example as many

# seconds on one core: a 1-layer GPT-2 of width 16, a few rows per task and a few steps
TINY = ["--old_steps", "4", "--old_rows", "8", "--hidden", "16", "--layers", "1", "--max_steps", "3",
        "--new_rows", "32", "--per_device_train_batch_size", "8", "--constraint_rows", "16", "--held_out_rows", "8",
        "--certify_rows", "12", "--constraint_batch_size", "2", "--forget_tolerance", "0.5"]


@pytest.fixture(scope="module")
def old_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("many") / "old"
    many.train_old_model(str(folder), many.parse(TINY))
    return str(folder)


def test_at_least_twenty_old_tasks_of_generated_families_some_close_some_conflicting():
    assert len(many.OLD_TASKS) >= 20 and many.NEW_TASK not in many.OLD_TASKS
    assert set(many.CLOSE_TASKS) | set(many.CONFLICTING_TASKS) <= set(many.OLD_TASKS)
    rng = random.Random(0)
    for task in (*many.OLD_TASKS, many.NEW_TASK):
        for row in many.make_rows(task, 20, rng):
            assert row["prompt"].startswith(f"{task}:") and row["prompt"].endswith("=") and row["completion"]
            # BOS, prompt, answer and EOS fit the GPT-2's context
            assert len(row["prompt"]) + len(row["completion"]) + 2 <= many.TASKS.max_positions
    known = {"rev": ("abc", "cba"), "rot2": ("abc", "cde"), "up": ("abj", "klt"), "sort": ("cab", "abc"),
             "f2": ("abcd", "ab"), "l1": ("abcd", "d"), "snd": ("abcd", "b"), "nf": ("cab", "d"),
             "swap": ("abcd", "dbca"), "dup": ("ab", "aabb"), "rotl": ("abcd", "bcda"), "fst": ("cab", "c")}
    for task, (word, answer) in known.items():
        rule = many.TASK_FAMILIES[task][1]
        draws = [rule(random.Random(i)) for i in range(2000)]
        assert all(a == answer for w, a in draws if w == word), task
    for task in ("add", "sub", "cnt", "intl"):  # the rules of two-part inputs
        for question, answer in (many.TASK_FAMILIES[task][1](random.Random(i)) for i in range(50)):
            if task == "add":
                a, b = question.split("+")
                assert int(answer) == int(a) + int(b)
            elif task == "sub":
                a, b = question.split("-")
                assert int(answer) == int(a) - int(b) >= 0
            elif task == "cnt":
                word, letter = question.split(",")
                assert int(answer) == word.count(letter) >= 1
            else:
                a, b = question.split(",")
                assert answer[::2] == a and answer[1::2] == b
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        many.make_rows("nope", 1, rng)


def test_defaults_sample_fewer_constraints_than_tasks_and_bad_input_is_a_clear_error():
    cfg = many.parse([])
    m = len(many.OLD_TASKS)
    assert cfg.constraints_per_step is not None and cfg.constraints_per_step < m
    assert (cfg.forget_tolerance, cfg.delta, cfg.certify_rows) == (0.03, 0.05, many.CERTIFY_ROWS)
    assert cfg.json == "outputs/llm_many_tasks_example/results.json"
    with pytest.raises(ValueError, match=rf"--constraints_per_step must be in \[1, {m}\], got {m + 1}"):
        many.parse(["--constraints_per_step", str(m + 1)])
    with pytest.raises(ValueError, match="--constraints_per_step"):
        many.parse(["--constraints_per_step", "0"])
    assert many.parse(["--constraints_per_step", str(m)]).constraints_per_step == m  # all of them: allowed
    with pytest.raises(ValueError, match="--forget_tolerance"):
        many.parse(["--forget_tolerance", "3"])  # a share of examples, not points


def test_the_certification_rows_are_sized_for_all_tasks_at_once():
    """The rule of benchmarks/certification_size.py for 24 tasks at power 0.95 gives the default; 1500 rows
    would not (all 24 tasks certify with probability 0.72 at a true 1.5% forgotten each)."""
    size = import_script("benchmarks", "certification_size")
    m = len(many.OLD_TASKS)
    result = size.main(["--tasks", str(m), "--power", "0.95"])
    assert result["chosen_n"] == many.CERTIFY_ROWS
    by_n = {r["n"]: r["probability_all_tasks_certify"]["0.015"] for r in result["table"]}
    assert by_n[many.CERTIFY_ROWS] >= 0.95 > by_n[1500]


def test_the_constrained_run_samples_its_constraints_per_step(old_model, tmp_path):
    cfg = many.parse(TINY + ["--constraints_per_step", "3"])
    trainer, _ = many.build_trainer(old_model, "hinge", 0, cfg, str(tmp_path))
    sampler = trainer.engine.sampler
    drawn = {}
    sample = sampler.sample

    def recording(step):
        drawn[step] = [int(i) for i in sample(step)]
        return sample(step)

    sampler.sample = recording
    trainer.train()
    m = len(many.OLD_TASKS)
    assert sampler.num_constraints == m == len(trainer.constraints) and sampler.num_per_step == 3
    assert drawn and all(len(set(ix)) == 3 and all(0 <= i < m for i in ix) for ix in drawn.values())
    assert len({tuple(ix) for ix in drawn.values()}) > 1 or len(drawn) == 1  # a fresh draw each step
    rows = many.rows_per_step(trainer)
    assert rows["constraint"] == 3 * cfg.constraint_batch_size  # |B_c| tasks, not m


def test_end_to_end_every_task_certified_and_the_results_record_the_fields(old_model, tmp_path):
    out = tmp_path / "result.json"
    assert main(["llm-many-tasks", *TINY, "--seeds", "0", "--old_model", old_model, "--json", str(out),
                 "--workers", "1", "--constraints_per_step", "2"]) == 0
    saved = json.loads(out.read_text())
    m = len(many.OLD_TASKS)
    assert "every old task loses at most 50 points" in saved["claim"] and len(saved["old_model_sha256"]) == 64
    assert set(saved["tasks"]) == {*many.OLD_TASKS, many.NEW_TASK}
    assert set(saved["summary"]["old_model"]) == {*many.OLD_TASKS, many.NEW_TASK}
    old = saved["summary"]["old_model"]  # the tasks the old model knows least are named
    assert saved["summary"]["weak_old_tasks"] == {t: old[t]["accuracy"] for t in many.OLD_TASKS
                                                  if old[t]["accuracy"] < many.WEAK}
    per_seed = saved["summary"]["per_seed"]
    assert set(per_seed) == {"none", "hinge"}
    for method, (row,) in per_seed.items():
        assert 0.0 <= row["new_task_accuracy"] <= 1.0 and set(row["old_task_change"]) == set(many.OLD_TASKS)
        changes = row["old_task_change"].values()
        assert row["worst_old_change"] == min(changes)
        assert row["mean_old_change"] == pytest.approx(sum(changes) / m)
        assert row["share_over_tolerance"] == sum(c < -0.5 for c in changes) / m
        # the certificate covers every old task, on the rows asked for
        assert row["certification_rows"] == {f"non_forgetting/{t}": 12 for t in many.OLD_TASKS}
        assert set(row["upper_bounds"]) == set(many.OLD_TASKS)
        assert row["largest_bound"] == max(row["upper_bounds"].values())
        assert row["tasks_certified"] == sum(b <= 0.5 for b in row["upper_bounds"].values())
        assert row["certified"] == (row["tasks_certified"] == m)
        assert row["seconds_per_step"] > 0 and row["rows_per_step"]["forward"] >= row["rows_per_step"]["backward"] > 0
    assert per_seed["hinge"][0]["rows_per_step"]["constraint"] == 2 * 2  # 2 of 24 constraints, 2 rows each
    assert per_seed["none"][0]["rows_per_step"]["constraint"] == 0
    assert any(k.startswith("hinge_certified_in_1_of_1") for k in saved["summary"]["goals"])
    assert saved["config"]["constraints_per_step"] == 2


def test_the_benchmarks_run_on_the_many_task_example(old_model, tmp_path, monkeypatch):
    ff = import_script("benchmarks", "forgetting_frontier")
    monkeypatch.setattr(ff, "ex", ff.ex)  # --example many_tasks switches the module's example: undone after
    out = tmp_path / "frontier.json"
    ff.main(["--example", "many_tasks", "--methods", "none", "hinge", "agem", "--values", "hinge=0.5",
             "--seeds", "0", "--workers", "1", "--json", str(out), "--old_model", old_model, *TINY,
             "--constraints_per_step", "2"])
    saved = json.loads(out.read_text())
    assert {r["method"] for r in saved["runs"]} == {"none", "hinge", "agem"}
    assert sorted(r["value"] for r in saved["runs"] if r["method"] == "agem") == [24.0, 48.0]  # a row per task
    for r in saved["runs"]:
        assert set(r["old_task_change"]) == set(many.OLD_TASKS)
        assert r["mean_old_change"] == pytest.approx(sum(r["old_task_change"].values()) / len(many.OLD_TASKS))
        assert 0.0 <= r["share_over_tolerance"] <= 1.0 and r["rows_per_step"]["forward"] > 0
        assert len(r["certification_rows"]) == len(many.OLD_TASKS)
    hinge = next(r for r in saved["runs"] if r["method"] == "hinge")
    assert hinge["rows_per_step"]["constraint"] == 2 * 2
    assert all("share_over_tolerance" in s for s in saved["settings"])
    cost = import_script("benchmarks", "example_step_cost")
    result = cost.main(["--example", "many_tasks", "--methods", "hinge=0.5", "none", "--reference", "none",
                        "--steps", "3", "--warmup", "1", "--rounds", "1", "--old_model", old_model, *TINY,
                        "--constraints_per_step", "2"])
    assert result["rows_per_step"]["hinge=0.5"]["constraint"] == 2 * 2
    assert result["example"]["constraints_per_step"] == 2


def test_stored_results_complete_to_the_current_settings():
    """Every committed many-task result's settings, completed with the settings added since (``stored_settings``),
    have exactly the example's current fields, so that ``--include`` / ``--example_result`` compare like with like."""
    import dataclasses
    import glob
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    fields = {f.name for f in dataclasses.fields(many.ManyTaskArguments)}
    files = glob.glob(os.path.join(root, "benchmarks", "results", "forgetting_frontier_many_tasks_*.json"))
    assert files
    for path in files:
        with open(path) as f:
            saved = json.load(f)["config"]["example"]
        assert set(many.stored_settings(saved)) == fields, path

