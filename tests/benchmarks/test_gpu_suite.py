"""The GPU suite's building code (benchmarks/rowwise_clip.py, benchmarks/llm_step.py) at tiny size.

The suite once could not build its first constrained CLIP variant at ViT-B/16 size: the old
model's reference values encoded every image once per class on the host (10,240 image forwards
per build for 256 images), and the row function kept the image bank on the host after the model
moved to the GPU. Here the quick mode's building path (``step_overhead.build``) runs at tiny size
and counts the images the vision tower encodes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT, import_script

rowwise_clip = import_script("benchmarks", "rowwise_clip")
step_overhead = import_script("benchmarks", "step_overhead")


class CountImages:
    """Forward pre-hook on the vision tower: how many images it encoded."""

    def __init__(self) -> None:
        self.images = 0

    def __call__(self, module, args, kwargs):
        pixels = kwargs.get("pixel_values", args[0] if args else None)
        self.images += int(pixels.shape[0])


def _quick_args(tmp_path, **over) -> argparse.Namespace:
    a = dict(model="tiny", device="cpu", bf16=False, bank_size=12, batch=2, m=10, per_step=2, constraint_batch=1,
             constraint_data="rows", workdir=str(tmp_path))
    a.update(over)
    return argparse.Namespace(**a)


@pytest.fixture
def counted(monkeypatch):
    """Every ZeroShotBankedCLIP built from now on counts its encoded images."""
    counters = []
    original = rowwise_clip.ZeroShotBankedCLIP.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        counter = CountImages()
        self.clip.vision_model.register_forward_pre_hook(counter, with_kwargs=True)
        counters.append(counter)

    monkeypatch.setattr(rowwise_clip.ZeroShotBankedCLIP, "__init__", init)
    return counters


@pytest.mark.parametrize("data", ["rows", "dataset"])
def test_reference_values_encode_each_image_once(tmp_path, counted, data):
    """Building the default step's trainer (10 classes, 1,024 rows over a bank of 12 images)
    encodes each distinct image exactly once: 12 forwards, not 1,024 x 10."""
    trainer = step_overhead.build("fused_gp0.1", _quick_args(tmp_path, constraint_data=data), steps=1)
    model = trainer.model
    (counter,) = counted
    assert counter.images == model.bank.shape[0] == 12
    # the values are the old model's per-row zero-shot CE for the row's own label, as ZeroShotLoss computes it
    row_fn = trainer.constraints[0].row_fn
    model.eval()
    for constraint in trainer.constraints[:3]:
        rows = [constraint.dataset[i] for i in range(4)]
        batch = {k: torch.stack([torch.as_tensor(r[k]) for r in rows]) for k in ("pixel_index", "label",
                                                                              "reference_loss")}
        with torch.no_grad():
            direct = row_fn.loss.per_sample(model, {"pixel_values": model.bank[batch["pixel_index"]],
                                                    "label": batch["label"]})
            gap = row_fn(model, batch)
        torch.testing.assert_close(batch["reference_loss"].float(), direct, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gap, torch.zeros_like(gap), rtol=0, atol=1e-5)  # the untrained model: h_k = 0
    assert len({round(float(constraint.dataset[0]["reference_loss"]), 6) for constraint in trainer.constraints}) > 1


def test_row_function_reads_the_bank_where_the_model_is(tmp_path):
    """The row function reads the model's bank at each call: after the model moves (here to
    float64, as ``.to("cuda")`` would move it), it indexes the moved bank, not a host copy."""
    trainer = step_overhead.build("fused_gp0.1", _quick_args(tmp_path), steps=1)
    row_fn, model = trainer.constraints[0].row_fn, trainer.model
    model.to(torch.float64)
    assert row_fn.bank is model.bank and row_fn.bank.dtype == torch.float64
    rows = [trainer.constraints[0].dataset[i] for i in range(2)]
    batch = {k: torch.stack([torch.as_tensor(r[k]) for r in rows]) for k in ("pixel_index", "label", "reference_loss")}
    with torch.no_grad():
        assert row_fn(model, batch).dtype == torch.float64


def test_llm_step_builds_the_recipe_constraints(tmp_path):
    """The LLM part: three non-forgetting constraints sharing one row function (the fused step), with
    the old model's losses, LoRA adapters only trainable, and |B_k|:|B_c|:gamma' parsed into the arguments."""
    llm_step = import_script("benchmarks", "llm_step")
    # 16 rows per task: a two-split's gradient part (12) holds one step's draw of 8, which replay of the
    # constraint rows needs
    a = argparse.Namespace(model="tiny", device="cpu", bf16=False, batch=2, accumulation=2, seq_len=8,
                           constraint_rows=16, workdir=str(tmp_path))
    trainer = llm_step.make_trainer(a, "2:1:0", steps=1)
    assert [c.name for c in trainer.constraints] == [f"non_forgetting/{t}" for t in llm_step.TASKS]
    assert len({id(c.row_fn) for c in trainer.constraints}) == 1
    assert (trainer.args.constraint_batch_size, trainer.args.constraints_per_step) == (2, 1)
    assert float(trainer.args.msvr_gamma_prime) == 0.0
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    unconstrained = llm_step.make_trainer(a, None, steps=1)
    assert unconstrained.constraints == [] and unconstrained.args.constraint_penalty == "none"
    with pytest.raises(SystemExit, match="not \\|B_k\\|:\\|B_c\\|:gamma'"):
        llm_step.parse_variant("8:all")
    # the recipe's --replay_old: replay of the constraints' own rows (one draw); :ownreplay the two-draw replay
    assert llm_step.parse_variant("8:all:0:replay0.5") == (8, None, 0.0, False, 0.5, 0.0, 0.0, False, False)
    assert llm_step.variant_key("8:all:0:separate:replay0.5") == "bk8_bcall_gp0_separate_replay0.5"
    assert llm_step.variant_key("8:all:0:nopenalty:replay0.5") == "bk8_bcall_gp0_nopenalty_replay0.5"
    assert llm_step.variant_key(llm_step.RECIPE_DEFAULT_VARIANT) == "bk8_bcall_gp0_replay0.5_split0.25"
    for bad in ("8:all:0:replay1", "8:all:0:replay", "8:all:0:sep", "8:all:0:split0", "8:all:0:split0.2:split0.3",
                "8:all:0:replay0.5:ownreplay0.5", "8:all:0:nopenalty:nopenalty", "8:all:0:proxy:split0.25"):
        with pytest.raises(SystemExit, match="replayR"):
            llm_step.parse_variant(bad)
    replayed = llm_step.make_trainer(a, "2:all:0:replay0.5", steps=1)
    assert replayed.regularised.regulariser.settings() == {"name": "replay", "ratio": 0.5, "rows": "constraint_rows"}
    own = llm_step.make_trainer(a, "2:all:0:ownreplay0.5", steps=1)
    assert own.regularised.regulariser.settings()["rows"] == 3 * a.constraint_rows
    same_rows = llm_step.make_trainer(a, "2:all:0:replay0.5:proxy", steps=1)  # the proxy on the gradient's rows
    assert same_rows.engine.settings().estimate_source == "one_split(proxy_statistic=True)"
    assert llm_step.variant_key("8:all:0:replay0.5:proxy") == "bk8_bcall_gp0_proxy_replay0.5"
    plain = llm_step.make_trainer(a, "2:all:0:nopenalty:replay0.5", steps=1)
    assert plain.args.constraint_penalty == "none" and plain.constraint_part_runs  # replay of the same rows
    # the recipe's default: its BENCHMARK_DEFAULTS, replay, two-split with the proxy indicator
    default = llm_step.make_trainer(a, llm_step.RECIPE_DEFAULT_VARIANT, steps=1)
    recipe = import_script("recipes", "llm_non_forgetting")
    assert {k: getattr(default.args, k) for k in recipe.BENCHMARK_DEFAULTS} == dict(
        recipe.BENCHMARK_DEFAULTS, msvr_gamma_prime=0.0)
    assert default.args.constraint_indicator_fraction == 0.25 and default.args.constraint_proxy_indicator
    assert default.regularised.regulariser.settings()["ratio"] == recipe.BENCHMARK_REPLAY


@pytest.mark.slow
def test_suite_quick_mode_runs_every_part(tmp_path):
    """``QUICK=1 DEVICE=cpu`` with the tiny models: every part finishes and writes its JSON."""
    env = dict(os.environ, QUICK="1", DEVICE="cpu", MODEL="tiny", LLM_MODEL="tiny", PART_LIMIT="240",
               OUT=str(tmp_path / "out"), PY=sys.executable, OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", "benchmarks/gpu_suite.sh"], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for part in ("clip_step", "clip_scaling", "llm_step"):
        assert (tmp_path / "out" / f"{part}.json").is_file(), part
    assert "all parts done" in proc.stdout


@pytest.mark.slow
def test_suite_stops_a_part_past_its_time_limit(tmp_path):
    """``PART_LIMIT``: a part past it is stopped and reported, writes no JSON, and the suite exits 1
    after running the other parts (one second is less than any part needs to import torch)."""
    env = dict(os.environ, QUICK="1", DEVICE="cpu", MODEL="tiny", LLM_MODEL="tiny", PART_LIMIT="1",
               OUT=str(tmp_path / "out"), PY=sys.executable, OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", "benchmarks/gpu_suite.sh"], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    for part in ("clip_step", "clip_scaling", "llm_step"):
        assert f"{part}: TIMED OUT after 1 s" in proc.stdout
        assert not (tmp_path / "out" / f"{part}.json").exists()
    assert "SOME PARTS FAILED" in proc.stdout
