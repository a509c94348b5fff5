"""Tiny, deterministic set-ups shared by the scale tests (distributed, resume,
accumulation, LoRA) and by ``tests/distributed/run_ddp_check.py``.

A two-layer MLP classifier on synthetic data; four constraints "cross-entropy on group
g <= tolerance" with a tolerance low enough that they stay active, so the penalty and
the MSVR estimators move the parameters. Nothing here depends on downloads.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import TrainerCallback

from hf_constrained import Certification, ConstrainedTrainer, ConstrainedTrainingArguments, Constraint
from hf_constrained.constraint import CertifyStatistic

NUM_FEATURES = 6
NUM_GROUPS = 4


class TinyClassifier(nn.Module):
    """``forward(x, labels) -> {"loss", "logits"}``: what the Trainer needs, nothing else."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(NUM_FEATURES, hidden)
        self.fc2 = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None) -> dict[str, Any]:
        logits = self.fc2(torch.tanh(self.fc1(x)))
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


class ListDataset(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict[str, torch.Tensor]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def make_rows(n: int, seed: int) -> tuple[list[dict[str, torch.Tensor]], list[int]]:
    """``n`` examples ``{"x", "labels"}`` and their group ids (the group shifts the features)."""
    g = torch.Generator().manual_seed(seed)
    groups = torch.randint(0, NUM_GROUPS, (n,), generator=g)
    x = torch.randn(n, NUM_FEATURES, generator=g) + 0.7 * groups[:, None].float()
    w = torch.randn(NUM_FEATURES, generator=g)
    labels = ((x @ w + 0.5 * torch.randn(n, generator=g)) > 0).long()
    rows = [{"x": x[i], "labels": labels[i]} for i in range(n)]
    return rows, groups.tolist()


def group_ce(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """h_g(w; B) = mean cross-entropy of the batch (all rows are from group g)."""
    return model(x=batch["x"], labels=batch["labels"])["loss"]


def make_data(seed: int = 0, n_train: int = 128, n_constraint: int = 96):
    train_rows, _ = make_rows(n_train, seed)
    c_rows, c_groups = make_rows(n_constraint, seed + 1)
    constraints = [
        Constraint(
            name=f"group{k}",
            fn=group_ce,
            dataset=ListDataset([r for r, gk in zip(c_rows, c_groups) if gk == k]),
            tolerance=0.25,
        )
        for k in range(NUM_GROUPS)
    ]
    return ListDataset(train_rows), constraints


def tiny_args(output_dir: str, **overrides: Any) -> ConstrainedTrainingArguments:
    kw: dict[str, Any] = dict(
        output_dir=output_dir,
        per_device_train_batch_size=8,
        learning_rate=0.05,
        max_steps=6,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        weight_decay=0.0,
        seed=0,
        data_seed=0,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        penalty_beta=5.0,
        msvr_gamma=0.8,
        msvr_gamma_prime=0.1,
        constraints_per_step=2,
        constraint_batch_size=6,
    )
    kw.update(overrides)
    return ConstrainedTrainingArguments(**kw)


def make_trainer(output_dir: str, model: Optional[nn.Module] = None, data_seed: int = 0,
                 regulariser: Optional[Any] = None, gradient_projection: Optional[Any] = None,
                 **overrides: Any) -> ConstrainedTrainer:
    torch.manual_seed(1234)
    model = TinyClassifier() if model is None else model
    train, constraints = make_data(data_seed)
    return ConstrainedTrainer(model=model, args=tiny_args(output_dir, **overrides), train_dataset=train,
                              constraints=constraints, regulariser=regulariser,
                              gradient_projection=gradient_projection)


def make_replay(rows_seen: list[list[int]]) -> Any:
    """Replay (ratio 0.5) of 40 rows of their own, recording the old rows of every micro-batch in ``rows_seen``."""
    from hf_constrained.batches import collate_examples
    from hf_constrained.method.regularisers import Replay

    replay = Replay(ListDataset(make_rows(40, 7)[0]), 0.5, collate_examples, seed=0)
    draw_rows = replay.replay_rows

    def recorded(draw: int, num_new: int) -> list[int]:
        rows = draw_rows(draw, num_new)
        rows_seen.append(rows)
        return rows

    replay.replay_rows = recorded
    return replay


def make_projection(kind: str, rows_per_task: int = 2) -> tuple[Any, Any]:
    """(gradient projection, regulariser) for the A-GEM checks: ``agem`` on two old tasks of 20 rows (labels
    flipped against the new task's rule, so the gradients conflict), ``rows_per_task`` rows of each per step and
    process; ``replay_agem``: replay (ratio 0.5) of the same 40 rows as A-GEM's reference batch."""
    from hf_constrained.batches import collate_examples
    from hf_constrained.method.projection import AGEM, ReplayAGEM
    from hf_constrained.method.regularisers import Replay

    old = [{**r, "labels": 1 - r["labels"]} for r in make_rows(40, 7)[0]]
    if kind == "agem":
        return AGEM([ListDataset(old[:20]), ListDataset(old[20:])], rows_per_task, collate_examples, seed=1), None
    replay = Replay(ListDataset(old), 0.5, collate_examples, seed=1)
    return ReplayAGEM(replay), replay


def snapshot(trainer: ConstrainedTrainer) -> dict[str, Any]:
    """Parameters, estimator state and stream positions, detached on CPU."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {
        "params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
        "estimator_values": trainer.engine.estimator.values.detach().cpu().clone(),
        "estimator_visited": trainer.engine.estimator.visited.detach().cpu().clone(),
        "streams": [None if s is None else s.state_dict() for s in trainer.engine.streams],
        "global_step": trainer.state.global_step,
    }


def record_constraint_calls(trainer: ConstrainedTrainer) -> list[tuple[str, list[int], bool]]:
    """Wrap every constraint function so each call appends (name, sample rows, grad on?)
    to the returned list: which rows of which constraint this process evaluated, in order."""
    calls: list[tuple[str, list[int], bool]] = []

    def wrap(name: str, fn):
        def recorded(model, batch):
            if trainer.in_training_step:  # not the preflight check before training
                calls.append((name, batch["sample_index"].tolist(), torch.is_grad_enabled()))
            return fn(model, batch)
        return recorded

    for c in trainer.constraints:
        c.fn = wrap(c.name, c.fn)
    return calls


# ---------------------------------------------------------------------- Setting II (CLIP)
def make_contrastive_trainer(output_dir: str, **overrides: Any):
    """The CLIP helper's ContrastiveConstrainedTrainer (per-sample MSVR estimators,
    Algorithm 2) on a tiny CLIP and 48 image-caption rows, a third of them positives."""
    from clip_synthetic import tiny_contrastive_setup

    from hf_constrained.clip import ContrastiveConstrainedTrainer
    from hf_constrained.clip.data import CLIPCollator

    tok, model, rows = tiny_contrastive_setup(48)
    # plain SGD: Adam would hide a wrong gradient scale (e.g. a factor of the world size)
    kw: dict[str, Any] = dict(per_device_train_batch_size=8, max_steps=4, learning_rate=0.5, optim="sgd",
                              constraint_penalty="none", objective_msvr_gamma=0.8, objective_msvr_gamma_prime=0.1)
    kw.update(overrides)
    return ContrastiveConstrainedTrainer(model=model, args=tiny_args(output_dir, **kw), train_dataset=rows,
                                         data_collator=CLIPCollator(tokenizer=tok))


def contrastive_snapshot(trainer) -> dict[str, Any]:
    model = trainer.accelerator.unwrap_model(trainer.model)
    snap: dict[str, Any] = {"params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
                            "global_step": trainer.state.global_step}
    for side, est in trainer.objective_estimators.items():
        snap[f"{side}_values"] = est.values.detach().cpu().clone()
        snap[f"{side}_visited"] = est.visited.detach().cpu().clone()
    return snap


class StopAt(TrainerCallback):
    """Interrupts training after ``step`` (the checkpoint of that step is still written)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


# ---------------------------------------------------------------------- row-wise (fused step)
def per_row_ce(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The shared row_fn: per-sample cross-entropy, one value per row."""
    return F.cross_entropy(model(x=batch["x"])["logits"], batch["labels"], reduction="none")


def row_errors(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A certification statistic's row function: 1.0 where the argmax class is wrong, else 0.0."""
    return (model(x=batch["x"])["logits"].argmax(-1) != batch["labels"]).double()


def error_statistic(tolerance: float = 0.2) -> CertifyStatistic:
    """The error rate as a certification statistic (for proxy indicators)."""
    return CertifyStatistic(row_errors, tolerance=tolerance, value_range=(0, 1))


def make_rowwise_trainer(output_dir: str, row_fn: Any = per_row_ce, **overrides: Any) -> ConstrainedTrainer:
    """The set-up of :func:`make_trainer` with row-wise constraints sharing one ``row_fn``: the
    four group constraints, plus a gap "CE on groups {0, 1} minus CE on groups {2, 3}" (a
    ``group_key`` difference of two group means, so a mean of per-process means would differ
    from the value on the global batch)."""
    torch.manual_seed(1234)
    model = TinyClassifier()
    train_rows, _ = make_rows(128, 0)
    c_rows, c_groups = make_rows(96, 1)
    c_rows = [dict(r, g=torch.tensor(int(gk >= 2))) for r, gk in zip(c_rows, c_groups)]
    constraints = [
        Constraint(name=f"group{k}", row_fn=row_fn, tolerance=0.25,
                   dataset=ListDataset([r for r, gk in zip(c_rows, c_groups) if gk == k]))
        for k in range(NUM_GROUPS)
    ]
    constraints.append(Constraint(name="gap", row_fn=row_fn, dataset=ListDataset(c_rows), tolerance=-0.1,
                                  group_key="g", outer=torch.abs))
    kw: dict[str, Any] = dict(constraints_per_step=3, max_steps=6)
    kw.update(overrides)
    return ConstrainedTrainer(model=model, args=tiny_args(output_dir, **kw), train_dataset=ListDataset(train_rows),
                              constraints=constraints)


# ---------------------------------------------------------------------- two-split estimation
def row_key(x: torch.Tensor) -> bytes:
    """A row's identity for the two-split checks: the bytes of its feature vector."""
    return x.detach().cpu().numpy().tobytes()


class Recorder:
    """The shared row_fn, recording which rows it scores with grad enabled and without."""

    def __init__(self) -> None:
        self.with_grad: set[bytes] = set()
        self.without_grad: set[bytes] = set()
        self.no_grad_means: list[float] = []
        self.grad_means: list[float] = []

    def __call__(self, model, batch):
        values = per_row_ce(model, batch)
        rows = {row_key(x) for x in batch["x"]}
        (self.with_grad if torch.is_grad_enabled() else self.without_grad).update(rows)
        (self.grad_means if torch.is_grad_enabled() else self.no_grad_means).append(float(values.detach().mean()))
        return values


def indicator_rows(trainer: ConstrainedTrainer, fraction: float) -> dict[str, set[bytes]]:
    """Each constraint's indicator rows (the part of its data that drives u_k under two-split estimation)."""
    from hf_constrained.method.strategies import split_for_indicator

    _, views = split_for_indicator(trainer.constraints, fraction, trainer.args.constraint_sampling_seed)
    return {c.name: {row_key(views[k].dataset[i]["x"]) for i in range(len(views[k].dataset))}
            for k, c in enumerate(trainer.constraints)}


def disjoint_trainer(output_dir: str, row_fn: Any, statistic: Any = None, **overrides: Any) -> ConstrainedTrainer:
    """One constraint per group on that group's rows, plus two constraints on ONE dataset object of
    other rows: they share its split."""
    torch.manual_seed(1234)
    train_rows, _ = make_rows(128, 0)
    c_rows, c_groups = make_rows(96, 1)
    shared = ListDataset(make_rows(60, 2)[0])  # rows of their own
    constraints = [Constraint(name=f"group{k}", row_fn=row_fn, tolerance=0.25,
                              certify=Certification(statistic=statistic),
                              dataset=ListDataset([r for r, gk in zip(c_rows, c_groups) if gk == k]))
                   for k in range(NUM_GROUPS - 1)]
    constraints += [Constraint(name=f"all{j}", row_fn=row_fn, tolerance=0.3 + 0.1 * j, dataset=shared,
                               certify=Certification(statistic=statistic)) for j in range(2)]
    kw: dict[str, Any] = dict(constraints_per_step=3, max_steps=8)
    kw.update(overrides)
    return ConstrainedTrainer(model=TinyClassifier(), args=tiny_args(output_dir, **kw),
                              train_dataset=ListDataset(train_rows), constraints=constraints)


def count_forwards(model: nn.Module) -> list[int]:
    """A counter of ``model``'s calls (a forward pre-hook)."""
    calls = [0]
    model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


class _ResetAtTrainBegin(TrainerCallback):
    def __init__(self, calls: list[int]) -> None:
        self.calls = calls

    def on_train_begin(self, args, state, control, **kwargs):
        self.calls[0] = 0  # the preflight's calls before training are no step's


def count_training_forwards(trainer: ConstrainedTrainer) -> list[int]:
    """A counter of the model calls of ``trainer``'s training steps (from the start of training)."""
    calls = count_forwards(trainer.model)
    trainer.add_callback(_ResetAtTrainBegin(calls))
    return calls
