"""LoRA through peft (issue 6, item 4): a ``PeftModel`` trains under constraints.

Asserted: the base weights do not change and the adapters do; the constraint functions
run through the adapted model (the penalty moves the adapters); checkpoints hold the
adapters only (plus the constraint state); resuming from a checkpoint gives bitwise the
same adapters and estimators as training straight through.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from scale_tiny import StopAt, TinyClassifier, make_trainer, snapshot

from hf_constrained.trainer import CONSTRAINT_STATE_NAME

STEPS = 8


def _lora_model() -> PeftModel:
    torch.manual_seed(1234)
    base = TinyClassifier()
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["fc1", "fc2"], lora_dropout=0.0,
                                           init_lora_weights="gaussian"))


def _base_weights(model: PeftModel) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def _adapters(model: PeftModel) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_straight")
    model = _lora_model()
    base0, lora0 = _base_weights(model), _adapters(model)
    trainer = make_trainer(str(out), model=model, max_steps=STEPS, save_strategy="steps", save_steps=4)
    trainer.train()
    return out, trainer, base0, lora0


def test_lora_trains_adapters_only(straight_run):
    _, trainer, base0, lora0 = straight_run
    model = trainer.model
    assert isinstance(model, PeftModel)
    assert lora0 and all(n in dict(model.named_parameters()) for n in lora0)
    for n, p in _base_weights(model).items():
        assert torch.equal(p, base0[n]), f"base weight {n} changed"
    changed = [n for n, p in _adapters(model).items() if not torch.equal(p, lora0[n])]
    assert len(changed) == len(lora0), f"adapters that did not move: {sorted(set(lora0) - set(changed))}"
    assert bool(trainer.engine.estimator.visited.all())


def test_lora_penalty_moves_the_adapters(straight_run, tmp_path):
    _, trainer, _, _ = straight_run
    unconstrained = make_trainer(str(tmp_path), model=_lora_model(), max_steps=STEPS, constraint_penalty="none")
    unconstrained.train()
    gap = max((p - _adapters(trainer.model)[n]).abs().max().item() for n, p in _adapters(unconstrained.model).items())
    assert gap > 1e-3, gap


def test_lora_checkpoint_holds_adapters_only(straight_run):
    out, trainer, _, _ = straight_run
    ckpt = out / "checkpoint-4"
    files = {p.name for p in ckpt.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", CONSTRAINT_STATE_NAME} <= files
    assert not any(f.startswith(("model.safetensors", "pytorch_model")) for f in files), files
    saved = load_file(str(ckpt / "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved), sorted(saved)
    n_adapter = sum(p.numel() for n, p in trainer.model.named_parameters() if "lora_" in n)
    assert sum(t.numel() for t in saved.values()) == n_adapter


def test_lora_resume_is_exact(straight_run, tmp_path):
    out, trainer, _, _ = straight_run
    ref = snapshot(trainer)
    stopped = make_trainer(str(tmp_path / "stopped"), model=_lora_model(), max_steps=STEPS,
                           save_strategy="steps", save_steps=4)
    stopped.add_callback(StopAt(4))
    stopped.train()
    assert stopped.state.global_step == 4
    resumed = make_trainer(str(tmp_path / "resumed"), model=_lora_model(), max_steps=STEPS,
                           save_strategy="steps", save_steps=4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "stopped" / "checkpoint-4"))
    got = snapshot(resumed)
    assert got["global_step"] == STEPS
    for n, p in ref["params"].items():
        assert torch.equal(got["params"][n], p), n
    assert torch.equal(got["estimator_values"], ref["estimator_values"])
    assert torch.equal(got["estimator_visited"], ref["estimator_visited"])
    assert got["streams"] == ref["streams"]
