"""The generated-shapes example (recipes/shapes_clip_example.py, ``--data shapes`` of the demo): its generator,
its splits, a short run end to end, and the warning for a certification split too small for the claim."""

import json
import logging
import os

import numpy as np
import pytest

from hf_constrained.clip import experiment as pipeline
from hf_constrained.clip.shapes import SHAPES, draw_shapes, render_shapes
from hf_constrained.recipes import demo_clip_digits as demo
from hf_constrained.recipes import shapes_clip_example as ex

# a run small enough for a test: a few images per split, 2 stage-1 epochs, 3 fine-tuning steps
TINY = ["--pretrain_images", "12", "--constraint_images", "8", "--selection_images", "8", "--stage1_epochs", "2",
        "--max_steps", "3", "--select_every", "1", "--batch_size", "16", "--constraint_batch_size", "8",
        "--negatives_per_class", "4"]


def test_generator_is_deterministic_per_seed_and_stream():
    a, la = draw_shapes(7, 2, [5] * len(SHAPES))
    b, lb = draw_shapes(7, 2, [5] * len(SHAPES))
    assert a.shape == (5 * len(SHAPES), 1, 16, 16) and a.dtype == np.float32
    assert np.array_equal(a, b) and np.array_equal(la, lb)
    assert a.min() >= -1 and a.max() <= 1
    assert np.array_equal(la, np.repeat(np.arange(len(SHAPES)), 5))
    # another seed, another stream: other images
    assert not np.array_equal(a, draw_shapes(8, 2, [5] * len(SHAPES))[0])
    assert not np.array_equal(a, draw_shapes(7, 3, [5] * len(SHAPES))[0])
    # a class's images do not depend on how many images the other classes get
    c, _ = draw_shapes(7, 2, [5, 9, 0, 1, 5, 5, 5, 5])
    assert np.array_equal(c[:5], a[:5]) and np.array_equal(c[-5:], a[-5:])
    with pytest.raises(ValueError, match="unknown shape"):
        render_shapes(0, 1, np.random.default_rng(0), classes=("hexagon",))


def test_shapes_are_told_apart_by_their_pixels_not_only_by_noise():
    """The classes differ in shape: drawn with the same random size, position, rotation and intensities, no two
    classes give the same picture; and a nearest-class-mean classifier (each image standardised) on a fresh draw
    is far above chance (a generator that drew the same picture for every class would fail both)."""
    same = [render_shapes(c, 20, np.random.default_rng(0), noise=0.0) for c in range(len(SHAPES))]
    for a in range(len(SHAPES)):
        for b in range(a + 1, len(SHAPES)):
            assert np.abs(same[a] - same[b]).mean() > 0.05, (SHAPES[a], SHAPES[b])

    def standardised(x: np.ndarray) -> np.ndarray:
        x = x.reshape(len(x), -1)
        x = x - x.mean(1, keepdims=True)
        return x / x.std(1, keepdims=True)

    x, y = draw_shapes(0, 0, [200] * len(SHAPES), noise=0.0)
    means = np.stack([standardised(x[y == c]).mean(0) for c in range(len(SHAPES))])
    t, ty = draw_shapes(0, 1, [100] * len(SHAPES), noise=0.0)
    pred = np.argmin(((standardised(t)[:, None] - means[None]) ** 2).sum(-1), axis=1)
    assert (pred == ty).mean() > 0.3  # chance: 1/8


def test_shapes_splits_are_independent_draws_that_never_share_an_image():
    cfg = pipeline.DemoConfig(**{**ex.SHAPES_DEFAULTS, "pretrain_images": 30, "constraint_images": 20,
                             "selection_images": 20, "held_out_images": 40, "certify_fraction": 0.75, "seed": 3})
    data = pipeline.shapes_split(cfg)
    n = len(SHAPES)
    assert [len(data[k]) for k in ("pretrain", "constraint", "selection")] == [30 * n, 20 * n, 20 * n]
    assert len(data["certify"]) == 30 * n and len(data["test"]) == 10 * n
    assert data["held_out"] == sorted(data["test"] + data["certify"])
    for split in pipeline.SPLITS:  # every class in every split, in the stated numbers
        counts = np.bincount(data["labels"][data[split]], minlength=n)
        assert len(set(counts)) == 1, split
    # no image in two splits (by index and by content), and the draw is the same for the same seed
    seen: dict[bytes, str] = {}
    for split in pipeline.SPLITS:
        for i in data[split]:
            key = data["images"][i].tobytes()
            assert key not in seen, (split, seen.get(key))
            seen[key] = split
    again = pipeline.shapes_split(cfg)
    assert np.array_equal(again["images"], data["images"])
    # the splits are their own generator streams: more held-out images leave stage 1, D_k and selection as they were
    more = pipeline.shapes_split(pipeline.DemoConfig(**{**cfg.__dict__, "held_out_images": 80}))
    for split in ("pretrain", "constraint", "selection"):
        assert np.array_equal(more["images"][more[split]], data["images"][data[split]]), split
    # the target data never holds a held-out image
    rows = pipeline.target_rows(data, cfg)
    assert not {r["pixel_values"].tobytes() for r in rows} & {data["images"][i].tobytes() for i in data["held_out"]}
    assert {r["label"] for r in rows if r["is_positive"]} == {cfg.target, cfg.pulled}


