"""Generic non-forgetting constraints: the old model's reference pass for causal LMs and
sequence classifiers, the shared row function, tolerances, LoRA's base as the old model."""

import copy
import dataclasses

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, BertConfig

from hf_constrained.batches import collate_examples
from hf_constrained.non_forgetting import (
    NonForgettingConfig,
    NonForgettingConstraint,
    PaddingCollator,
    ReferenceGap,
    ReferenceLossDataset,
    causal_lm_per_example_loss,
    non_forgetting_constraints,
    reference_losses,
    sequence_classification_per_example_loss,
)
from hf_constrained.recipes.tiny_lm import char_tokenizer, tiny_causal_lm
from hf_constrained.text_data import tokenize_sft

PROMPTS = ["rev:abc=", "rev:hello=", "add:2+3=", "cp:xy=", "add:11+4=", "rev:a=", "cp:abcdefg=", "rev:qrs="]
ANSWERS = ["cba", "olleh", "5", "xy", "15", "a", "abcdefg", "srq"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    char_tokenizer().save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def causal_lm(request, tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    tiny_causal_lm(len(tokenizer), request.param, hidden_size=32, layers=2, heads=2).save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def lm_rows(tokenizer):
    raw = Dataset.from_dict({"prompt": PROMPTS, "completion": ANSWERS})
    return tokenize_sft(raw, tokenizer, name="toy")


def _perturbed(model, scale=0.1, seed=3):
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return new


def _direct_lm_losses(model, rows):
    """Each example alone (no padding), through the model's own loss (mean token CE of its labels)."""
    out = []
    with torch.no_grad():
        for r in rows:
            out.append(model(input_ids=torch.tensor([r["input_ids"]]), labels=torch.tensor([r["labels"]])).loss)
    return torch.stack(out)


def test_prompt_tokens_carry_no_loss(tokenizer, lm_rows):
    row = lm_rows[0]
    n_prompt = len(PROMPTS[0])
    assert row["labels"][:n_prompt] == [-100] * n_prompt
    assert row["labels"][n_prompt:] == row["input_ids"][n_prompt:]
    assert row["input_ids"][-1] == tokenizer.eos_token_id


def test_causal_lm_reference_pass_matches_each_example_alone(causal_lm, lm_rows, tokenizer):
    collate = PaddingCollator(tokenizer)
    # batches of 3 rows of different lengths: every row but the longest is padded
    ref = reference_losses(causal_lm, lm_rows, causal_lm_per_example_loss, collate, batch_size=3)
    torch.testing.assert_close(ref, _direct_lm_losses(causal_lm, lm_rows), rtol=1e-5, atol=1e-5)
    # the reference pass computes what the model says, not a constant: another model differs
    other = reference_losses(_perturbed(causal_lm), lm_rows, causal_lm_per_example_loss, collate)
    assert (other - ref).abs().max() > 1e-3


def test_causal_lm_loss_without_labels_masks_padding(causal_lm, lm_rows, tokenizer):
    text_rows = [{"input_ids": r["input_ids"]} for r in lm_rows]
    batch = PaddingCollator(tokenizer)(text_rows)
    assert "labels" not in batch and batch["attention_mask"].sum() == sum(len(r["input_ids"]) for r in text_rows)
    with torch.no_grad():
        values = causal_lm_per_example_loss(causal_lm, batch)
        alone = torch.stack([causal_lm(input_ids=torch.tensor([r["input_ids"]]),
                                       labels=torch.tensor([r["input_ids"]])).loss for r in text_rows])
    torch.testing.assert_close(values, alone, rtol=1e-5, atol=1e-5)


def test_sequence_classifier_reference_pass_matches_each_example_alone(tokenizer, tmp_path):
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=3, pad_token_id=0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path)
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    texts = ["good", "bad movie", "so so so", "fine", "terrible plot twist", "ok"]
    rows = [{"input_ids": tokenizer(t)["input_ids"], "label": i % 3} for i, t in enumerate(texts)]
    ref = reference_losses(model, rows, sequence_classification_per_example_loss, PaddingCollator(tokenizer),
                           batch_size=4)
    with torch.no_grad():
        alone = torch.stack([model(input_ids=torch.tensor([r["input_ids"]]), labels=torch.tensor([r["label"]])).loss
                             for r in rows])
    torch.testing.assert_close(ref, alone, rtol=1e-5, atol=1e-5)


def test_constraints_share_one_row_function_and_measure_new_minus_old(causal_lm, lm_rows, tokenizer):
    collate = PaddingCollator(tokenizer)
    data = {"reverse": lm_rows.select(range(4)), "other": lm_rows.select(range(4, 8))}
    constraints = non_forgetting_constraints(causal_lm, causal_lm_per_example_loss, data, collate,
                                             config=NonForgettingConfig(batch_size=2,
                                                                        tolerance={"reverse": 0.1, "other": 0.0},
                                                                        relative_tolerance=0.5))
    assert [c.name for c in constraints] == ["non_forgetting/reverse", "non_forgetting/other"]
    assert all(isinstance(c, NonForgettingConstraint) and c.rowwise for c in constraints)
    assert constraints[0].row_fn is constraints[1].row_fn  # one group: one fused model call
    assert constraints[0].collate_fn is constraints[1].collate_fn
    old = _direct_lm_losses(causal_lm, lm_rows)
    assert constraints[0].tolerance == pytest.approx(0.1 + 0.5 * float(old[:4].mean()), rel=1e-5)
    assert constraints[1].tolerance == pytest.approx(0.5 * float(old[4:].mean()), rel=1e-5)

    c = constraints[1]
    batch = (c.collate_fn or collate_examples)([c.dataset[i] for i in [0, 2, 3]])
    torch.testing.assert_close(batch["reference_loss"], old[[4, 6, 7]], rtol=1e-5, atol=1e-5)
    new = _perturbed(causal_lm)
    with torch.no_grad():
        assert abs(float(c.fn(causal_lm, batch))) < 1e-5  # the old model itself: h = 0
        expected = (_direct_lm_losses(new, [lm_rows[i] for i in [4, 6, 7]]) - old[[4, 6, 7]]).mean()
        torch.testing.assert_close(c.fn(new, batch), expected, rtol=1e-4, atol=1e-5)
        # the fused form: one call over the rows of both constraints gives each row's gap
        both = collate([constraints[0].dataset[0], c.dataset[0]])
        gaps = c.row_fn(new, both)
    assert gaps.shape == (2,)
    torch.testing.assert_close(gaps, _direct_lm_losses(new, [lm_rows[0], lm_rows[4]]) - old[[0, 4]],
                               rtol=1e-4, atol=1e-5)


def test_the_loss_increase_surrogate_keeps_only_the_rows_whose_loss_rose(causal_lm, lm_rows, tokenizer):
    """``row_transform=torch.relu`` on a non-forgetting constraint (the LLM example's ``--constraint_surrogate
    loss_increase``): per row max(0, l(w, x) - l(w_old, x)), from a forward of its own and from shared logits
    alike; its gradient is the gradient of the mean over the rows whose loss rose only (checked against the
    plain gap's per-row gradients), so a row whose loss fell cannot offset one at risk."""
    collate = PaddingCollator(tokenizer)
    rows = lm_rows.select(range(8))
    (plain,) = non_forgetting_constraints(causal_lm, causal_lm_per_example_loss, {"t": rows}, collate)
    increase = dataclasses.replace(plain, fn=None, row_transform=torch.relu)  # fn: derived from row_fn again
    batch = collate([plain.dataset[i] for i in range(8)])
    new = _perturbed(causal_lm, scale=0.05, seed=5)
    gaps = plain.row_values(plain.row_fn(new, batch))
    rose = gaps > 0
    assert rose.any() and (~rose).any(), gaps  # rows of both signs, or the test shows nothing
    torch.testing.assert_close(increase.row_values(increase.row_fn(new, batch)), gaps.clamp(min=0))
    with torch.no_grad():
        logits = new(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(increase.row_values(increase.row_fn.values_from_logits(logits, batch)),
                               gaps.detach().clamp(min=0), rtol=1e-5, atol=1e-6)
    params = [p for p in new.parameters() if p.requires_grad]
    surrogate = torch.autograd.grad(increase.row_values(increase.row_fn(new, batch)).mean(), params,
                                    allow_unused=True)
    per_row = plain.row_fn(new, batch)
    expected = torch.autograd.grad(per_row[rose].sum() / len(per_row), params, allow_unused=True)
    for got, want in zip(surrogate, expected):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    mean_change = torch.autograd.grad(plain.row_fn(new, batch).mean(), params, allow_unused=True)
    assert any(a is not None and not torch.allclose(a, b, atol=1e-7) for a, b in zip(surrogate, mean_change))


def test_lora_base_serves_as_old_model(causal_lm, lm_rows, tokenizer):
    from peft import LoraConfig, get_peft_model

    collate = PaddingCollator(tokenizer)
    base = reference_losses(causal_lm, lm_rows, causal_lm_per_example_loss, collate)
    targets = ["c_attn"] if causal_lm.config.model_type == "gpt2" else ["q_proj", "v_proj"]
    peft_model = get_peft_model(copy.deepcopy(causal_lm), LoraConfig(r=2, target_modules=targets))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # a trained adapter
    adapted = reference_losses(peft_model, lm_rows, causal_lm_per_example_loss, collate)
    assert (adapted - base).abs().max() > 1e-3
    (c,) = non_forgetting_constraints(peft_model, causal_lm_per_example_loss, {"all": lm_rows}, collate)
    torch.testing.assert_close(c.dataset.losses, base, rtol=1e-5, atol=1e-5)  # adapter disabled: the base
    (d,) = non_forgetting_constraints(peft_model, causal_lm_per_example_loss, {"all": lm_rows}, collate,
                                      config=NonForgettingConfig(use_base_of_adapter=False))
    torch.testing.assert_close(d.dataset.losses, adapted, rtol=1e-5, atol=1e-5)
    # the adapters are active again after the reference pass
    torch.testing.assert_close(reference_losses(peft_model, lm_rows, causal_lm_per_example_loss, collate), adapted)


def test_held_out_rows_get_their_own_reference_losses(causal_lm, lm_rows, tokenizer):
    collate = PaddingCollator(tokenizer)
    (c,) = non_forgetting_constraints(causal_lm, causal_lm_per_example_loss, {"t": lm_rows.select(range(5))}, collate,
                                      eval_datasets={"t": lm_rows.select(range(5, 8))})
    assert isinstance(c.eval_dataset, ReferenceLossDataset) and len(c.eval_dataset) == 3
    torch.testing.assert_close(c.eval_dataset.losses, _direct_lm_losses(causal_lm, lm_rows)[5:], rtol=1e-5, atol=1e-5)
    assert c.metadata["old_eval_loss"] == pytest.approx(float(c.eval_dataset.losses.mean()))


def test_clear_errors(causal_lm, lm_rows, tokenizer):
    collate = PaddingCollator(tokenizer)
    gap = ReferenceGap(causal_lm_per_example_loss)
    with pytest.raises(KeyError, match="reference_loss"):
        gap(causal_lm, collate([lm_rows[0]]))
    no_target = {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [-100, -100, -100]}
    with pytest.raises(KeyError, match="no 'attention_mask' field"):
        collate([lm_rows[0], {"input_ids": [5, 6]}])
    with pytest.raises(ValueError, match="no label token"):
        causal_lm_per_example_loss(causal_lm, collate([lm_rows[0], no_target]))
    with pytest.raises(KeyError, match="not in datasets"):
        non_forgetting_constraints(causal_lm, causal_lm_per_example_loss, {"a": lm_rows}, collate,
                                   eval_datasets={"b": lm_rows})
    with pytest.raises(KeyError, match="no entry for protected task 'a'"):
        non_forgetting_constraints(causal_lm, causal_lm_per_example_loss, {"a": lm_rows}, collate,
                                   config=NonForgettingConfig(tolerance={"b": 0.1}))
    with pytest.raises(ValueError, match="one value per row"):
        reference_losses(causal_lm, lm_rows, lambda m, b: causal_lm_per_example_loss(m, b).mean(), collate)


def _direct_exact_match(model, rows):
    """Each example alone: 1 when every answer token is the argmax next-token prediction."""
    out = []
    with torch.no_grad():
        for r in rows:
            logits = model(input_ids=torch.tensor([r["input_ids"]])).logits[0, :-1]
            labels = torch.tensor(r["labels"][1:])
            keep = labels != -100
            out.append(float(bool((logits.argmax(-1)[keep] == labels[keep]).all())))
    return torch.tensor(out, dtype=torch.float64)


def test_certification_rows_measure_the_share_of_examples_forgotten(causal_lm, lm_rows, tokenizer):
    from hf_constrained.non_forgetting import CORRECT_KEY, ForgottenRows
    from hf_constrained.per_sample_loss import causal_lm_per_example_correct

    collate = PaddingCollator(tokenizer)
    new = _perturbed(causal_lm, scale=0.5)
    # answers the old model gets right by construction (its own greedy continuation), so forgetting can show
    greedy = []
    with torch.no_grad():
        for r in lm_rows:
            prompt = [t for t, lab in zip(r["input_ids"], r["labels"]) if lab == -100]
            ids = list(prompt)
            for _ in range(2):
                ids.append(int(causal_lm(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            greedy.append({"input_ids": ids, "attention_mask": [1] * len(ids),
                           "labels": [-100] * len(prompt) + ids[len(prompt):]})
    lm_rows = Dataset.from_list(greedy)
    data = {"reverse": lm_rows.select(range(4))}
    certify = {"reverse": lm_rows.select(range(4, 8))}
    constraints = non_forgetting_constraints(causal_lm, causal_lm_per_example_loss, data, collate,
                                             certify_datasets=certify, correct=causal_lm_per_example_correct,
                                             config=NonForgettingConfig(batch_size=3, forget_tolerance=0.25))
    c = constraints[0]
    assert c.certify.statistic.tolerance == 0.25 and c.certify.statistic.bound == "clopper_pearson"
    assert c.certification_range() == (0.0, 1.0)
    rows = [lm_rows[i] for i in range(4, 8)]
    old_right = _direct_exact_match(causal_lm, rows)
    assert old_right.tolist() == [1.0] * 4
    batch = collate([c.certify.dataset[i] for i in range(4)])
    torch.testing.assert_close(batch[CORRECT_KEY].double(), old_right)
    torch.testing.assert_close(causal_lm_per_example_correct(new, batch), _direct_exact_match(new, rows))
    forgotten = ForgottenRows(causal_lm_per_example_correct)(new, batch)
    torch.testing.assert_close(forgotten, old_right * (1 - _direct_exact_match(new, rows)))
    assert 0 < float(forgotten.sum()) <= 4  # the perturbed model forgets some of them
    # the old model forgets nothing
    assert float(ForgottenRows(causal_lm_per_example_correct)(causal_lm, batch).sum()) == 0.0
    with pytest.raises(ValueError, match="certify_dataset needs correct="):
        non_forgetting_constraints(causal_lm, causal_lm_per_example_loss, data, collate, certify_datasets=certify)


def test_old_correctness_on_the_training_rows_lets_a_proxy_indicator_train(causal_lm, lm_rows, tokenizer, tmp_path):
    """``old_correct_on_rows``: the training rows carry the old model's exact match, as the
    certification rows do, so ``constraint_proxy_indicator`` can evaluate the share forgotten on
    the indicator rows; without it the statistic finds no old correctness and training stops."""
    from hf_constrained import ConstrainedTrainer, ConstrainedTrainingArguments
    from hf_constrained.non_forgetting import CORRECT_KEY
    from hf_constrained.per_sample_loss import causal_lm_per_example_correct

    collate = PaddingCollator(tokenizer)
    data, certify = {"reverse": lm_rows.select(range(6))}, {"reverse": lm_rows.select(range(6, 8))}

    def build(old_correct_on_rows: bool) -> list:
        return non_forgetting_constraints(causal_lm, causal_lm_per_example_loss, data, collate,
                                          certify_datasets=certify, correct=causal_lm_per_example_correct,
                                          config=NonForgettingConfig(batch_size=3, forget_tolerance=0.5,
                                                                     old_correct_on_rows=old_correct_on_rows))

    (c,) = build(True)
    batch = collate([c.dataset[i] for i in range(6)])
    torch.testing.assert_close(batch[CORRECT_KEY].double(), causal_lm_per_example_correct(causal_lm, batch))
    torch.testing.assert_close(batch["reference_loss"].float(), causal_lm_per_example_loss(causal_lm, batch).float())

    def train(constraints: list, name: str) -> None:
        args = ConstrainedTrainingArguments(
            output_dir=str(tmp_path / name), max_steps=2, per_device_train_batch_size=4, report_to=[], use_cpu=True,
            save_strategy="no", constraint_batch_size=2, constraint_indicator_fraction=0.5,
            constraint_proxy_indicator=True, disable_tqdm=True, remove_unused_columns=False)
        ConstrainedTrainer(model=copy.deepcopy(causal_lm), args=args, train_dataset=lm_rows.select(range(6)),
                           data_collator=collate, constraints=constraints).train()

    train([c], "with")  # trains
    with pytest.raises(KeyError, match=CORRECT_KEY):
        train(build(False), "without")
    with pytest.raises(ValueError, match="old_correct_on_rows serves the certificate's statistic"):
        non_forgetting_constraints(causal_lm, causal_lm_per_example_loss, data, collate,
                                   config=NonForgettingConfig(old_correct_on_rows=True))


# ---------------------------------------------------------------------- the statement in the user's units
def _greedy_rows(causal_lm, lm_rows):
    """Rows whose answer is the old model's own greedy continuation: the old model gets each right."""
    greedy = []
    with torch.no_grad():
        for r in lm_rows:
            prompt = [t for t, lab in zip(r["input_ids"], r["labels"]) if lab == -100]
            ids = list(prompt)
            for _ in range(2):
                ids.append(int(causal_lm(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            greedy.append({"input_ids": ids, "attention_mask": [1] * len(ids),
                           "labels": [-100] * len(prompt) + ids[len(prompt):]})
    return Dataset.from_list(greedy)


def test_points_lost_is_the_paired_change_with_its_own_bound(causal_lm, lm_rows, tokenizer):
    from hf_constrained.non_forgetting import PairedChange
    from hf_constrained.per_sample_loss import causal_lm_per_example_correct

    collate = PaddingCollator(tokenizer)
    rows = _greedy_rows(causal_lm, lm_rows)
    (c,) = non_forgetting_constraints(causal_lm, causal_lm_per_example_loss, {"reverse": lm_rows.select(range(4))},
                                      collate, certify_datasets={"reverse": rows},
                                      correct=causal_lm_per_example_correct,
                                      config=NonForgettingConfig(accuracy_drop_tolerance=0.3))
    stat = c.certify.statistic
    assert isinstance(stat.row_fn, PairedChange) and stat.bound == "paired_change" and stat.value_range == (-1.0, 1.0)
    assert stat.tolerance == 0.3 and c.certification_tolerance() == 0.3
    batch = collate([c.certify.dataset[i] for i in range(len(rows))])
    new = _perturbed(causal_lm, scale=0.5)
    change = stat.row_fn(new, batch)
    old_right, new_right = _direct_exact_match(causal_lm, list(rows)), _direct_exact_match(new, list(rows))
    torch.testing.assert_close(change, old_right - new_right)  # accuracy lost, per row
    assert float(stat.row_fn(causal_lm, batch).abs().sum()) == 0.0


@pytest.mark.parametrize("statement, match", [
    (dict(forget_tolerance=-0.1), "'non_forgetting/reverse': tolerance -0.1 cannot be expressed"),
    (dict(accuracy_drop_tolerance=1.5), "'non_forgetting/reverse': tolerance 1.5 cannot be expressed"),
    (dict(forget_tolerance=0.0), "'non_forgetting/reverse': tolerance 0 can never be certified"),
    (dict(forget_tolerance=0.1, accuracy_drop_tolerance=0.1), "not both"),
])
def test_a_statement_the_statistic_cannot_express_is_an_error_naming_the_task(causal_lm, lm_rows, tokenizer,
                                                                             statement, match):
    from hf_constrained.per_sample_loss import causal_lm_per_example_correct

    with pytest.raises(ValueError, match=match):
        non_forgetting_constraints(causal_lm, causal_lm_per_example_loss, {"reverse": lm_rows.select(range(4))},
                                   PaddingCollator(tokenizer),
                                   certify_datasets={"reverse": lm_rows.select(range(4, 8))},
                                   correct=causal_lm_per_example_correct, config=NonForgettingConfig(**statement))


def test_the_certifiable_target_is_the_largest_value_the_split_certifies():
    from hf_constrained.certification.bounds import clopper_pearson_upper_bound, paired_change_upper_bounds
    from hf_constrained.non_forgetting import certifiable_target, forgetting_statistic, points_lost_statistic

    correct = lambda model, batch: None  # noqa: E731 - never called
    n, tol = 1000, 0.02
    share = certifiable_target(forgetting_statistic(correct, tol), n, 0.05)
    k = round(share * n)
    # at the first look (delta / 2): k forgotten of n still certify, k + 1 do not
    assert clopper_pearson_upper_bound(k, n, 0.045) <= tol < clopper_pearson_upper_bound(k + 1, n, 0.045)
    points = certifiable_target(points_lost_statistic(correct, tol), n, 0.05)
    k = round(points * n)
    assert (paired_change_upper_bounds([k], [0], n, 0.045)[0]
            <= tol < paired_change_upper_bounds([k + 1], [0], n, 0.045)[0])
    assert 0 < points < share < tol  # the paired bound spends part of delta on rows newly right
    assert certifiable_target(forgetting_statistic(correct, tol), 100, 0.05) is None  # 100 rows cannot certify 2%


def test_the_proxy_margin_is_sized_from_the_statement_and_a_small_split_warns_before_training(
        causal_lm, lm_rows, tokenizer, tmp_path, caplog):
    from hf_constrained import ConstrainedTrainer, ConstrainedTrainingArguments
    from hf_constrained.non_forgetting import certifiable_target
    from hf_constrained.per_sample_loss import causal_lm_per_example_correct

    collate = PaddingCollator(tokenizer)
    certify = Dataset.from_list([lm_rows[i] for i in range(6, 8)] * 100)  # 200 certification rows
    (c,) = non_forgetting_constraints(causal_lm, causal_lm_per_example_loss, {"reverse": lm_rows.select(range(6))},
                                      collate, certify_datasets={"reverse": certify},
                                      correct=causal_lm_per_example_correct,
                                      config=NonForgettingConfig(batch_size=8, accuracy_drop_tolerance=0.05,
                                                                 old_correct_on_rows=True))
    target = certifiable_target(c.certify.statistic, 200, 0.05)
    assert target is not None and c.margin.value == pytest.approx(0.05 - target) and c.margin.value > 0
    assert c.metadata["certifiable_target"] == target
    # without the proxy (no old correctness on the training rows) the loss constraint keeps its own units
    (plain,) = non_forgetting_constraints(causal_lm, causal_lm_per_example_loss, {"reverse": lm_rows.select(range(6))},
                                          collate, certify_datasets={"reverse": certify},
                                          correct=causal_lm_per_example_correct,
                                          config=NonForgettingConfig(batch_size=8, accuracy_drop_tolerance=0.05))
    assert plain.margin is None
    # 2 certification rows cannot certify 5 points even with nothing forgotten: the trainer says so before training
    (small,) = non_forgetting_constraints(causal_lm, causal_lm_per_example_loss, {"reverse": lm_rows.select(range(6))},
                                          collate, certify_datasets={"reverse": lm_rows.select(range(6, 8))},
                                          correct=causal_lm_per_example_correct,
                                          config=NonForgettingConfig(batch_size=8, accuracy_drop_tolerance=0.05))
    args = ConstrainedTrainingArguments(output_dir=str(tmp_path / "run"), max_steps=1, report_to=[], use_cpu=True,
                                        save_strategy="no", disable_tqdm=True, remove_unused_columns=False)
    with caplog.at_level("WARNING", logger="hf_constrained.safety.split_checks"):
        ConstrainedTrainer(model=copy.deepcopy(causal_lm), args=args, train_dataset=lm_rows.select(range(6)),
                           data_collator=collate, constraints=[small])
    text = caplog.text
    assert "'non_forgetting/reverse'" in text and "(2 rows) can never certify tolerance 0.05" in text
    assert "it needs at least" in text


def _linear_correct(model, batch):
    """0/1 per row: the linear classifier's argmax is the row's label."""
    return (model(batch["x"]).argmax(dim=1) == batch["label"]).float()


def test_shares_forgotten_count_rows_right_before_and_wrong_now():
    """``with_old_correctness`` stores the old model's correctness once (keeping ``reference_loss``);
    ``shares_forgotten`` is, per task, the share of rows right under the old model and wrong under the new one,
    counted here row by row; ``largest_share_forgotten`` is the largest share minus the rate (feasible at <= 0)."""
    from hf_constrained.non_forgetting import largest_share_forgotten, shares_forgotten, with_old_correctness

    gen = torch.Generator().manual_seed(0)
    old = torch.nn.Linear(4, 3)
    new = copy.deepcopy(old)
    with torch.no_grad():
        new.weight.add_(torch.randn(3, 4, generator=gen))  # some rows flip, both ways
    tasks = {}
    for task, n in (("a", 37), ("b", 50)):
        x = torch.randn(n, 4, generator=gen)
        rows = [{"x": x[i], "label": int(old(x[i]).argmax()) if i % 3 else int(torch.randint(3, (1,), generator=gen))}
                for i in range(n)]
        tasks[task] = ReferenceLossDataset(rows, torch.arange(n, dtype=torch.float32))
    marked = {t: with_old_correctness(old, rows, _linear_correct, batch_size=8) for t, rows in tasks.items()}
    expected = {}
    for task, rows in tasks.items():
        right = [int(old(r["x"]).argmax()) == r["label"] for r in (rows[i] for i in range(len(rows)))]
        now = [int(new(r["x"]).argmax()) == r["label"] for r in (rows[i] for i in range(len(rows)))]
        assert [marked[task][i]["reference_correct"] for i in range(len(rows))] == [float(r) for r in right]
        assert marked[task][5]["reference_loss"] == 5.0  # the rows keep their reference loss
        expected[task] = sum(r and not w for r, w in zip(right, now)) / len(rows)
    assert 0 < min(expected.values()) and expected["a"] != expected["b"]
    shares = shares_forgotten(new, marked, _linear_correct, batch_size=8)
    assert shares == pytest.approx(expected, abs=1e-12)
    assert shares_forgotten(old, marked, _linear_correct) == {"a": 0.0, "b": 0.0}  # the old model forgets nothing
    largest = largest_share_forgotten(marked, _linear_correct, 0.05, batch_size=8)
    assert largest(new) == pytest.approx(max(expected.values()) - 0.05, abs=1e-12) and largest(old) == -0.05
    with pytest.raises(ValueError, match="share"):
        largest_share_forgotten(marked, _linear_correct, 1.0)


def test_rows_kept_old_correct_keeps_the_rows_the_old_model_answers(causal_lm, lm_rows, tokenizer):
    """``NonForgettingConfig(rows_kept="old_correct")``: each constraint trains on the rows ``correct`` marks right
    under the old model, in order, with their own reference losses (a ``datasets.Dataset`` or a plain list of rows);
    without ``correct``, with no row answered, or with another value it is an error naming the task or the field."""
    collate = PaddingCollator(tokenizer)
    answered = {"rev:hello=", "cp:xy=", "add:11+4=", "cp:abcdefg="}

    def correct(model, batch):  # a stand-in for exact match: right on the prompts of `answered`
        texts = [tokenizer.decode(ids) for ids in batch["input_ids"].tolist()]
        return torch.tensor([float(any(t.startswith(a) for a in answered)) for t in texts])

    config = NonForgettingConfig(rows_kept="old_correct")
    for data in (lm_rows, [lm_rows[i] for i in range(len(lm_rows))]):
        (c,) = non_forgetting_constraints(causal_lm, causal_lm_per_example_loss, {"toy": data}, collate,
                                          correct=correct, config=config)
        kept = [i for i, p in enumerate(PROMPTS) if p in answered]
        assert [c.dataset[j]["input_ids"] for j in range(len(c.dataset))] == [lm_rows[i]["input_ids"] for i in kept]
        full = reference_losses(causal_lm, lm_rows, causal_lm_per_example_loss, collate)
        torch.testing.assert_close(c.dataset.losses, full[kept], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="protected task 'toy': rows_kept='old_correct' needs correct"):
        non_forgetting_constraints(causal_lm, causal_lm_per_example_loss, {"toy": lm_rows}, collate, config=config)
    with pytest.raises(ValueError, match="protected task 'toy'.*answers none of its 8 rows right"):
        non_forgetting_constraints(causal_lm, causal_lm_per_example_loss, {"toy": lm_rows}, collate,
                                   correct=lambda m, b: torch.zeros(len(b["input_ids"])), config=config)
    with pytest.raises(ValueError, match="rows_kept must be 'all' or 'old_correct'"):
        NonForgettingConfig(rows_kept="answered")
