"""Recipe defaults that set off no warning of torch's or the library's own (issue 32, item 6):
pinned memory only with an accelerator (the ROC recipe printed torch's pin_memory warning at every
epoch), and no gradient clipping in the ROC and safe-release defaults (the method expects none)."""

from __future__ import annotations

import warnings

import pytest
from test_fairness_roc import _csv_recipe_flags, _roc_recipe, splits  # noqa: F401 (fixture)

from hf_constrained import ConstrainedTrainingArguments
from hf_constrained.recipe_args import parse_recipe_args


@pytest.fixture
def no_accelerator(monkeypatch):
    """The arguments resolved as on a machine without an accelerator, also where this one has one."""
    import hf_constrained.config as config

    monkeypatch.setattr(config, "accelerator_available", lambda: False)


def _without_use_cpu(flags: list[str]) -> list[str]:
    i = flags.index("--use_cpu")
    return flags[:i] + flags[i + 2:]  # TrainingArguments turns pinning off itself with --use_cpu


def test_pin_memory_is_off_by_default_without_an_accelerator(tmp_path, no_accelerator):
    (args,) = parse_recipe_args([ConstrainedTrainingArguments], ["--output_dir", str(tmp_path)])
    assert args.dataloader_pin_memory is False
    (asked,) = parse_recipe_args([ConstrainedTrainingArguments], ["--output_dir", str(tmp_path),
                                                                  "--dataloader_pin_memory", "true"])
    assert asked.dataloader_pin_memory is True  # what a user asks for is kept


def test_pin_memory_keeps_the_trainers_default_with_an_accelerator(tmp_path, monkeypatch):
    import hf_constrained.config as config

    monkeypatch.setattr(config, "accelerator_available", lambda: True)
    (args,) = parse_recipe_args([ConstrainedTrainingArguments], ["--output_dir", str(tmp_path)])
    assert args.dataloader_pin_memory is True
    assert ConstrainedTrainingArguments(output_dir=str(tmp_path)).dataloader_pin_memory is True


def test_library_arguments_pin_memory_only_with_an_accelerator(tmp_path, no_accelerator):
    """The library's own arguments (the README's quick start builds them in Python) follow the machine too,
    keep an explicit value, and a trainer built from them on a CPU prints no pin_memory warning."""
    from scale_tiny import TinyClassifier, make_data

    from hf_constrained import ConstrainedTrainer

    args = ConstrainedTrainingArguments(output_dir=str(tmp_path), report_to=[], max_steps=2, save_strategy="no",
                                        constraint_batch_size=4)
    assert args.dataloader_pin_memory is False
    assert ConstrainedTrainingArguments(output_dir=str(tmp_path), dataloader_pin_memory=True).dataloader_pin_memory
    train, constraints = make_data(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ConstrainedTrainer(model=TinyClassifier(), args=args, train_dataset=train, constraints=constraints).train()
    assert not [w for w in caught if "pin_memory" in str(w.message)]


def test_the_roc_recipe_prints_no_pin_memory_warning_on_a_cpu(splits, tmp_path, no_accelerator):  # noqa: F811
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # count every emission, not the first per location
        flags = _without_use_cpu(_csv_recipe_flags(splits, tmp_path))
        _roc_recipe().main(flags + ["--num_train_epochs", "3", "--output_dir", str(tmp_path / "run"),
                                    "--save_model", "false"])
    pinned = [w for w in caught if "pin_memory" in str(w.message)]
    assert len(pinned) <= 1, f"{len(pinned)} pin_memory warnings"


def _safe_release():
    from conftest import import_script

    return import_script("recipes", "safe_release_digits")


def test_safe_release_defaults_do_not_set_off_the_clipping_warning(tmp_path, caplog):
    """With the recipe's defaults (every one but the length of the run) no step is clipped, so the
    library's warning that clipping shrinks the exact penalty's beta does not fire."""
    import json
    import logging

    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="hf_constrained.clipping"):
        _safe_release().main(["--output_dir", str(out), "--max_steps", "30", "--eval_steps", "10",
                              "--save_steps", "10"])
    assert "gradient clipping" not in caplog.text
    log = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert all(entry.get("clip/clipped_fraction", 0.0) == 0.0 for entry in log)

