"""benchmarks/forgetting_frontier.py end to end on a tiny old model (seconds): every method runs with the
same example settings, steps and seeds, and the JSON holds each run's target metric, paired old-task changes,
certificate and time per step."""

from __future__ import annotations

import json
import math

import pytest
from conftest import import_script

ff = import_script("benchmarks", "forgetting_frontier")
TINY = ["--old_steps", "5", "--old_rows", "20", "--hidden", "16", "--max_steps", "2", "--new_rows", "64",
        "--constraint_rows", "40", "--held_out_rows", "16", "--certify_rows", "16", "--constraint_batch_size", "8"]


def test_every_method_runs_with_the_same_steps_and_seeds(tmp_path):
    out, figure = tmp_path / "frontier.json", tmp_path / "frontier.png"
    one_value = [f"{m}={d.values[0]:g}" for m, d in ff.METHODS.items() if d.knob]
    result = ff.main(["--seeds", "0", "1", "--workers", "1", "--values", *one_value, "--json", str(out),
                      "--figure", str(figure), "--old_model", str(tmp_path / "old"), *TINY])
    saved = json.loads(out.read_text())
    assert saved["runs"] == json.loads(json.dumps(result["runs"]))
    assert figure.stat().st_size > 0 and not (tmp_path / "frontier.json.partial.jsonl").exists()
    runs = saved["runs"]
    assert {r["method"] for r in runs} == set(ff.METHODS)
    for method in ff.METHODS:
        mine = [r for r in runs if r["method"] == method]
        assert sorted(r["seed"] for r in mine) == [0, 1] and {r["steps"] for r in mine} == {2}
    tasks = {"reverse", "copy", "add"}
    old = saved["old_model"]
    for r in runs:
        assert set(r["old_task_change"]) == tasks
        assert r["worst_old_change"] == min(r["old_task_change"].values())
        assert 0.0 <= r["new_task_accuracy"] <= 1.0 and r["seconds_per_step"] > 0
        assert all(-1.0 <= c <= 1.0 and 0.0 <= old[t]["accuracy"] + c <= 1.0 for t, c in r["old_task_change"].items())
        assert r["certification_rows"] == {f"non_forgetting/{t}": 16 for t in tasks}
        assert r["largest_bound"] == max(r["upper_bounds"].values())
        assert r["certified_claim"] == (r["largest_bound"] <= 0.03)
    # each baseline ran as configured, inside the same trainer
    by = {r["method"]: r for r in runs if r["seed"] == 0}
    assert by["none"]["regulariser"] is None and by["hinge"]["regulariser"] is None
    assert by["replay"]["regulariser"]["name"] == "replay" and by["replay"]["regulariser"]["ratio"] == 0.25
    assert by["hinge+replay"]["regulariser"]["name"] == "replay"
    assert by["kl"]["regulariser"]["lam"] == 1.0 and by["l2"]["regulariser"]["lam"] == 0.1
    assert by["hinge+kl"]["regulariser"]["name"] == "kl" and by["hinge"]["regulariser"] is None  # no default anchor
    # the constraints' own settings, per run: the hinge at the claim, the combinations at --combo_tolerance
    assert by["none"]["constraint_settings"] is None and by["kl"]["constraint_settings"] is None
    assert by["hinge"]["constraint_settings"]["forget_tolerance"] == 0.03
    assert by["hinge_beta"]["constraint_settings"]["penalty_beta"] == 5.0
    assert by["hinge+kl"]["constraint_settings"]["forget_tolerance"] == saved["config"]["benchmark"]["combo_tolerance"]
    assert saved["config"]["benchmark"]["combo_tolerance"] == saved["config"]["example"]["forget_tolerance"]
    assert all(r["certificate_level"] == pytest.approx(0.045) for r in runs)  # each run its own first look
    # the summary: one entry per setting, over both seeds; the frontier names only settings that ran
    assert len(saved["settings"]) == len(ff.METHODS)
    assert all(s["seeds"] == [0, 1] for s in saved["settings"])
    assert set(saved["frontier"]["per_method"]) == set(ff.METHODS)
    assert saved["config"]["example"]["max_steps"] == 2 and "<local>" in saved["command"]


