"""How a recipe's script ends (``hf_constrained.distributed.exit_after_all_ranks``): its exit status in one process,
and in a launched gloo run every rank out of the process group, its exit hooks run, then out without the
interpreter's teardown."""

from __future__ import annotations

import os
import subprocess
import sys

from launch_once import free_port

SCRIPT = """
import atexit, os, sys
import torch.distributed as dist
from hf_constrained.distributed import exit_after_all_ranks
atexit.register(lambda: print("exit hooks ran, group", "alive" if dist.is_initialized() else "gone"))
if sys.argv[1] == "launched":
    dist.init_process_group("gloo", rank=0, world_size=1)
print("results written", flush=False)
exit_after_all_ranks(3)
"""


def _run(mode: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, timeout=120)


def test_one_process_exits_with_the_status_through_the_normal_teardown():
    proc = _run("single")
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.split() == ["results", "written", "exit", "hooks", "ran,", "group", "gone"]


def test_a_gloo_rank_leaves_the_group_and_exits_with_its_exit_hooks_run_and_its_output_flushed():
    proc = _run("launched")
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.split() == ["results", "written", "exit", "hooks", "ran,", "group", "gone"]  # left it first
