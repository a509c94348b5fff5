"""Bad input gets an error that names the constraint, key, flag or file, before training."""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest
import torch
from conftest import TinyNet, class_loss
from conftest import tiny_args as make_args
from conftest import tiny_rows as make_data
from datasets import Dataset
from transformers import HfArgumentParser

from hf_constrained import ConstrainedTrainer, ConstrainedTrainingArguments, Constraint, ConstraintValueError
from hf_constrained.batches import collate_examples
from hf_constrained.errors import check_model_path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ----------------------------------------------------------------------------- settings
@pytest.mark.parametrize("kw,exc,match", [
    (dict(penalty_beta=float("inf")), ValueError, "penalty_beta must be > 0 and finite, got inf"),
    (dict(penalty_beta=float("nan")), ValueError, "penalty_beta must be > 0 and finite, got nan"),
    (dict(msvr_gamma_prime=float("inf")), ValueError, "msvr_gamma_prime must be >= 0 and finite"),
    (dict(msvr_gamma_prime="inf"), ValueError, "msvr_gamma_prime must be >= 0 and finite"),
    (dict(msvr_gamma_prime=float("nan")), ValueError, "msvr_gamma_prime must be >= 0 and finite"),
    (dict(objective_msvr_gamma_prime=float("inf")), ValueError, "objective_msvr_gamma_prime must be >= 0 and finite"),
    (dict(penalty_beta="10"), TypeError, "penalty_beta must be a number, got str '10'"),
    (dict(msvr_gamma="0.8"), TypeError, "msvr_gamma must be a number, got str"),
    (dict(constraint_batch_size=2.5), TypeError, "constraint_batch_size must be an integer, got float 2.5"),
    (dict(constraints_per_step="2"), TypeError, "constraints_per_step must be an integer, got str"),
    (dict(msvr_gamma_prime=[0.1]), TypeError, "msvr_gamma_prime must be a number >= 0 or 'theory', got list"),
])
def test_bad_settings_rejected_by_name(tmp_path, kw, exc, match):
    with pytest.raises(exc, match=match):
        ConstrainedTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)


def test_gamma_prime_theory_and_numbers_parse_from_the_command_line(tmp_path):
    parser = HfArgumentParser(ConstrainedTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none", "--msvr_gamma_prime", "theory",
         "--objective_msvr_gamma_prime", "0.25"])
    assert args.msvr_gamma_prime == "theory" and args.objective_msvr_gamma_prime == 0.25
    (default,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--use_cpu"])
    assert default.msvr_gamma_prime == 0.1
    with pytest.raises(ValueError, match="msvr_gamma_prime must be a number >= 0 or 'theory', got 'theroy'"):
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--msvr_gamma_prime", "theroy"])


def test_string_tolerance_names_the_constraint():
    with pytest.raises(TypeError, match="constraint 'c': tolerance must be a number, got str '0.1'"):
        Constraint("c", class_loss, dataset=make_data(4), tolerance="0.1")
    assert Constraint("c", class_loss, dataset=make_data(4), tolerance=np.float32(0.5)).tolerance == 0.5


# ----------------------------------------------------------------------------- constraint data
def test_preflight_runs_every_constraint_sharing_one_fn(tmp_path):
    """Two constraints share one fn; only the second one's rows lack a key: the error names it."""
    good = make_data(16)
    bad = Dataset.from_dict({"x": good["x"], "target": good["labels"]})  # "labels" renamed
    cons = [Constraint("good", class_loss, dataset=good, tolerance=1.0),
            Constraint("renamed", class_loss, dataset=bad, tolerance=1.0)]
    trainer = ConstrainedTrainer(model=TinyNet(), args=make_args(tmp_path, max_steps=2), train_dataset=good,
                                 constraints=cons)
    with pytest.raises(ConstraintValueError, match=r"constraint 'renamed': its function reads key 'labels', which "
                                                   r"its batches do not have \(batch keys: \['sample_index', "
                                                   r"'target', 'x'\]\)"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_ragged_rows_name_the_key_and_shapes(tmp_path):
    rows = [{"ids": torch.tensor([1, 2, 3]), "labels": 0}, {"ids": torch.tensor([1, 2]), "labels": 1}]
    with pytest.raises(ValueError, match=r"key 'ids': .*rows of different shapes \[\(2,\), \(3,\)\].*collate_fn"):
        collate_examples(rows)
    with pytest.raises(ValueError, match=r"key 'ids': .*different shapes"):
        collate_examples([{"ids": [1, 2, 3]}, {"ids": [1, 2]}])
    with pytest.raises(KeyError, match="1 of 2 rows have no key 'labels'"):
        collate_examples([{"ids": [1], "labels": 0}, {"ids": [2]}])
    # and through the trainer, before training, with the constraint's name
    data = make_data(8)
    cons = [Constraint("ragged", class_loss, dataset=rows)]
    trainer = ConstrainedTrainer(model=TinyNet(), args=make_args(tmp_path, max_steps=1), train_dataset=data,
                                 constraints=cons)
    with pytest.raises(ConstraintValueError, match=r"constraint 'ragged': rows 0..1 of its dataset cannot be made "
                                                   r"into a batch: ValueError: key 'ids'"):
        trainer.train()


# ----------------------------------------------------------------------------- model paths
def test_missing_local_model_path_is_named(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match=r"--model_name_or_path='.*no-such-model': the local path does not"):
        check_model_path(missing)
    with pytest.raises(ValueError, match="neither a local model directory nor a hub id"):
        check_model_path("a/b/c")
    (tmp_path / "model").mkdir()
    assert check_model_path(str(tmp_path / "model")) == str(tmp_path / "model")


def test_clip_recipe_names_a_missing_model_path(tmp_path):
    spec = importlib.util.spec_from_file_location("clip_non_forgetting_errors",
                                                  os.path.join(ROOT, "recipes", "clip_non_forgetting.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    with pytest.raises(FileNotFoundError, match="--model_name_or_path='./missing-clip'"):
        mod.main(["--model_name_or_path", "./missing-clip", "--output_dir", str(tmp_path), "--use_cpu",
                  "--report_to", "none", "--bdd100k_root", str(tmp_path / "nothing-here")])


def test_max_steps_zero_is_an_error(tmp_path):
    """``max_steps=0`` would train one step (the Trainer checks the bound only after a step)."""
    from scale_tiny import tiny_args

    with pytest.raises(ValueError, match="max_steps"):
        tiny_args(str(tmp_path), max_steps=0)