def test_dominance_and_frontier():
    def setting(method, value, acc, drop):
        return {"method": method, "value": value, "new_task_accuracy": {"median": acc},
                "worst_old_change": {"median": drop}}

    a, b, c = setting("x", 1, 0.9, -0.05), setting("x", 2, 0.8, -0.10), setting("y", 1, 0.95, -0.20)
    assert ff.dominates(a, b) and not ff.dominates(b, a) and not ff.dominates(a, c) and not ff.dominates(a, a)
    front = ff.frontier([a, b, c])
    assert front["per_method"] == {"x": [1], "y": [1]}
    assert front["dominated_by"]["x=2"] == ["x=1"] and front["dominated_by"]["y=1"] == []


def test_a_setting_is_beaten_only_at_about_its_own_cost():
    """Equal cost: a better setting that forwards more than 10% more rows per step does not dominate; at any cost
    it does (both are recorded)."""
    def setting(method, acc, drop, rows):
        return {"method": method, "value": 0.5, "new_task_accuracy": {"median": acc},
                "worst_old_change": {"median": drop}, "rows_forwarded_per_step": rows}

    cheap, dear, near = setting("replay", 1.0, -0.02, 64), setting("hinge", 1.0, -0.01, 131), \
        setting("kl", 1.0, -0.01, 70)
    assert not ff.dominates(dear, cheap) and ff.dominates(dear, cheap, equal_cost=False)
    assert ff.dominates(near, cheap)  # 70 rows: within 10% of 64
    front = ff.frontier([cheap, dear, near])
    assert front["dominated_by"]["replay=0.5"] == ["kl=0.5"]
    assert front["dominated_by_at_any_cost"]["replay=0.5"] == ["hinge=0.5", "kl=0.5"]
    # stored runs without rows per step compare as before
    assert ff.dominates({**dear, "rows_forwarded_per_step": None}, cheap)


def test_bad_knob_values_are_errors_naming_the_flag():
    with pytest.raises(SystemExit, match="--values 'none=1'"):
        ff.parse_values(["none=1"])
    with pytest.raises(SystemExit, match="--values 'ewc=1'"):
        ff.parse_values(["ewc=1"])
    assert ff.parse_values(["replay=0.5,0.75"]) == {"replay": (0.5, 0.75)}
    assert math.isnan(ff.METHODS["none"].values[0])


def test_runs_taken_from_the_example_are_its_runs_and_must_match_its_settings(tmp_path):
    from hf_constrained.recipes import llm_tiny_example as ex

    old, example_json = str(tmp_path / "old"), str(tmp_path / "example.json")
    saved = ex.main(["--seeds", "0", "--workers", "1", "--old_model", old, "--json", example_json, *TINY])
    result = ff.main(["--seeds", "0", "--workers", "1", "--methods", "replay", "--values", "replay=0.5",
                      "--example_result", example_json, "--old_model", old, "--json", str(tmp_path / "f.json"), *TINY])
    by = {r["method"]: r for r in result["runs"]}
    # the example's constrained run is the hinge with its replay (--replay_old 0.5): the benchmark's hinge+replay
    assert set(by) == {"none", "hinge+replay", "replay"} and {r["steps"] for r in result["runs"]} == {2}
    for method, penalty in (("none", "none"), ("hinge+replay", "hinge")):
        run = next(r for r in saved["runs"] if r["penalty"] == penalty)
        assert by[method]["new_task_accuracy"] == run["held_out"]["first"]["accuracy"]
        assert by[method]["upper_bounds"] == run["certificate"]["upper_bounds"]
        assert by[method]["seconds_per_step"] == run["seconds_per_step"]  # the example's run, not a new one
    assert by["hinge+replay"]["value"] == 0.5 and by["none"]["value"] is None
    assert by["hinge+replay"]["constraint_settings"]["forget_tolerance"] == 0.03
    assert by["hinge+replay"]["constraint_settings"]["penalty_beta"] == 0.25
    assert by["none"]["constraint_settings"] is None
    # a later invocation gathers earlier result files without running anything
    merged = ff.main(["--seeds", "0", "--workers", "1", "--methods", "--include", str(tmp_path / "f.json"),
                      "--old_model", old, "--json", str(tmp_path / "m.json"), *TINY])
    assert merged["runs"] == json.loads((tmp_path / "f.json").read_text())["runs"]
    with pytest.raises(SystemExit, match="come twice"):
        ff.main(["--seeds", "0", "--workers", "1", "--methods", "--include", str(tmp_path / "f.json"),
                 str(tmp_path / "m.json"), "--old_model", old, "--json", str(tmp_path / "n.json"), *TINY])
    with pytest.raises(SystemExit, match=r"differ from this run's in \['max_steps'\]"):
        ff.main(["--seeds", "0", "--workers", "1", "--methods", "replay", "--values", "replay=0.5",
                 "--example_result", example_json, "--old_model", old, "--json", str(tmp_path / "g.json"),
                 *TINY, "--max_steps", "3"])


