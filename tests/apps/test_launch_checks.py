"""A multi-process launch that cannot form one run is refused once, before anything loads; with
``--use_cpu true`` it is one DDP run over gloo (issue 32, item 6: the shipped multi_gpu.yaml on a
machine without GPUs ran two independent copies writing into one folder)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from launch_once import free_port

from hf_constrained import launch
from hf_constrained.launch import check_multi_process_launch, multi_process_launch_problem

ROOT = Path(__file__).resolve().parents[2]


def test_the_problem_is_named_only_for_several_processes_without_gpu_or_use_cpu(monkeypatch):
    monkeypatch.setattr(launch, "accelerator_available", lambda: False)
    gpu_args, cpu_args = SimpleNamespace(use_cpu=False), SimpleNamespace(use_cpu=True)
    assert multi_process_launch_problem(gpu_args, {}) is None
    assert multi_process_launch_problem(gpu_args, {"WORLD_SIZE": "1"}) is None
    assert multi_process_launch_problem(cpu_args, {"WORLD_SIZE": "2"}) is None  # DDP on gloo
    problem = multi_process_launch_problem(gpu_args, {"WORLD_SIZE": "2"})
    assert "launched as 2 processes" in problem and "--use_cpu true" in problem and "no GPU" in problem
    monkeypatch.setattr(launch, "accelerator_available", lambda: True)
    assert multi_process_launch_problem(gpu_args, {"WORLD_SIZE": "2"}) is None


def test_only_the_first_process_says_it(monkeypatch):
    monkeypatch.setattr(launch, "accelerator_available", lambda: False)
    said: list[str] = []
    args = SimpleNamespace(use_cpu=False)
    with pytest.raises(SystemExit) as first:
        check_multi_process_launch(args, said.append, {"WORLD_SIZE": "2", "RANK": "0"})
    with pytest.raises(SystemExit) as second:
        check_multi_process_launch(args, said.append, {"WORLD_SIZE": "2", "RANK": "1"})
    assert first.value.code == second.value.code == 2 and len(said) == 1




def _launch(*flags: str, tmp_path: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch",
           "--config_file", str(ROOT / "recipes" / "accelerate_configs" / "multi_gpu.yaml"), "--num_processes", "2",
           "--main_process_port", str(free_port()), str(ROOT / "tests" / "distributed" / "parse_only.py"),
           "--output_dir", str(tmp_path / "out"), "--report_to", "none", *flags]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=str(tmp_path))


@pytest.mark.slow
def test_the_shipped_multi_gpu_config_without_gpus(tmp_path):
    # the launched processes see no CUDA device (CUDA_VISIBLE_DEVICES=""), so a GPU machine runs this too; only
    # a device that variable cannot hide (MPS, XPU) would make the launch a real multi-device run
    current = getattr(getattr(torch, "accelerator", None), "current_accelerator", lambda: None)()
    if current is not None and current.type != "cuda":
        pytest.skip(f"this machine's {current.type} device cannot be hidden from the launched processes")
    refused = _launch(tmp_path=tmp_path)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert output.count("launched as 2 processes") == 1, output[-3000:]
    assert "PARSED" not in output  # nothing ran past the flags: no copy started
    gloo = _launch("--use_cpu", "true", tmp_path=tmp_path)
    assert gloo.returncode == 0, (gloo.stdout + gloo.stderr)[-3000:]
    # both ranks write into one pipe, so their lines can interleave (seen in CI); read the records, not lines
    assert sorted(re.findall(r"PARSED rank=\d+ world_size=\d+", gloo.stdout)) == [
        "PARSED rank=0 world_size=2", "PARSED rank=1 world_size=2"]
