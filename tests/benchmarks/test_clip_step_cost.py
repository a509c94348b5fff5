"""benchmarks/clip_step_cost.py on the CLIP demo at tiny size (seconds): the images each method's step forwards and
backpropagates, counted on the vision tower, are the demo's batch plus what the method reads."""

from __future__ import annotations

import pytest
from conftest import import_script

csc = import_script("benchmarks", "clip_step_cost")
TINY = ["--stage1_epochs", "1", "--batch_size", "8", "--constraint_batch_size", "4", "--steps", "3", "--warmup", "1",
        "--rounds", "1"]


def test_images_per_step_are_the_batch_plus_what_each_method_reads(tmp_path):
    result = csc.main(["--methods", "none", "replay=0.5", "hinge", "hinge@msvr_gamma_prime=0.1",
                       "hinge@indicator_fraction=0", "--reference", "replay=0.5", "--cache_dir", str(tmp_path),
                       "--json", str(tmp_path / "cost.json"), *TINY])
    rows = {m: r["images_per_step"] for m, r in result["methods"].items()}
    protected = 9  # the digits demo protects every digit but the target
    objective_look_ahead = rows["none"]["no_grad"]  # Algorithm 2's previous-iterate term of the contrastive loss
    assert rows["none"]["backward"] == 8
    assert rows["replay=0.5"]["backward"] == 8 + 8 and rows["replay=0.5"]["no_grad"] == objective_look_ahead
    constraint = protected * 4
    assert rows["hinge"]["backward"] == 8 + constraint
    # the indicator rows (two-split: the demo's 8 images per class) are a forward-only pass; the constraint
    # look-ahead (gamma' 0.1, off by default) another over the next step's indicator images; one split (no indicator
    # rows) and no look-ahead leave none
    indicator = protected * 8
    assert rows["hinge"]["no_grad"] == objective_look_ahead + indicator
    assert rows["hinge@msvr_gamma_prime=0.1"]["no_grad"] == objective_look_ahead + 2 * indicator
    assert rows["hinge@indicator_fraction=0"]["no_grad"] == objective_look_ahead
    assert result["methods"]["replay=0.5"]["ratio"] == pytest.approx(1.0)
    assert all(r["seconds_per_step"] > 0 and r["timed_steps"] == 2 for r in result["methods"].values())


def test_a_method_it_does_not_know_is_an_error_naming_it():
    with pytest.raises(SystemExit, match="'dropout' is not a demo setting"):
        csc.parse_method("hinge@dropout=0.1")
    with pytest.raises(SystemExit, match="replay=VALUE"):
        csc.parse_method("replay")