def test_bad_data_options_name_the_flag():
    with pytest.raises(ValueError, match="--data"):
        pipeline.demo_data(pipeline.DemoConfig(data="mnist"))
    with pytest.raises(ValueError, match="--target"):
        pipeline.demo_data(pipeline.DemoConfig(data="shapes", target=8))
    with pytest.raises(ValueError, match="--held_out_images"):
        pipeline.shapes_split(pipeline.DemoConfig(data="shapes", target=1, pulled=0, held_out_images=-1))
    with pytest.raises(SystemExit):
        ex.main(["--data", "digits", "--cache_dir", "unused"])


def test_a_short_run_writes_a_certificate_in_points(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_CONSTRAINED_LEDGER", str(tmp_path / "ledger.json"))  # a fresh ledger: the first look
    out = tmp_path / "results.json"
    assert ex.main([*TINY, "--held_out_images", "120", "--seed", "5", "--cache_dir", str(tmp_path / "c"),
                    "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "on shapes (target: ring" in printed
    assert "every protected shape loses at most 3 points of accuracy" in printed
    assert "Why 120 images per shape: a 3-point claim needs at least 102 with none forgotten" in printed
    result = json.loads(out.read_text())
    assert result["config"]["data"] == "shapes" and result["config"]["forget_tolerance"] == 0.03
    cert = result["per_seed"][0]["runs"][0]["certificate"]
    protected = [s for s in SHAPES if s != "ring"]
    assert sorted(cert["rows"]) == sorted(f"non_forgetting/{s}" for s in protected)
    assert set(cert["rows"].values()) == {120}
    assert cert["look"] == 1 and cert["level"] == pytest.approx(0.045)
    # the bound is the exact Clopper-Pearson bound of each class's count forgotten, at the first look's level
    from hf_constrained.certification.bounds import clopper_pearson_upper_bound
    for key, share in cert["forgotten"].items():
        assert cert["bounds"][key] == pytest.approx(clopper_pearson_upper_bound(round(share * 120), 120, 0.045))
    assert cert["certified"] == all(b <= 0.03 for b in cert["bounds"].values())
    folder = tmp_path / "c" / "seed-5-hinge"
    report = json.loads((folder / "safety_report.json").read_text())
    assert report["constraints"] and os.path.isfile(folder / "README.md")


def test_a_certification_split_too_small_for_the_claim_is_warned_before_training(tmp_path, monkeypatch, caplog):
    """50 images per class can never certify 3 points (even with none forgotten the bound is 5.9 points):
    the library's check (hf_constrained.safety.split_checks.check_certifiable) names the constraint, the split size
    and the rows it needs, before training."""
    monkeypatch.setenv("HF_CONSTRAINED_LEDGER", str(tmp_path / "ledger.json"))
    with caplog.at_level(logging.WARNING, logger="hf_constrained"):
        ex.main([*TINY, "--held_out_images", "50", "--max_steps", "1", "--seed", "6",
                 "--cache_dir", str(tmp_path / "c"), "--output", str(tmp_path / "r.json")])
    warned = [r.getMessage() for r in caplog.records if "can never certify" in r.getMessage()]
    assert len(warned) == len(SHAPES) - 1
    assert any("'non_forgetting/circle'" in w and "(50 rows)" in w and "needs at least 102" in w for w in warned)
    # and no such warning when the split is sized from the claim (120 >= 102)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_constrained"):
        ex.main([*TINY, "--held_out_images", "120", "--max_steps", "1", "--seed", "6",
                 "--cache_dir", str(tmp_path / "c"), "--output", str(tmp_path / "r2.json")])
    assert not [r for r in caplog.records if "can never certify" in r.getMessage()]


def test_committed_shapes_results_come_from_the_command_shown_beside_them():
    """Every committed result of the example stores the command that wrote it and its complete parsed settings;
    re-parsing that command with the example's own parser gives those settings, and docs/generated_images.md
    shows the command."""
    import argparse
    import glob
    import shlex

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    files = sorted(glob.glob(os.path.join(root, "benchmarks", "results", "shapes_*.json")))
    assert files
    shown = open(os.path.join(root, "docs", "generated_images.md")).read()
    for path in files:
        with open(path) as f:
            saved = json.load(f)
        words = shlex.split(saved["command"])
        assert words[:3] == ex.MODULE_COMMAND.split(), path
        parser = argparse.ArgumentParser(allow_abbrev=False)
        ex.add_arguments(parser)
        ns = parser.parse_args(words[3:])
        # results written before the demo's options named MSVR's gamma' ran at the library's 0.1, the value the
        # example pins
        assert demo.parsed_config(ns) == {"msvr_gamma_prime": 0.1, **pipeline.stored_config(saved["config"])}, path
        assert ns.output == os.path.relpath(path, root), path
        assert saved["command"] in shown, path
        assert saved["config"]["data"] == "shapes" and saved["config"]["forget_tolerance"] == 0.03
