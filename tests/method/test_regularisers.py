"""The baselines users run instead of constraints (hf_constrained.method.regularisers): replay, KL and L2
to the old model, inside the ConstrainedTrainer and combined with its penalties."""

from __future__ import annotations

import copy
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from scale_tiny import ListDataset, TinyClassifier, make_data, make_rows, tiny_args
from torch import nn

from hf_constrained import ConstrainedTrainer
from hf_constrained.batches import collate_examples
from hf_constrained.method.regularisers import (
    KLToOld,
    L2ToOld,
    OldRowStream,
    Replay,
    kl_old_new,
    make_regulariser,
    scored_logits,
)


def old_rows(n: int = 40) -> ListDataset:
    """Rows marked ``old`` = 1 (the new-task rows carry 0), so a model can count them."""
    rows, _ = make_rows(n, 7)
    return ListDataset([{**r, "old": torch.tensor(1)} for r in rows])


def new_rows(n: int = 64) -> ListDataset:
    rows, _ = make_rows(n, 3)
    return ListDataset([{**r, "old": torch.tensor(0)} for r in rows])


class CountingClassifier(TinyClassifier):
    """Records how many old and new rows each forward pass sees."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int]] = []

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None,
                old: Optional[torch.Tensor] = None) -> dict[str, Any]:
        if old is not None and self.training:
            self.seen.append((int(old.sum()), int((old == 0).sum())))
        return super().forward(x, labels)


@pytest.mark.parametrize("ratio", [0.2, 0.5, 0.75])
def test_replay_batches_hold_the_share_of_old_rows(tmp_path, ratio):
    torch.manual_seed(0)
    model = CountingClassifier()
    replay = Replay(old_rows(), ratio, collate_examples)
    trainer = ConstrainedTrainer(model=model, args=tiny_args(str(tmp_path), constraint_penalty="none", max_steps=5),
                                 train_dataset=new_rows(), regulariser=replay)
    trainer.train()
    # each step: one forward of the 8 new rows, then one of the replayed old rows
    assert len(model.seen) == 10
    new_counts, old_counts = model.seen[0::2], model.seen[1::2]
    assert all(o == 0 and n == 8 for o, n in new_counts)
    k = round(ratio / (1 - ratio) * 8)
    assert all(o == k and n == 0 for o, n in old_counts)
    assert abs(k / (8 + k) - ratio) <= 0.5 / (8 + k) + 1e-9  # the nearest share a whole number of rows gives


def test_replay_walks_shuffled_passes_and_is_a_function_of_the_draw():
    stream = OldRowStream(10, seed=3)
    first_pass = stream.rows(0, 5) + stream.rows(1, 5)
    assert sorted(first_pass) == list(range(10))  # every row once per pass
    second_pass = stream.rows(2, 5) + stream.rows(3, 5)
    assert sorted(second_pass) == list(range(10)) and second_pass != first_pass
    assert OldRowStream(10, seed=3).rows(3, 5) == stream.rows(3, 5)  # a resumed run reads the same rows
    assert OldRowStream(10, seed=4).rows(0, 10) != first_pass


def test_replay_loss_is_the_mean_over_the_mixed_batch():
    torch.manual_seed(0)
    model = CountingClassifier()
    old, new = old_rows(12), new_rows(8)
    replay = Replay(old, 0.6, collate_examples)  # 12 old rows with 8 new
    new_batch = collate_examples([new[i] for i in range(8)])
    objective = model(x=new_batch["x"], labels=new_batch["labels"])["loss"]
    mixed = replay.apply(model, objective, new_batch, draw=0)
    rows = [old[i] for i in replay.replay_rows(0, 8)] + [new[i] for i in range(8)]
    together = collate_examples(rows)
    expected = F.cross_entropy(model(x=together["x"])["logits"], together["labels"])
    torch.testing.assert_close(mixed, expected)


def tiny_lm(seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=13, n_embd=16, n_layer=1, n_head=2, n_positions=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def lm_rows(n: int = 6) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, 13, (8,), generator=g)
        labels = ids.clone()
        labels[:4] = -100  # the prompt is not scored
        rows.append({"input_ids": ids, "attention_mask": torch.ones(8, dtype=torch.long), "labels": labels})
    return rows


def test_kl_is_zero_at_the_old_model_and_positive_away_from_it():
    model, rows = tiny_lm(0), lm_rows()
    kl = KLToOld(model, rows, 1.0, collate_examples)
    batch = collate_examples(rows)
    assert float(kl.kl(model, batch).detach()) == pytest.approx(0.0, abs=1e-7)
    assert float(kl.kl(tiny_lm(1), batch).detach()) > 1e-3


def test_kl_gradient_matches_the_formula():
    g = torch.Generator().manual_seed(0)
    old_logits, new_logits = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g, requires_grad=True)
    value = kl_old_new(old_logits, new_logits)
    p, q = old_logits.softmax(-1), new_logits.detach().softmax(-1)
    torch.testing.assert_close(value, (p * (p.log() - q.log())).sum(-1).mean())
    (grad,) = torch.autograd.grad(value, new_logits)
    torch.testing.assert_close(grad, (q - p) / 5)  # d KL(p || softmax(z)) / dz = softmax(z) - p, per row


def test_kl_compares_only_the_scored_next_token_positions():
    batch = collate_examples(lm_rows(2))
    logits = torch.randn(2, 8, 13)
    kept = scored_logits(logits, batch)
    assert kept.shape == (2 * 4, 13)  # labels 4..7 are scored: predicted from positions 3..6
    torch.testing.assert_close(kept[:4], logits[0, 3:7])
    torch.testing.assert_close(scored_logits(logits[:, 0], batch), logits[:, 0])  # class logits: whole


def test_kl_in_training_keeps_the_model_closer_to_the_old_one(tmp_path):
    def train(regulariser):
        torch.manual_seed(0)
        model = TinyClassifier()
        old = copy.deepcopy(model)
        reg = regulariser(model)
        trainer = ConstrainedTrainer(model=model, args=tiny_args(str(tmp_path), constraint_penalty="none",
                                                                 max_steps=20, learning_rate=0.1),
                                     train_dataset=new_rows(), regulariser=reg)
        trainer.train()
        batch = collate_examples([old_rows()[i] for i in range(40)])
        return float(kl_old_new(old(x=batch["x"])["logits"], model(x=batch["x"])["logits"]).detach())

    def logits_fn(m, b):
        return m(x=b["x"])["logits"]

    free = train(lambda m: None)
    anchored = train(lambda m: KLToOld(m, old_rows(), 10.0, collate_examples, rows_per_step=8, logits_fn=logits_fn))
    assert anchored < 0.5 * free


def test_l2_gradient_pulls_toward_the_old_weights():
    torch.manual_seed(0)
    model = TinyClassifier()
    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    l2 = L2ToOld(0.5)
    l2.bind(model, lambda b: b)
    assert float(l2.distance(model)) == 0.0
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    wrapped = nn.Module()
    wrapped.module = model  # as DDP wraps it: parameter names "module.<name>"
    torch.testing.assert_close(l2.distance(wrapped), 0.5 * sum(((p - old[n]) ** 2).sum()
                                                                for n, p in model.named_parameters()))
    loss = l2.apply(model, torch.zeros(()), None, draw=0)
    loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 0.5 * (p.detach() - old[n]))


@pytest.mark.parametrize("penalty", ["none", "hinge", "squared_hinge"])
def test_l2_in_training_with_every_penalty(tmp_path, penalty):
    def distance(lam: Optional[float]) -> float:
        torch.manual_seed(1234)
        model = TinyClassifier()
        old = {n: p.detach().clone() for n, p in model.named_parameters()}
        train, constraints = make_data(0)
        trainer = ConstrainedTrainer(model=model, args=tiny_args(str(tmp_path), constraint_penalty=penalty,
                                                                 max_steps=10, learning_rate=0.1),
                                     train_dataset=train, constraints=constraints,
                                     regulariser=None if lam is None else L2ToOld(lam))
        trainer.train()
        return sum(float(((p.detach() - old[n]) ** 2).sum()) for n, p in model.named_parameters())

    assert distance(5.0) < 0.5 * distance(None)


def test_replay_with_the_hinge_reads_both_streams(tmp_path):
    torch.manual_seed(1234)
    model = CountingClassifier()
    train, constraints = make_data(0)
    train = ListDataset([{**r, "old": torch.tensor(0)} for r in train.rows])
    trainer = ConstrainedTrainer(model=model, args=tiny_args(str(tmp_path), constraint_penalty="hinge", max_steps=3),
                                 train_dataset=train, constraints=constraints,
                                 regulariser=Replay(old_rows(), 0.5, collate_examples))
    trainer.train()
    assert [o for o, _ in model.seen] == [0, 8] * 3  # 8 new rows, then 8 old ones, every step
    assert trainer.engine is not None and trainer.constraint_estimates()  # the hinge ran too


def test_bad_settings_name_the_regulariser():
    with pytest.raises(ValueError, match="Replay: ratio"):
        Replay(old_rows(), 1.0, collate_examples)
    with pytest.raises(ValueError, match="Replay: the old-task rows are empty"):
        Replay([], 0.5, collate_examples)
    with pytest.raises(ValueError, match="KLToOld: lam"):
        KLToOld(nn.Linear(2, 2), old_rows(), 0.0, collate_examples)
    with pytest.raises(ValueError, match="L2ToOld: lam"):
        L2ToOld(float("nan"))
    with pytest.raises(ValueError, match="unknown regulariser 'ewc'"):
        make_regulariser("ewc")
    with pytest.raises(TypeError, match="ObjectiveRegulariser"):
        ConstrainedTrainer(model=TinyClassifier(), args=tiny_args("unused", constraint_penalty="none"),
                           train_dataset=new_rows(), regulariser=lambda: 0)
    assert isinstance(make_regulariser("l2", lam=1.0), L2ToOld)


@pytest.mark.parametrize("make", [lambda: L2ToOld(2.0), lambda: Replay(old_rows(), 0.5, collate_examples)],
                         ids=["l2", "replay"])
def test_gradient_accumulation_gives_the_same_steps(tmp_path, make):
    """Two micro-batches of 4 rows train as one batch of 8: the regulariser counts once per step (L2) and
    the old rows of the two micro-batches are the step's rows (replay draws by position)."""
    def train(batch: int, accumulation: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = CountingClassifier()
        trainer = ConstrainedTrainer(model=model, args=tiny_args(str(tmp_path), constraint_penalty="none", max_steps=4,
                                                                 per_device_train_batch_size=batch,
                                                                 gradient_accumulation_steps=accumulation),
                                     train_dataset=new_rows(), regulariser=make())
        trainer.train()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    whole, accumulated = train(8, 1), train(4, 2)
    for name in whole:
        torch.testing.assert_close(accumulated[name], whole[name], rtol=1e-5, atol=1e-6)
