"""DDP with constraints over part of the model, constraint-only parameters, and resuming a
1-process checkpoint with 2 processes (2 CPU processes, gloo; see
``tests/distributed/run_ddp_reliability.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from launch_once import free_port, launch_once
from scale_tiny import StopAt, make_trainer

pytestmark = pytest.mark.slow  # every test here starts processes

HERE = Path(__file__).resolve().parents[1]  # tests/
CONFIGS = HERE.parent / "recipes" / "accelerate_configs"




def _launch(out: Path) -> None:
    one = make_trainer(str(out / "one"), max_steps=6, save_strategy="steps", save_steps=3)
    one.add_callback(StopAt(3))
    one.train()  # a 1-process checkpoint at step 3
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "multi_gpu.yaml"),
           "--num_processes", "2", "--main_process_port", str(free_port()),
           str(HERE / "distributed" / "run_ddp_reliability.py"), "--out", str(out),
           "--checkpoint", str(out / "one" / "checkpoint-3")]

    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"accelerate launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    (out / "launch_stderr.txt").write_text(proc.stderr)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = launch_once(tmp_path_factory, "ddp_reliability", _launch)
    results = [json.loads((out / f"reliability_rank{r}.json").read_text()) for r in range(2)]
    results[0]["_log"] = (out / "launch_stderr.txt").read_text()
    return results


@pytest.mark.parametrize("case,steps", [("partial", 4), ("extra_all", 4), ("resume_1to2", 6)])
def test_runs_that_must_work_under_ddp(ranks, case, steps):
    r0, r1 = ranks[0][case], ranks[1][case]
    assert r0["status"] == r1["status"] == "ok", (r0, r1)
    assert r0["step"] == r1["step"] == steps
    assert r0["params"] == r1["params"]  # both ranks hold the same weights


def test_constraint_only_parameter_with_sampling_stops_with_its_name(ranks):
    for r in ranks:
        res = r["extra_sampled"]
        assert res["status"] == "RuntimeError"
        assert "received no gradient" in res["message"] and "extra.weight" in res["message"]
        assert "constraints_per_step" in res["message"]


def test_find_unused_parameters_refused_before_training(ranks):
    for r in ranks:
        res = r["find_unused"]
        assert res["status"] == "ValueError" and "ddp_find_unused_parameters=False" in res["message"]


def test_resume_on_more_processes_says_what_changed(ranks):
    assert "resuming a checkpoint written by 1 process(es)" in ranks[0]["_log"]
    assert "prefetched draw of step 3 is dropped" in ranks[0]["_log"]


def test_fsdp_requested_on_cpu_is_an_error(tmp_path, monkeypatch):
    """``accelerate launch --config_file fsdp.yaml --use_cpu true`` sets ACCELERATE_USE_FSDP but
    Accelerate then runs without FSDP: refused instead of silently training unsharded."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="FSDP was requested .* without FSDP .*multi_gpu.yaml"):
        make_trainer(str(tmp_path / "fsdp"))
