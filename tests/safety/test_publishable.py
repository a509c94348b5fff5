"""Nothing secret or local leaves the machine: reproduce commands, cards, reports, checkpoints.

A recipe run with a Hub token on its command line and an absolute output folder must write
neither into any file (cards, reports, results, trainer state, figures, checkpoints and their
``training_args.bin``), and the token must not reach the console either.
"""

from __future__ import annotations

import copy
import os
import pickle

import torch
import yaml

from hf_constrained import ConstrainedTrainingArguments
from hf_constrained.cli import main
from hf_constrained.publishable import is_secret_flag, publishable_argv, publishable_command, redact_secrets

FAKE_TOKEN = "hf_FAKEsecretTOKEN0123456789abcdefghijklmn"


def test_reproduce_command_drops_secret_flags_and_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = str(tmp_path / "runs" / "x")
    argv = ["--hub_token", FAKE_TOKEN, "--output_dir", out, f"--logging_dir={out}/logs",
            "--config", "/home/alice/settings.yaml", "--wandb_api_key=abc", "--push_to_hub",
            "--include_num_input_tokens_seen", "true", "--data", str(tmp_path / "data" / "rows.csv"),
            "--protected", "a=/srv/data/a.jsonl,b=rel/b.jsonl", "--note", FAKE_TOKEN]
    shown = publishable_argv(argv)
    assert shown == ["--output_dir", "<output_dir>", "--logging_dir=<output_dir>/logs",
                     "--config", "<local>/settings.yaml", "--push_to_hub", "--include_num_input_tokens_seen", "true",
                     "--data", os.path.join("data", "rows.csv"), "--protected", "a=<local>/a.jsonl,b=rel/b.jsonl",
                     "--note", "<redacted>"]
    command = publishable_command("python recipes/x.py", argv)
    assert FAKE_TOKEN not in command and str(tmp_path) not in command and "/home/alice" not in command
    assert command.startswith("python recipes/x.py --output_dir '<output_dir>'")
    assert [is_secret_flag(f) for f in ("--hub_token", "--api-key", "--password", "--max_new_tokens", "--keys")] == [
        True, True, True, False, False]
    assert redact_secrets(f"token={FAKE_TOKEN}.") == "token=<redacted>."


def test_the_reproduce_program_is_one_that_exists_where_the_command_runs(tmp_path, monkeypatch):
    """In a clone (recipes/ under the current folder) the script; elsewhere (after pip install) the
    installed module; started by ``hf-constrained <recipe>``, that command."""
    from pathlib import Path

    from hf_constrained.publishable import reproduce_program

    root = Path(__file__).resolve().parents[2]
    monkeypatch.setattr("sys.argv", ["pytest"])
    monkeypatch.chdir(root)
    assert reproduce_program("accelerate launch recipes/llm_non_forgetting.py") == \
        "accelerate launch recipes/llm_non_forgetting.py"
    monkeypatch.chdir(tmp_path)
    assert reproduce_program("accelerate launch recipes/llm_non_forgetting.py") == \
        "accelerate launch -m hf_constrained.recipes.llm_non_forgetting"
    assert reproduce_program("python recipes/roc_fairness.py") == "python -m hf_constrained.recipes.roc_fairness"
    assert reproduce_program("python recipes/not_a_recipe.py") == "python recipes/not_a_recipe.py"
    monkeypatch.setattr("sys.argv", ["hf-constrained llm", "--max_steps", "2"])
    assert publishable_command("accelerate launch recipes/llm_non_forgetting.py", ["--max_steps", "2"]) == \
        "hf-constrained llm --max_steps 2"


def test_a_config_file_is_saved_with_the_run_without_secrets_or_local_paths(tmp_path, monkeypatch):
    """``--config FILE``: a copy in the output folder (no secret key, no token, no absolute path), cited by
    the command relative to the current folder (or as ``<output_dir>/...`` when the run is elsewhere)."""
    monkeypatch.setattr("sys.argv", ["pytest"])
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    config = tmp_path / "elsewhere" / "run.yaml"
    config.parent.mkdir()
    config.write_text(yaml.safe_dump({"hub_token": FAKE_TOKEN, "wandb_api_key": "k", "note": FAKE_TOKEN,
                                      "dataset_name": "/srv/data/new.jsonl", "output_dir": str(work / "out"),
                                      "protected_datasets": [f"math={work}/data/math.jsonl"], "max_steps": 3}))
    command = publishable_command("python recipes/x.py", ["--config", str(config), "--max_steps", "2"],
                                  output_dir=str(work / "out"))
    assert command == "python recipes/x.py --config out/recipe_config.yaml --max_steps 2"
    text = (work / "out" / "recipe_config.yaml").read_text()
    assert FAKE_TOKEN not in text and "hub_token" not in text and "wandb_api_key" not in text
    assert str(tmp_path) not in text and "/srv" not in text
    saved = yaml.safe_load(text)
    assert saved["dataset_name"] == "<local>/new.jsonl" and saved["protected_datasets"] == ["math=data/math.jsonl"]
    assert saved["max_steps"] == 3 and saved["note"] == "<redacted>"
    # a run outside the current folder: the copy by its place in the output folder
    command = publishable_command("python recipes/x.py", [f"--config={config}"], output_dir=str(tmp_path / "o"))
    assert command == "python recipes/x.py --config '<output_dir>/recipe_config.yaml'"
    assert (tmp_path / "o" / "recipe_config.yaml").is_file()


