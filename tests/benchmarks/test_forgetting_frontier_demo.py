"""benchmarks/forgetting_frontier_demo.py end to end on tiny demo settings (seconds): every method runs with the same
demo settings, steps and seed, and the JSON holds each run's target gain, paired protected-digit changes,
certificate (a first look each) and time per step, with forgetting_frontier.py's summary and frontier."""

from __future__ import annotations

import json

import pytest
from conftest import import_script

ffd = import_script("benchmarks", "forgetting_frontier_demo")
TINY = ["--stage1_epochs", "2", "--max_steps", "2", "--constraint_copies", "1", "--eval_copies", "1",
        "--select_every", "0", "--batch_size", "16"]


def test_every_method_runs_on_the_same_demo_settings(tmp_path, monkeypatch):
    out, figure = tmp_path / "frontier.json", tmp_path / "frontier.png"
    one_value = [f"{m}={d.values[0]:g}" for m, d in ffd.METHODS.items() if d.knob]
    finetuned = []  # each run's record from the demo (in this process: one worker), in the runs' order
    finetune = ffd.pipeline.finetune
    monkeypatch.setattr(ffd.pipeline, "finetune", lambda *a, **k: finetuned.append(finetune(*a, **k)) or finetuned[-1])
    # --margin 0.1: the constraints are trained to h_k <= 0.05 - 0.1 < 0, violated from the first step, so in two
    # steps the hinges must act (at the demo's margin they would not have yet, and every run would equal `none`)
    result = ffd.main(["--seeds", "0", "--workers", "1", "--values", *one_value, "--json", str(out),
                       "--figure", str(figure), "--cache_dir", str(tmp_path / "cache"), "--margin", "0.1", *TINY])
    saved = json.loads(out.read_text())
    assert saved["runs"] == json.loads(json.dumps(result["runs"]))
    assert figure.stat().st_size > 0 and not (tmp_path / "frontier.json.partial.jsonl").exists()
    runs = saved["runs"]
    assert [r["method"] for r in runs] == list(ffd.METHODS)
    protected = {n for n in ffd.pipeline.DIGIT_NAMES if n != "nine"}
    for r in runs:
        assert r["seed"] == 0 and r["steps"] == 2 and r["target"] == "nine"
        assert set(r["old_task_change"]) == protected
        assert r["worst_old_change"] == min(r["old_task_change"].values())
        assert r["old_task_change"][r["worst_old_class"]] == r["worst_old_change"]
        assert r["target_gain"] == pytest.approx(r["target_accuracy"] - r["old_target_accuracy"])
        assert r["largest_bound"] == max(r["upper_bounds"].values())
        # every run is the first look at its certification images, at 0.9 delta, whatever ran before it
        assert r["look"] == 1 and r["level"] == pytest.approx(0.9 * 0.05)
        assert r["certified_claim"] == all(b <= 0.15 for b in r["upper_bounds"].values())
        assert r["seconds_per_step"] > 0 and r["cpu_seconds_per_step"] > 0
    by = {r["method"]: r for r in runs}
    assert by["none"]["regulariser"] is None and by["hinge"]["regulariser"] is None
    assert by["squared_hinge"]["regulariser"] is None and by["squared_hinge"]["penalty"] == "squared_hinge"
    assert by["replay"]["regulariser"]["ratio"] == 0.5 and by["kl"]["regulariser"]["lam"] == 1.0
    assert len(saved["settings"]) == len(ffd.METHODS) and all("target_gain" in s for s in saved["settings"])
    assert set(saved["frontier"]["per_method"]) == set(ffd.METHODS)
    assert saved["chosen"]["values"] == {"none": None, "replay": 0.5, "kl": 1.0, "hinge": 10.0, "squared_hinge": 10.0}
    assert saved["chosen"]["chosen_on"] == [0]  # a tuning run: chosen on its own seeds
    assert saved["config"]["demo"]["steps"] == 2 and "<local>" in saved["command"]
    # the constrained runs are not plain fine-tuning: from the same old model, seed and batches, the hinge moved
    # the weights elsewhere (the constraint values on D_k differ) and lowered the largest of them
    assert [f["penalty"] for f in finetuned] == [r["penalty"] for r in runs]
    h = {r["method"]: f["h_train"] for r, f in zip(runs, finetuned)}
    assert set(h["none"]) == set(h["hinge"]) and h["hinge"] != h["none"] and h["squared_hinge"] != h["none"]
    assert max(h["hinge"].values()) < max(h["none"].values())

    # a report run (seeds 100 and up) never chooses on its own seeds: it records the tuning file's choice or none
    report = ["--seeds", "100", "--workers", "1", "--methods", "none", "--cache_dir", str(tmp_path / "cache"), *TINY]
    assert "chosen" not in ffd.main([*report, "--json", str(tmp_path / "report.json")])
    assert "chosen" not in json.loads((tmp_path / "report.json").read_text())
    reported = ffd.main([*report, "--json", "", "--chosen_from", str(out)])
    assert reported["chosen"] == {**saved["chosen"], "from": "<local>/frontier.json"}


