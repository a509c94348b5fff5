"""benchmarks/example_step_cost.py on a tiny old model (seconds): the methods' step times side by side, their
ratios to the reference, and the rows each step forwards and backpropagates."""

from __future__ import annotations

import json

import pytest
from conftest import import_script

cost = import_script("benchmarks", "example_step_cost")
TINY = ["--old_steps", "5", "--old_rows", "20", "--hidden", "16", "--new_rows", "64", "--constraint_rows", "40",
        "--held_out_rows", "16", "--certify_rows", "16", "--constraint_batch_size", "8"]


def test_the_one_draw_step_backpropagates_replays_rows_and_forwards_its_estimates(tmp_path):
    out = tmp_path / "cost.json"
    result = cost.main(["--methods", "hinge+replay=0.5", "replay_rows=0.5", "hinge+replay_own=0.5",
                        "hinge+replay=0.5@msvr_gamma_prime=0.1", "none", "--reference", "replay_rows=0.5",
                        "--steps", "4", "--warmup", "1", "--rounds", "1", "--json", str(out),
                        "--old_model", str(tmp_path / "old"), *TINY])
    assert json.loads(out.read_text())["ratio_to_reference"] == result["ratio_to_reference"]
    assert result["ratio_to_reference"]["replay_rows=0.5"] == 1.0
    rows = result["rows_per_step"]
    one, replay, two = rows["hinge+replay=0.5"], rows["replay_rows=0.5"], rows["hinge+replay_own=0.5"]
    # 32 new rows and 3 tasks x 8 constraint rows: replay of the constraint rows adds no rows to the hinge's step
    assert replay == {"forward": 56, "backward": 56, "new": 32, "constraint": 24, "indicator": 0, "look_ahead": 0,
                      "replay": 0, "kl": 0}
    assert one["backward"] == replay["backward"] and one["replay"] == 0
    # the two-split indicator rows: forward only; the example's default has no look-ahead (gamma' 0), which adds
    # the next step's indicator rows at the current parameters, forward only
    assert one["forward"] - one["backward"] == one["indicator"] == 24 and one["look_ahead"] == 0
    ahead = rows["hinge+replay=0.5@msvr_gamma_prime=0.1"]
    assert ahead["look_ahead"] == 24 and ahead["forward"] == one["forward"] + 24
    # replay of rows of its own beside the hinge: 32 more rows forward and backward (two draws of old rows)
    assert two["replay"] == 32 and two["backward"] == one["backward"] + 32
    assert rows["none"] == {"forward": 32, "backward": 32, "new": 32, "constraint": 0, "indicator": 0,
                            "look_ahead": 0, "replay": 0, "kl": 0}
    assert all(t > 0 for t in result["seconds_per_step"].values())


def test_bad_methods_are_refused():
    with pytest.raises(SystemExit, match="none of"):
        cost.parse_method("nope=1", cost.ff.ex.parse(TINY))
    with pytest.raises(SystemExit, match="takes ratio=value"):
        cost.parse_method("replay", cost.ff.ex.parse(TINY))
    with pytest.raises(SystemExit, match="no flag --nope"):
        cost.parse_method("replay=0.5@nope=1", cost.ff.ex.parse(TINY))
