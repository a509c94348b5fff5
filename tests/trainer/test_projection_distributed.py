"""A-GEM and replay + A-GEM across two processes (DDP on CPU, gloo): every rank projects the same gradient along
the same reference gradient (the processes' reference gradients averaged with their row weights), so the ranks
stay bitwise identical and match one process reading the same rows (2 processes x 2 reference rows of each task =
1 process x 4; replay: each rank its own old rows, together the 1-process run's) to float rounding; under gradient
accumulation and after a stop and resume too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch_once import free_port, launch_once
from scale_tiny import make_projection, make_trainer

pytestmark = pytest.mark.slow  # starts processes

HERE = Path(__file__).resolve().parents[1]  # tests/
CONFIGS = HERE.parent / "recipes" / "accelerate_configs"
STEPS = 6
TOL = 1e-5


def _launch(out: Path) -> None:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "multi_gpu.yaml"),
           "--num_processes", "2", "--main_process_port", str(free_port()),
           str(HERE / "distributed" / "run_agem_check.py"), "--out", str(out), "--steps", str(STEPS)]
    # the checkout's package first (an installed copy elsewhere would be the one tested otherwise)
    path = os.pathsep.join(p for p in (str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=path)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"accelerate launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = launch_once(tmp_path_factory, "agem_ddp", _launch)
    return [torch.load(out / f"rank{r}_agem.pt", weights_only=False) for r in range(2)]


def _one_process(tmp_path: Path, kind: str) -> dict:
    projection, regulariser = make_projection(kind, rows_per_task=4)  # the rows both ranks read together
    trainer = make_trainer(str(tmp_path / kind), regulariser=regulariser, gradient_projection=projection,
                           max_steps=STEPS, per_device_train_batch_size=8, constraint_batch_size=6)
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return {"params": params, "projected": trainer.projected.projected_steps}


@pytest.mark.parametrize("kind,run", [("agem", "agem"), ("replay_agem", "replay_agem"), ("agem", "agem_ga"),
                                      ("agem", "agem_resumed")])
def test_two_processes_project_alike_and_match_one_process(ranks, tmp_path, kind, run):
    r0, r1 = ranks[0][run], ranks[1][run]
    assert ranks[0]["num_processes"] == 2 and r0["global_step"] == STEPS
    assert r0["steps"] == r1["steps"] and r0["projected"] == r1["projected"]
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name]), name  # the same projection on every rank
    single = _one_process(tmp_path, kind)
    if run != "agem_resumed":  # the resumed run counts its own steps only
        assert r0["projected"] == single["projected"] > 0
    for name, p in single["params"].items():
        torch.testing.assert_close(r0["params"][name], p, rtol=0, atol=TOL)


def test_resumed_two_process_run_is_the_straight_one(ranks):
    for r in range(2):
        for name, p in ranks[r]["agem"]["params"].items():
            assert torch.equal(ranks[r]["agem_resumed"]["params"][name], p), (r, name)
