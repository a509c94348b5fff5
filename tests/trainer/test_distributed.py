"""Multi-process training through Accelerate (issue 6, item 1).

Two CPU processes (gloo) launched with ``accelerate launch --config_file
recipes/accelerate_configs/multi_gpu.yaml`` train the tiny constrained
set-up of ``scale_tiny`` with 4 objective rows and 3 constraint rows per process; one
process in this test trains the same global batches (8 objective rows, 6 constraint
rows). Asserted:

* both ranks end with identical estimator values, first-visit flags, stream positions
  and parameters (every rank samples the same B_c from (seed, step) and the constraint
  values are all-reduced before the MSVR update);
* each rank evaluated its own contiguous half of every global constraint batch, and the
  two halves make up exactly the 1-process batch (no rank recomputes the other's rows);
* the 2-process run agrees with the 1-process run: estimators and parameters within
  1e-5 (absolute) after 6 steps. The difference is float rounding: a mean of two
  3-row means (all-reduce, then DDP's gradient average) instead of one 6-row mean.

The same launch also trains with gradient accumulation (2 processes x 2 micro-batches of 2
rows, against the 1-process run of 8 rows), and stops after step 3's checkpoint and resumes
to step 6 (bitwise equal to the straight 2-process run on both ranks).

With two-split estimation (``constraint_indicator_fraction``) it checks, on each rank, that no
indicator row ever reaches a gradient, that the ranks agree bitwise and match one process, and
that a stopped and resumed 2-process run is bitwise the straight one.

It also trains the CLIP helper's ``ContrastiveConstrainedTrainer`` (Setting
II: one MSVR estimator per training sample and side) with 4 rows per process against 8
rows in one process, and checks its per-sample estimators the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch_once import free_port, launch_once
from scale_tiny import (
    Recorder,
    TinyClassifier,
    contrastive_snapshot,
    disjoint_trainer,
    error_statistic,
    make_contrastive_trainer,
    make_replay,
    make_rowwise_trainer,
    make_trainer,
    per_row_ce,  # noqa: E402  (the shared row_fn)
    record_constraint_calls,
    snapshot,
)

pytestmark = pytest.mark.slow  # every test here starts processes

HERE = Path(__file__).resolve().parents[1]  # tests/
CONFIGS = HERE.parent / "recipes" / "accelerate_configs"
STEPS = 6
TOL = 1e-5




def _launch_two_processes(out: Path) -> None:
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        # the shipped DDP config; with use_cpu=True in the training arguments the ranks run on CPU (gloo)
        "--config_file", str(CONFIGS / "multi_gpu.yaml"), "--num_processes", "2",
        "--main_process_port", str(free_port()),
        str(HERE / "distributed" / "run_ddp_check.py"),
        "--out", str(out), "--per-device-batch", "4", "--constraint-batch", "3", "--steps", str(STEPS),
        "--contrastive", "--extra", "--fused", "--two-split", "--replay",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"accelerate launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    out = launch_once(tmp_path_factory, "scale_ddp", _launch_two_processes)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    ranks[0]["out"] = str(out)
    return ranks


@pytest.fixture(scope="module")
def two_process_contrastive(two_process_run):
    out = Path(two_process_run[0]["out"])
    return [torch.load(out / f"rank{r}_contrastive.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    trainer = make_trainer(str(tmp_path_factory.mktemp("single")), max_steps=STEPS,
                           per_device_train_batch_size=8, constraint_batch_size=6)
    calls = record_constraint_calls(trainer)
    trainer.train()
    snap = snapshot(trainer)
    snap["constraint_calls"] = calls
    return snap


def test_replay_ranks_read_disjoint_old_rows_that_make_up_one_process_run(two_process_run, tmp_path):
    """With replay, each rank reads its own old rows (draw = micro-batch number * processes + rank): per step the
    two ranks' rows are disjoint and together the rows one process with the global batch reads; the 2-process run
    then matches that process within float rounding."""
    out = Path(two_process_run[0]["out"])
    r0, r1 = [torch.load(out / f"rank{r}_replay.pt", weights_only=False) for r in range(2)]
    single_rows: list[list[int]] = []
    single = make_trainer(str(tmp_path / "replay"), regulariser=make_replay(single_rows), max_steps=STEPS,
                          per_device_train_batch_size=8, constraint_batch_size=6)
    single.train()
    assert len(r0["replay_rows"]) == len(r1["replay_rows"]) == len(single_rows) == STEPS
    for rows0, rows1, rows in zip(r0["replay_rows"], r1["replay_rows"], single_rows):
        assert len(rows0) == len(rows1) == 4 and not set(rows0) & set(rows1)
        assert rows0 + rows1 == rows  # rank r holds slice [4r, 4r + 4) of the step's 8 old rows
    for name, p in snapshot(single)["params"].items():
        torch.testing.assert_close(r0["params"][name], p, rtol=0, atol=TOL)
        assert torch.equal(r0["params"][name], r1["params"][name]), name


def test_two_ranks_hold_identical_state(two_process_run):
    r0, r1 = two_process_run
    assert r0["num_processes"] == r1["num_processes"] == 2
    assert r0["distributed_type"] == "DistributedType.MULTI_CPU"
    assert r0["global_step"] == r1["global_step"] == STEPS
    assert torch.equal(r0["estimator_visited"], r1["estimator_visited"])
    assert torch.equal(r0["estimator_values"], r1["estimator_values"])  # bitwise: same all-reduced values
    assert r0["streams"] == r1["streams"]
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name


def test_ranks_split_each_global_constraint_batch(two_process_run, one_process_run):
    r0, r1 = two_process_run
    single = one_process_run["constraint_calls"]
    # same constraints in the same order (B_c from (seed, step)), with and without grad (prefetch)
    assert [(n, g) for n, _, g in r0["constraint_calls"]] == [(n, g) for n, _, g in r1["constraint_calls"]]
    assert [(n, g) for n, _, g in r0["constraint_calls"]] == [(n, g) for n, _, g in single]
    assert any(not g for _, _, g in single)  # the previous-iterate prefetch ran (gamma' > 0)
    for (_, rows0, _), (_, rows1, _), (_, rows, _) in zip(r0["constraint_calls"], r1["constraint_calls"], single):
        assert len(rows0) == len(rows1) == 3
        assert rows0 + rows1 == rows  # rank r holds slice [3r, 3r + 3) of the global batch


def test_two_processes_match_one_process_on_the_same_global_batch(two_process_run, one_process_run):
    r0, _ = two_process_run
    single = one_process_run
    assert r0["streams"] == single["streams"]
    assert torch.equal(r0["estimator_visited"], single["estimator_visited"])
    torch.testing.assert_close(r0["estimator_values"], single["estimator_values"], rtol=0, atol=TOL)
    for name, p in single["params"].items():
        torch.testing.assert_close(r0["params"][name], p, rtol=0, atol=TOL)
    # the comparison is not vacuous: training moved the parameters much more than TOL
    torch.manual_seed(1234)  # make_trainer's initialisation
    start = TinyClassifier()
    moved = max((p.detach() - single["params"][n]).abs().max().item() for n, p in start.named_parameters())
    assert moved > 100 * TOL


@pytest.mark.parametrize("name,kind", [("single_gpu", "NO"), ("multi_gpu", "MULTI_GPU"), ("fsdp", "FSDP")])
def test_shipped_accelerate_configs_load(name, kind):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(CONFIGS / f"{name}.yaml"))
    assert str(config.distributed_type).endswith(kind)


def test_accumulation_across_processes_matches_one_process(two_process_run, one_process_run):
    """2 processes x 2 micro-batches of 2 rows == 1 process x 8 rows: the constraint part runs once
    per optimizer step and DDP syncs the accumulated gradient (penalty included) at the window's end."""
    out = Path(two_process_run[0]["out"])
    g0, g1 = (torch.load(out / f"rank{r}_ga.pt", weights_only=False) for r in range(2))
    single = one_process_run
    assert torch.equal(g0["estimator_values"], g1["estimator_values"])
    assert g0["streams"] == g1["streams"] == single["streams"]
    torch.testing.assert_close(g0["estimator_values"], single["estimator_values"], rtol=0, atol=TOL)
    for name, p in single["params"].items():
        assert torch.equal(g0["params"][name], g1["params"][name]), name
        torch.testing.assert_close(g0["params"][name], p, rtol=0, atol=TOL)


