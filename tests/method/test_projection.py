"""A-GEM and replay + A-GEM (hf_constrained.method.projection) against a hand-computed projection.

A float64 linear least-squares model whose gradients are written out in closed form: every step of the trainer
is replayed by hand (the new batch's gradient g, the reference gradient g_ref of the step's reference rows at w_t,
A-GEM's projection when g . g_ref < 0, plain SGD) and must match to float rounding. Then: gradient accumulation
(two micro-batches train as one batch), the replay batch as the reference batch, kill-and-resume, bad input.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from scale_tiny import ListDataset, StopAt, make_data, make_trainer, snapshot, tiny_args
from torch import nn
from transformers import TrainerCallback

from hf_constrained import ConstrainedTrainer
from hf_constrained.batches import collate_examples
from hf_constrained.method.projection import (
    AGEM,
    PROJECTIONS,
    GradientProjection,
    MicroBatch,
    ProjectedGradient,
    ReplayAGEM,
    agem_project,
    make_projection,
)
from hf_constrained.method.regularisers import L2ToOld, Replay
from hf_constrained.trainer import CONSTRAINT_STATE_NAME

D = 4  # features
B = 8  # new rows per step
LR = 0.1


class Linear64(nn.Module):
    """``pred = x . w + b``, loss the mean squared error: gradients in closed form (:func:`hand_grad`)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(D, 1).double()

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None) -> dict[str, Any]:
        pred = self.lin(x.double()).squeeze(-1)
        return {"loss": None if labels is None else ((pred - labels.double()) ** 2).mean(), "logits": pred}


def rows(n: int, coef: torch.Tensor, seed: int) -> ListDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    y = x @ coef + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    return ListDataset([{"x": x[i], "labels": y[i]} for i in range(n)])


NEW = torch.tensor([1.0, -2.0, 0.5, 1.5], dtype=torch.float64)


def old_tasks(conflict: bool) -> list[ListDataset]:
    """Two old tasks of 12 and 20 rows; ``conflict``: targets against the new task's (g . g_ref < 0 from the start)."""
    sign = -1.0 if conflict else 1.0
    return [rows(12, sign * NEW, 11), rows(20, sign * NEW + 0.2, 12)]


