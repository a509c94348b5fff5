"""Hub-native model cards: metadata read back with huggingface_hub, model-index with the
held-out constraint values, library_name / base_model for transformers, custom and peft
models, a usage snippet that loads the model, create_model_card / push_to_hub arguments,
relative paths only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard, metadata_load
from huggingface_hub.repocard_data import model_index_to_eval_results
from safety_tiny import ThetaConfig, ThetaModel, make_trainer
from test_safety_gate import hub  # noqa: F401 (fixture)

from hf_constrained.safety.card import (CONSTRAINT_METRIC_TYPE, PAPER_URL, ModelCardInfo, describe_model,
                                        metric_id, render_model_card, usage_snippet)
from hf_constrained.safety.finish import finish_run
from hf_constrained.safety.report import ConstraintResult, SafetyReport, objective_metrics_from


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("card") / "run"
    trainer = make_trainer(str(out), tolerance=2.0, max_steps=4)  # selection keeps checkpoint-2
    trainer.train()
    report = finish_run(trainer, old_model_values={"theta_cap": 0.5, "scaled_theta": 0.5},
                        base_model_name="org/theta-base", datasets=["org/theta-data"], plots=False)
    return trainer, report, out


def test_card_metadata_validates_and_holds_every_constraint_value(run):
    trainer, report, out = run
    card = ModelCard.load(out / "README.md")  # parses the metadata into ModelCardData (raises if invalid)
    assert card.data.library_name == "transformers" and card.data.base_model == "org/theta-base"
    assert card.data.datasets == ["org/theta-data"]
    name, results = model_index_to_eval_results(metadata_load(out / "README.md")["model-index"])
    assert name == "run"
    constraint_results = {r.dataset_config: r for r in results if r.metric_type == CONSTRAINT_METRIC_TYPE}
    assert list(constraint_results) == [c.name for c in report.constraints]
    for c in report.constraints:
        result = constraint_results[c.name]
        assert result.metric_value == pytest.approx(c.value)
        assert result.metric_args["tolerance"] == c.tolerance and result.metric_args["verdict"] == c.verdict
        assert result.metric_args["old_model_value"] == 0.5 and result.verified is False
    objective = {r.metric_type: r.metric_value for r in results if r.metric_type != CONSTRAINT_METRIC_TYPE}
    assert objective == pytest.approx({metric_id(k): v for k, v in report.objective_metrics.items()})
    assert {r.dataset_split for r in results if r.metric_type != CONSTRAINT_METRIC_TYPE} == {"validation"}
    assert "loss" in objective
    # each constraint in a result of its own
    assert len({(r.dataset_config, r.dataset_split) for r in results}) == len(report.constraints) + 1


def test_card_has_usage_versions_paper_and_no_local_paths(run):
    trainer, report, out = run
    text = (out / "README.md").read_text()
    assert "from safety_tiny import ThetaModel" in text and "defined in `safety_tiny`" in text
    assert PAPER_URL in text and "Single-loop Algorithms for Stochastic Non-Convex Optimization" in text
    assert "- transformers " in text and "- torch " in text and "- hf_constrained " in text
    for directory in (str(out), os.path.abspath(str(out)), os.getcwd()):
        assert directory not in text
    assert "checkpoint-2" in text and report.checkpoint == "checkpoint-2"
    assert str(out) not in (out / "safety_report.json").read_text()


def test_usage_snippet_loads_the_saved_model(run):
    trainer, _, out = run
    trainer.save_model()  # the selected weights, next to the card
    source = describe_model(trainer.model)
    namespace: dict = {}
    exec(usage_snippet(source, str(out)), namespace)  # noqa: S102 (the card's own snippet)
    assert torch.equal(namespace["model"].theta, trainer.model.theta.detach())


def test_objective_metrics_are_held_out_only(run):
    _, report, out = run
    assert objective_metrics_from({"eval_auc": 0.9, "train_auc": 0.95, "train_loss": 1.0, "loss": 2.0,
                                   "learning_rate": 0.1, "eval_runtime": 1.0, "test_f1": 0.5}) == {
        "eval_auc": 0.9, "test_f1": 0.5}
    text = (out / "README.md").read_text()
    section = text.split("## Objective metrics (held-out)")[1].split("##")[0]
    assert "eval_loss" in section and "train_" not in section


def test_create_model_card_and_push_to_hub_arguments_are_honoured(tmp_path, hub):  # noqa: F811 (fixture)
    out = tmp_path / "run"
    trainer = make_trainer(str(out), tolerance=2.0, max_steps=2, eval_strategy="no", save_strategy="no",
                           load_best_model_at_end=False, metric_for_best_model=None)
    trainer.train()
    finish_run(trainer, base_model_name="org/theta-base", plots=False)
    trainer.create_model_card(license="mit", language="en", finetuned_from="org/other-base",
                              dataset=["org/ds1"], tags="my-tag", tasks="image-classification",
                              model_name="theta-model")
    data = metadata_load(out / "README.md")
    assert (data["license"], data["language"], data["base_model"], data["datasets"]) == (
        "mit", "en", "org/other-base", ["org/ds1"])
    assert "my-tag" in data["tags"] and data["model-index"][0]["name"] == "theta-model"
    assert {r["task"]["type"] for r in data["model-index"][0]["results"]} == {"image-classification"}
    assert "# theta-model" in (out / "README.md").read_text()
    trainer.push_to_hub(license="apache-2.0", dataset="org/ds2", language="fr")
    uploaded = hub.cards[-1]
    assert "license: apache-2.0" in uploaded and "- org/ds2" in uploaded and "language: fr" in uploaded


def _tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=32))


def test_transformers_model_card_and_snippet(tmp_path):
    model = _tiny_bert()
    model.save_pretrained(tmp_path / "bert")
    source = describe_model(model)
    assert (source.library_name, source.class_name, source.module) == (
        "transformers", "BertForSequenceClassification", None)
    namespace: dict = {}
    exec(usage_snippet(source, str(tmp_path / "bert")), namespace)  # noqa: S102
    assert type(namespace["model"]).__name__ == "BertForSequenceClassification"


def test_peft_adapter_card(tmp_path):
    from peft import LoraConfig, get_peft_model

    base = _tiny_bert()
    base.save_pretrained(tmp_path / "base")
    base = type(base).from_pretrained(tmp_path / "base")
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["query", "value"]))
    source = describe_model(model)
    assert source.library_name == "peft" and source.adapter_base_model == str(tmp_path / "base")
    model.save_pretrained(tmp_path / "adapter")
    namespace: dict = {}
    exec(usage_snippet(source, str(tmp_path / "adapter")), namespace)  # noqa: S102
    assert type(namespace["model"]).__name__.startswith("PeftModel")
    report = SafetyReport([ConstraintResult("a", 0.1, 0.2)])
    card = str(render_model_card(report, model_name="m", source=source))
    data = ModelCard(card).data
    # a local base model is not a Hub id: named in the text, not in the metadata
    assert data.library_name == "peft" and data.base_model is None and str(tmp_path) not in card
    source.adapter_base_model = "org/tiny-bert"
    data = ModelCard(str(render_model_card(report, model_name="m", source=source))).data
    assert data.library_name == "peft" and data.base_model == "org/tiny-bert"


def test_info_overrides_do_not_leak_between_cards():
    info = ModelCardInfo(base_model="org/a", tags=["t"])
    other = info.with_trainer_card_arguments(finetuned_from="org/b", tags=["u"], dataset="org/d")
    assert (other.base_model, other.tags, other.datasets) == ("org/b", ["t", "u"], ["org/d"])
    assert (info.base_model, info.tags, info.datasets) == ("org/a", ["t"], [])


def test_training_metrics_passed_explicitly_are_not_held_out(tmp_path, caplog):
    trainer = make_trainer(str(tmp_path / "run"), max_steps=1, eval_strategy="no", save_strategy="no",
                           load_best_model_at_end=False, metric_for_best_model=None)
    trainer.train()
    report = finish_run(trainer, plots=False, objective_metrics={"train_auc": 0.9, "test_auc": 0.8})
    assert report.objective_metrics == {"test_auc": 0.8}
    assert "train_auc measured on training data" in caplog.text


def test_a_recipe_run_as_a_script_is_named_by_its_installed_module(monkeypatch):
    """``python recipes/safe_release_digits.py`` defines its model in ``__main__``: the card's
    snippet imports it from ``hf_constrained.recipes``, which exists after ``pip install``; any
    other script is named by its file."""
    import importlib
    import sys
    import types

    main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    model_class = type("DigitMLP", (torch.nn.Module,), {"__module__": "__main__"})
    main.__file__ = str(Path(__file__).resolve().parents[2] / "recipes" / "safe_release_digits.py")
    source = describe_model(model_class())
    assert source.module == "hf_constrained.recipes.safe_release_digits"
    assert hasattr(importlib.import_module(source.module), "DigitMLP")
    main.__file__ = "/somewhere/my_training.py"
    assert describe_model(model_class()).module == "my_training"


def _card_snippet(card: str) -> str:
    """The Python block under "How to use" in a rendered card."""
    return card.split("## How to use")[1].split("```python\n")[1].split("```")[0]


def _transformers_model(folder: Path):
    model = _tiny_bert()
    model.save_pretrained(folder)
    return model


def _lora(base, folder: Path, **lora):
    """``base`` saved and reloaded (the adapter records the folder as its base), with LoRA weights
    set to random values (a loader that drops the adapters would then differ)."""
    from peft import LoraConfig, get_peft_model

    base.save_pretrained(folder / "base")
    base = type(base).from_pretrained(folder / "base")
    model = get_peft_model(base, LoraConfig(r=2, **lora))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p))
    model.save_pretrained(folder / "model")
    return model


def _causal_lm_adapter(folder: Path):
    from hf_constrained.recipes.tiny_lm import tiny_causal_lm

    base = tiny_causal_lm(20, "gpt2", hidden_size=16, layers=1, heads=2)
    return _lora(base, folder, task_type="CAUSAL_LM", target_modules=["c_attn"], fan_in_fan_out=True)


def _clip_adapter(folder: Path):
    from hf_constrained.clip.tiny import tiny_clip

    base = tiny_clip(20, hidden_size=16, layers=1, heads=2, projection_dim=8)
    return _lora(base, folder, target_modules=["q_proj", "v_proj"])


def _custom_module(folder: Path):
    """The safe-release recipe's model, saved as its ``Trainer`` saves a plain ``nn.Module``."""
    from safetensors.torch import save_file

    from hf_constrained.recipes.safe_release_digits import DigitMLP

    torch.manual_seed(0)
    model = DigitMLP()
    folder.mkdir()
    save_file(model.state_dict(), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return model


@pytest.mark.parametrize("make", [_transformers_model, _causal_lm_adapter, _clip_adapter, _custom_module],
                         ids=["transformers", "causal_lm_lora", "clip_lora", "custom_module"])
def test_card_usage_snippet_runs_as_written(tmp_path, monkeypatch, make):
    """The card's snippet, with its repo id pointed at the saved folder, loads the saved weights."""
    import huggingface_hub

    model = make(tmp_path / "model") if make in (_transformers_model, _custom_module) else make(tmp_path)
    folder = tmp_path / "model"
    repo_id = "org/published-model"
    card = str(render_model_card(SafetyReport([ConstraintResult("a", 0.1, 0.2)]), model_name="m",
                                 source=describe_model(model), repo_id=repo_id))
    snippet = _card_snippet(card)
    assert repo_id in snippet and str(tmp_path) not in card

    def hf_hub_download(repo, filename, **_):  # the Hub, served from the saved folder
        assert repo == str(folder)
        return str(folder / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    namespace: dict = {}
    exec(snippet.replace(repo_id, str(folder)), namespace)  # noqa: S102 (the card's own snippet)
    loaded, saved = namespace["model"].state_dict(), model.state_dict()
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key


SNAKE = r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$"


@pytest.mark.parametrize("given", [dict(eval_dataset="digits"), dict(datasets=["org/digits-data"]), {}])
def test_model_index_follows_the_hub_spec(tmp_path, given):
    """dataset.type names the data (never a split), the split is in dataset.split, metric types are
    lower_snake_case ids, the certificate's bound is on the certification split with delta/n/tolerance."""
    import re

    from test_certificate_gate import make

    from hf_constrained.safety.card import CERTIFIED_METRIC_TYPE, UNNAMED_DATASET

    trainer = make(tmp_path)
    report = finish_run(trainer, plots=False, objective_metrics={"eval_loss": 1.0, "eval_AUC score": 0.5,
                                                                                "test_accuracy": 0.75}, **given)
    path = tmp_path / "run" / "README.md"
    ModelCard.load(path)  # validates the metadata
    name, results = model_index_to_eval_results(metadata_load(path)["model-index"])
    expected_type = {"eval_dataset": "digits", "datasets": "org/digits-data"}.get(next(iter(given), ""),
                                                                                  UNNAMED_DATASET)
    assert {r.dataset_type for r in results} == {expected_type}
    assert all(r.verified is False and re.match(SNAKE, r.metric_type) for r in results)
    assert {r.metric_type for r in results} == {CONSTRAINT_METRIC_TYPE, CERTIFIED_METRIC_TYPE, "loss", "auc_score",
                                                "accuracy"}
    by_type = {r.metric_type: r for r in results}
    value, bound = by_type[CONSTRAINT_METRIC_TYPE], by_type[CERTIFIED_METRIC_TYPE]
    assert (value.dataset_split, value.dataset_config) == ("validation", "rate")
    assert bound.dataset_split == "certification" and bound.dataset_config == "rate"
    assert bound.metric_value == pytest.approx(report.certified_bounds()["rate"])
    assert bound.metric_args["delta"] == 0.05 and bound.metric_args["n"] == 300
    assert bound.metric_args["tolerance"] == 0.2 and bound.metric_args["certified"] is True
    assert by_type["auc_score"].metric_name == "AUC score (validation)"
    assert by_type["loss"].dataset_split == "validation"
    assert by_type["accuracy"].dataset_split == "test" and by_type["accuracy"].metric_value == 0.75
    assert not any("held-out" in (r.dataset_type, r.dataset_split) for r in results)


@pytest.mark.slow
def test_safe_release_card_names_its_data_in_the_model_index(tmp_path):
    """The recipes pass their data's name: the safe-release card's results are on ``digits``."""
    from hf_constrained.cli import main

    out = tmp_path / "release"
    assert main(["safe-release", "--max_steps", "4", "--output_dir", str(out)]) == 0
    name, results = model_index_to_eval_results(metadata_load(out / "README.md")["model-index"])
    assert {r.dataset_type for r in results} == {"digits"}
    assert {r.dataset_split for r in results} == {"validation", "certification"}