def test_resume_across_processes_is_exact(two_process_run):
    """Stop after step 3's checkpoint and resume to step 6 with 2 processes: bitwise the same
    parameters, estimators and streams as the straight 2-process run, on both ranks."""
    out = Path(two_process_run[0]["out"])
    for r in range(2):
        resumed = torch.load(out / f"rank{r}_resumed.pt", weights_only=False)
        straight = two_process_run[r]
        assert resumed["global_step"] == straight["global_step"] == STEPS
        assert torch.equal(resumed["estimator_values"], straight["estimator_values"])
        assert torch.equal(resumed["estimator_visited"], straight["estimator_visited"])
        assert resumed["streams"] == straight["streams"]
        for name, p in straight["params"].items():
            assert torch.equal(resumed["params"][name], p), (r, name)


# ------------------------------------------------------------- the fused step (row-wise constraints)
def test_fused_step_all_reduces_sums_and_counts(two_process_run, tmp_path):
    """Row-wise constraints (one row_fn call per step for all sampled ones) on 2 x 3 rows equal
    1 x 6 rows: the per-constraint sums and counts are all-reduced, so the group-difference
    constraint ``gap`` is the difference of GLOBAL group means (a mean of the two processes'
    differences would not be), and the gradient is that of the global value."""
    out = Path(two_process_run[0]["out"])
    f0, f1 = (torch.load(out / f"rank{r}_fused.pt", weights_only=False) for r in range(2))
    single = make_rowwise_trainer(str(tmp_path / "fused_single"), per_device_train_batch_size=8,
                                  constraint_batch_size=6)

    single.train()
    ref = snapshot(single)
    assert torch.equal(f0["estimator_values"], f1["estimator_values"])
    assert f0["streams"] == f1["streams"] == ref["streams"]
    assert torch.equal(f0["estimator_visited"], ref["estimator_visited"]) and bool(ref["estimator_visited"][4])
    torch.testing.assert_close(f0["estimator_values"], ref["estimator_values"], rtol=0, atol=TOL)
    for name, p in ref["params"].items():
        assert torch.equal(f0["params"][name], f1["params"][name]), name
        torch.testing.assert_close(f0["params"][name], p, rtol=0, atol=TOL)
    # on such batches, the mean of the two processes' gap values differs from the global gap by far
    # more than TOL (so a means-of-means reduction would have failed the comparison above)
    rows = single.constraints[4].dataset

    def gap(v, gg):
        return v[gg == 0].mean() - v[gg == 1].mean()

    differences = []
    for t in range(6, 30):
        draw = single.engine.draw(t)
        if 4 not in draw.constraint_ids.tolist():
            continue
        batch = [rows[i] for i in draw.sample_indices[draw.constraint_ids.tolist().index(4)]]
        x = torch.stack([r["x"] for r in batch])
        y = torch.stack([r["labels"] for r in batch])
        g = torch.stack([r["g"] for r in batch])
        with torch.no_grad():
            ce = per_row_ce(single.model, {"x": x, "labels": y})
        halves = [gap(ce[:3], g[:3]), gap(ce[3:], g[3:])]
        if all(torch.isfinite(h) for h in halves):
            differences.append(abs(float(sum(halves) / 2 - gap(ce, g))))
    assert differences and max(differences) > 100 * TOL, differences


