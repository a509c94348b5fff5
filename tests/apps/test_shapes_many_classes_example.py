"""The many-class vision example (recipes/shapes_many_classes_example.py, ``--data many_shapes`` of the demo): its
generator of 32 classes, its splits, a short run end to end with the per-run numbers, the benchmark on it, and the
warning for a certification split too small for the claim."""

import json
import logging
import os

import numpy as np
import pytest
from conftest import import_script

from hf_constrained.clip import experiment as pipeline
from hf_constrained.clip.many_shapes import MANY_SHAPES, SIZES, TONES, draw_many_shapes, parts, render_many_shapes
from hf_constrained.clip.shapes import SHAPES, render_shape, render_shapes
from hf_constrained.recipes import shapes_many_classes_example as ex

# a run small enough for a test: a few images per split, 1 stage-1 epoch, 3 fine-tuning steps
TINY = ["--pretrain_images", "6", "--constraint_images", "6", "--selection_images", "4", "--stage1_epochs", "1",
        "--max_steps", "3", "--select_every", "1", "--batch_size", "16", "--constraint_batch_size", "4",
        "--negatives_per_class", "2"]
M = len(MANY_SHAPES) - 1  # the protected classes


def test_the_classes_are_every_shape_in_two_sizes_and_two_tones():
    assert len(MANY_SHAPES) == 32 and len(set(MANY_SHAPES)) == 32
    assert {parts(n) for n in MANY_SHAPES} == {(s, t, k) for s in SIZES for t in TONES for k in SHAPES}
    assert MANY_SHAPES[ex.MANY_CLASSES_DEFAULTS["target"]] == "large bright ring"
    assert MANY_SHAPES[ex.MANY_CLASSES_DEFAULTS["pulled"]] == "large bright circle"
    with pytest.raises(ValueError, match="unknown class"):
        parts("huge bright ring")
    with pytest.raises(ValueError, match="out of range"):
        render_many_shapes(32, 1, np.random.default_rng(0))


def test_the_eight_shape_draws_are_unchanged_and_the_tones_and_sizes_show_in_the_pixels():
    # the eight-shape example's renderer is render_shape at its own radius band, bright: the same draws
    for c, name in enumerate(SHAPES):
        a = render_shapes(c, 5, np.random.default_rng(c))
        assert np.array_equal(a, render_shape(name, 5, np.random.default_rng(c)))
    # without noise, a dark class is its bright twin negated (same draws), and a small shape covers fewer pixels
    i, j = MANY_SHAPES.index("large bright cross"), MANY_SHAPES.index("large dark cross")
    bright = render_many_shapes(i, 20, np.random.default_rng(1), noise=0.0)
    assert np.allclose(render_many_shapes(j, 20, np.random.default_rng(1), noise=0.0), -bright)
    small = render_many_shapes(MANY_SHAPES.index("small bright cross"), 200, np.random.default_rng(2), noise=0.0)
    large = render_many_shapes(i, 200, np.random.default_rng(2), noise=0.0)

    def covered(x: np.ndarray) -> np.ndarray:  # the share of pixels nearer the foreground than the background
        flat = x.reshape(len(x), -1)
        return (flat > (flat.min(1, keepdims=True) + flat.max(1, keepdims=True)) / 2).mean(1)

    assert covered(small).mean() < 0.75 * covered(large).mean()


def test_the_generator_is_deterministic_and_each_class_its_own_stream():
    a, la = draw_many_shapes(7, 2, [3] * 32)
    b, lb = draw_many_shapes(7, 2, [3] * 32)
    assert a.shape == (96, 1, 16, 16) and a.dtype == np.float32 and a.min() >= -1 and a.max() <= 1
    assert np.array_equal(a, b) and np.array_equal(la, lb) and np.array_equal(la, np.repeat(np.arange(32), 3))
    assert not np.array_equal(a, draw_many_shapes(8, 2, [3] * 32)[0])
    assert not np.array_equal(a, draw_many_shapes(7, 3, [3] * 32)[0])
    counts = [3] * 32
    counts[5], counts[20] = 0, 11  # a class's images do not depend on how many the others get
    c, lc = draw_many_shapes(7, 2, counts)
    for k in (0, 6, 31):
        assert np.array_equal(c[lc == k], a[la == k])


