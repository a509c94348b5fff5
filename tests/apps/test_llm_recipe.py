"""The language-model recipe (recipes/llm_non_forgetting.py) on tiny GPT-2 / Llama checkpoints:
local JSONL data in the three SFT formats, LoRA, a YAML config with command-line overrides,
clear errors, and a 2-process run through ``accelerate launch``."""

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import UploadRecorder
from launch_once import free_port
from recipe_outputs import assert_report_checks, run_card_snippet

from hf_constrained.recipes.tiny_lm import char_tokenizer, tiny_causal_lm

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "llm_non_forgetting.py"


def _recipe():
    spec = importlib.util.spec_from_file_location("llm_non_forgetting", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("llm")
    tok = char_tokenizer()
    paths = {}
    for kind in ("gpt2", "llama"):
        path = base / kind
        tiny_causal_lm(len(tok), kind, hidden_size=32, layers=1, heads=2).save_pretrained(path)
        tok.save_pretrained(path)
        paths[kind] = str(path)
    words = ["abc", "hello", "xyz", "qrs", "mnop", "dog", "cat", "tree", "sun", "moon", "star", "leaf"]
    paths["target"] = _write_jsonl(base / "sort.jsonl",
                                   [{"prompt": f"sort:{w}=", "completion": "".join(sorted(w))} for w in words])
    paths["reverse"] = _write_jsonl(base / "reverse.jsonl",
                                    [{"prompt": f"rev:{w}=", "completion": w[::-1]} for w in words])
    paths["copy"] = _write_jsonl(base / "copy.jsonl", [{"text": f"cp:{w}={w}"} for w in words])
    paths["safety"] = _write_jsonl(base / "refusals.jsonl", [
        {"messages": [{"role": "user", "content": f"harm {w}?"}, {"role": "assistant", "content": "no."}]}
        for w in words])
    return paths


def _flags(setup, out, model="gpt2", **extra):
    flags = {
        "model_name_or_path": setup[model], "dataset_name": setup["target"],
        "safety_dataset": setup["safety"], "output_dir": str(out), "max_steps": 3,
        "per_device_train_batch_size": 4, "learning_rate": 1e-2, "constraint_batch_size": 3,
        "eval_fraction": 0.25, "use_cpu": True, "report_to": "none", "save_strategy": "no",
        "logging_steps": 1, "disable_tqdm": True, "seed": 0, "reference_batch_size": 4,
    }
    flags.update(extra)
    argv = ["--protected_datasets", f"reverse={setup['reverse']}", setup["copy"]]
    for k, v in flags.items():
        argv += [f"--{k}", str(v)]
    return argv


def test_recipe_trains_under_one_constraint_per_protected_set_and_reports(setup, tmp_path):
    out = tmp_path / "run"
    results = _recipe().main(_flags(setup, out, constraint_tolerance=0.05))
    assert sorted(results["constraints"]) == ["non_forgetting/copy", "non_forgetting/reverse", "safety/refusals"]
    # the defaults (but --constraint_batch_size 3): the hinge on top of replay 0.5, two-split with the proxy indicator
    assert results["regulariser"] == {"name": "replay", "ratio": 0.5, "rows": "constraint_rows"}
    assert results["penalty_beta"] == 0.25 and results["constraint_step"]["constraint_proxy_indicator"] is True
    assert results["train_metrics"]["train_loss"] > 0
    assert "eval_loss" in results["eval_metrics"]
    report = results["safety_report"]
    assert {c["name"] for c in report["constraints"]} == set(results["constraints"])
    assert all(c["data"] == "held-out" for c in report["constraints"])
    for name in ("llm_results.json", "safety_report.json", "README.md", "model.safetensors", "tokenizer.json"):
        assert (out / name).exists(), name
    log = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert any("constraint/penalty_loss" in e for e in log)  # the constraints were trained on
    # 12 rows per file, 25% held out: 9 constraint rows and 3 held-out rows each
    assert all(c["old_loss"] > 0 for c in results["constraints"].values())
    card = (out / "README.md").read_text()
    assert "non_forgetting/reverse" in card and "safety/refusals" in card
    # every protected set and the safety set has a certification split: 3 held-out rows, half of them certify
    assert {k: v["rows"] for k, v in results["certification_splits"].items()} == {n: 2 for n in results["constraints"]}
    assert set(results["certified_bounds"]) == set(results["constraints"])
    assert results["certified"] is False  # 2 rows cannot certify 5% (a 0/1 rate over 2 rows: bound >= 0.78)
    assert results["safe"] is False
    # the recipe's own output passes `report --check`, and the card's snippet loads model and tokenizer
    assert_report_checks(out, certified=False)
    loaded = run_card_snippet(out)
    # a tokenizer is named `tokenizer` in the card's snippet (`processor` read as an image processor)
    assert "processor" not in loaded
    assert "Tokenizer" in type(loaded["tokenizer"]).__name__ and loaded["tokenizer"]("ab")["input_ids"]
    assert type(loaded["model"]).__name__ == "GPT2LMHeadModel"
    assert "%" not in card.split("## Data")[1].split("\n## ")[0]  # fractions, as every number of the card


def test_the_defaults_are_the_benchmarks_choice_and_turn_off_only_where_they_cannot_apply(setup, tmp_path, caplog):
    """With no flag given, the recipe runs the setting the forgetting benchmark chose (docs/benchmarks.md): the hinge
    at beta 0.25 on top of replay 0.5, gamma 0.2, gamma' 0.1, 8 rows per constraint, two-split 0.25 with the proxy
    indicator, margin 0.02.
    Replay is off for plain SFT, without protected sets and with packing; the proxy indicator without a
    certificate: each with a warning, except plain SFT; a value the user gave is kept or refused, never changed."""
    recipe = _recipe()
    base = ["--model_name_or_path", setup["gpt2"], "--dataset_name", setup["target"], "--output_dir", str(tmp_path),
            "--bf16", "false"]
    protected = ["--protected_datasets", setup["reverse"]]
    config = recipe.parse_arguments(base + protected)
    args, data = config.training, config.data
    assert (args.constraint_penalty, args.penalty_beta, data.replay_old) == ("hinge", 0.25, 0.5)
    assert {k: getattr(args, k) for k in recipe.BENCHMARK_DEFAULTS} == {
        "penalty_beta": 0.25, "msvr_gamma": 0.2, "msvr_gamma_prime": 0.0, "constraint_batch_size": 8,
        "constraint_indicator_fraction": 0.25, "constraint_proxy_indicator": True, "constraint_margin": 0.02}
    with caplog.at_level("WARNING", logger="llm_non_forgetting"):
        caplog.clear()
        plain = recipe.parse_arguments(base + protected + ["--constraint_penalty", "none"])
        assert plain.data.replay_old == 0.0 and plain.training.constraint_proxy_indicator is False
        assert "replay" not in caplog.text and "proxy" not in caplog.text  # plain SFT: nothing to say
        assert recipe.parse_arguments(base + ["--safety_dataset", setup["safety"]]).data.replay_old == 0.0
        assert "replay off" in caplog.text and "no --protected_datasets" in caplog.text
        caplog.clear()
        assert recipe.parse_arguments(base + protected + ["--replay_old", "0.25"]).data.replay_old == 0.25
        assert "replay" not in caplog.text
        no_certificate = recipe.parse_arguments(base + protected + ["--certify_fraction", "0"])
        assert no_certificate.training.constraint_proxy_indicator is False and no_certificate.data.replay_old == 0.5
        assert "the proxy indicator is off" in caplog.text and "--certify_fraction 0" in caplog.text
        caplog.clear()  # the default beta is the hinge's: kept for the squared hinge, with a warning
        squared = recipe.parse_arguments(base + protected + ["--constraint_penalty", "squared_hinge"]).training
        assert squared.penalty_beta == 0.25
        assert "never run with --constraint_penalty squared_hinge" in caplog.text
        caplog.clear()
        recipe.parse_arguments(base + protected + ["--constraint_penalty", "squared_hinge", "--penalty_beta", "800"])
        assert "squared_hinge" not in caplog.text
        if importlib.util.find_spec("trl") is not None:  # a packed batch is one row: the default replay is off
            caplog.clear()
            assert recipe.parse_arguments(base + protected + ["--packing", "true"]).data.replay_old == 0.0
            assert "replay off" in caplog.text and "--packing" in caplog.text
    with pytest.raises(ValueError, match="--constraint_proxy_indicator follows the certificate's statistic.*pass "
                                         "--constraint_proxy_indicator false"):
        recipe.parse_arguments(base + protected + ["--certify_fraction", "0", "--constraint_proxy_indicator", "true"])


def test_the_defaults_that_follow_other_flags_never_fail_on_a_flag_the_user_did_not_give(setup, tmp_path):
    """The default proxy indicator follows two-split estimation (one split in a config file: no proxy, no error about
    a flag the user never set) and the default margin yields to another margin rule the user gives."""
    recipe = _recipe()
    base = ["--model_name_or_path", setup["gpt2"], "--dataset_name", setup["target"], "--output_dir", str(tmp_path),
            "--bf16", "false", "--protected_datasets", setup["reverse"]]
    config = tmp_path / "one_split.yaml"
    config.write_text("constraint_indicator_fraction: null\n")
    one_split = recipe.parse_arguments(base + ["--config", str(config)]).training
    assert one_split.constraint_indicator_fraction is None and one_split.constraint_proxy_indicator is False
    assert type(one_split.estimate_source()).__name__ == "OneSplit"
    command_line = recipe.parse_arguments(base + ["--constraint_indicator_fraction", "0"]).training  # the same, typed
    assert command_line.constraint_indicator_fraction is None and command_line.constraint_proxy_indicator is False
    for rule, value in (("constraint_confidence", 0.9), ("constraint_certificate_delta", 0.05)):
        args = recipe.parse_arguments(base + [f"--{rule}", str(value)]).training
        assert args.constraint_margin is None and getattr(args, rule) == value
        assert args.constraint_proxy_indicator is True  # the rest of the defaults stand
    with pytest.raises(ValueError, match="at most one of constraint_margin"):  # both given: the user's conflict
        recipe.parse_arguments(base + ["--constraint_confidence", "0.9", "--constraint_margin", "0.02"])


def test_replay_mixes_the_protected_sets_constraint_rows_into_every_batch(setup, tmp_path):
    """``--replay_old`` adds the protected sets' constraint rows (never held-out or certification rows) to the
    objective's batches: the run records it, and its training loss is no longer the new task's alone."""
    recipe = _recipe()
    plain = recipe.main(_flags(setup, tmp_path / "plain", constraint_penalty="none"))
    replayed = recipe.main(_flags(setup, tmp_path / "replay", constraint_penalty="none", replay_old=0.5))
    # the constraints' own rows of each step (12 rows per protected file, 25% held out: 9 each of reverse and copy)
    assert replayed["regulariser"] == {"name": "replay", "ratio": 0.5, "rows": "constraint_rows"}
    # with TRL installed this is ConstrainedSFTTrainer's path (the plain trainer's: test_llm_recipe_flags.py)
    assert replayed["trl"] == (importlib.util.find_spec("trl") is not None)
    assert plain["regulariser"] is None
    card = (tmp_path / "replay" / "README.md").read_text()  # the card says the protected rows were trained on
    assert "replayed as a share 0.5 of the loss" in card
    assert "replayed" not in (tmp_path / "plain" / "README.md").read_text()
    assert replayed["train_metrics"]["train_loss"] != pytest.approx(plain["train_metrics"]["train_loss"], rel=1e-3)
    argv = ["--model_name_or_path", setup["gpt2"], "--dataset_name", setup["target"], "--output_dir", str(tmp_path),
            "--use_cpu", "True", "--report_to", "none"]
    with pytest.raises(ValueError, match=r"--replay_old is the old rows' share of the loss, in \[0, 1\); got 1.0"):
        recipe.main(argv + ["--protected_datasets", setup["reverse"], "--replay_old", "1"])
    with pytest.raises(ValueError, match="--replay_old 0.5 replays the protected sets' rows, but there is no "
                                         "--protected_datasets"):
        recipe.main(argv + ["--safety_dataset", setup["safety"], "--replay_old", "0.5"])
    if importlib.util.find_spec("trl") is not None:  # a packed batch is one row: replay cannot count its rows
        with pytest.raises(ValueError, match="--replay_old counts a batch's rows; it cannot be used with --packing"):
            recipe.main(argv + ["--protected_datasets", setup["reverse"], "--replay_old", "0.5", "--packing", "true"])


def _clopper_pearson_upper(k: int, n: int, delta: float) -> float:
    from scipy.stats import beta

    return 1.0 if k >= n else float(beta.ppf(1 - delta, k + 1, n - k))


@pytest.mark.parametrize("model,extra", [
    ("gpt2", {}),
    ("llama", {"use_peft": True, "lora_r": 2, "lora_target_modules": "q_proj,v_proj"})])
def test_certificate_bounds_the_share_of_each_task_forgotten(setup, tmp_path, model, extra, caplog):
    """The certified value is the share of certification rows the old model (with LoRA: the adapter-disabled base)
    answers exactly and the new one does not, recomputed here from the saved models; its bound is Clopper-Pearson
    at --delta over the split's rows; the verdict follows --forget_tolerance."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_constrained.per_sample_loss import PaddingCollator, causal_lm_per_example_correct

    recipe = _recipe()
    out = tmp_path / "cert"
    argv = _flags(setup, out, model=model, eval_fraction=0.5, certify_fraction=0.5, forget_tolerance=1.0, delta=0.1,
                  max_steps=2, **extra)
    results = recipe.main(argv)
    cert = results["safety_report"]["certificate"]
    assert results["certified"] is True and results["forget_tolerance"] == 1.0  # a share is always <= 1
    assert cert["delta"] == 0.1 and set(cert["bound"].values()) == {"clopper_pearson"}
    config = recipe.parse_arguments(argv)
    tokenizer = AutoTokenizer.from_pretrained(setup[model])
    old = AutoModelForCausalLM.from_pretrained(setup[model]).eval()
    if extra:
        from peft import PeftModel

        new = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(setup[model]), str(out)).eval()
    else:
        new = AutoModelForCausalLM.from_pretrained(out).eval()
    collate = PaddingCollator(tokenizer)
    for name, source in (("reverse", setup["reverse"]), ("copy", setup["copy"])):
        splits = recipe.load_tokenized(source, "train", tokenizer, config, name, None, config.training.seed,
                                       certify=True)
        assert len(splits.certify) == 3 and len(splits.held_out) == 3
        assert not set(map(tuple, splits.certify["input_ids"])) & set(map(tuple, splits.held_out["input_ids"]))
        with torch.no_grad():
            batch = collate([splits.certify[i] for i in range(len(splits.certify))])
            lost = causal_lm_per_example_correct(old, batch) * (1 - causal_lm_per_example_correct(new, batch))
        key = f"non_forgetting/{name}"
        assert cert["num_rows"][key] == 3
        assert cert["values"][0][key] == pytest.approx(float(lost.mean()))
        # at the delta the split's first look spends: 0.9 of --delta 0.1 (the ledger of looks)
        assert results["certified_bounds"][key] == pytest.approx(_clopper_pearson_upper(int(lost.sum()), 3, 0.09))
    # the same run at a tolerance 3 rows cannot support is NOT CERTIFIED, and the card says so
    with caplog.at_level(logging.WARNING, logger="llm_non_forgetting"):
        results = recipe.main(_flags(setup, tmp_path / "strict", model=model, eval_fraction=0.5, max_steps=1,
                                     forget_tolerance=0.05, **extra))
    assert "non_forgetting/copy: 3 certification rows cannot certify --forget_tolerance 0.05" in caplog.text
    assert results["certified"] is False
    assert all(b >= 1 - 0.05 ** (1 / 3) - 1e-9 for b in results["certified_bounds"].values())
    assert "NOT CERTIFIED" in (tmp_path / "strict" / "README.md").read_text().upper()


def test_without_certification_split_the_run_is_not_certified(setup, tmp_path):
    results = _recipe().main(_flags(setup, tmp_path / "none", certify_fraction=0.0, max_steps=1))
    assert results["certification_splits"] == {} and results["certified"] is False
    assert results["safety_report"]["certificate"] is None


def test_lora_llama_saves_the_adapter(setup, tmp_path):
    out = tmp_path / "lora"
    results = _recipe().main(_flags(setup, out, model="llama", use_peft=True, lora_r=2,
                                    lora_target_modules="q_proj,v_proj", max_steps=2))
    assert (out / "adapter_config.json").exists() and not (out / "model.safetensors").exists()
    assert results["train_metrics"]["train_loss"] > 0
    # the adapter moved: the saved weights differ from the base (LoRA B starts at zero)
    from safetensors.torch import load_file

    weights = load_file(out / "adapter_model.safetensors")
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in weights.items())


def test_yaml_config_with_command_line_override(setup, tmp_path):
    recipe = _recipe()
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model_name_or_path": setup["gpt2"], "dataset_name": setup["target"],
                                      "protected_datasets": [setup["reverse"]], "output_dir": str(tmp_path / "o"),
                                      "penalty_beta": 3.0, "constraint_penalty": "squared_hinge",
                                      "max_steps": 7, "msvr_gamma_prime": 0.2}))
    parsed = recipe.parse_arguments(["--config", str(config), "--max_steps", "2"])
    args = parsed.training
    assert parsed.model.model_name_or_path == setup["gpt2"] and parsed.data.protected_datasets == [setup["reverse"]]
    assert args.penalty_beta == 3.0 and args.constraint_penalty == "squared_hinge"
    assert args.msvr_gamma_prime == 0.2
    assert args.max_steps == 2  # the command line overrides the file
    config.write_text(yaml.safe_dump({"model_name_or_path": "x", "dataset_name": "y", "penalty": 3}))
    with pytest.raises(ValueError, match=r"unknown keys \['penalty'\]"):
        recipe.parse_arguments(["--config", str(config), "--output_dir", str(tmp_path)])


def test_bad_input_is_a_clear_error_before_training(setup, tmp_path):
    recipe = _recipe()
    argv = ["--model_name_or_path", setup["gpt2"], "--dataset_name", setup["target"],
            "--output_dir", str(tmp_path), "--use_cpu", "True", "--report_to", "none"]
    with pytest.raises(ValueError, match="no constraint"):
        recipe.main(argv)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        recipe.main(argv + ["--protected_datasets", "./missing.jsonl"])
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "a", "answer": "b"}] * 4)
    with pytest.raises(ValueError, match="cannot tell the text format"):
        recipe.main(argv + ["--protected_datasets", bad])
    for flag, value, message in (("certify_fraction", "1.0", "--certify_fraction must be in"),
                                 ("certify_fraction", "-0.1", "--certify_fraction must be in"),
                                 ("forget_tolerance", "1.5", "--forget_tolerance is a share"),
                                 ("delta", "0", "--delta must be in")):
        with pytest.raises(ValueError, match=message):
            recipe.main(argv + ["--protected_datasets", setup["reverse"], f"--{flag}", value])
    with pytest.raises(ValueError, match="--eval_fraction is 0"):
        recipe.main(argv + ["--protected_datasets", setup["reverse"], "--eval_fraction", "0"])
    with pytest.raises(ValueError, match="two datasets named 'reverse'"):
        recipe.main(argv + ["--protected_datasets", f"reverse={setup['reverse']}", f"reverse={setup['copy']}"])


def test_mistyped_model_path_fails_before_any_model_loads(setup, tmp_path, monkeypatch):
    """A mistyped local --model_name_or_path is an error naming the flag, raised before the
    tokenizer or the model is loaded (as the CLIP recipe does)."""
    from huggingface_hub import constants

    recipe = _recipe()

    class NoLoading:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            raise AssertionError(f"loaded {args} before checking --model_name_or_path")

    monkeypatch.setattr(recipe, "AutoTokenizer", NoLoading)
    monkeypatch.setattr(recipe, "AutoModelForCausalLM", NoLoading)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    argv = _flags(setup, tmp_path / "out")
    for mistyped, error, message in (
            (setup["gpt2"] + "-typo", FileNotFoundError, "the local path does not exist"),
            ("./tiny-gpt2-typo", FileNotFoundError, "the local path does not exist"),
            ("runs/tiny-gpt2-typo", FileNotFoundError, "not in the local Hugging Face cache"),
            ("runs//tiny", ValueError, "neither a local model directory nor a hub id")):
        bad = [mistyped if a == setup["gpt2"] else a for a in argv]
        with pytest.raises(error, match=message) as raised:
            recipe.main(bad)
        assert f"--model_name_or_path={mistyped!r}" in str(raised.value)




@pytest.mark.slow
def test_two_process_run(setup, tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "accelerate.commands.launch",
           "--config_file", str(ROOT / "recipes" / "accelerate_configs" / "multi_gpu.yaml"), "--num_processes", "2",
           "--main_process_port", str(free_port()), str(RECIPE)] + _flags(setup, out, max_steps=2)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"accelerate launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    results = json.loads((out / "llm_results.json").read_text())
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert results["safety_report"] is not None and len(results["safety_report"]["constraints"]) == 3
    assert results["num_processes"] == 2


@pytest.mark.parametrize("use_trl", [True, False])
def test_shipped_yaml_config_uses_only_recipe_flags(use_trl):
    from transformers import HfArgumentParser

    recipe = _recipe()
    parser = HfArgumentParser(recipe._dataclass_types(use_trl))
    flags = {a.dest for a in parser._actions}
    config = yaml.safe_load((ROOT / "recipes" / "configs" / "llm_non_forgetting_lora.yaml").read_text())
    assert config and sorted(set(config) - flags) == []
    # the constrained step it ships is the recipe's default (the benchmark's choice, docs/llm.md), not a drifted copy
    assert {k: config[k] for k in recipe.BENCHMARK_DEFAULTS} == recipe.BENCHMARK_DEFAULTS
    assert config["replay_old"] == recipe.BENCHMARK_REPLAY and config["constraint_penalty"] == "hinge"
    # the values parse with the flags' types (bf16 needs a GPU, so it is left to the run)
    argv = [f"--{k}={v}" for k, v in config.items() if not isinstance(v, list) and k != "bf16"]
    namespace = parser.parse_args(argv + ["--protected_datasets", *config["protected_datasets"],
                                          "--lora_target_modules", *config["lora_target_modules"]])
    assert namespace.lora_r == 16 and namespace.use_peft is True and namespace.lora_target_modules == ["all-linear"]
    assert namespace.dataset_name == "data/new_task.jsonl"
    assert namespace.lora_r == 16 and namespace.relative_tolerance == 0.02 and namespace.max_grad_norm == 0.0
    assert namespace.protected_datasets == ["math=data/math.jsonl", "code=data/code.jsonl"]


@pytest.fixture(scope="module")
def answering_model(setup, tmp_path_factory):
    """A tiny GPT-2 that answers a protected task exactly on every row ("one:<word>=" -> "a"), so that
    forgetting is measurable, and the task's data (40 rows)."""
    import itertools

    import torch
    from datasets import Dataset

    from hf_constrained.per_sample_loss import PaddingCollator, causal_lm_per_example_correct
    from hf_constrained.text_data import tokenize_sft

    base = tmp_path_factory.mktemp("answering")
    tok = char_tokenizer()
    words = ["".join(p) for p in itertools.islice(itertools.permutations("abcdefg", 3), 40)]
    rows = [{"prompt": f"one:{w}=", "completion": "a"} for w in words]
    batch = PaddingCollator(tok)([r for r in tokenize_sft(Dataset.from_list(rows), tok, name="one")])
    torch.manual_seed(0)
    model = tiny_causal_lm(len(tok), "gpt2", hidden_size=32, layers=1, heads=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(60):
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        assert causal_lm_per_example_correct(model.eval(), batch).all()
    model.save_pretrained(base / "old")
    tok.save_pretrained(base / "old")
    return str(base / "old"), _write_jsonl(base / "one.jsonl", rows)


@pytest.mark.parametrize("lora", [False, True])
def test_forgetting_every_answer_is_not_certified_and_keeping_them_is(setup, answering_model, tmp_path, lora,
                                                                       monkeypatch):
    """The old model answers all 10 certification rows: fine-tuning that forgets most of them has a large
    forgotten share (NOT CERTIFIED at 0.35); a run that leaves the weights as they are (learning rate 0) forgets
    none (bound 1 - 0.045^(1/10) = 0.27 at the first look's delta, 0.9 of 0.05, CERTIFIED at 0.35). With LoRA the base
    is the old model. The two runs are separate scenarios: each counts its looks in a ledger of its own."""
    old, data = answering_model
    recipe = _recipe()

    def run(name, lr):
        monkeypatch.setenv("HF_CONSTRAINED_LEDGER", str(tmp_path / f"{name}-ledger.json"))
        argv = ["--model_name_or_path", old, "--dataset_name", setup["target"], "--protected_datasets", data,
                "--output_dir", str(tmp_path / name), "--max_steps", "6", "--learning_rate", str(lr),
                "--constraint_penalty", "none", "--eval_fraction", "0.5", "--forget_tolerance", "0.35",
                "--use_cpu", "True", "--report_to", "none", "--save_strategy", "no",
                "--per_device_train_batch_size", "4", "--disable_tqdm", "True", "--seed", "0"]
        if lora:
            argv += ["--use_peft", "--lora_r", "2", "--lora_target_modules", "c_attn"]
        return recipe.main(argv)

    forgot = run("forgot", 5e-2)
    cert = forgot["safety_report"]["certificate"]
    assert cert["num_rows"] == {"non_forgetting/one": 10}
    forgotten = round(cert["values"][0]["non_forgetting/one"] * 10)
    assert forgotten >= 5  # most answers forgotten (all of them without LoRA)
    expected = _clopper_pearson_upper(forgotten, 10, 0.045)
    assert forgot["certified_bounds"]["non_forgetting/one"] == pytest.approx(expected)
    assert forgot["certified"] is False
    kept = run("kept", 0.0)
    assert kept["safety_report"]["certificate"]["values"][0]["non_forgetting/one"] == 0.0
    assert kept["certified_bounds"]["non_forgetting/one"] == pytest.approx(1 - 0.045 ** (1 / 10))
    assert kept["certified"] is True and kept["safe"] is True


def test_protected_rows_kept_old_correct_reads_only_the_rows_the_old_model_answers(setup, answering_model, tmp_path,
                                                                                      monkeypatch):
    """``--protected_rows_kept old_correct``: the old model answers every row of "one", so its constraint keeps all
    of its training rows; it answers none of "reverse", which is an error naming that set before training."""
    old, data = answering_model
    recipe = _recipe()
    monkeypatch.setenv("HF_CONSTRAINED_LEDGER", str(tmp_path / "ledger.json"))
    argv = ["--model_name_or_path", old, "--dataset_name", setup["target"], "--max_steps", "1",
            "--eval_fraction", "0.5", "--forget_tolerance", "0.35", "--use_cpu", "True", "--report_to", "none",
            "--save_strategy", "no", "--per_device_train_batch_size", "4", "--disable_tqdm", "True",
            "--protected_rows_kept", "old_correct"]
    seen = []
    real = recipe.non_forgetting_constraints

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.extend((c.name, len(c.dataset), kwargs["config"].rows_kept) for c in out)
        return out

    monkeypatch.setattr(recipe, "non_forgetting_constraints", spy)
    recipe.main(argv + ["--output_dir", str(tmp_path / "one"), "--protected_datasets", f"one={data}"])
    assert seen == [("non_forgetting/one", 20, "old_correct")]  # the 20 training rows of 40 (eval_fraction 0.5)
    with pytest.raises(ValueError, match="protected task 'reverse'.*answers none of its"):
        recipe.main(argv + ["--output_dir", str(tmp_path / "two"), "--protected_datasets", f"one={data}",
                            f"reverse={setup['reverse']}"])


def test_push_comes_last_and_a_refusal_keeps_every_local_file(setup, tmp_path, monkeypatch):
    """--push_to_hub on a run that is not certified: results, report, card and trainer state are all
    written, nothing is uploaded, and the command's status is 1; --allow_unsafe_push uploads, status 0."""
    import transformers.trainer as hf_trainer

    from hf_constrained.cli import main as cli_main

    hub = UploadRecorder()
    monkeypatch.setattr(hf_trainer, "hf_api", lambda: hub)
    out = tmp_path / "refused"
    status = cli_main(["llm", *_flags(setup, out, push_to_hub=True, hub_model_id="user/model")])
    assert status == 1 and hub.calls == []
    for name in ("llm_results.json", "safety_report.json", "README.md", "trainer_state.json", "model.safetensors"):
        assert (out / name).exists(), name
    assert json.loads((out / "llm_results.json").read_text())["certified"] is False
    out = tmp_path / "override"
    status = cli_main(["llm", *_flags(setup, out, push_to_hub=True, hub_model_id="user/model",
                                      allow_unsafe_push=True)])
    assert status == 0 and ("upload_folder", "user/model") in hub.calls
    assert "UNSAFE" in (out / "README.md").read_text() or "NOT CERTIFIED" in (out / "README.md").read_text()


def test_a_missing_logger_package_fails_before_any_model_loads(setup, tmp_path, monkeypatch):
    """The shipped LoRA config reports to TensorBoard: without the package the error names the flag
    before the model loads (the Trainer would fail only when it is built)."""
    import importlib.util as util

    recipe = _recipe()

    class NoLoading:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            raise AssertionError("loaded a model before checking --report_to")

    real = util.find_spec
    monkeypatch.setattr(util, "find_spec", lambda name, *a: None if name.startswith("tensorboard") else real(name, *a))
    monkeypatch.setattr(recipe, "AutoTokenizer", NoLoading)
    monkeypatch.setattr(recipe, "AutoModelForCausalLM", NoLoading)
    with pytest.raises(ValueError, match="--report_to tensorboard: the tensorboard package is not installed"):
        recipe.main([*_flags(setup, tmp_path / "out"), "--report_to", "tensorboard"])