# ------------------------------------------------------------- Setting II (per-sample estimators)
@pytest.fixture(scope="module")
def one_process_contrastive(tmp_path_factory):
    trainer = make_contrastive_trainer(str(tmp_path_factory.mktemp("clip_single")), per_device_train_batch_size=8)
    trainer.train()
    return contrastive_snapshot(trainer)


def test_per_sample_estimators_identical_across_ranks(two_process_contrastive):
    """ContrastiveConstrainedTrainer (Algorithm 2): features are all-gathered, so every rank
    updates the per-sample estimators u_{1,i} of the whole global batch identically."""
    r0, r1 = two_process_contrastive
    assert r0["global_step"] == r1["global_step"] > 0
    for side in ("image", "text"):
        assert bool(r0[f"{side}_visited"].any())
        assert torch.equal(r0[f"{side}_visited"], r1[f"{side}_visited"])
        assert torch.equal(r0[f"{side}_values"], r1[f"{side}_values"])
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name


def test_per_sample_estimators_match_one_process(two_process_contrastive, one_process_contrastive, tmp_path):
    """2 x 4 rows == 1 x 8 rows: same samples visited, the same estimator values (relative
    1e-4: g_i = mean exp(d/t) spans many orders of magnitude at t = 0.05) and parameters
    within 1e-5 under plain SGD (a wrong gradient scale, e.g. by the world size, fails)."""
    r0, _ = two_process_contrastive
    single = one_process_contrastive
    for side in ("image", "text"):
        assert torch.equal(r0[f"{side}_visited"], single[f"{side}_visited"])
        torch.testing.assert_close(r0[f"{side}_values"], single[f"{side}_values"], rtol=1e-4, atol=1e-12)
    for name, p in single["params"].items():
        torch.testing.assert_close(r0["params"][name], p, rtol=0, atol=TOL)
    start = make_contrastive_trainer(str(tmp_path), per_device_train_batch_size=8).model  # untrained
    moved = max((p.detach() - single["params"][n]).abs().max().item() for n, p in start.named_parameters())
    assert moved > 100 * TOL


