"""Constraints with TRL's SFTTrainer (hf_constrained.integrations.trl): the composed config,
the method resolution order (SFT objective + penalty in one loss), TRL's packing and chat
templates on the objective, and no TRL import without the extra."""

import copy
import importlib
import os
import re
import sys

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_constrained import ConstrainedTrainingArguments
from hf_constrained.non_forgetting import (
    NonForgettingConfig,
    PaddingCollator,
    causal_lm_per_example_loss,
    non_forgetting_constraints,
)
from hf_constrained.recipes.tiny_lm import char_tokenizer, tiny_causal_lm
from hf_constrained.text_data import tokenize_sft
from hf_constrained.trainer_internals import trainer_prepare_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORDS = ["abc", "hello", "xyz", "qrs", "mnop", "dog", "cat", "tree", "sun", "moon", "star", "leaf", "sky", "sea"]


def test_no_trl_import_without_the_extra(monkeypatch):
    """Only hf_constrained/integrations/trl.py imports TRL, and without TRL it says how to install it."""
    importers = []
    for folder, _, files in os.walk(os.path.join(ROOT, "hf_constrained")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    if re.search(r"^\s*(from trl\b|import trl\b)", f.read(), re.MULTILINE):
                        importers.append(os.path.relpath(path, ROOT))
    assert importers == [os.path.join("hf_constrained", "integrations", "trl.py")]
    monkeypatch.setitem(sys.modules, "trl", None)  # TRL absent
    monkeypatch.delitem(sys.modules, "hf_constrained.integrations.trl", raising=False)
    with pytest.raises(ImportError, match=re.escape("pip install 'hf_constrained[trl]'")):
        importlib.import_module("hf_constrained.integrations.trl")


trl = pytest.importorskip("trl", reason="TRL is not installed: pip install 'hf_constrained[trl]' (or the dev extra)")
from hf_constrained.integrations.trl import ConstrainedSFTConfig, ConstrainedSFTTrainer  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    tok = char_tokenizer()
    tiny_causal_lm(len(tok), "gpt2", hidden_size=32, layers=1, heads=2).save_pretrained(path)
    tok.save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    # the objective in TRL's conversational format (rendered with the chat template by TRL)
    target = Dataset.from_dict({"messages": [[{"role": "user", "content": f"sort {w}"},
                                              {"role": "assistant", "content": "".join(sorted(w))}] for w in WORDS]})
    protected = tokenize_sft(Dataset.from_dict({"prompt": [f"rev:{w}=" for w in WORDS[:6]],
                                                "completion": [w[::-1] for w in WORDS[:6]]}), tokenizer)
    return str(path), tokenizer, model, target, protected


def _config(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
                use_cpu=True, bf16=False, gradient_checkpointing=False, report_to=[], save_strategy="no",
                logging_steps=1, disable_tqdm=True, constraint_batch_size=6, max_length=32, seed=0)
    base.update(kw)
    return ConstrainedSFTConfig(**base)


def test_config_combines_sft_config_and_constraint_fields(tmp_path):
    config = ConstrainedSFTConfig(output_dir=str(tmp_path), use_cpu=True, packing=True, penalty_beta=3.0,
                                  constraint_penalty="squared_hinge")
    assert isinstance(config, trl.SFTConfig) and isinstance(config, ConstrainedTrainingArguments)
    assert config.packing and config.penalty_beta == 3.0 and config.constraint_penalty == "squared_hinge"
    assert config.learning_rate == trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True).learning_rate  # TRL's default
    assert config.msvr_gamma == 0.8 and config.msvr_gamma_prime == 0.1  # the paper's
    with pytest.raises(ValueError, match="penalty_beta"):
        ConstrainedSFTConfig(output_dir=str(tmp_path), use_cpu=True, penalty_beta=-1.0)
    mro = ConstrainedSFTTrainer.__mro__
    assert mro.index(trl.SFTTrainer) < mro.index(mro[-2])  # SFTTrainer before Trainer
    assert mro[1].__name__ == "ConstrainedTrainer"


def test_plain_sft_config_is_refused(setup, tmp_path):
    path, tokenizer, model, target, protected = setup
    with pytest.raises(TypeError, match="ConstrainedSFTConfig"):
        ConstrainedSFTTrainer(model=model, args=trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False),
                              train_dataset=target, processing_class=tokenizer)


def test_loss_is_the_sft_objective_plus_the_hinge_penalty(setup, tmp_path):
    path, tokenizer, model, target, protected = setup
    old = copy.deepcopy(model)
    (c,) = non_forgetting_constraints(old, causal_lm_per_example_loss, {"reverse": protected},
                                      PaddingCollator(tokenizer),
                                      config=NonForgettingConfig(tolerance=-5.0))  # always violated: weight beta
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    beta = 7.0
    trainer = ConstrainedSFTTrainer(model=new, args=_config(tmp_path, penalty_beta=beta, msvr_gamma_prime=0.0),
                                    train_dataset=target, processing_class=tokenizer, constraints=[c])
    batch = trainer_prepare_inputs(trainer, next(iter(trainer.get_train_dataloader())))
    new.eval()  # no dropout: the three forward passes below must see the same function
    sft = trl.SFTTrainer.compute_loss(trainer, new, dict(batch)).detach()
    # the constraint batch is the whole protected set (6 rows), so h(w; B) is its exact value
    h = c.fn(new, trainer.batches.constraint_rows(c, list(range(len(c.dataset))))).detach()
    trainer.in_training_step, trainer.current_gradient_accumulation_steps = True, 1  # as inside train()
    try:
        total = trainer.compute_loss(new, dict(batch))
    finally:
        trainer.in_training_step = False
    assert total.requires_grad and abs(float(h)) > 1e-3
    torch.testing.assert_close(total.detach(), sft + beta * h, rtol=1e-5, atol=1e-5)


def test_training_with_packing_and_chat_template_keeps_trl_features(setup, tmp_path):
    from hf_constrained import finish_run

    path, tokenizer, model, target, protected = setup
    split = protected.train_test_split(test_size=2, seed=0)
    constraints = non_forgetting_constraints(model, causal_lm_per_example_loss, {"reverse": split["train"]},
                                             PaddingCollator(tokenizer), eval_datasets={"reverse": split["test"]},
                                             config=NonForgettingConfig(tolerance=0.01))
    trainer = ConstrainedSFTTrainer(model=copy.deepcopy(model), args=_config(tmp_path, packing=True, max_length=64,
                                                                constraint_batch_size=2),
                                    train_dataset=target, processing_class=tokenizer, constraints=constraints)
    # TRL rendered the chat template and packed the rows into fewer, longer sequences
    assert len(trainer.train_dataset) < len(target)
    first = tokenizer.decode(trainer.train_dataset[0]["input_ids"])
    assert "u:sort " in first and "|a:" in first
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert logs and all("mean_token_accuracy" in e for e in logs)  # TRL's compute_loss and log ran
    assert all("constraint/penalty_loss" in e for e in logs)  # and so did the constrained step
    assert bool(trainer.engine.estimator.visited.all())
    report = finish_run(trainer, old_model_values={"non_forgetting/reverse": 0.0}, plots=False)
    assert [r.name for r in report.constraints] == ["non_forgetting/reverse"]
    assert (tmp_path / "safety_report.json").exists()
    assert "non_forgetting/reverse" in (tmp_path / "README.md").read_text()
