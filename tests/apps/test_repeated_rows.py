"""Repeated rows in a JSONL are dropped before any split, with a warning naming the file and the count
(issue 32, item 6): a row written twice could otherwise land in both the constraint's training rows and
its certification split, which the trainer refuses with an error about a split the recipe made."""

from __future__ import annotations

import json
import logging

from test_llm_recipe import _flags, _recipe, _write_jsonl, setup  # noqa: F401 (fixture)

from hf_constrained.text_data import load_text_dataset


def test_load_text_dataset_drops_repeated_rows_with_a_warning(tmp_path, caplog):
    rows = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(6)]
    path = _write_jsonl(tmp_path / "rows.jsonl", rows + [rows[2], rows[4], rows[2]])
    with caplog.at_level(logging.WARNING, logger="hf_constrained.text_data"):
        ds = load_text_dataset(path)
    assert len(ds) == 6 and [r["prompt"] for r in ds] == [f"p{i}" for i in range(6)]
    assert f"{path}: 3 repeated row(s) dropped before splitting (row 7 repeats row 3" in caplog.text
    caplog.clear()
    assert len(load_text_dataset(path, drop_repeats=False)) == 9
    with caplog.at_level(logging.WARNING, logger="hf_constrained.text_data"):
        assert len(load_text_dataset(_write_jsonl(tmp_path / "clean.jsonl", rows))) == 6
    assert "repeated" not in caplog.text
    # rows equal in every column only: the same prompt with another completion is kept
    other = _write_jsonl(tmp_path / "other.jsonl", rows + [{"prompt": "p1", "completion": "different"}])
    assert len(load_text_dataset(other)) == 7


def test_the_llm_recipe_trains_on_a_protected_file_with_repeated_rows(setup, tmp_path, caplog):  # noqa: F811
    with open(setup["copy"]) as f:
        rows = [json.loads(line) for line in f]
    copy = _write_jsonl(tmp_path / "copy.jsonl", rows + rows[:4])  # four rows written twice
    argv = _flags({**setup, "copy": copy}, tmp_path / "run", constraint_tolerance=0.05)
    with caplog.at_level(logging.WARNING, logger="hf_constrained.text_data"):
        results = _recipe().main(argv)
    assert f"{copy}: 4 repeated row(s) dropped before splitting" in caplog.text
    assert "non_forgetting/copy" in results["constraints"]