# ------------------------------------------------------------- proxy indicators
def test_a_proxy_indicator_on_the_gradient_rows_across_processes(two_process_run, tmp_path):
    """One split with the proxy indicator under DDP: each rank scores the statistic (the 0/1 error) on its slice of the
    gradient's rows, the sums and counts are all-reduced with the surrogate's, and the ranks hold the state of one
    process on the same global batches."""
    out = Path(two_process_run[0]["out"])
    r0, r1 = (torch.load(out / f"rank{r}_one_split_proxy.pt", weights_only=False) for r in range(2))
    assert torch.equal(r0["estimator_values"], r1["estimator_values"])
    single = disjoint_trainer(str(tmp_path / "single"), per_row_ce, statistic=error_statistic(), max_steps=STEPS,
                              per_device_train_batch_size=8, constraint_batch_size=6, constraint_proxy_indicator=True)
    single.train()
    ref = snapshot(single)
    assert torch.equal(r0["estimator_visited"], ref["estimator_visited"])
    torch.testing.assert_close(r0["estimator_values"], ref["estimator_values"], rtol=0, atol=TOL)
    assert bool((ref["estimator_values"] > 0).any())  # error rates: the statistic, all-reduced
    for name, p in ref["params"].items():
        torch.testing.assert_close(r0["params"][name], p, rtol=0, atol=TOL)


# ------------------------------------------------------------- two-split estimation
def test_two_split_estimation_across_processes(two_process_run, tmp_path):
    """Two-split estimation under DDP: each rank scores its slice of the global indicator and
    gradient batches, and on no rank does an indicator row reach a gradient; the ranks hold
    identical state, match one process on the same global batches (8 objective and 6 constraint
    rows) within TOL, and a stop at step 3 / resume to step 6 is bitwise the straight run."""
    out = Path(two_process_run[0]["out"])
    r0, r1 = (torch.load(out / f"rank{r}_two_split.pt", weights_only=False) for r in range(2))
    indicator = set().union(*r0["indicator"].values())
    assert r0["indicator"] == r1["indicator"]  # one seeded split, the same on every rank
    for rank in (r0, r1):
        assert rank["with_grad"] and not (rank["with_grad"] & indicator)
        assert rank["resumed_with_grad"] and not (rank["resumed_with_grad"] & indicator)
        assert rank["without_grad"] & indicator  # the estimate read indicator rows on this rank
    # the ranks scored different rows: each its own slice of the global batches
    assert r0["with_grad"] != r1["with_grad"]
    assert torch.equal(r0["estimator_values"], r1["estimator_values"])
    assert r0["streams"] == r1["streams"]
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name
    # one process on the same global batches
    record = Recorder()
    single = disjoint_trainer(str(tmp_path / "single"), record, max_steps=STEPS, per_device_train_batch_size=8,
                              constraint_batch_size=6, constraint_indicator_fraction=0.5)
    single.train()
    ref = snapshot(single)
    assert r0["streams"] == ref["streams"]
    assert torch.equal(r0["estimator_visited"], ref["estimator_visited"])
    torch.testing.assert_close(r0["estimator_values"], ref["estimator_values"], rtol=0, atol=TOL)
    for name, p in ref["params"].items():
        torch.testing.assert_close(r0["params"][name], p, rtol=0, atol=TOL)
    assert r0["with_grad"] | r1["with_grad"] == record.with_grad  # the two slices make up the global batches
    # exact resume on both ranks
    for rank in (r0, r1):
        resumed = rank["resumed"]
        assert resumed["global_step"] == STEPS
        assert torch.equal(resumed["estimator_values"], rank["estimator_values"])
        assert resumed["streams"] == rank["streams"]
        for name, p in rank["params"].items():
            assert torch.equal(resumed["params"][name], p), name
