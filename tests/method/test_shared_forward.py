"""The constraint rows in the objective's forward (hf_constrained.method.shared_forward): the same step as
separate forwards, one model call fewer, and only where the values cannot change."""

from __future__ import annotations

import torch
from scale_tiny import count_forwards, count_training_forwards
from torch import nn
from transformers import (
    GPT2Config,
    GPT2DoubleHeadsModel,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from hf_constrained import ConstrainedTrainer, ConstrainedTrainingArguments
from hf_constrained.method.regularisers import ConstraintRowReplay, Replay
from hf_constrained.method.shared_forward import (
    MergedForward,
    SharedObjectiveForward,
    merge_right_padded,
    trains_as_it_evaluates,
)
from hf_constrained.non_forgetting import NonForgettingConfig, ReferenceGap, non_forgetting_constraints
from hf_constrained.per_sample_loss import PaddingCollator, causal_lm_per_example_loss

VOCAB = 48


class Rows(torch.utils.data.Dataset):
    """Token rows of varied lengths, the loss on the second half (prompt/completion)."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for _ in range(n):
            length = int(torch.randint(6, 14, (1,), generator=g))
            ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
            labels = [-100] * (length // 2) + ids[length // 2:]
            self.rows.append({"input_ids": ids, "labels": labels})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def llama(tmp_path, dropout: float = 0.0) -> nn.Module:
    config = LlamaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=32, vocab_size=VOCAB, attention_dropout=dropout)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    return LlamaForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.float64)


def make_trainer(tmp_path, model: nn.Module, name: str, *, accumulation: int = 1,
                 cls: type = ConstrainedTrainer, regulariser=None) -> ConstrainedTrainer:
    collate = PaddingCollator(pad_token_id=0)
    args = ConstrainedTrainingArguments(
        output_dir=str(tmp_path / name), per_device_train_batch_size=4, gradient_accumulation_steps=accumulation,
        max_steps=4, learning_rate=0.05, lr_scheduler_type="constant", max_grad_norm=0.0, seed=0, use_cpu=True,
        report_to=[], save_strategy="no", disable_tqdm=True, remove_unused_columns=False,
        constraint_penalty="hinge", penalty_beta=5.0, constraint_batch_size=3, msvr_gamma_prime=0.1)
    protected = {"a": Rows(24, 1), "b": Rows(24, 2)}
    constraints = non_forgetting_constraints(model, causal_lm_per_example_loss, protected, collate,
                                             row_fn=ReferenceGap(causal_lm_per_example_loss),
                                             config=NonForgettingConfig(tolerance=-1.0, batch_size=8))
    return cls(model=model, args=args, train_dataset=Rows(32, 0), data_collator=collate, constraints=constraints,
               regulariser=regulariser)


def test_shared_forward_gives_the_separate_forwards_step(tmp_path):
    """float64: parameters and estimates after 4 steps (hinge active: tolerance -1) agree to 1e-12 whether
    the constraint rows run in the objective's forward or in their own; the shared run makes one model call
    fewer per step (the objective's and the rows' forward are one)."""
    results = {}
    for accumulation in (1, 2):
        for shared in (True, False):
            trainer = make_trainer(tmp_path, llama(tmp_path), f"run_{shared}_{accumulation}",
                                   accumulation=accumulation)
            trainer._forward_shareable = shared
            calls = count_forwards(trainer.model)
            trainer.train()
            params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
            results[shared] = (params, trainer.engine.estimator.values.clone(), calls[0])
        (p1, u1, c1), (p0, u0, c0) = results[True], results[False]
        assert torch.allclose(p1, p0, rtol=0, atol=1e-12), (p1 - p0).abs().max()
        assert torch.allclose(u1, u0, rtol=0, atol=1e-12)
        initial = torch.cat([p.detach().flatten() for p in llama(tmp_path).parameters()])
        assert (p1 - initial).abs().max() > 1e-3  # it trained
        assert c0 - c1 == 4, (c0, c1)  # one call fewer per optimizer step


def test_replay_of_the_constraint_rows_shares_the_objectives_forward(tmp_path):
    """Replay that reads the constraints' rows (ConstraintRowReplay) keeps one forward for the objective's, the
    replayed and the constraint rows: float64 parameters and estimates agree to 1e-12 with the rows in a forward
    of their own, and each step makes two model calls (that forward and the look-ahead), where replay with
    rows of its own beside the hinge makes four (objective, replayed rows, constraint rows, look-ahead)."""
    results = {}
    for shared in (True, False):
        trainer = make_trainer(tmp_path, llama(tmp_path), f"replay_{shared}", regulariser=ConstraintRowReplay(0.5))
        trainer._forward_shareable = shared
        calls = count_training_forwards(trainer)
        trainer.train()
        params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        results[shared] = (params, trainer.engine.estimator.values.clone(), calls[0])
    (p1, u1, c1), (p0, u0, c0) = results[True], results[False]
    assert torch.allclose(p1, p0, rtol=0, atol=1e-12), (p1 - p0).abs().max()
    assert torch.allclose(u1, u0, rtol=0, atol=1e-12)
    assert (c1, c0) == (2 * 4, 3 * 4)
    collate = PaddingCollator(pad_token_id=0)
    own = make_trainer(tmp_path, llama(tmp_path), "own", regulariser=Replay(Rows(24, 1), 0.5, collate))
    calls = count_training_forwards(own)
    own.train()
    assert calls[0] == 4 * 4, calls[0]


def test_shared_forward_moves_the_parameters_as_the_penalty_says(tmp_path):
    """The shared forward's loss carries the constraint gradient: with the hinge always active, the step
    differs from the unconstrained one on the same data (a shared forward that dropped the rows would not)."""
    trainer = make_trainer(tmp_path, llama(tmp_path), "c")
    trainer.train()
    assert trainer._forward_shareable is True
    plain = make_trainer(tmp_path, llama(tmp_path), "p")
    plain.penalty.active = False  # the same trainer without the constraint part
    plain.train()
    a = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    b = torch.cat([p.detach().flatten() for p in plain.model.parameters()])
    assert (a - b).abs().max() > 1e-6


def test_only_where_no_value_changes(tmp_path):
    assert trains_as_it_evaluates(llama(tmp_path))
    assert not trains_as_it_evaluates(llama(tmp_path, dropout=0.1))  # functional dropout, from the config
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=VOCAB))
    assert not trains_as_it_evaluates(gpt2)  # nn.Dropout modules
    # without dropout: GPT-2's summary_first_dropout (0.1) is read by GPT2DoubleHeadsModel's head only
    quiet = GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0,
                       attn_pdrop=0.0)
    assert quiet.summary_first_dropout > 0 and trains_as_it_evaluates(GPT2LMHeadModel(quiet))
    assert not trains_as_it_evaluates(GPT2DoubleHeadsModel(quiet))  # its summary head's nn.Dropout(0.1)
    trainer = make_trainer(tmp_path, gpt2, "g")
    assert not trainer.objective_forward_shareable()

    class CustomObjective(ConstrainedTrainer):  # a user's objective may read the batch: never merged into
        def compute_objective_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_objective_loss(model, inputs, return_outputs, num_items_in_batch)

    assert make_trainer(tmp_path, llama(tmp_path), "l").objective_forward_shareable()
    assert not make_trainer(tmp_path, llama(tmp_path), "u", cls=CustomObjective).objective_forward_shareable()
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.ones(2, 3, dtype=torch.long)}
    assert SharedObjectiveForward.for_inputs({**batch, "position_ids": batch["labels"]}, print) is None
    assert SharedObjectiveForward.for_inputs(batch, print) is not None


def test_merge_pads_on_the_right():
    objective = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.tensor([[1, 1, 1]])}
    rows = {"input_ids": torch.tensor([[1, 2, 3, 4, 9], [3, 4, 0, 0, 0]]),
            "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])}
    merged = merge_right_padded(objective, rows)
    assert merged["input_ids"].tolist() == [[5, 6, 7, 0, 0], [1, 2, 3, 4, 9], [3, 4, 0, 0, 0]]
    assert merged["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]


def test_merged_forward_gives_the_models_own_loss_and_logits(tmp_path):
    """One call over objective and constraint rows: the objective's loss and logits are the model's own on
    the objective's rows alone (with and without num_items_in_batch), the rows' logits their own."""
    model = llama(tmp_path)
    collate = PaddingCollator(pad_token_id=0)
    objective = collate([Rows(3, 7)[i] for i in range(3)])
    rows = collate([Rows(4, 8)[i] for i in range(4)])
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(9)}):
        merged = MergedForward(model, {k: rows[k] for k in ("input_ids", "attention_mask")})
        out = merged(**objective, **kwargs)
        alone = model(**objective, **kwargs)
        assert torch.allclose(out["loss"], alone.loss, rtol=0, atol=1e-12)
        assert torch.allclose(out["logits"], alone.logits, rtol=0, atol=1e-12)
        by_themselves = model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"]).logits
        width = rows["input_ids"].shape[1]
        assert torch.allclose(merged.row_logits[:, :width], by_themselves, rtol=0, atol=1e-12)


def test_merged_forward_with_constraint_rows_wider_than_the_objectives_float32_gpt2():
    """GPT-2 in float32: the objective's logits are a slice of the merged (wider) logits, and its loss function
    views them flat; the merged loss is the model's own on the objective's rows."""
    config = GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    objective = {"input_ids": torch.randint(1, VOCAB, (3, 5)), "attention_mask": torch.ones(3, 5, dtype=torch.long)}
    objective["labels"] = objective["input_ids"].clone()
    rows = {"input_ids": torch.randint(1, VOCAB, (2, 9)), "attention_mask": torch.ones(2, 9, dtype=torch.long)}
    out = MergedForward(model, rows)(**objective)
    alone = model(**objective)
    assert torch.allclose(out["loss"], alone.loss, rtol=0, atol=1e-6)
