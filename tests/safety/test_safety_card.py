"""Hub-native model cards: metadata read back with huggingface_hub, model-index with the
held-out constraint values, library_name / base_model for transformers, custom and peft
models, a usage snippet that loads the model, create_model_card / push_to_hub arguments,
relative paths only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard, metadata_load
from huggingface_hub.repocard_data import model_index_to_eval_results
from safety_tiny import make_trainer
from test_safety_gate import hub  # noqa: F401 (fixture)

from hf_constrained.publishing.card import PAPER_URL, ModelCardInfo, describe_model, render_model_card, usage_snippet
from hf_constrained.publishing.report import ConstraintResult, SafetyReport, objective_metrics_from
from hf_constrained.safety.finish import finish_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("card") / "run"
    trainer = make_trainer(str(out), tolerance=2.0, max_steps=4)  # selection keeps checkpoint-2
    trainer.train()
    report = finish_run(trainer, old_model_values={"theta_cap": 0.5, "scaled_theta": 0.5},
                        base_model_name="org/theta-base", datasets=["org/theta-data"], plots=False)
    return trainer, report, out


def test_card_metadata_validates_and_has_no_invented_model_index(run):
    """No Hub task is named and the only objective metric is a loss: no model-index at all, rather
    than one with invented task, dataset or metric types."""
    trainer, report, out = run
    card = ModelCard.load(out / "README.md")  # parses the metadata into ModelCardData (raises if invalid)
    assert card.data.library_name == "transformers" and card.data.base_model == "org/theta-base"
    assert card.data.datasets == ["org/theta-data"]
    assert "model-index" not in metadata_load(out / "README.md")
    assert "eval_loss" in report.objective_metrics


@pytest.mark.parametrize("info, expected", [
    (dict(task="tabular-regression", datasets=["org/digits-data"]), {"accuracy": "test", "roc_auc": "validation"}),
    (dict(task="tabular-regression", eval_dataset="digits"), None),  # a short name is no Hub dataset
    (dict(datasets=["org/digits-data"]), None),  # no task
    (dict(task="my-own-task", datasets=["org/digits-data"]), None),  # not a Hub task
])
def test_model_index_carries_real_hub_types_or_nothing(info, expected):
    report = SafetyReport([ConstraintResult("a", 0.1, 0.2)],
                          objective_metrics={"eval_loss": 1.0, "eval_auc": 0.7, "test_accuracy": 0.75,
                                             "eval_accuracy/cat": 0.5})
    card = render_model_card(report, model_name="m", info=ModelCardInfo(**info))
    data = card.data.to_dict()
    if expected is None:
        assert "model-index" not in data and not card.data.eval_results
        return
    name, results = model_index_to_eval_results(data["model-index"])
    assert {r.metric_type: r.dataset_split for r in results} == expected
    assert {(r.task_type, r.dataset_type) for r in results} == {("tabular-regression", "org/digits-data")}
    assert all(r.verified is False for r in results)
    by_type = {r.metric_type: r.metric_value for r in results}
    assert by_type == {"accuracy": 0.75, "roc_auc": 0.7}


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
    assert "my-tag" in data["tags"] and data["pipeline_tag"] == "image-classification"
    assert "model-index" not in data  # its only objective metric is a loss: no Hub metric type
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


@pytest.mark.parametrize("loader, name", [("AutoTokenizer", "tokenizer"), ("CLIPTokenizerFast", "tokenizer"),
                                          ("AutoProcessor", "processor"), ("CLIPProcessor", "processor")])
def test_the_usage_snippet_names_a_tokenizer_tokenizer(loader, name):
    """The demo's card said ``processor = AutoTokenizer.from_pretrained(...)``: a tokenizer is ``tokenizer``."""
    from hf_constrained.publishing.card import ModelSource

    snippet = usage_snippet(ModelSource("transformers", "CLIPModel", processor_class=loader), "owner/name")
    assert f"\n{name} = {loader}.from_pretrained(repo_id)" in snippet
    compile(snippet, "<card>", "exec")  # Python as written
