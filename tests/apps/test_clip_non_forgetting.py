"""Non-forgetting constraint values, the reference pass, LoRA's base as old model, text heads."""

import copy

import pytest
import torch

from hf_constrained.batches import collate_examples
from hf_constrained.clip import (
    CLIPWithClassTextHeads,
    NonForgettingConfig,
    NonForgettingConstraint,
    ZeroShotLoss,
    non_forgetting_constraints,
    reference_losses,
    zero_shot_accuracy,
)
from hf_constrained.clip.data import CLIPCollator, RowDataset
from hf_constrained.clip.tiny import tiny_clip, word_tokenizer

CLASSES = ["clear", "rainy", "foggy"]
TEMPLATE = "the weather is {}."
TAU = 0.05


@pytest.fixture(scope="module")
def setup():
    tok = word_tokenizer([TEMPLATE.format(c) for c in CLASSES])
    model = tiny_clip(len(tok), image_size=8, patch_size=4, hidden_size=32, layers=1, heads=2, projection_dim=16)
    model.eval()
    prompts = tok([TEMPLATE.format(c) for c in CLASSES], padding=True, return_tensors="pt")
    loss = ZeroShotLoss(prompts["input_ids"], prompts["attention_mask"], temperature=TAU)
    g = torch.Generator().manual_seed(1)
    rows = [{"pixel_values": torch.randn(3, 8, 8, generator=g).numpy(), "label": i % 3} for i in range(12)]
    return tok, model, loss, prompts, RowDataset(rows)


def _direct_ce(model, prompts, pixel_values, labels):
    img = model.get_image_features(pixel_values=pixel_values).pooler_output
    txt = model.get_text_features(**prompts).pooler_output
    img = img / img.norm(dim=-1, keepdim=True)
    txt = txt / txt.norm(dim=-1, keepdim=True)
    return torch.nn.functional.cross_entropy(img @ txt.T / TAU, labels, reduction="none")


def _perturbed(model, scale=0.05, seed=3):
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return new


def test_zero_shot_loss_is_cross_entropy_over_all_prompts(setup):
    tok, model, loss, prompts, data = setup
    batch = CLIPCollator()([data[i] for i in range(6)])
    with torch.no_grad():
        torch.testing.assert_close(loss.per_sample(model, batch),
                                   _direct_ce(model, prompts, batch["pixel_values"], batch["label"]))


def test_constraint_is_new_minus_old_loss_on_the_same_samples(setup):
    tok, model, loss, prompts, data = setup
    collate = CLIPCollator()
    (c,) = non_forgetting_constraints(model, loss, {"clear": data}, collate, config=NonForgettingConfig(batch_size=5))
    assert isinstance(c, NonForgettingConstraint) and c.name == "non_forgetting/clear"
    rows = [2, 7, 11]
    batch = (c.collate_fn or collate_examples)([c.dataset[i] for i in rows])
    with torch.no_grad():
        assert abs(float(c.fn(model, batch))) < 1e-5  # the old model itself: h = 0
        new = _perturbed(model)
        expected = (_direct_ce(new, prompts, batch["pixel_values"], batch["label"])
                    - _direct_ce(model, prompts, batch["pixel_values"], batch["label"])).mean()
        torch.testing.assert_close(c.fn(new, batch), expected, rtol=1e-4, atol=1e-5)
    assert float(c.fn(new, batch).detach()) != 0.0


def test_reference_pass_runs_in_eval_mode_and_restores_mode(setup):
    tok, model, loss, prompts, data = setup
    seen = []
    hook = model.register_forward_pre_hook(lambda m, a: seen.append(m.training))
    model.train()
    try:
        reference_losses(model, data, loss, CLIPCollator(), batch_size=4)
    finally:
        hook.remove()
    assert seen and not any(seen) and model.training
    model.eval()


def test_missing_reference_loss_and_bad_label_are_clear_errors(setup):
    tok, model, loss, prompts, data = setup
    batch = CLIPCollator()([data[i] for i in range(3)])
    with pytest.raises(KeyError, match="reference_loss"):
        loss(model, batch)
    batch["label"] = torch.tensor([0, 1, 5])
    with pytest.raises(ValueError, match="outside"):
        loss.per_sample(model, batch)


def test_lora_base_serves_as_old_model(setup):
    from peft import LoraConfig, get_peft_model

    tok, model, loss, prompts, data = setup
    base_losses = reference_losses(model, data, loss, CLIPCollator())
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # a trained adapter
    adapted = reference_losses(peft_model, data, loss, CLIPCollator())
    with peft_model.disable_adapter():
        disabled = reference_losses(peft_model, data, loss, CLIPCollator())
    torch.testing.assert_close(disabled, base_losses)
    assert not torch.allclose(adapted, base_losses)


