"""Long work shows progress and the LLM example's default is one seed (issue 32, item 6)."""

from __future__ import annotations

import torch
from conftest import TinyNet, tiny_args, tiny_rows

from hf_constrained import ConstrainedTrainer
from hf_constrained.progress import StepProgressBar
from hf_constrained.recipes import llm_tiny_example as ex


def test_the_llm_example_defaults_to_one_seed_and_takes_more_as_a_flag():
    assert ex.parse([]).seeds == [0]
    assert ex.parse(["--seeds", "0", "1", "2", "3", "4"]).seeds == [0, 1, 2, 3, 4]


def test_a_quiet_run_shows_its_steps_in_one_bar(tmp_path, capsys):
    data = tiny_rows(32)
    trainer = ConstrainedTrainer(model=TinyNet(), args=tiny_args(tmp_path, max_steps=5, constraint_penalty="none",
                                                                 disable_tqdm=True),
                                 train_dataset=data, callbacks=[StepProgressBar("old model", leave=True)])
    trainer.train()
    err = capsys.readouterr().err
    assert "old model" in err and "5/5" in err


def test_the_old_model_of_the_llm_example_shows_progress(tmp_path, capsys):
    cfg = ex.parse(["--old_steps", "3", "--old_rows", "40", "--hidden", "16", "--layers", "1"])  # 120 rows, batch 64
    torch.manual_seed(0)
    ex.train_old_model(str(tmp_path / "old"), cfg)
    err = capsys.readouterr().err
    assert "training the old model" in err and "3/3" in err
