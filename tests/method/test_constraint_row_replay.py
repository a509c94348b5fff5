"""Replay of the constraints' own rows (``ConstraintRowReplay``): one draw of old rows per step, each row's loss
computed once, one backward applying replay's weight plus the hinge's (Algorithm 1, lines 5, 6 and 9).

The float64 test recomputes every step by hand from the paper's lines and the replay's loss
``(1 - r) F_new + (1/|B_c|) sum_k (r + beta 1[u_k^t > tol_k]) h_k(w_t; B_k^t)``, with no trainer code."""

from __future__ import annotations

import copy

import pytest
import torch
from scale_tiny import StopAt, count_training_forwards
from torch import nn

from hf_constrained import ConstrainedTrainer, ConstrainedTrainingArguments
from hf_constrained.method.regularisers import ConstraintRowReplay, Replay
from hf_constrained.method.sampling import ConstraintBatchStream, ConstraintSampler
from hf_constrained.non_forgetting import NonForgettingConfig, non_forgetting_constraints

SEED, M, SAMPLED, B = 0, 3, 2, 4
GAMMA, GAMMA_PRIME, BETA, LR, STEPS, RATIO = 0.5, 0.3, 2.0, 0.3, 6, 0.4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1, self.lin2 = nn.Linear(3, 6), nn.Linear(6, 2)
        self.double()

    def forward(self, x, labels=None):  # no **kwargs: the Trainer averages gradient accumulation windows
        logits = self.lin2(torch.tanh(self.lin1(x.double())))
        return {"loss": None if labels is None else nn.functional.cross_entropy(logits, labels), "logits": logits}


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int, flip: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, generator=g).double()
        self.y = (self.x[:, 0] + 0.3 * torch.randn(n, generator=g).double() > 0).long()
        if flip:  # the new task disagrees with the old ones: fitting it forgets them
            self.y = 1 - self.y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


def row_ce(model, batch):
    return nn.functional.cross_entropy(model(batch["x"])["logits"], batch["labels"], reduction="none")


def setup(tmp_path, name: str, penalty: str = "hinge", accumulation: int = 1, **overrides):
    old = [Rows(10, 11), Rows(9, 12), Rows(12, 13)]
    constraints = non_forgetting_constraints(Net(), row_ce, {f"t{k}": d for k, d in enumerate(old)},
                                             config=NonForgettingConfig(tolerance=0.0, batch_size=16))
    args = ConstrainedTrainingArguments(
        output_dir=str(tmp_path / name), per_device_train_batch_size=8 // accumulation,
        gradient_accumulation_steps=accumulation, learning_rate=LR, optim="sgd", weight_decay=0.0, max_grad_norm=0.0,
        lr_scheduler_type="constant", max_steps=STEPS, report_to=[], disable_tqdm=True,
        use_cpu=True, seed=SEED, logging_strategy="no", constraint_penalty=penalty, penalty_beta=BETA,
        msvr_gamma=GAMMA, msvr_gamma_prime=str(GAMMA_PRIME), constraints_per_step=SAMPLED, constraint_batch_size=B,
        **{"save_strategy": "no", **overrides})
    trainer = ConstrainedTrainer(model=Net(), args=args, train_dataset=Rows(8, 10, flip=True),
                                 constraints=constraints, regulariser=ConstraintRowReplay(RATIO))
    return trainer, old


def by_hand(old: list[Rows], penalty: str) -> tuple[nn.Module, torch.Tensor]:
    model, train = Net(), Rows(8, 10, flip=True)
    with torch.no_grad():
        # the old model's row losses, once, stored in float32 as the library stores them
        reference = [row_ce(model, {"x": d.x, "labels": d.y}).float().double() for d in old]
    sampler = ConstraintSampler(M, SAMPLED, SEED)
    streams = [ConstraintBatchStream(len(d), SEED, k) for k, d in enumerate(old)]
    u, visited = torch.zeros(M, dtype=torch.float64), torch.zeros(M, dtype=torch.bool)
    previous_model, params = None, list(model.parameters())

    def h(net, k, rows):  # h_k(w; B_k): the mean row loss now minus the old model's on the same rows
        return row_ce(net, {"x": old[k].x[rows], "labels": old[k].y[rows]}).mean() - reference[k][rows].mean()

    for t in range(STEPS):
        ids = sampler.sample(t).tolist()                                            # line 3
        rows = {k: streams[k].next_indices(B) for k in ids}                         # line 5: the one draw
        total = (1 - RATIO) * nn.functional.cross_entropy(model(train.x)["logits"], train.y)
        for k in ids:
            value = h(model, k, rows[k])
            cur = value.detach()
            u_t = u[k].clone() if visited[k] else cur                               # u_k^t
            if penalty == "hinge":
                prev = cur if previous_model is None else h(previous_model, k, rows[k]).detach()
                u[k] = (1 - GAMMA) * u[k] + GAMMA * cur + GAMMA_PRIME * (cur - prev) if visited[k] else cur  # line 6
                visited[k] = True
            weight = BETA * float(u_t > 0) if penalty == "hinge" else 0.0          # line 9
            total = total + (RATIO + weight) * value / len(ids)                     # replay's weight + the hinge's
        grads = torch.autograd.grad(total, params)
        previous_model = copy.deepcopy(model)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p -= LR * g
    return model, u


