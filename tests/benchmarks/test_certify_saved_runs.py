"""benchmarks/certify_saved_runs.py: the forgetting benchmark's saved runs certified with ``hf-constrained certify``
give the certificates the benchmark computed inside each run (the same rows, statistic and bound)."""

from __future__ import annotations

import json
import shutil

from conftest import import_script

ff = import_script("benchmarks", "forgetting_frontier")
csr = import_script("benchmarks", "certify_saved_runs")
# an old model that answers some rows right, so that forgetting shows in the bounds
SMALL = ["--old_steps", "150", "--old_rows", "60", "--hidden", "32", "--max_steps", "4", "--new_rows", "64",
         "--constraint_rows", "40", "--held_out_rows", "16", "--certify_rows", "48", "--constraint_batch_size", "8"]


def test_the_command_certifies_each_saved_run_as_the_benchmark_did(tmp_path):
    saved, old = tmp_path / "saved", str(tmp_path / "old")
    ff.main(["--seeds", "0", "--workers", "1", "--methods", "none", "replay", "--values", "replay=0.5",
             "--json", str(tmp_path / "ff.json"), "--old_model", old, "--save_models", str(saved),
             "--learning_rate", "0.05", *SMALL])
    rows = sorted(p.name for p in (saved / "certification_rows").iterdir())
    assert rows == ["add.jsonl", "copy.jsonl", "reverse.jsonl"]
    first = json.loads((saved / "certification_rows" / "add.jsonl").read_text().splitlines()[0])
    assert set(first) == {"id", "prompt", "completion"} and first["id"] == "add/certify/0"
    assert sorted(p.name for p in (saved / "runs").iterdir()) == ["none-none-seed0", "replay-0.5-seed0"]
    result = csr.main(["--runs", str(saved), "--old_model", old, "--frontier_json", str(tmp_path / "ff.json"),
                       "--json", str(tmp_path / "c.json")])
    assert result["compared_with_benchmark"] == {"runs": 2, "same_verdict": 2, "largest_bound_difference": 0.0}
    bounds = [b for r in result["runs"].values() for b in r["upper_bounds"].values()]
    assert max(bounds) > min(bounds)  # forgetting differs between tasks or runs: the comparison can fail
    # every draw kept, draws of the same text included
    assert all(set(r["num_rows"].values()) == {48} for r in result["runs"].values())
    assert all(set(r["looks"].values()) == {1} for r in result["runs"].values())  # each its user's first look
    assert set(result["summary"]) == {"none-none", "replay-0.5"}
    assert str(tmp_path) not in (tmp_path / "c.json").read_text()  # no local path in the result file
    # one user certifying both models on the same rows spends a second look: the later model is tested at a
    # smaller level, so its bounds are wider than the benchmark's
    fresh = tmp_path / "fresh"  # the same saved runs, never certified (a model certified twice is one look)
    shutil.copytree(saved, fresh, ignore=shutil.ignore_patterns("certificates"))
    shared = csr.main(["--runs", str(fresh), "--old_model", old, "--frontier_json", str(tmp_path / "ff.json"),
                       "--ledger", "shared"])
    assert sorted(max(r["looks"].values()) for r in shared["runs"].values()) == [1, 2]
    assert shared["compared_with_benchmark"]["largest_bound_difference"] > 0


def test_the_many_task_example_writes_every_old_task_s_certification_rows(tmp_path):
    from hf_constrained.recipes import llm_many_tasks_example as many

    cfg = many.parse(["--certify_rows", "5"])
    paths = many.write_certification_rows(cfg, str(tmp_path))
    assert sorted(paths) == sorted(many.OLD_TASKS) and len(paths) == 24
    rows = [json.loads(line) for line in open(paths["add"])]
    assert [r["id"] for r in rows] == [f"add/certify/{i}" for i in range(5)] and rows[0]["prompt"].startswith("add:")
