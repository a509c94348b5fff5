"""The CLIP non-forgetting path with ``share_objective_call``: the contrastive objective and the
zero-shot constraint rows in ONE ``model(...)`` call give the same run as separate calls.

CLIP's losses are computed in fp32 by design (``clip_embeddings`` casts the embeddings), so the
comparison is at fp32 round-off; the generic float64 comparison is ``tests/test_shared_call.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import TrainerCallback

from clip_synthetic import tiny_contrastive_setup
from hf_constrained import ConstrainedTrainingArguments
from hf_constrained.clip.contrastive import ContrastiveConstrainedTrainer, _stack_texts
from hf_constrained.clip.data import CLIPCollator, RowDataset
from hf_constrained.clip.encode import clip_embeddings
from hf_constrained.clip.non_forgetting import ZeroShotLoss, non_forgetting_constraints


class CountCalls(TrainerCallback):
    def __init__(self, model):
        self.calls = []
        self.handle = model.register_forward_pre_hook(lambda mod, args, kw: self.calls.append(torch.is_grad_enabled()),
                                                      with_kwargs=True)

    def on_train_begin(self, args, state, control, **kwargs):
        self.calls.clear()


@pytest.fixture(scope="module")
def tiny():
    return tiny_contrastive_setup(24)


def _run(tiny, tmp_path, name, **kw):
    tok, model, data = tiny
    model = copy.deepcopy(model)
    # prompts of two lengths: the shared call pads captions and prompts to one length
    prompts = tok(["a photo of a cat", "a dog", "a photo of a car"], padding=True, return_tensors="pt")
    loss = ZeroShotLoss(prompts["input_ids"], prompts["attention_mask"], temperature=0.05)
    collate = CLIPCollator(tokenizer=tok)
    protected = {name_: RowDataset([r for r in data.rows if r["label"] == c]) for c, name_ in ((1, "dog"), (2, "car"))}
    constraints = non_forgetting_constraints(model, loss, protected, collate, tolerance=-0.01)  # active from the start
    args = ConstrainedTrainingArguments(
        output_dir=str(tmp_path / name), max_steps=6, learning_rate=0.05, optim="sgd", weight_decay=0.0,
        report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0, constraint_batch_size=3,
        lr_scheduler_type="constant",  # SGD: Adam would turn round-off gradients (e.g. of k_proj.bias) into steps
        constraints_per_step=2, penalty_beta=5.0, msvr_gamma_prime=0.3, max_grad_norm=0.0, **kw)
    counter = CountCalls(model)
    trainer = ContrastiveConstrainedTrainer(model=model, args=args, train_dataset=data, data_collator=collate,
                                            constraints=constraints, callbacks=[counter])
    trainer.train()
    return trainer, counter.calls


@pytest.mark.parametrize("accumulation", [1, 2])
def test_shared_call_equals_separate_calls(tiny, tmp_path, accumulation):
    kw = dict(gradient_accumulation_steps=accumulation, per_device_train_batch_size=8 // accumulation)
    separate, separate_calls = _run(tiny, tmp_path, "separate", lookahead_placement="before_backward", **kw)
    shared, shared_calls = _run(tiny, tmp_path, "shared", share_objective_call=True, lookahead_placement="in_call",
                                **kw)
    assert shared._shared_group == 0
    for name, p in separate.model.named_parameters():
        torch.testing.assert_close(dict(shared.model.named_parameters())[name], p, rtol=2e-4, atol=2e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(shared.estimator.values, separate.estimator.values, rtol=1e-4, atol=1e-6)
    assert torch.equal(shared.estimator.visited, separate.estimator.visited)
    torch.testing.assert_close(shared._next_draw.previous, separate._next_draw.previous, rtol=1e-4, atol=1e-6)
    for side in ("image", "text"):
        torch.testing.assert_close(shared.objective_estimators[side].values,
                                   separate.objective_estimators[side].values, rtol=1e-4, atol=1e-6)
    # separate: per step the objective's window (+ its look-ahead), the constraints' call and the constraint
    # look-ahead; shared: the constraint rows and their look-ahead ride in the objective's first call
    assert len(separate_calls) - len(shared_calls) == 2 * 6
    # not vacuous: the constraints moved the parameters
    plain, _ = _run(tiny, tmp_path, "plain", constraint_penalty="none", **kw)
    gap = max((dict(plain.model.named_parameters())[n] - p).abs().max().item()
              for n, p in shared.model.named_parameters())
    assert gap > 1e-4


def test_padded_texts_embed_as_separate_calls(tiny):
    tok, model, _ = tiny
    a = tok(["a photo of a cat", "a dog"], padding=True, return_tensors="pt")
    b = tok(["a car"], padding=True, return_tensors="pt")
    ids, mask = _stack_texts(a["input_ids"], a["attention_mask"], b["input_ids"], b["attention_mask"])
    pixels = torch.randn(3, 3, 8, 8)
    model.eval()
    with torch.no_grad():
        _, joint = clip_embeddings(model, pixels, ids, mask)
        _, first = clip_embeddings(model, pixels, a["input_ids"], a["attention_mask"])
        _, second = clip_embeddings(model, pixels, b["input_ids"], b["attention_mask"])
    torch.testing.assert_close(joint, torch.cat([first, second]), rtol=1e-5, atol=1e-6)


def test_clip_recipe_runs_with_the_shared_call(tmp_path, monkeypatch):
    """The recipe shares the objective's call by default; ``--share_objective_call false`` gives
    separate calls, ``--lookahead_placement in_call`` ONE model call per step, and it ends where the
    separate calls end (3 AdamW steps of 1e-4: every parameter within a few steps' movement)."""
    from clip_synthetic import make_bdd100k, save_tiny_clip
    from test_clip_recipe import COMMON, _recipe

    bdd = make_bdd100k(str(tmp_path / "bdd100k"), per_class=3)
    texts = [f"the weather is {c}." for c in ("clear", "overcast", "snowy", "rainy", "partly cloudy", "foggy")]
    clip = save_tiny_clip(str(tmp_path / "tiny-clip"), texts)
    shared_calls = []
    original = ContrastiveConstrainedTrainer.objective_with_rows

    def counted(self, *args, **kwargs):
        shared_calls.append(self.state.global_step)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ContrastiveConstrainedTrainer, "objective_with_rows", counted)
    base = ["--model_name_or_path", clip, "--bdd100k_root", bdd, "--task", "foggy", "--constraint_penalty",
            "hinge", "--penalty_beta", "10", *COMMON]
    separate = _recipe().main(base + ["--output_dir", str(tmp_path / "separate"), "--share_objective_call", "false"])
    assert shared_calls == []
    shared = _recipe().main(base + ["--output_dir", str(tmp_path / "shared"), "--lookahead_placement", "in_call"])
    assert shared_calls == [0, 1, 2]  # one shared call per optimizer step
    for name, value in separate["constraints_train"].items():
        assert abs(shared["constraints_train"][name] - value) < 1e-2, name