@pytest.mark.parametrize("penalty,accumulation", [("hinge", 1), ("hinge", 2), ("none", 1)])
def test_one_draw_step_matches_the_step_computed_by_hand(tmp_path, penalty, accumulation):
    trainer, old = setup(tmp_path, "run", penalty=penalty, accumulation=accumulation)
    forwards = count_training_forwards(trainer)  # the preflight's calls before training are not steps
    trainer.train()
    model, u = by_hand(old, penalty)
    for (name, p), q in zip(trainer.model.named_parameters(), model.parameters()):
        assert (p.detach() - q.detach()).abs().max().item() < 1e-12, name
    if penalty == "hinge":
        assert (trainer.engine.estimator.values - u).abs().max().item() < 1e-12
        active = torch.stack(trainer.engine.step_metrics["constraint/sampled_active_fraction"])
        assert 0 < active.sum() < len(active), active  # the hinge switched on at some steps, not all
    # model calls per step: the objective (per micro-batch), the old rows once, the look-ahead (hinge only);
    # the replay draws and forwards nothing of its own
    assert forwards[0] == STEPS * (accumulation + 1 + (penalty == "hinge")), forwards[0]


def test_replay_share_moves_the_step(tmp_path):
    """Not vacuous: without the replay's weight the trained parameters differ (the rows carry it)."""
    trainer, _ = setup(tmp_path, "with")
    trainer.train()
    other, _ = setup(tmp_path, "without")
    other.regularised = None  # the same run, the hinge alone
    other.train()
    a = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    b = torch.cat([p.detach().flatten() for p in other.model.parameters()])
    assert (a - b).abs().max() > 1e-4


def test_resume_is_bitwise_exact(tmp_path):
    straight, _ = setup(tmp_path, "straight", save_strategy="steps", save_steps=3)
    straight.train()
    stopped, _ = setup(tmp_path, "stopped", save_strategy="steps", save_steps=3)
    stopped.add_callback(StopAt(3))
    stopped.train()
    resumed, _ = setup(tmp_path, "resumed", save_strategy="steps", save_steps=3)
    resumed.train(resume_from_checkpoint=str(tmp_path / "stopped" / "checkpoint-3"))
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(straight.engine.estimator.values, resumed.engine.estimator.values)


def _trainer_with(constraints, regulariser, **args):
    args = ConstrainedTrainingArguments(output_dir="unused", use_cpu=True, report_to=[], constraint_penalty="hinge",
                                        **args)
    return ConstrainedTrainer(model=Net(), args=args, train_dataset=Rows(8, 10), constraints=constraints,
                              regulariser=regulariser)


def test_what_cannot_be_replayed_in_one_draw_is_refused_before_training():
    cons = non_forgetting_constraints(Net(), row_ce, {"small": Rows(5, 1), "big": Rows(40, 2)},
                                      config=NonForgettingConfig(tolerance=0.0))
    with pytest.raises(ValueError, match=r"'non_forgetting/small'.* 5 rows .* draw of 8"):
        _trainer_with(cons, ConstraintRowReplay(0.5), constraint_batch_size=8)
    cons = non_forgetting_constraints(Net(), row_ce, {"a": Rows(40, 1)}, config=NonForgettingConfig(tolerance=0.0))
    cons[0].row_transform = torch.relu
    with pytest.raises(ValueError, match="'non_forgetting/a'.*row_transform"):
        _trainer_with(cons, ConstraintRowReplay(0.5))
    with pytest.raises(ValueError, match="has no constraints|give the trainer constraints"):
        args = ConstrainedTrainingArguments(output_dir="unused", use_cpu=True, report_to=[], constraint_penalty="none")
        ConstrainedTrainer(model=Net(), args=args, train_dataset=Rows(8, 10), regulariser=ConstraintRowReplay(0.5))
    from hf_constrained import Constraint
    plain = Constraint("plain", row_fn=row_ce, dataset=Rows(40, 3), tolerance=0.5)
    with pytest.raises(ValueError, match="'plain'.*not a per-row loss"):
        _trainer_with([plain], ConstraintRowReplay(0.5))
    for bad in (0, 1, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="ratio"):
            ConstraintRowReplay(bad)


def test_replay_of_its_own_rows_beside_the_hinge_says_it_draws_twice(caplog):
    cons = non_forgetting_constraints(Net(), row_ce, {"a": Rows(40, 1)}, config=NonForgettingConfig(tolerance=0.0))
    with caplog.at_level("INFO", logger="hf_constrained.method.regularisers"):
        _trainer_with(cons, Replay(Rows(40, 1), 0.5, collate=lambda rows: torch.utils.data.default_collate(rows)))
    assert "two draws of old rows" in caplog.text
