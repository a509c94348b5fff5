"""Fewer model calls per step: the look-ahead placements and the call shared with the objective.

Against the fused step with separate calls (objective; constraints with grad; look-ahead without),
in float64 with dropout off, sampled constraints, tolerances, ``outer``, a ``group_key``
difference, a scalar constraint mixed in and gradient accumulation:

* ``lookahead_placement`` ``after_backward`` / ``in_call`` give the same parameters, estimators
  and look-ahead values as ``before_backward`` (the look-ahead is at w_t in every placement);
* ``share_objective_call`` (the objective and the constraint rows in ONE model call) gives the
  same update, with one model call per step where the look-ahead rides in it too.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import TrainerCallback

from hf_constrained import ConstrainedTrainer, Constraint, constraints_per_value
from test_fused_step import Net64, make_args, make_data, per_row_ce, rowwise_constraints


class SharedCE:
    """The per-row cross-entropy (the group's row_fn) that can also compute the model's own
    objective in the same forward: the train rows and the constraint rows concatenated."""

    def __call__(self, model, batch):
        return per_row_ce(model, batch)

    def objective_with_rows(self, model, inputs, batch):
        n = inputs["x"].shape[0]
        logits = model(torch.cat([inputs["x"].double(), batch["x"].double()]))["logits"]
        objective = nn.functional.cross_entropy(logits[:n], inputs["labels"])
        return objective, nn.functional.cross_entropy(logits[n:], batch["labels"], reduction="none")


def shared_constraints(data, row_fn) -> list[Constraint]:
    cons = rowwise_constraints(data)
    for c in cons:
        if c.rowwise:
            c.row_fn = row_fn
    return cons


class CountingNet(Net64):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, bool]] = []

    def forward(self, x, labels=None, **kw):
        self.calls.append((x.shape[0], torch.is_grad_enabled()))
        return super().forward(x, labels, **kw)


class ClearCalls(TrainerCallback):
    """Counts only the training steps' calls (not the preflight check before training)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if isinstance(model, CountingNet):
            model.calls.clear()


def train(tmp_path, name, constraints, model=None, **kw):
    trainer = ConstrainedTrainer(model=model or Net64(), args=make_args(tmp_path, name, **kw),
                                 train_dataset=make_data(64, 1), constraints=constraints, callbacks=[ClearCalls()])
    trainer.train()
    return trainer


def assert_same_run(a: ConstrainedTrainer, b: ConstrainedTrainer) -> None:
    for name, p in b.model.named_parameters():
        torch.testing.assert_close(dict(a.model.named_parameters())[name], p, rtol=1e-12, atol=1e-13,
                                   msg=lambda m, n=name: f"{n}: {m}")
    assert torch.equal(a.estimator.visited, b.estimator.visited)
    torch.testing.assert_close(a.estimator.values, b.estimator.values, rtol=1e-6, atol=1e-7)
    assert [s and s.state_dict() for s in a.streams] == [s and s.state_dict() for s in b.streams]
    assert a._next_draw.sample_indices == b._next_draw.sample_indices
    torch.testing.assert_close(a._next_draw.previous, b._next_draw.previous, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("placement", ["after_backward", "in_call"])
def test_lookahead_placements_give_the_same_update(tmp_path, placement, accumulation):
    data = make_data(90, 0)
    kw = dict(gradient_accumulation_steps=accumulation, per_device_train_batch_size=16 // accumulation)
    reference = train(tmp_path, "before", rowwise_constraints(data), lookahead_placement="before_backward", **kw)
    model = CountingNet()
    other = train(tmp_path, placement, rowwise_constraints(data), model=model, lookahead_placement=placement, **kw)
    assert_same_run(other, reference)
    no_grad_calls = [n for n, g in model.calls if not g]
    if placement == "in_call":  # the look-ahead rides in the constraint call: no no-grad call in training
        assert not no_grad_calls
    else:
        assert len(no_grad_calls) == 8  # one per optimizer step


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("placement", ["before_backward", "in_call"])
def test_shared_objective_call_gives_the_same_update(tmp_path, placement, accumulation):
    data = make_data(90, 0)
    kw = dict(gradient_accumulation_steps=accumulation, per_device_train_batch_size=16 // accumulation)
    reference = train(tmp_path, "separate", rowwise_constraints(data), lookahead_placement="before_backward", **kw)
    model = CountingNet()
    shared = train(tmp_path, f"shared_{placement}", shared_constraints(data, SharedCE()), model=model,
                   share_objective_call=True, lookahead_placement=placement, **kw)
    assert shared._shared_group == 0
    assert_same_run(shared, reference)
    if placement == "in_call":
        # per optimizer step ONE model call with grad holds the objective's rows, B_k^t and B_k^(t+1)
        # (the scalar weight_norm constraint does not call the model), then one call per further micro-batch
        assert all(g for n, g in model.calls)
        assert len(model.calls) == 8 * accumulation
        assert sum(n > 16 // accumulation for n, g in model.calls) == 8
    # not vacuous: the constraints moved the parameters
    plain = train(tmp_path, "plain", rowwise_constraints(data), constraint_penalty="none", **kw)
    gap = max((dict(plain.model.named_parameters())[n] - p).abs().max().item()
              for n, p in shared.model.named_parameters())
    assert gap > 1e-3


def test_shared_objective_call_needs_a_row_fn_that_supports_it(tmp_path):
    with pytest.raises(ValueError, match="objective_with_rows"):
        ConstrainedTrainer(model=Net64(), args=make_args(tmp_path, "x", share_objective_call=True),
                           train_dataset=make_data(64, 1), constraints=rowwise_constraints(make_data(90, 0)))


class BatchNormNet(Net64):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(8).double()


@pytest.mark.parametrize("setting", [dict(share_objective_call=True), dict(lookahead_placement="in_call")])
def test_concatenated_calls_refuse_batchnorm(tmp_path, setting):
    with pytest.raises(ValueError, match="BatchNorm"):
        ConstrainedTrainer(model=BatchNormNet(), args=make_args(tmp_path, "bn", **setting),
                           train_dataset=make_data(64, 1), constraints=shared_constraints(make_data(90, 0), SharedCE()))


def test_lookahead_placement_is_checked(tmp_path):
    with pytest.raises(ValueError, match="lookahead_placement"):
        make_args(tmp_path, "x", lookahead_placement="later")


def test_in_call_with_plain_row_values(tmp_path):
    """Constraints without row_transform, one per unit: the fused step takes the outputs as the
    values without per-constraint slicing; with the look-ahead in the call it must take only the
    step's rows of the longer call."""
    data = make_data(90, 0)

    def plain_constraints():
        return constraints_per_value(data, "cls", row_fn=per_row_ce, name="ce_cls{value}",
                                     tolerance={0: 0.2, 1: 0.35, 2: 0.5})

    reference = train(tmp_path, "before", plain_constraints(), lookahead_placement="before_backward",
                      constraints_per_step=2)
    other = train(tmp_path, "in_call", plain_constraints(), lookahead_placement="in_call", constraints_per_step=2)
    assert_same_run(other, reference)