def test_the_chosen_setting_gains_most_within_the_stated_drop():
    def setting(method, value, gain, drop):
        return {"method": method, "value": value, "target_gain": {"median": gain},
                "worst_old_change": {"median": drop}}

    settings = [setting("replay", 0.5, 0.30, -0.04), setting("replay", 0.75, 0.20, -0.02),
                setting("kl", 1, 0.40, -0.06), setting("kl", 3, 0.35, -0.05)]
    assert ffd.choose(settings, 0.03) == {"replay": 0.75, "kl": 3}  # kl: none within 3 points, the smallest drop
    assert ffd.choose(settings, 0.05) == {"replay": 0.5, "kl": 3}
    settings.append(setting("kl", 10, 0.10, -0.03))
    assert ffd.choose(settings, 0.03) == {"replay": 0.75, "kl": 10}
    front = ffd.ff.frontier(settings, target="target_gain")
    assert front["per_method"] == {"replay": [0.5, 0.75], "kl": [1, 3, 10]}
    assert front["dominated_by"]["kl=10"] == ["replay=0.75"] and front["dominated_by"]["kl=3"] == []


def test_a_run_tunes_or_reports(tmp_path):
    """Seeds below 100 tune, from 100 on report; a mix, or a choice taken from a file that did not tune on tuning
    seeds, is refused before any run."""
    assert not ffd.is_report_run([0, 1, 2, 3, 4]) and ffd.is_report_run([100, 101, 102, 103, 104])
    with pytest.raises(SystemExit, match="either tunes .* or reports"):
        ffd.main(["--seeds", "4", "100", "--json", ""])
    with pytest.raises(SystemExit, match="makes its own choice"):
        ffd.main(["--seeds", "0", "--chosen_from", str(tmp_path / "tuning.json"), "--json", ""])
    bad = {"old.json": {"chosen": {"rule": "r", "values": {"hinge": 10.0}}},  # no chosen_on (an older report file)
           "report.json": {"chosen": {"rule": "r", "values": {"hinge": 10.0}, "chosen_on": [100, 101]}},
           "none.json": {"runs": []}}
    for name, content in bad.items():
        (tmp_path / name).write_text(json.dumps(content))
        with pytest.raises(SystemExit, match=f"--chosen_from .*{name}"):
            ffd.main(["--seeds", "100", "--chosen_from", str(tmp_path / name), "--json", ""])
    with pytest.raises(SystemExit, match="cannot read"):
        ffd.main(["--seeds", "100", "--chosen_from", str(tmp_path / "missing.json"), "--json", ""])


def test_flags_the_benchmark_sets_are_refused():
    with pytest.raises(SystemExit, match="--penalties"):
        ffd.demo_settings(["--penalties", "hinge"])
    with pytest.raises(SystemExit, match="--values 'none=1'"):
        ffd.ff.parse_values(["none=1"], methods=ffd.METHODS)
    assert ffd.demo_settings(["--penalty_beta", "3"])["beta"] == 3.0