def test_the_splits_are_independent_draws_that_never_share_an_image():
    cfg = pipeline.DemoConfig(**{**ex.MANY_CLASSES_DEFAULTS, "pretrain_images": 5, "constraint_images": 4,
                                 "selection_images": 3, "held_out_images": 8, "seed": 3})
    data = pipeline.shapes_split(cfg)
    assert [len(data[k]) for k in ("pretrain", "constraint", "selection", "certify")] == [160, 128, 96, 256]
    seen: dict[bytes, str] = {}
    for split in pipeline.SPLITS:
        assert len(set(np.bincount(data["labels"][data[split]], minlength=32))) <= 1, split
        for i in data[split]:
            key = data["images"][i].tobytes()
            assert key not in seen, (split, seen.get(key))
            seen[key] = split
    rows = pipeline.target_rows(data, cfg)
    assert {r["label"] for r in rows if r["is_positive"]} == {6, 2}
    assert {r["label"] for r in rows if not r["is_positive"]} == set(range(32)) - {6, 2}


def test_a_short_run_prints_and_writes_the_per_run_numbers(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_CONSTRAINED_LEDGER", str(tmp_path / "ledger.json"))  # a fresh ledger: the first look
    out = tmp_path / "results.json"
    assert ex.main([*TINY, "--held_out_images", "110", "--seed", "5", "--penalties", "hinge,none",
                    "--cache_dir", str(tmp_path / "c"), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "on many_shapes (target: large bright ring" in printed
    assert "every protected class loses at most 3 points of accuracy" in printed
    assert "Per run (held-out images" in printed and "| 5 | hinge | " in printed and "| 5 | none | " in printed
    result = json.loads(out.read_text())
    assert result["config"]["data"] == "many_shapes" and result["config"]["constraints_per_step"] == 6
    hinge, none = result["summary"]["hinge"][0], result["summary"]["none"][0]
    for s in (hinge, none):
        assert s["target_class"] == "large bright ring" and -100 <= s["mean_protected_change"] <= 100
        assert s["share_over_tolerance"] == len(s["classes_over_tolerance"]) / M
        assert s["seconds_per_step"] > 0 and s["rows_per_step"]["new"] == 16
    # 6 of the 31 constraints per step, 4 rows each (and the indicator's rows of two-split estimation)
    assert hinge["rows_per_step"]["constraint"] == 6 * 4 and none["rows_per_step"]["constraint"] == 0
    run = result["per_seed"][0]["runs"][0]
    cert = run["certificate"]
    assert len(cert["rows"]) == M and set(cert["rows"].values()) == {110} and cert["look"] == 1
    assert cert["certified"] == all(b <= 0.03 for b in cert["bounds"].values())
    folder = tmp_path / "c" / "seed-5-hinge"
    assert json.loads((folder / "safety_report.json").read_text())["constraints"]
    assert os.path.isfile(folder / "README.md")


def test_a_certification_split_too_small_for_the_claim_is_warned_before_training(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HF_CONSTRAINED_LEDGER", str(tmp_path / "ledger.json"))
    with caplog.at_level(logging.WARNING, logger="hf_constrained"):
        ex.main([*TINY, "--held_out_images", "50", "--max_steps", "1", "--seed", "6",
                 "--cache_dir", str(tmp_path / "c"), "--output", str(tmp_path / "r.json")])
    warned = [r.getMessage() for r in caplog.records if "can never certify" in r.getMessage()]
    assert len(warned) == M
    assert any("'non_forgetting/small dark bar'" in w and "(50 rows)" in w and "needs at least 102" in w
               for w in warned)


def test_bad_options_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--constraints_per_step"):
        pipeline.check_settings(pipeline.DemoConfig(constraints_per_step=-1))
    with pytest.raises(ValueError, match="--target"):
        pipeline.demo_data(pipeline.DemoConfig(data="many_shapes", target=32))
    with pytest.raises(SystemExit):
        ex.main(["--data", "shapes", "--cache_dir", str(tmp_path)])


def test_the_frontier_benchmark_runs_on_the_example(tmp_path):
    ffd = import_script("benchmarks", "forgetting_frontier_demo")
    result = ffd.main(["--example", "many_classes", "--methods", "none", "hinge", "--seeds", "0", "--workers", "1",
                       "--json", str(tmp_path / "f.json"), "--cache_dir", str(tmp_path / "c"), *TINY,
                       "--held_out_images", "20", "--select_every", "0"])
    assert [r["method"] for r in result["runs"]] == ["none", "hinge"] and result["runs"][1]["value"] == 10.0
    for r in result["runs"]:
        assert len(r["old_task_change"]) == M and r["target"] == "large bright ring"
        assert r["mean_old_change"] == pytest.approx(np.mean(list(r["old_task_change"].values())))
        assert r["share_over_tolerance"] == len(r["tasks_over_tolerance"]) / M
        assert r["rows_per_step"]["forward"] >= 16
    assert result["config"]["demo"]["constraints_per_step"] == 6 and "mean_old_change" in result["settings"][0]
