"""``load_tabular_csv``: problems in a user's CSV are named by column, row count and line."""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd
import pytest

from hf_constrained.fairness.data import TabularColumns, TabularSplit, feature_names, load_tabular_csv


def _frame(n: int = 60, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"age": rng.integers(18, 80, n).astype(float), "hours": rng.normal(40, 5, n),
                         "city": rng.choice(["a", "b"], n), "g": rng.choice(["M", "F"], n),
                         "y": rng.choice([0, 1], n)})


def _load(path, **kw):
    return load_tabular_csv(str(path), TabularColumns(label_column="y", group_column="g", group_value="M", **kw))


def test_string_in_numeric_column_is_an_error_not_one_hot(tmp_path):
    df = _frame().astype({"age": object})
    df.loc[17, "age"] = "unknown"
    df.to_csv(tmp_path / "d.csv", index=False)
    with pytest.raises(ValueError, match=r"column 'age' is numeric except 1 of 60 rows \(line 19: 'unknown'\)"):
        _load(tmp_path / "d.csv")
    # declared categorical, it is one-hot encoded as asked
    ds = _load(tmp_path / "d.csv", categorical_columns=["age", "city", "g"])
    assert "age=unknown" in feature_names(ds)


def test_all_empty_column_dropped_with_warning_not_every_row(tmp_path, caplog):
    df = _frame()
    df["notes"] = np.nan
    df.to_csv(tmp_path / "d.csv", index=False)
    with caplog.at_level(logging.WARNING, logger="hf_constrained.fairness.data"):
        ds = _load(tmp_path / "d.csv")
    assert "dropping column(s) ['notes']: empty in all 60 rows" in caplog.text
    assert sum(len(ds[s]) for s in ds) == 60  # no row lost
    df = _frame()
    df["y"] = np.nan
    df.to_csv(tmp_path / "e.csv", index=False)
    with pytest.raises(ValueError, match="column 'y' is empty in all 60 rows"):
        _load(tmp_path / "e.csv")


def test_infinite_values_named_by_column_and_line(tmp_path):
    df = _frame()
    df.loc[[3, 8], "hours"] = np.inf
    df.to_csv(tmp_path / "d.csv", index=False)
    with pytest.raises(ValueError, match=r"column 'hours' has 2 infinite value\(s\) \(lines 5, 10\)"):
        _load(tmp_path / "d.csv")


def test_dropped_rows_and_binarised_labels_are_reported(tmp_path, caplog):
    df = _frame()
    df.loc[[1, 2, 5], "hours"] = np.nan
    df.loc[4, "city"] = np.nan
    df["y"] = np.random.default_rng(1).choice([0, 1, 2], 60)
    df.to_csv(tmp_path / "d.csv", index=False)
    with caplog.at_level(logging.WARNING, logger="hf_constrained.fairness.data"):
        ds = _load(tmp_path / "d.csv")
    assert "dropping 4 of 60 rows with missing values (missing per column: {'hours': 3, 'city': 1})" in caplog.text
    ones = int((df.dropna()["y"] == 1).sum())
    assert f"label column 'y' has 3 values: label = 1 for 1 ({ones} rows), 0 for ['0', '2'] ({56 - ones} rows)" \
        in caplog.text
    labels = np.concatenate([TabularSplit.from_dataset(ds[s]).label for s in ds])
    assert labels.sum() == ones and len(labels) == 56
