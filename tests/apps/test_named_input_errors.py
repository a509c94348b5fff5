"""Errors that name what is wrong: an empty CSV names the file and its flag; a user's constraint that
raises during the pre-training check is named (issue 32, item 7)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import TinyNet, class_loss, tiny_args, tiny_rows

from hf_constrained import ConstrainedTrainer, Constraint, ConstraintValueError
from hf_constrained.fairness.data import TabularColumns, load_tabular_csv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("content, match", [
    ("", r"CSV file '.*empty\.csv' \(--csv_path\) is empty: it needs a header line"),
    ("y,g\n", r"CSV file '.*empty\.csv' \(--csv_path\) has a header but no data rows"),
])
def test_an_empty_csv_names_the_file_and_the_flag(tmp_path, content, match):
    path = tmp_path / "empty.csv"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_tabular_csv(str(path), TabularColumns(label_column="y", group_column="g"))


def test_an_empty_test_csv_names_its_own_flag(tmp_path):
    good = tmp_path / "train.csv"
    good.write_text("x,y,g\n" + "".join(f"{i},{i % 2},{i % 3 == 0:d}\n" for i in range(40)))
    (tmp_path / "test.csv").write_text("")
    with pytest.raises(ValueError, match=r"test\.csv' \(--csv_test_path\) is empty"):
        load_tabular_csv(str(good), TabularColumns(label_column="y", group_column="g"),
                         test_path=str(tmp_path / "test.csv"))


def test_the_roc_recipe_reports_an_empty_csv_in_one_line(tmp_path):
    (tmp_path / "empty.csv").write_text("")
    env = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "roc_fairness.py"), "--dataset", "csv",
                           "--csv_path", str(tmp_path / "empty.csv"), "--label_column", "y", "--group_column", "g",
                           "--output_dir", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=300, cwd=str(tmp_path))
    assert proc.returncode != 0
    assert "--csv_path" in proc.stderr and "empty.csv" in proc.stderr and "is empty" in proc.stderr
    assert "EmptyDataError" not in proc.stderr and "No columns to parse" not in proc.stderr


def _raises_runtime_error(model, batch):
    raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x3 and 4x2)")


def test_a_runtime_error_in_a_users_constraint_names_the_constraint(tmp_path):
    data = tiny_rows(16)
    cons = [Constraint("fine", class_loss, dataset=data, tolerance=1.0),
            Constraint("shape_bug", _raises_runtime_error, dataset=data, tolerance=1.0)]
    trainer = ConstrainedTrainer(model=TinyNet(), args=tiny_args(tmp_path, max_steps=2), train_dataset=data,
                                 constraints=cons)
    with pytest.raises(ConstraintValueError, match=r"constraint 'shape_bug' failed on rows 0\.\.\d+ of its dataset "
                                                   r"before training: RuntimeError: mat1 and mat2 shapes") as info:
        trainer.train()
    assert isinstance(info.value.__cause__, RuntimeError)  # the user's error stays chained for --debug
    assert trainer.state.global_step == 0
