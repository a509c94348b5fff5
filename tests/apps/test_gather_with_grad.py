"""The differentiable all-gather of the CLIP trainer (torch's ``all_gather`` from
``torch.distributed.nn.functional``) on a 2-process gloo run: the same forward and gradients as
the hand-written all-gather it replaced (bitwise: with two ranks the backward sums two numbers,
in either order the same float), and the gradient of the sum of every rank's loss computed on
one process from the definition."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch_once import launch_once

pytestmark = pytest.mark.slow  # every test here starts processes

HERE = Path(__file__).resolve().parents[1]  # tests/


def _launch(out: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           str(HERE / "distributed" / "run_gather_check.py"), "--out", str(out)]

    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(HERE.parent))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = launch_once(tmp_path_factory, "gather_with_grad", _launch)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gradients_equal_the_previous_all_gather_bitwise(ranks, dtype):
    for rank in ranks:
        new, old = rank[f"library_{dtype}"], rank[f"previous_{dtype}"]
        for key in ("gathered_image", "loss", "image_grad", "text_grad"):
            assert torch.equal(new[key], old[key]), key
    # both ranks see the same gathered batch, and each its own loss (the losses differ)
    assert torch.equal(ranks[0][f"library_{dtype}"]["gathered_image"], ranks[1][f"library_{dtype}"]["gathered_image"])
    assert ranks[0][f"library_{dtype}"]["loss"] != ranks[1][f"library_{dtype}"]["loss"]


def test_gradients_are_those_of_the_sum_of_every_ranks_loss(ranks):
    for rank in ranks:
        new, direct = rank["library_float64"], rank["direct_float64"]
        for key in ("image_grad", "text_grad"):
            torch.testing.assert_close(new[key], direct[key], rtol=1e-12, atol=1e-12)
            # the other rank's loss matters: this rank's loss alone gives another gradient
            own = rank["own_only_float64"][key]
            assert (own - direct[key]).abs().max() > 0.1 * direct[key].abs().max()
