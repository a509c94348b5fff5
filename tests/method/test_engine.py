"""Algorithm 1 without the Trainer: :class:`~hf_constrained.method.engine.ConstraintEngine` driven
by a plain PyTorch loop gives the independent float64 replay's parameters and estimators, and its
state (assembled from its parts) continues a run exactly."""

from __future__ import annotations

import torch
from test_replay_float64 import BETA, GAMMA, GAMMA_PRIME, LR, SAMPLED, SEED, STEPS, B, Net, Rows, constraints, replay
from torch import nn

from hf_constrained.batches import BatchMaker
from hf_constrained.method.engine import ConstraintEngine, Placement, StepConfig
from hf_constrained.method.penalties import make_penalty


def engine_for(cons) -> ConstraintEngine:
    return ConstraintEngine(cons, make_penalty("hinge", BETA), BatchMaker(None, lambda batch: batch),
                            StepConfig(gamma=GAMMA, gamma_prime=GAMMA_PRIME, num_sampled=SAMPLED, batch_size=B,
                                       seed=SEED),
                            Placement(torch.device("cpu"), torch.float64))


def train(model: nn.Module, engine: ConstraintEngine, train_rows: Rows, steps: range) -> None:
    """Lines 3-10 of Algorithm 1 per step: the objective plus the engine's penalty loss, one
    backward, the look-ahead of the next step at w_t, then the SGD step."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for t in steps:
        loss = nn.functional.cross_entropy(model(train_rows.x)["logits"], train_rows.y)
        (loss + engine.penalty_loss(model, t)).backward()
        engine.look_ahead(model, t + 1)
        opt.step()
        opt.zero_grad()


def test_engine_in_a_plain_loop_matches_the_replay():
    train_rows, data = Rows(16, 10), [Rows(11, 11), Rows(9, 12), Rows(12, 13)]
    cons = constraints(data)
    model, engine = Net(), engine_for(cons)
    train(model, engine, train_rows, range(STEPS))
    reference = Net()
    u, visited = replay(reference, train_rows, data, [c.tolerance for c in cons], "hinge")
    assert torch.equal(engine.estimator.visited, visited)
    assert (engine.estimator.values - u).abs().max().item() < 1e-12
    for p, q in zip(model.parameters(), reference.parameters()):
        assert (p.detach() - q.detach()).abs().max().item() < 1e-12


def test_engine_state_continues_a_run_exactly():
    """Stop after 3 steps, rebuild everything from ``state_dict`` (estimators, streams, row
    spread, the drawn next step with its look-ahead values) and the parameters: the same end."""
    train_rows, data = Rows(16, 10), [Rows(11, 11), Rows(9, 12), Rows(12, 13)]
    straight_model, straight = Net(), engine_for(constraints(data))
    train(straight_model, straight, train_rows, range(STEPS))

    model, first = Net(), engine_for(constraints(data))
    train(model, first, train_rows, range(3))
    state, weights = first.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    assert state["next_draw"]["step"] == 3 and state["next_draw"]["previous"] is not None
    resumed_model, resumed = Net(), engine_for(constraints(data))
    resumed_model.load_state_dict(weights)
    resumed.load_state_dict(state)
    train(resumed_model, resumed, train_rows, range(3, STEPS))
    assert torch.equal(resumed.estimator.values, straight.estimator.values)
    for p, q in zip(resumed_model.parameters(), straight_model.parameters()):
        assert torch.equal(p, q)
