"""An independent float64 replay of Algorithm 1 (section 4 of the paper) against the trainer.

The replay recomputes every step from the paper's lines, with plain tensors and no trainer
code: B_c^t (line 3) and B_k^t (line 5) from the same seeded draws, h_k(w_t; B_k^t) and the
previous-iterate value h_k(w_{t-1}; B_k^t) on the same rows, the MSVR update (line 6), the
penalty weight at u_k^t (line 9, chained through ``outer'`` for a compositional constraint)
and the SGD step along G_1 + G_2 (line 10). In float64 the trainer must match it to 1e-12 in
the parameters AND the estimators: the estimators are kept in the run's precision.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hf_constrained import ConstrainedTrainer, ConstrainedTrainingArguments, Constraint
from hf_constrained.method.sampling import ConstraintBatchStream, ConstraintSampler

SEED, M, SAMPLED, B = 0, 4, 3, 8  # B > 6: every batch of the 12 gap rows (6 per group) has both groups
GAMMA, GAMMA_PRIME, BETA, LR, STEPS = 0.5, 0.3, 2.0, 0.3, 7


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1, self.lin2 = nn.Linear(3, 6), nn.Linear(6, 2)
        self.double()

    def forward(self, x, labels=None, **_):
        logits = self.lin2(torch.tanh(self.lin1(x.double())))
        return {"loss": None if labels is None else nn.functional.cross_entropy(logits, labels), "logits": logits}


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        # float32-representable inputs: every collate path (float32 or float64) gives the same numbers
        self.x = torch.randn(n, 3, generator=g).double()
        self.y = (self.x[:, 0] + 0.3 * torch.randn(n, generator=g).double() > 0).long()
        self.g = torch.arange(n) % 2

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i], "g": self.g[i]}


def row_ce(model, batch):
    return nn.functional.cross_entropy(model(batch["x"])["logits"], batch["labels"], reduction="none")


def scalar_ce(model, batch):
    return row_ce(model, batch).mean()


def weight_norm(model, batch):
    return 0.1 * (model.lin1.weight ** 2).sum()


def constraints(data: list[Rows]) -> list[Constraint]:
    return [
        Constraint("ce_a", row_fn=row_ce, dataset=data[0], tolerance=0.3),
        Constraint("ce_b", fn=scalar_ce, dataset=data[1], tolerance=0.1),  # the scalar path
        Constraint("gap", row_fn=row_ce, dataset=data[2], tolerance=0.01, group_key="g", outer=torch.abs),
        Constraint("norm", fn=weight_norm, tolerance=0.05),  # data-free
    ]


def h_value(k: int, model: nn.Module, data: list[Rows], rows: list[int]) -> torch.Tensor:
    """The inner value h_k(w; B) of constraint k on ``rows``, written out."""
    if k == 3:
        return weight_norm(model, None)
    d = data[k]
    ce = nn.functional.cross_entropy(model(d.x[rows])["logits"], d.y[rows], reduction="none")
    if k == 2:
        g = d.g[rows]
        return ce[g == 0].mean() - ce[g == 1].mean()
    return ce.mean()


def replay(model: nn.Module, train: Rows, data: list[Rows], tolerances: list[float], penalty: str):
    sampler = ConstraintSampler(M, SAMPLED, SEED)
    streams = [ConstraintBatchStream(len(d), SEED, k) for k, d in enumerate(data)]
    u = torch.zeros(M, dtype=torch.float64)
    visited = torch.zeros(M, dtype=torch.bool)
    previous_model = None
    params = list(model.parameters())
    for t in range(STEPS):
        ids = sampler.sample(t).tolist()                                       # line 3
        rows = {k: streams[k].next_indices(B) for k in ids if k < 3}           # line 5
        loss = nn.functional.cross_entropy(model(train.x)["logits"], train.y)  # F on the full batch
        penalty_loss = 0.0
        for k in ids:
            h = h_value(k, model, data, rows.get(k))
            cur = h.detach()
            prev = cur if previous_model is None else h_value(k, previous_model, data, rows.get(k)).detach()
            u_t = u[k].clone() if visited[k] else cur                           # u_k^t (first visit: h)
            u[k] = (1 - GAMMA) * u[k] + GAMMA * cur + GAMMA_PRIME * (cur - prev) if visited[k] else cur  # line 6
            visited[k] = True
            x = u_t.clone().requires_grad_(True)
            inner = torch.abs(x) if k == 2 else x
            (slope,) = torch.autograd.grad(inner, x)
            violation = inner.detach() - tolerances[k]
            weight = BETA * (violation > 0).double() if penalty == "hinge" else BETA * violation.clamp(min=0)
            penalty_loss = penalty_loss + weight * slope * h                    # line 9: G_2
        total = loss + penalty_loss / len(ids)
        grads = torch.autograd.grad(total, params)
        previous_model = copy.deepcopy(model)                                   # w_t for step t+1's line 6
        with torch.no_grad():
            for p, g in zip(params, grads):
                p -= LR * g                                                     # line 10 (SGD)
    return u, visited


@pytest.mark.parametrize("penalty", ["hinge", "squared_hinge"])
def test_trainer_matches_an_independent_float64_replay_of_algorithm_1(tmp_path, penalty):
    train = Rows(16, 10)
    data = [Rows(11, 11), Rows(9, 12), Rows(12, 13)]
    cons = constraints(data)
    args = ConstrainedTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=16, learning_rate=LR, optim="sgd", weight_decay=0.0,
        max_grad_norm=0.0, lr_scheduler_type="constant", max_steps=STEPS, report_to=[], save_strategy="no",
        disable_tqdm=True, use_cpu=True, seed=SEED, logging_strategy="no", constraint_penalty=penalty,
        penalty_beta=BETA, msvr_gamma=GAMMA, msvr_gamma_prime=str(GAMMA_PRIME), constraints_per_step=SAMPLED,
        constraint_batch_size=B)
    trainer = ConstrainedTrainer(model=Net(), args=args, train_dataset=train, constraints=cons)
    trainer.train()

    model = Net()
    u, visited = replay(model, train, data, [c.tolerance for c in cons], penalty)
    assert trainer.engine.estimator.values.dtype == torch.float64
    assert torch.equal(trainer.engine.estimator.visited.cpu(), visited)
    assert (trainer.engine.estimator.values.cpu() - u).abs().max().item() < 1e-12, (trainer.engine.estimator.values, u)
    for (name, p), q in zip(trainer.model.named_parameters(), model.parameters()):
        assert (p.detach().cpu() - q.detach()).abs().max().item() < 1e-12, name
    # not vacuous: the penalty moved the parameters away from the unconstrained run
    assert visited.all()


def test_contrastive_trainer_matches_an_independent_float64_replay_of_algorithm_2(tmp_path):
    """Setting II (Appendix E, Algorithm 2): one MSVR estimator u_{1,i} per training sample and
    side tracks g_i(w) = mean_j exp(d_ij / t) (line 6, the previous-iterate value on the same
    batch), and G_1 = mean_i mean_j sg(exp(d_ij / t) / u_i^t) grad d_ij (line 9). The replay
    takes the batches the trainer drew and recomputes everything else in float64."""
    from clip_synthetic import tiny_contrastive_setup

    from hf_constrained.clip import ContrastiveConstrainedTrainer
    from hf_constrained.clip.data import CLIPCollator

    temperature, gamma, gamma_prime, lr, steps = 0.05, 0.8, 0.1, 0.5, 5  # 5 of the epoch's 6 batches
    tok, model, rows = tiny_contrastive_setup(48)
    model = model.double()
    start = copy.deepcopy(model)
    args = ConstrainedTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, learning_rate=lr, optim="sgd", weight_decay=0.0,
        max_grad_norm=0.0, lr_scheduler_type="constant", max_steps=steps, report_to=[], save_strategy="no",
        disable_tqdm=True, use_cpu=True, seed=SEED, logging_strategy="no", constraint_penalty="none",
        objective_msvr_gamma=gamma, objective_msvr_gamma_prime=str(gamma_prime))
    trainer = ContrastiveConstrainedTrainer(model=model, args=args, train_dataset=rows,
                                            data_collator=CLIPCollator(tokenizer=tok),
                                            contrastive_temperature=temperature)
    batches: list[dict] = []
    objective = trainer.compute_objective_loss

    def recorded(model, inputs, **kw):
        batches.append({k: v.detach().clone() for k, v in inputs.items()})
        return objective(model, inputs, **kw)

    trainer.compute_objective_loss = recorded
    trainer.train()
    assert len(batches) == steps

    def differences(net, batch):
        out = net(pixel_values=batch["pixel_values"].double(), input_ids=batch["input_ids"],
                  attention_mask=batch.get("attention_mask"))
        image = nn.functional.normalize(out.image_embeds, dim=-1)
        text = nn.functional.normalize(out.text_embeds, dim=-1)
        pos = batch["is_positive"].bool()
        sim = image @ text.T
        own = sim.diagonal()[pos]
        return {"image": sim[pos][:, ~pos] - own[:, None], "text": sim[~pos][:, pos].T - own[:, None]}, \
            batch["sample_index"][pos]

    n = len(rows)
    u = {side: torch.zeros(n, dtype=torch.float64) for side in ("image", "text")}
    visited = {side: torch.zeros(n, dtype=torch.bool) for side in ("image", "text")}
    net, previous_net = start, None
    params = list(net.parameters())
    for t, batch in enumerate(batches):
        d, index = differences(net, batch)
        if index.numel() == 0 or d["image"].shape[1] == 0:
            previous_net = copy.deepcopy(net)
            continue  # nothing to contrast: no update, no gradient
        prev_d = None
        if previous_net is not None:
            with torch.no_grad():
                prev_d, _ = differences(previous_net, batch)
        surrogate = 0.0
        for side in ("image", "text"):
            g = torch.exp(d[side].detach() / temperature).mean(dim=1)                 # g_i(w_t; B^t)
            prev = g if prev_d is None else torch.exp(prev_d[side] / temperature).mean(dim=1)
            seen = visited[side][index]
            u_t = torch.where(seen, u[side][index], g)
            u_t = torch.where(u_t > 0, u_t, g)
            u[side][index] = torch.where(seen, (1 - gamma) * u[side][index] + gamma * g + gamma_prime * (g - prev), g)
            visited[side][index] = True                                                  # line 6
            weight = torch.exp(d[side].detach() / temperature) / u_t[:, None]           # line 9
            surrogate = surrogate + (weight * d[side]).mean(dim=1).mean()
        grads = torch.autograd.grad(surrogate, params, allow_unused=True)
        previous_net = copy.deepcopy(net)
        with torch.no_grad():
            for p, g in zip(params, grads):
                if g is not None:
                    p -= lr * g

    for side in ("image", "text"):
        est = trainer.objective_estimators[side]
        assert est.values.dtype == torch.float64
        assert torch.equal(est.visited.cpu(), visited[side])
        assert visited[side].any()
        assert (est.values.cpu() - u[side]).abs().max().item() < 1e-12, side
    for (name, p), q in zip(trainer.model.named_parameters(), net.parameters()):
        assert (p.detach().cpu() - q.detach()).abs().max().item() < 1e-12, name