def test_class_text_heads_start_as_the_base_and_round_trip(setup, tmp_path):
    tok, model, loss, prompts, data = setup
    heads = CLIPWithClassTextHeads(copy.deepcopy(model), num_classes=3, rank=2).eval()
    pix = CLIPCollator()([data[i] for i in range(4)])["pixel_values"]
    ids = torch.arange(3)
    with torch.no_grad():
        out = heads(pixel_values=pix, input_ids=prompts["input_ids"], attention_mask=prompts["attention_mask"],
                    text_class_ids=ids)
        ref = model(pixel_values=pix, **prompts)
        torch.testing.assert_close(out.text_embeds, ref.text_embeds, rtol=1e-5, atol=1e-6)
        heads.head_b[1].normal_()
        out2 = heads(pixel_values=pix, input_ids=prompts["input_ids"], attention_mask=prompts["attention_mask"],
                     text_class_ids=torch.tensor([0, 1, -1]))
    changed = (out2.text_embeds - ref.text_embeds).abs().sum(dim=1) > 1e-4
    assert changed.tolist() == [False, True, False]  # only class 1's head moved; -1 uses P alone
    heads.save_pretrained(str(tmp_path))
    again = CLIPWithClassTextHeads.from_pretrained(str(tmp_path)).eval()
    torch.testing.assert_close(again.head_b, heads.head_b)
    head_loss = ZeroShotLoss(prompts["input_ids"], prompts["attention_mask"], temperature=TAU, class_heads=True)
    acc = zero_shot_accuracy(again, data, head_loss, CLIPCollator(), CLASSES)
    assert set(acc) == set(CLASSES)


def test_certification_rows_count_images_right_before_and_wrong_now(setup):
    """ZeroShotCorrect agrees with zero_shot_predictions; the constraints' certification rows carry the
    old model's correctness, and the certified statistic is old right * new wrong per image."""
    from hf_constrained.clip import ZeroShotCorrect
    from hf_constrained.clip.non_forgetting import zero_shot_predictions
    from hf_constrained.non_forgetting import CORRECT_KEY, ForgottenRows

    tok, model, loss, prompts, rows = setup
    collate = CLIPCollator(tokenizer=tok)
    new = _perturbed(model, scale=0.5)
    correct = ZeroShotCorrect(loss)
    old_pred, labels = zero_shot_predictions(model, rows, loss, collate, batch_size=5)
    new_pred, _ = zero_shot_predictions(new, rows, loss, collate, batch_size=5)
    batch = collate([rows[i] for i in range(len(rows))])
    with torch.no_grad():
        torch.testing.assert_close(correct(model, batch), (old_pred == labels).float())
        torch.testing.assert_close(correct(new, batch), (new_pred == labels).float())
    old_right, new_right = (old_pred == labels).double(), (new_pred == labels).double()
    assert float((old_right * (1 - new_right)).sum()) > 0  # the perturbed model forgets some images
    by_class = {c: RowDataset([rows[i] for i in range(len(rows)) if rows[i]["label"] == k])
                for k, c in enumerate(CLASSES)}
    certify = {c: RowDataset([rows[i] for i in range(len(rows)) if rows[i]["label"] == k])
               for k, c in enumerate(CLASSES[:2])}
    constraints = non_forgetting_constraints(model, loss, by_class, collate, certify_datasets=certify,
                                             config=NonForgettingConfig(forget_tolerance={"clear": 0.1, "rainy": 0.3},
                                                                        batch_size=4))
    assert [c.certifiable for c in constraints] == [True, True, False]
    for c, tol in zip(constraints[:2], (0.1, 0.3)):
        stat = c.certify.statistic
        assert (stat.tolerance, stat.bound, stat.value_range) == (tol, "clopper_pearson", (0.0, 1.0))
        k = CLASSES.index(c.metadata["task"])
        idx = (labels == k).nonzero().flatten()
        cb = collate([c.certify.dataset[i] for i in range(len(c.certify.dataset))])
        torch.testing.assert_close(cb[CORRECT_KEY].double(), old_right[idx])
        with torch.no_grad():
            torch.testing.assert_close(stat.row_fn(new, cb), old_right[idx] * (1 - new_right[idx]))
            assert float(ForgottenRows(correct)(model, cb).sum()) == 0.0  # the old model forgets nothing
    with pytest.raises(ValueError, match="forget_tolerance"):
        non_forgetting_constraints(model, loss, by_class, collate, certify_datasets=certify)