def test_training_arguments_pickle_without_token_or_absolute_paths(tmp_path):
    """``training_args.bin`` is a pickle of the arguments; copies in the process keep everything."""
    args = ConstrainedTrainingArguments(output_dir=str(tmp_path / "run"), hub_token=FAKE_TOKEN, use_cpu=True,
                                        report_to="none")
    data = pickle.dumps(args)
    assert FAKE_TOKEN.encode() not in data and str(tmp_path).encode() not in data
    loaded = pickle.loads(data)
    assert loaded.hub_token is None and loaded.output_dir == "<output_dir>"
    assert loaded.penalty_beta == args.penalty_beta and loaded.constraint_penalty == args.constraint_penalty
    for copied in (copy.copy(args), copy.deepcopy(args)):
        assert copied.hub_token == FAKE_TOKEN and copied.output_dir == str(tmp_path / "run")
    assert FAKE_TOKEN not in args.to_json_string()


def _files_containing(folder, needles: list[bytes]) -> list[str]:
    found = []
    for directory, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                data = f.read()
            found += [f"{os.path.relpath(path, folder)}: {needle.decode()}" for needle in needles if needle in data]
    return found


def test_a_recipe_run_writes_no_token_and_no_absolute_path(tmp_path, capsys, caplog):
    """The safe-release recipe (a card, a report, figures, checkpoints) with ``--hub_token`` on its
    command line, an absolute ``--output_dir`` and an absolute ``--config``: no file it writes
    holds the token or the absolute folder, binary files (``training_args.bin``) included."""
    out = tmp_path / "run"
    config = tmp_path / "release.yaml"
    config.write_text(yaml.safe_dump({"max_steps": 10, "eval_steps": 5, "save_steps": 5, "hub_token": FAKE_TOKEN}))
    assert main(["safe-release", "--config", str(config), "--output_dir", str(out),
                 "--hub_token", FAKE_TOKEN]) == 0
    written = sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs)
    assert "README.md" in written and "safety_report.json" in written
    assert any(p.endswith("training_args.bin") for p in written) and any(p.endswith(".png") for p in written)
    assert _files_containing(out, [FAKE_TOKEN.encode(), str(tmp_path).encode()]) == []
    card = (out / "README.md").read_text()
    # started through the command line: reproduced by it, with the copy of the config saved in the run
    assert "hf-constrained safe-release --config '<output_dir>/recipe_config.yaml' --output_dir '<output_dir>'" in card
    assert "hub_token" not in card and "hub_token" not in (out / "recipe_config.yaml").read_text()
    assert yaml.safe_load((out / "recipe_config.yaml").read_text())["max_steps"] == 10
    printed = capsys.readouterr()
    assert FAKE_TOKEN not in printed.out + printed.err + caplog.text
    # the checkpoint's arguments still hold the run's settings
    args = torch.load(out / "checkpoint-10" / "training_args.bin", weights_only=False)
    assert args.max_steps == 10 and args.hub_token is None and args.output_dir == "<output_dir>"


def test_cards_and_reports_never_hold_a_token(tmp_path, caplog):
    """Whatever a caller passes (a reproduce command or a model name with a token in it), the
    card and the report written to disk hold ``<redacted>`` instead, and the report verifies."""
    from hf_constrained.publishing.card import ModelCardInfo, render_model_card, write_model_card
    from hf_constrained.publishing.report import ConstraintResult, SafetyReport
    from hf_constrained.publishing.verify import check_run_dir

    report = SafetyReport([ConstraintResult("c", 0.1, 0.2)], model_name=f"run-{FAKE_TOKEN}", safety_rule="point")
    report.save(str(tmp_path))
    card = render_model_card(report, model_name="m",
                             info=ModelCardInfo(reproduce_command=f"python x.py --hub_token {FAKE_TOKEN}",
                                                               dataset_description=f"rows from {FAKE_TOKEN}"))
    write_model_card(str(tmp_path), card)
    assert _files_containing(tmp_path, [FAKE_TOKEN.encode()]) == []
    assert "<redacted>" in (tmp_path / "README.md").read_text()
    assert SafetyReport.load(str(tmp_path)).model_name == "run-<redacted>"
    assert check_run_dir(str(tmp_path)).exit_code == 0
    assert "contained a Hugging Face token" in caplog.text


def test_the_report_module_redacts_the_same_tokens():
    from hf_constrained.publishable import HF_TOKEN_PATTERN
    from hf_constrained.publishing import report

    assert report._HF_TOKEN.pattern == HF_TOKEN_PATTERN.pattern


def test_a_trainer_run_with_tensorboard_writes_no_token_and_no_absolute_path(tmp_path):
    """A trainer (a ``PreTrainedModel``, so ``config.json`` too) with ``hub_token`` and TensorBoard
    logging, checkpoints, the feasible best reloaded, ``save_model`` and ``finish_run``: neither
    the token nor the absolute output folder is in any file, event files included."""
    from safety_tiny import make_trainer

    from hf_constrained.safety.finish import finish_run

    out = tmp_path / "run"
    trainer = make_trainer(str(out), tolerance=2.0, max_steps=3, hub_token=FAKE_TOKEN, report_to=["tensorboard"])
    trainer.train()
    trainer.save_model(str(out))
    finish_run(trainer, plots=False)
    assert any("tfevents" in f for _, _, files in os.walk(out) for f in files)
    assert _files_containing(out, [FAKE_TOKEN.encode(), str(tmp_path).encode()]) == []
    assert trainer.args.hub_token == FAKE_TOKEN  # the running trainer keeps it for its pushes
