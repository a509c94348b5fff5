"""CLIP's constraint images in the contrastive objective's forward (``MergedCLIPForward``): one vision and one text
tower call per step for the batch's and the constraint rows' images and texts, the same step as separate forwards."""

from __future__ import annotations

import torch
from clip_synthetic import TINY_CAPTIONS, tiny_contrastive_setup
from scale_tiny import count_training_forwards

from hf_constrained import ConstrainedTrainingArguments
from hf_constrained.clip import (
    ContrastiveConstrainedTrainer,
    NonForgettingConfig,
    ZeroShotLoss,
    non_forgetting_constraints,
)
from hf_constrained.clip.data import CLIPCollator, RowDataset
from hf_constrained.clip.non_forgetting import MergedCLIPForward
from hf_constrained.method.regularisers import ConstraintRowReplay

STEPS = 4


def make_trainer(tmp_path, name: str, *, regulariser=None, model=None):
    tok, clip, rows = tiny_contrastive_setup(48)
    model = (model or clip).double()
    prompts = tok(TINY_CAPTIONS, padding=True, return_tensors="pt")
    loss = ZeroShotLoss(prompts["input_ids"], prompts["attention_mask"], temperature=0.05)
    g = torch.Generator().manual_seed(5)
    protected = {c: RowDataset([{"pixel_values": (torch.randn(3, 8, 8, generator=g) + k).numpy(), "label": k}
                                for _ in range(12)]) for k, c in enumerate(("dog", "car"), start=1)}
    constraints = non_forgetting_constraints(model, loss, protected, CLIPCollator(),
                                             config=NonForgettingConfig(tolerance=-1.0, batch_size=8))
    args = ConstrainedTrainingArguments(
        output_dir=str(tmp_path / name), per_device_train_batch_size=8, learning_rate=0.05, optim="sgd",
        weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant", max_steps=STEPS, report_to=[],
        save_strategy="no", disable_tqdm=True, use_cpu=True, seed=0, logging_strategy="no",
        constraint_penalty="hinge", penalty_beta=2.0, constraint_batch_size=4, msvr_gamma_prime="0.1")
    trainer = ContrastiveConstrainedTrainer(model=model, args=args, train_dataset=rows,
                                            data_collator=CLIPCollator(tokenizer=tok), constraints=constraints,
                                            contrastive_temperature=0.05, regulariser=regulariser)
    return trainer, count_training_forwards(trainer)


def test_constraint_images_join_the_contrastive_forward(tmp_path):
    """float64: parameters and estimates agree to 1e-12 with the constraint images in the objective's forward or in
    their own (hinge active: tolerance -1; with and without replay of the constraint rows), and the shared run
    makes one model call fewer per step."""
    for replay in (None, 0.5):
        results = {}
        for shared in (True, False):
            trainer, calls = make_trainer(tmp_path, f"{shared}_{replay}",
                                          regulariser=None if replay is None else ConstraintRowReplay(replay))
            assert trainer.objective_forward_shareable()
            trainer._forward_shareable = shared
            trainer.train()
            params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
            results[shared] = (params, trainer.engine.estimator.values.clone(), calls[0])
        (p1, u1, c1), (p0, u0, c0) = results[True], results[False]
        assert torch.allclose(p1, p0, rtol=0, atol=1e-12), (p1 - p0).abs().max()
        assert torch.allclose(u1, u0, rtol=0, atol=1e-12)
        # per step: the objective's previous-iterate pass of the next batch, the objective (with the constraint
        # images when shared), the constraint rows (when not), the constraints' look-ahead
        assert c0 - c1 == STEPS, (c0, c1)
        initial = torch.cat([p.detach().flatten() for p in tiny_contrastive_setup(48)[1].double().parameters()])
        assert (p1 - initial).abs().max() > 1e-3  # it trained


def test_merged_clip_forward_gives_each_image_and_text_its_own_embedding():
    tok, model, rows = tiny_contrastive_setup(12)
    model.eval()
    prompts = tok(TINY_CAPTIONS, padding=True, return_tensors="pt")
    loss = ZeroShotLoss(prompts["input_ids"], prompts["attention_mask"], temperature=0.05)
    batch = CLIPCollator(tokenizer=tok)([rows[i] for i in range(6)])
    g = torch.Generator().manual_seed(1)
    constraint = {"pixel_values": torch.randn(5, 3, 8, 8, generator=g), "label": torch.tensor([0, 1, 2, 1, 0])}
    with torch.no_grad():
        merged = MergedCLIPForward(model, loss, constraint["pixel_values"])
        out = merged(pixel_values=batch["pixel_values"], input_ids=batch["input_ids"],
                     attention_mask=batch["attention_mask"])
        alone = model(pixel_values=batch["pixel_values"], input_ids=batch["input_ids"],
                      attention_mask=batch["attention_mask"])
        torch.testing.assert_close(out.image_embeds, alone.image_embeds)
        torch.testing.assert_close(out.text_embeds, alone.text_embeds)
        torch.testing.assert_close(merged.row_losses(constraint), loss.per_sample(model, constraint))
    heads = ZeroShotLoss(prompts["input_ids"], prompts["attention_mask"], class_heads=True)
    assert heads.merged_forward is None and loss.merged_forward is not None