def stack(data: ListDataset, idx: Optional[list[int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    idx = range(len(data)) if idx is None else idx
    return torch.stack([data[i]["x"] for i in idx]), torch.stack([data[i]["labels"] for i in idx])


def hand_grad(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient of mean((x . w[:D] + w[D] - y)^2) in (weight, bias), written out."""
    resid = x @ w[:D] + w[D] - y
    return torch.cat([2.0 / len(y) * resid @ x, (2.0 / len(y) * resid.sum()).reshape(1)])


def params(model: Linear64) -> torch.Tensor:
    return torch.cat([model.lin.weight.detach().reshape(-1), model.lin.bias.detach()])


def args(out: str, **kw: Any):
    base = dict(constraint_penalty="none", optim="sgd", learning_rate=LR, max_steps=5, per_device_train_batch_size=B,
                max_grad_norm=0.0, weight_decay=0.0)
    base.update(kw)
    return tiny_args(out, **base)


def train(out: str, projection: Optional[GradientProjection], regulariser: Any = None,
          new: Optional[ListDataset] = None, **kw: Any) -> tuple[Linear64, ConstrainedTrainer]:
    model = Linear64()
    trainer = ConstrainedTrainer(model=model, args=args(out, **kw), train_dataset=new or rows(B, NEW, 3),
                                 data_collator=collate_examples, regulariser=regulariser,
                                 gradient_projection=projection)
    trainer.train()
    return model, trainer


def by_hand_agem(agem: AGEM, steps: int, max_grad_norm: float = 0.0) -> tuple[torch.Tensor, list[bool]]:
    """The A-GEM run replayed by hand: every step's batch is the whole new set (B rows)."""
    w = params(Linear64())
    xn, yn = stack(rows(B, NEW, 3))
    projected = []
    for t in range(steps):
        g = hand_grad(w, xn, yn)
        if max_grad_norm > 0:  # the Trainer clips first (torch's clip_grad_norm_), then A-GEM projects
            g = g * min(1.0, max_grad_norm / (float(g.norm()) + 1e-6))
        xs, ys = zip(*(stack(d, r) for d, r in zip(agem.datasets, agem.reference_rows(t))))
        g_ref = hand_grad(w, torch.cat(xs), torch.cat(ys))
        dot = float(g @ g_ref)
        projected.append(dot < 0)
        if dot < 0:
            g = g - dot / float(g_ref @ g_ref) * g_ref
        w = w - LR * g
    return w, projected


# ---------------------------------------------------------------------------------------------- the projection
def test_projection_formula_on_conflicting_and_agreeing_gradients():
    g = [torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([2.0], dtype=torch.float64)]
    ref = [torch.tensor([-1.0, 1.0], dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64)]
    # g . ref = -1 - 2 = -3 < 0, ||ref||^2 = 3: g - (-3 / 3) ref = g + ref
    assert agem_project(g, ref) == (True, -3.0)
    assert torch.equal(g[0], torch.tensor([0.0, 1.0], dtype=torch.float64)) and torch.equal(g[1], torch.tensor([1.0],
                                                                                            dtype=torch.float64))
    assert float(sum((a * b).sum() for a, b in zip(g, ref))) == 0.0  # now orthogonal to the reference
    agree = [torch.tensor([1.0, 0.5], dtype=torch.float64)]
    before = agree[0].clone()
    assert agem_project(agree, [torch.tensor([1.0, -1.0], dtype=torch.float64)]) == (False, 0.5)
    assert torch.equal(agree[0], before)  # g . ref >= 0: unchanged
    orthogonal = [torch.tensor([1.0, 1.0], dtype=torch.float64)]
    assert agem_project(orthogonal, [torch.tensor([1.0, -1.0], dtype=torch.float64)])[0] is False
    zero_ref = [torch.tensor([1.0, 1.0], dtype=torch.float64)]
    assert agem_project(zero_ref, [torch.zeros(2, dtype=torch.float64)])[0] is False
    # a parameter without a gradient counts as a zero gradient and stays without one
    g2 = [None, torch.tensor([1.0], dtype=torch.float64)]
    assert agem_project(g2, [torch.tensor([5.0], dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64)])[0]
    assert g2[0] is None and torch.allclose(g2[1], torch.tensor([1.0 - 1.0 / 26], dtype=torch.float64))


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.5])
def test_agem_steps_match_the_hand_computed_projection(tmp_path, max_grad_norm):
    agem = AGEM(old_tasks(conflict=True), 3, collate_examples, seed=5)
    model, trainer = train(str(tmp_path), agem, max_grad_norm=max_grad_norm)
    w, projected = by_hand_agem(agem, 5, max_grad_norm)
    assert all(projected), "the set-up must conflict at every step"
    torch.testing.assert_close(params(model), w, rtol=0, atol=1e-12)
    assert trainer.projected.projected_steps == trainer.projected.steps == 5
    # the projection changed the run: plain SGD (and the same steps with the opposite rule) end elsewhere
    plain, _ = train(str(tmp_path / "plain"), None, max_grad_norm=max_grad_norm)
    assert (params(plain) - w).abs().max() > 1e-3


def test_agem_leaves_agreeing_gradients_unchanged(tmp_path):
    agem = AGEM(old_tasks(conflict=False), 3, collate_examples, seed=5)
    model, trainer = train(str(tmp_path), agem)
    w, projected = by_hand_agem(agem, 5)
    assert not any(projected) and trainer.projected.projected_steps == 0 and trainer.projected.steps == 5
    plain, _ = train(str(tmp_path / "plain"), None)
    assert torch.equal(params(model), params(plain))  # exactly SGD
    torch.testing.assert_close(params(model), w, rtol=0, atol=1e-12)


def test_reference_batch_is_balanced_and_a_function_of_seed_and_draw():
    tasks = old_tasks(True)
    agem = AGEM(tasks, 3, collate_examples, seed=1)
    seen: list[set[int]] = [set(), set()]
    for draw in range(4):
        per_task = agem.reference_rows(draw)
        assert [len(r) for r in per_task] == [3, 3]  # equal rows per task, whatever the task's size
        assert all(0 <= i < len(d) for r, d in zip(per_task, tasks) for i in r)
        for s, r in zip(seen, per_task):
            s.update(r)
        batch = agem.reference_batch(draw)
        assert batch["x"].shape == (6, D)
        assert per_task == AGEM(tasks, 3, collate_examples, seed=1).reference_rows(draw)  # nothing to save
    assert seen[0] == set(range(12))  # 12 rows of 12 in four draws: a shuffled pass
    assert AGEM(tasks, 3, collate_examples, seed=2).reference_rows(0) != agem.reference_rows(0)
    # one reference batch per optimizer step: the first micro-batch of the window, drawn by step
    assert agem.reference_loss(Linear64(), None, MicroBatch(2, 1, 2)) is None
    loss, weight = agem.reference_loss(Linear64(), None, MicroBatch(2, 0, 2, world=2, rank=1))
    assert weight == 6 and MicroBatch(2, 0, 2, world=2, rank=1).step_draw == 5


def test_agem_from_a_task_column_groups_rows_by_task():
    data = ListDataset([{"x": torch.zeros(D), "labels": torch.tensor(0.0), "task": torch.tensor(i % 3)}
                        for i in range(10)])
    agem = AGEM.from_task_column(data, "task", 2, collate_examples)
    assert agem.task_names == ["0", "1", "2"] and [len(d) for d in agem.datasets] == [4, 3, 3]
    assert {int(agem.datasets[1][i]["task"]) for i in range(3)} == {1}
    from datasets import Dataset

    hf = Dataset.from_dict({"v": list(range(6)), "task": ["a", "b", "a", "b", "b", "b"]})
    agem = AGEM.from_task_column(hf, "task", 1, collate_examples)
    assert agem.settings()["rows"] == {"a": 2, "b": 4} and agem.settings()["rows_per_step"] == 2
    with pytest.raises(ValueError, match="task column 'nope'"):
        AGEM.from_task_column(hf, "nope", 1, collate_examples)


# ---------------------------------------------------------------------------------------------- accumulation
def _accumulated(tmp_path, make, accumulation: int) -> tuple[torch.Tensor, ProjectedGradient]:
    projection, regulariser = make()
    model, trainer = train(str(tmp_path / f"ga{accumulation}"), projection, regulariser, new=rows(64, NEW, 3),
                           per_device_train_batch_size=B // accumulation, gradient_accumulation_steps=accumulation,
                           max_steps=6)
    return params(model), trainer.projected


def _agem():
    return AGEM(old_tasks(conflict=True), 3, collate_examples, seed=5), None


def _replay_agem():
    # the replayed rows are in the objective too: g . g_ref < 0 needs old targets at less than the new ones' scale
    replay = Replay(rows(20, -0.5 * NEW, 13), 0.5, collate_examples, seed=4)
    return ReplayAGEM(replay), replay


@pytest.mark.parametrize("make", [_agem, _replay_agem], ids=["agem", "replay_agem"])
def test_gradient_accumulation_projects_the_whole_step_once(tmp_path, make):
    """Two micro-batches of 4 rows train as one batch of 8 (to float rounding): the projection acts once, on the
    accumulated gradient, against one reference gradient at w_t. Projecting each micro-batch would differ."""
    whole, w_proj = _accumulated(tmp_path, make, 1)
    accumulated, a_proj = _accumulated(tmp_path, make, 2)
    assert w_proj.projected_steps > 0 and a_proj.projected_steps == w_proj.projected_steps
    assert w_proj.steps == a_proj.steps == 6
    torch.testing.assert_close(accumulated, whole, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------- replay + A-GEM
@pytest.mark.parametrize("accumulation", [1, 2])
def test_replay_agem_reference_batch_is_the_replay_batch(tmp_path, accumulation):
    """g_ref is the gradient at w_t of the replay loss on exactly the old rows the replay mixed into the step."""
    projection, replay = _replay_agem()
    replay_rows: dict[int, list[int]] = {}  # step -> the replay's old rows of the step (all its micro-batches)
    draw_rows, apply = replay.replay_rows, replay.apply
    state = {"in_apply": False, "step": None}

    def recorded(draw: int, num_new: int) -> list[int]:
        out = draw_rows(draw, num_new)
        if state["in_apply"]:
            replay_rows.setdefault(state["step"], []).extend(out)
        return out

    def applied(model, objective, inputs, draw):
        state["in_apply"] = True
        try:
            return apply(model, objective, inputs, draw)
        finally:
            state["in_apply"] = False

    replay.replay_rows, replay.apply = recorded, applied
    model = Linear64()
    trainer = ConstrainedTrainer(model=model, args=args(str(tmp_path), per_device_train_batch_size=B // accumulation,
                                                        gradient_accumulation_steps=accumulation, max_steps=4),
                                 train_dataset=rows(64, NEW, 3), data_collator=collate_examples, regulariser=replay,
                                 gradient_projection=projection)
    reference, checked = trainer.projected.reference, []

    def checked_reference(step: int) -> list[torch.Tensor]:
        g_ref = reference(step)
        x, y = stack(replay.dataset, replay_rows[step])  # the parameters are still w_t here
        torch.testing.assert_close(torch.cat([r.reshape(-1) for r in g_ref]), hand_grad(params(model), x, y),
                                   rtol=0, atol=1e-12)
        checked.append(step)
        return g_ref

    trainer.projected.reference = checked_reference

    class Step(TrainerCallback):
        def on_step_begin(self, args, s, control, **kw):
            state["step"] = s.global_step

    trainer.add_callback(Step())
    trainer.train()
    assert checked == [0, 1, 2, 3]
    assert all(len(r) == B for r in replay_rows.values())  # ratio 0.5: as many old rows as new ones per step
    assert trainer.projected.projected_steps > 0


def test_replay_agem_needs_its_replay_as_the_trainers_regulariser(tmp_path):
    projection, replay = _replay_agem()
    for regulariser in (None, L2ToOld(1.0), Replay(replay.dataset, 0.5, collate_examples, seed=4)):
        with pytest.raises(ValueError, match="regulariser must be the same Replay"):
            train(str(tmp_path), projection, regulariser)


# ---------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize("make", ["agem", "replay_agem"])
def test_resume_projects_as_the_uninterrupted_run(tmp_path, make):
    """Kill after step 4's checkpoint, resume to 8: bitwise the straight run (with the hinge, on the tiny
    classifier's constraints, their rows the old tasks)."""
    def run(out: str, stop: Optional[int] = None, resume: Optional[str] = None) -> dict:
        _, constraints = make_data(0)
        old = [c.dataset for c in constraints]
        if make == "agem":
            projection, regulariser = AGEM(old, 2, collate_examples, seed=3), None
        else:
            regulariser = Replay(ListDataset([r for d in old for r in d.rows]), 0.5, collate_examples, seed=3)
            projection = ReplayAGEM(regulariser)
        trainer = make_trainer(out, regulariser=regulariser, gradient_projection=projection, max_steps=8,
                               save_strategy="steps", save_steps=4, gradient_accumulation_steps=2,
                               per_device_train_batch_size=4)
        if stop is not None:
            trainer.add_callback(StopAt(stop))
        trainer.train(resume_from_checkpoint=resume)
        return snapshot(trainer) | {"projected": trainer.projected.projected_steps}

    straight = run(str(tmp_path / "straight"))
    assert straight["projected"] > 0
    run(str(tmp_path / "stopped"), stop=4)
    ckpt = tmp_path / "stopped" / "checkpoint-4"
    assert (ckpt / CONSTRAINT_STATE_NAME).is_file()
    resumed = run(str(tmp_path / "resumed"), resume=str(ckpt))
    assert resumed["global_step"] == straight["global_step"] == 8
    for name, p in straight["params"].items():
        assert torch.equal(resumed["params"][name], p), name
    assert torch.equal(resumed["estimator_values"], straight["estimator_values"])


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_input_is_an_error_naming_the_argument():
    tasks = old_tasks(True)
    with pytest.raises(ValueError, match="old_tasks is empty"):
        AGEM([], 2, collate_examples)
    with pytest.raises(ValueError, match=r"old_tasks\['b'\] is empty"):
        AGEM({"a": tasks[0], "b": ListDataset([])}, 2, collate_examples)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="rows_per_task must be an integer >= 1"):
            AGEM(tasks, bad, collate_examples)
    with pytest.raises(TypeError, match="old_tasks is one dataset per old task"):
        AGEM(tasks[0], 2, collate_examples)  # one dataset, not a list of them
    with pytest.raises(TypeError, match="replay must be a Replay"):
        ReplayAGEM(L2ToOld(1.0))
    with pytest.raises(TypeError, match="gradient_projection must be a GradientProjection"):
        ConstrainedTrainer(model=Linear64(), args=args("unused"), train_dataset=rows(B, NEW, 3),
                           data_collator=collate_examples, gradient_projection=L2ToOld(1.0))
    with pytest.raises(ValueError, match="unknown gradient projection 'gem'"):
        make_projection("gem")
    assert set(PROJECTIONS) == {"agem", "replay_agem"}
    assert make_projection("agem", old_tasks=tasks, rows_per_task=1, collate=collate_examples).settings() == {
        "name": "agem", "rows_per_task": 1, "tasks": 2, "rows_per_step": 2, "rows": {"0": 12, "1": 20}, "seed": 0}


def test_projection_logs_its_share_of_projected_steps(tmp_path):
    agem = AGEM(old_tasks(conflict=True), 3, collate_examples, seed=5)
    _, trainer = train(str(tmp_path), agem, logging_strategy="steps", logging_steps=1)
    shares = [e["projection/projected_share"] for e in trainer.state.log_history if "projection/projected_share" in e]
    assert shares == [1.0] * 5