@pytest.mark.parametrize("workers", [1, 2])
def test_run_jobs_returns_the_results_in_the_jobs_order_and_reports_each_once(workers):
    ended = []
    assert ff.run_jobs(abs, [-3, 1, -2], workers, lambda r, i: ended.append((i, r)), first=(abs, [-1])) == [3, 1, 2]
    assert sorted(i for i, _ in ended) == [0, 1, 2] and sorted(r for _, r in ended) == [1, 2, 3]


def test_the_stored_example_result_is_read_with_settings_added_since():
    """The README's frontier command reads benchmarks/results/llm_example.json (--example_result): a setting added
    after it was stored counts at the value that ran before it existed, and any other value is refused."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "benchmarks", "results", "llm_example.json")) as f:
        saved = json.load(f)
    ff.same_settings(saved["config"], ff.ex.parse([]), "llm_example.json", "--example_result")
    for added, value, other in (("warmup_steps", 0, ["--warmup_steps", "30"]),
                                ("constraint_surrogate", "loss_change", ["--constraint_surrogate", "loss_increase"]),
                                ("per_device_train_batch_size", 32, ["--per_device_train_batch_size", "16"])):
        assert ff.ex.SETTINGS_ADDED_LATER[added] == value
        older = {k: v for k, v in saved["config"].items() if k != added}  # as stored before the flag existed
        ff.same_settings(older, ff.ex.parse([]), "llm_example.json", "--example_result")
        with pytest.raises(SystemExit, match=rf"differ from this run's in \['{added}'\]"):
            ff.same_settings(older, ff.ex.parse(other), "llm_example.json", "--example_result")
    # a file stored before --replay_old existed ran without replay: it matches a run without replay only
    assert ff.ex.SETTINGS_ADDED_LATER["replay_old"] == 0.0
    older = {k: v for k, v in saved["config"].items() if k != "replay_old"}
    with pytest.raises(SystemExit, match=r"differ from this run's in \['replay_old'\]"):
        ff.same_settings(older, ff.ex.parse([]), "llm_example.json", "--example_result")
    ff.same_settings(older, ff.ex.parse(["--replay_old", "0"]), "llm_example.json", "--example_result")


def test_agem_and_replay_agem_run_and_record_their_settings(tmp_path):
    """The gradient-projection baselines: A-GEM (knob: reference rows per step, equal rows of the 3 old tasks) and
    replay + A-GEM (knob: the replay ratio; the replay batch is the reference batch) run inside the same trainer and
    record their settings."""
    result = ff.main(["--seeds", "0", "--workers", "1", "--methods", "agem", "replay_agem", "--values", "agem=6",
                      "replay_agem=0.5", "--old_model", str(tmp_path / "old"), "--json", str(tmp_path / "a.json"),
                      *TINY])
    by = {r["method"]: r for r in result["runs"]}
    assert set(by) == {"agem", "replay_agem"} and {r["steps"] for r in by.values()} == {2}
    agem, replay_agem = by["agem"], by["replay_agem"]
    assert agem["knob"] == "rows_per_step" and agem["value"] == 6 and agem["regulariser"] is None
    settings = agem["gradient_projection"]
    assert settings["name"] == "agem" and settings["rows_per_task"] == 2 and settings["rows_per_step"] == 6
    assert settings["rows"] == {"reverse": 40, "copy": 40, "add": 40}  # the constraint rows, every old task
    assert 0 <= settings["projected_steps"] <= 2
    assert replay_agem["regulariser"] == {"name": "replay", "ratio": 0.5, "rows": 120, "seed": 0}
    assert replay_agem["gradient_projection"]["name"] == "replay_agem"
    assert replay_agem["gradient_projection"]["replay"] == replay_agem["regulariser"]
    assert all(r["constraint_settings"] is None and 0.0 <= r["new_task_accuracy"] <= 1.0 for r in by.values())
    assert {s["method"] for s in result["settings"]} == {"agem", "replay_agem"}
    # their cost in rows: the reference batch is one more forward and backward per step
    from hf_constrained.recipes import llm_tiny_example as ex

    cfg = ex.parse([*TINY, "--seeds", "0"])
    for spec, reference in ((("agem", 6.0), 6), (("replay_agem", 0.5), 32)):
        trainer, _ = ex.build_trainer(str(tmp_path / "old"), "none", 0, cfg, str(tmp_path / "cost"), spec)
        rows = ex.rows_per_step(trainer)
        assert rows["agem_reference"] == reference and rows["replay"] == (reference if spec[0] == "replay_agem" else 0)
        assert rows["backward"] == rows["new"] + rows["replay"] + reference


def test_agem_reference_rows_must_split_equally_over_the_old_tasks():
    from datasets import Dataset

    from hf_constrained.recipes import llm_tiny_example as ex

    rows = {t: Dataset.from_dict({"input_ids": [[1], [2]]}) for t in ex.OLD_TASKS}
    for bad in (4.0, 1.0, 7.5):
        with pytest.raises(ValueError, match="agem: the reference rows per step must be a multiple of the 3 old"):
            ex.baseline_projection(("agem", bad), None, rows, None, 0)
    assert ex.baseline_projection(("agem", 9.0), None, rows, None, 0).rows_per_task == 3
    assert ex.baseline_projection(("replay", 0.5), None, rows, None, 0) is None
    assert ex.baseline_regulariser(("agem", 9.0), None, rows, None, 0) is None
    with pytest.raises(ValueError, match="unknown baseline 'gem'"):
        ex.baseline_regulariser(("gem", 1.0), None, rows, None, 0)


def test_the_figure_shows_cost_when_every_method_learns_the_new_task_alike(tmp_path, monkeypatch):
    """Where every method reaches the same new-task metric, the figure plots the worst old-task change against the
    rows forwarded per step (the equal-cost frontier); otherwise the new task against the worst change."""
    def setting(method, change, rows, target=1.0):
        return {"method": method, "value": None, "new_task_accuracy": {"median": target, "worst": target},
                "worst_old_change": {"median": change, "worst": change - 0.05}, "rows_forwarded_per_step": rows}
    drawn, real = [], ff.plot_against_cost
    monkeypatch.setattr(ff, "plot_against_cost", lambda settings, path, claim, title: drawn.append(path))
    ff.plot([setting("replay", -0.2, 128), setting("hinge+replay", -0.4, 128)], str(tmp_path / "a.png"), 0.03)
    assert drawn == [str(tmp_path / "a.png")]
    ff.plot([setting("replay", -0.2, 128, 0.9), setting("none", -1.0, 32)], str(tmp_path / "b.png"), 0.03)
    assert drawn == [str(tmp_path / "a.png")] and (tmp_path / "b.png").stat().st_size > 0
    real([setting("replay", -0.2, 128), setting("hinge+replay", -0.4, 128)], str(tmp_path / "c.png"), 0.03, "t")
    assert (tmp_path / "c.png").stat().st_size > 0
