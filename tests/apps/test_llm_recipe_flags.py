"""The LLM recipe's command line follows TRL's scripts: TrlParser over TRL's ScriptArguments,
ModelConfig and the package's ConstrainedSFTConfig, trained by ConstrainedSFTTrainer (TRL's
metrics in the log); the same flag names without TRL; short usage errors; old flags named with
their replacement; ``--bf16`` where no GPU supports it; the reproduce command and the saved copy
of ``--config``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from hf_constrained.recipes.tiny_lm import char_tokenizer, tiny_causal_lm

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "llm_non_forgetting.py"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
       "PYTHONPATH": str(ROOT)}


def _recipe():
    from hf_constrained.recipes import llm_non_forgetting

    return llm_non_forgetting


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("llm_flags")
    tok = char_tokenizer()
    tiny_causal_lm(len(tok), "gpt2", hidden_size=32, layers=1, heads=2).save_pretrained(base / "gpt2")
    tok.save_pretrained(base / "gpt2")
    words = ["abc", "hello", "xyz", "qrs", "mnop", "dog", "cat", "tree", "sun", "moon", "star", "leaf"]
    files = {"target": [{"prompt": f"sort:{w}=", "completion": "".join(sorted(w))} for w in words],
             "reverse": [{"prompt": f"rev:{w}=", "completion": w[::-1]} for w in words]}
    paths = {"model": str(base / "gpt2")}
    for name, rows in files.items():
        path = base / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths[name] = str(path)
    return paths


def _argv(tiny, out, **extra):
    flags = {"model_name_or_path": tiny["model"], "dataset_name": tiny["target"], "protected_datasets": tiny["reverse"],
             "output_dir": str(out), "max_steps": 2, "per_device_train_batch_size": 4, "learning_rate": 1e-2,
             "constraint_batch_size": 3, "eval_fraction": 0.25, "use_cpu": True, "report_to": "none",
             "save_strategy": "no", "logging_steps": 1, "disable_tqdm": True, "seed": 0, "reference_batch_size": 4}
    flags.update(extra)
    return [x for k, v in flags.items() for x in (f"--{k}", str(v))]


class NoLoading:
    @staticmethod
    def from_pretrained(*args, **kwargs):
        raise AssertionError(f"loaded {args} before the flags were checked")


def test_trl_parses_the_flags_and_its_trainer_logs_its_metrics(tiny, tmp_path, monkeypatch):
    """With TRL: TrlParser over TRL's dataclasses (a list-valued --lora_target_modules, --max_length,
    --packing, --chat_template_path are TRL's flags), ConstrainedSFTTrainer (mean_token_accuracy and
    num_tokens in the log history); run from a folder without recipes/ and with --config, the reproduce
    command names the module and cites the saved copy of the file, which holds no token and no absolute path."""
    pytest.importorskip("trl")
    from trl import ModelConfig, ScriptArguments, TrlParser

    from hf_constrained.integrations.trl import ConstrainedSFTConfig

    recipe = _recipe()
    parsed = recipe.parse_arguments(_argv(tiny, tmp_path / "p", use_peft=True, max_length=64, packing=True,
                                          chat_template_path="t.jinja") + ["--lora_target_modules", "c_attn", "c_proj"])
    assert parsed.trl is True
    assert type(parsed.dataset) is ScriptArguments and type(parsed.model) is ModelConfig
    assert type(parsed.training) is ConstrainedSFTConfig
    assert parsed.model.lora_target_modules == ["c_attn", "c_proj"] and parsed.dataset.dataset_name == tiny["target"]
    assert parsed.training.max_length == 64 and parsed.training.packing is True
    assert parsed.training.chat_template_path == "t.jinja"
    assert recipe.lora_targets(["q_proj,v_proj"]) == ["q_proj", "v_proj"] and recipe.lora_targets(["all-linear"]) \
        == "all-linear"
    # a parser of the script's own shape (trl/scripts/sft.py) reads the same flags
    assert isinstance(TrlParser(recipe._dataclass_types(True)), TrlParser)

    monkeypatch.chdir(tmp_path)  # no recipes/ here: as after pip install
    secret = "hf_" + "a" * 34
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model_name_or_path": tiny["model"], "dataset_name": tiny["target"],
                                      "protected_datasets": [tiny["reverse"]], "hub_token": secret,
                                      "output_dir": str(tmp_path / "ignored")}))
    out = tmp_path / "run"
    argv = ["--config", str(config)] + _argv(tiny, out)[4:]  # model and data from the file
    results = recipe.main(argv)
    assert results["trl"] is True
    log = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert any("mean_token_accuracy" in e and "num_tokens" in e for e in log)
    assert any("constraint/penalty_loss" in e for e in log)
    command = results["command"]
    assert command.startswith("accelerate launch -m hf_constrained.recipes.llm_non_forgetting ")
    assert "--config run/recipe_config.yaml" in command and "run.yaml" not in command
    assert command in (out / "README.md").read_text()
    saved = (out / "recipe_config.yaml").read_text()
    assert secret not in saved and "hub_token" not in saved and str(tmp_path) not in saved
    assert yaml.safe_load(saved)["dataset_name"] == "<local>/target.jsonl"


def test_without_trl_the_same_flags_train_with_the_plain_trainer(tiny, tmp_path):
    """TRL hidden (a sys.modules block): the same flag names through HfArgumentParser, ConstrainedTrainer
    (no TRL metrics), replay included; a TRL-only flag is an error naming the extra to install."""
    script = textwrap.dedent("""
        import json, sys
        sys.modules["trl"] = None  # import trl fails
        from hf_constrained.recipes import llm_non_forgetting as recipe
        argv = json.loads(sys.argv[1])
        assert not recipe.trl_available()
        try:
            recipe.main(argv + ["--packing", "true"])
        except ValueError as err:
            print("ERROR", err)
        results = recipe.main(argv + ["--use_peft", "--lora_target_modules", "c_attn", "c_proj", "--replay_old", "0.5"])
        print("TRL", results["trl"], "REPLAY", results["regulariser"]["name"], results["regulariser"]["ratio"])
    """)
    out = tmp_path / "plain"
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(_argv(tiny, out))], capture_output=True,
                          text=True, env=ENV, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERROR --packing: implemented by TRL, which is not installed; pip install 'hf_constrained[trl]'" \
        in proc.stdout
    assert "TRL False REPLAY replay 0.5" in proc.stdout
    log = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert any("constraint/penalty_loss" in e for e in log)
    assert not any("mean_token_accuracy" in e for e in log)
    assert json.loads((out / "adapter_config.json").read_text())["target_modules"] in (["c_attn", "c_proj"],
                                                                                         ["c_proj", "c_attn"])


def test_trl_only_flags_are_the_trl_fields_the_fallback_lacks():
    """The list of flags that need TRL is exactly what TRL's dataclasses have beyond the fallback's."""
    pytest.importorskip("trl")
    import dataclasses

    recipe = _recipe()
    names = lambda types: {f.name for t in types for f in dataclasses.fields(t)}  # noqa: E731
    assert names(recipe._dataclass_types(True)) - names(recipe._dataclass_types(False)) == recipe.TRL_ONLY_FLAGS


def test_a_usage_error_is_a_few_lines_and_help_lists_every_flag(capsys):
    from hf_constrained.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["llm", "--no_such_flag", "1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --no_such_flag 1" in err and err.startswith("usage: hf-constrained llm")
    assert len(err.strip().splitlines()) <= 4, err
    assert main(["llm", "--help-all"]) == 0  # --help: the main flags; --help-all: every flag
    out = capsys.readouterr().out
    for flag in ("--dataset_name", "--use_peft", "--lora_target_modules", "--max_length", "--protected_datasets",
                 "--penalty_beta", "--config"):
        assert flag in out


@pytest.mark.parametrize("flags, message", [
    (["--target_dataset", "x.jsonl"], "--target_dataset was replaced: the target data is --dataset_name"),
    (["--target_split", "train"], "--target_split was replaced: the target's split is --dataset_train_split"),
    (["--text_column", "body"], "--text_column was replaced: the text column is --dataset_text_field"),
])
def test_old_flags_name_their_replacement(flags, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        _recipe().parse_arguments(flags + ["--output_dir", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) <= 4


def test_old_lora_and_config_keys_name_their_replacement(tiny, tmp_path):
    from hf_constrained.recipe_args import RecipeConfigError

    recipe = _recipe()
    with pytest.raises(ValueError, match=r"--lora_r without --use_peft: .* add --use_peft true"):
        recipe.parse_arguments(_argv(tiny, tmp_path, lora_r=16))
    with pytest.raises(ValueError, match=r"--lora_r 0: full fine-tuning is the default"):
        recipe.parse_arguments(_argv(tiny, tmp_path, lora_r=0))
    with pytest.raises(ValueError, match="--dataset_test_split is not used by this recipe"):
        recipe.parse_arguments(_argv(tiny, tmp_path, dataset_test_split="validation"))
    config = tmp_path / "old.yaml"
    config.write_text(yaml.safe_dump({"target_dataset": "x.jsonl", "model_name_or_path": "m"}))
    with pytest.raises(RecipeConfigError, match="key 'target_dataset' was replaced: the target data is --dataset_name"):
        recipe.parse_arguments(["--config", str(config), "--output_dir", str(tmp_path)])


def test_shipped_config_on_a_machine_without_bf16_names_the_flag_before_loading(tmp_path, monkeypatch, capsys):
    """The shipped LoRA config asks for bf16: where no GPU supports it the run stops before the tokenizer
    or the model loads, naming --bf16 and how to turn it off; --bf16 false runs on (to the next check)."""
    from hf_constrained import recipe_args

    recipe = _recipe()
    monkeypatch.setattr(recipe_args, "bf16_supported", lambda: False)
    monkeypatch.setattr(recipe, "AutoTokenizer", NoLoading)
    monkeypatch.setattr(recipe, "AutoModelForCausalLM", NoLoading)
    with pytest.raises(SystemExit) as exit_:
        recipe.main(["--config", "llm_non_forgetting_lora.yaml", "--output_dir", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--bf16 true (set by --config llm_non_forgetting_lora.yaml)" in err and "pass --bf16 false" in err
    assert len(err.strip().splitlines()) <= 4
    # turned off, the run goes on to load the model
    with pytest.raises(AssertionError, match="before the flags were checked"):
        recipe.main(["--config", "llm_non_forgetting_lora.yaml", "--output_dir", str(tmp_path), "--bf16", "false",
                     "--report_to", "none", "--model_name_or_path", str(tmp_path)])


def test_use_peft_without_peft_names_the_extra_before_loading(tiny, tmp_path, monkeypatch):
    from hf_constrained.extras import MissingExtraError

    recipe = _recipe()
    monkeypatch.setattr(recipe, "has_module", lambda name: name != "peft")
    monkeypatch.setattr(recipe, "AutoTokenizer", NoLoading)
    monkeypatch.setattr(recipe, "AutoModelForCausalLM", NoLoading)
    with pytest.raises(MissingExtraError, match=r"--use_peft: .* pip install 'hf_constrained\[peft\]'"):
        recipe.main(_argv(tiny, tmp_path, use_peft=True))


def test_a_default_bf16_is_turned_off_where_it_is_unavailable_and_logged(tiny, tmp_path, monkeypatch, caplog):
    pytest.importorskip("trl")
    from hf_constrained import recipe_args

    monkeypatch.setattr(recipe_args, "bf16_supported", lambda: False)
    argv = _argv(tiny, tmp_path)
    del argv[argv.index("--use_cpu"):argv.index("--use_cpu") + 2]
    with caplog.at_level("WARNING", logger="hf_constrained.recipe_args"):
        parsed = _recipe().parse_arguments(argv)
    assert parsed.training.bf16 is False
    assert "bf16 is on by default, but this machine has no GPU with bf16 support" in caplog.text


def test_sft_collator_gives_the_batches_of_the_padding_collator():
    """SFTPaddingCollator (transformers' DataCollatorForSeq2Seq) pads like PaddingCollator: on the right,
    input_ids with the pad token, labels with -100, attention 0; reference losses collated the same way."""
    import torch
    from datasets import Dataset

    from hf_constrained.per_sample_loss import PaddingCollator
    from hf_constrained.text_data import SFTPaddingCollator, tokenize_sft

    tok = char_tokenizer()
    tok.padding_side = "left"  # the collator pads answers on the right whatever the tokenizer says
    rows = tokenize_sft(Dataset.from_list([{"prompt": "rev:" + w + "=", "completion": w[::-1]}
                                           for w in ["a", "hello", "xyz", "moonlight"]]), tok)
    rows = [dict(r, reference_loss=float(i) / 3, row_index=i) for i, r in enumerate(rows)]
    ours, theirs = SFTPaddingCollator(tok)(rows), PaddingCollator(tok)(rows)
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    assert (ours["labels"][0, len(rows[0]["labels"]):] == -100).all() and tok.padding_side == "left"
    padded = SFTPaddingCollator(tok, pad_to_multiple_of=8)(rows)
    assert padded["input_ids"].shape[1] % 8 == 0


def _llm_commands(path: Path) -> list[list[str]]:
    """The shell commands of ``path`` that run this recipe (a trailing backslash continues a line), as argv
    after the program."""
    import shlex

    commands, current = [], None
    for line in path.read_text().splitlines():
        if current is None and line.startswith(("accelerate launch", "hf-constrained llm ")) and \
                ("llm_non_forgetting" in line or line.startswith("hf-constrained llm ")):
            current = ""
        if current is not None:
            current += " " + line.rstrip("\\ ")
            if not line.rstrip().endswith("\\"):
                commands.append(shlex.split(current.split("#")[0]))
                current = None
    out = []
    for argv in commands:
        start = next(i for i, a in enumerate(argv) if "llm_non_forgetting" in a or a == "llm") + 1
        if "--help" not in argv[start:]:
            out.append(argv[start:])
    return out


@pytest.mark.parametrize("use_trl", [True, False])
def test_the_documented_commands_parse(use_trl, tmp_path, monkeypatch):
    """README's and docs/llm.md's commands of this recipe use its flags (here on a CPU: --bf16 false)."""
    if use_trl:
        pytest.importorskip("trl")
    monkeypatch.chdir(tmp_path)  # shipped configs by their file name, as after pip install
    commands = _llm_commands(ROOT / "README.md") + _llm_commands(ROOT / "docs" / "llm.md")
    assert len(commands) >= 4
    for argv in commands:
        parsed = _recipe().parse_arguments(argv + ["--bf16", "false"], use_trl=use_trl)
        assert parsed.dataset.dataset_name and parsed.model.model_name_or_path and parsed.data.protected_datasets
        assert parsed.model.use_peft and _recipe().lora_targets(parsed.model.lora_target_modules) == "all-linear"


def test_a_setting_the_recipe_refuses_is_one_line_from_the_command(capsys):
    """A flag the recipe cannot honour, found before anything loads, is one error line naming it
    (status 2), as argparse's own usage errors are, not a traceback."""
    from hf_constrained.cli import main

    assert main(["llm", "--dataset_test_split", "test"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hf-constrained llm: error: --dataset_test_split is not used")
