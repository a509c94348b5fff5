"""Many constraints of one formula: 200 rows A_k x <= b_k of a stochastic linear system.

Each constraint k has its own noisy rows (a, b) with E[a] = A_k, E[b] = b_k and per-row value
``a . x - b``; all 200 are declared in ONE ``constraints_per_value`` call with one shared
``row_fn``. Objective: mean ||x - c||^2 over a batch of noisy targets c. Timed, alternating
in one process over ``--rounds`` rounds (process CPU time per optimizer step, one thread):

* ``plain``: a plain ``Trainer`` step on the objective alone (``--batch`` rows);
* ``plain_same_rows``: a plain ``Trainer`` step on ``--batch + |B_c| |B_k|`` objective rows (the
  rows a constrained step reads and collates, at the same per-row data cost);
* ``fused``: the ConstrainedTrainer, |B_c| = 20 sampled constraints, gamma' = 0.1, the
  row-wise form (one ``row_fn`` call with grad and one without per step);
* ``per_constraint``: the same constraints as scalar ``fn``s (20 + 20 calls per step).

Also reports the set-up time of ``constraints_per_value`` for the 200 constraints.

    python benchmarks/linear_system_step.py --out benchmarks/results/linear_system_step_fused_cpu.json
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import numpy as np
import torch
from datasets import Dataset
from torch import nn
from transformers import Trainer, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import StepTimer, machine, summary, write_json  # noqa: E402

from hf_constrained import ConstrainedTrainer, ConstrainedTrainingArguments, Constraint, constraints_per_value  # noqa: E402


class Point(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.zeros(dim))

    def forward(self, c: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": ((self.x - c) ** 2).sum(dim=1).mean()}


def row_values(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """a . x - b for each row: the per-row values of constraint A_k x <= b_k."""
    x = model.x if hasattr(model, "x") else model.module.x
    return batch["a"] @ x - batch["b"]


def make_data(m: int, rows_per: int, dim: int, seed: int = 0) -> tuple[Dataset, Dataset]:
    rng = np.random.default_rng(seed)
    A = rng.normal(size=(m, dim)) / np.sqrt(dim)
    b = rng.uniform(0.5, 1.0, size=m)
    k = np.repeat(np.arange(m), rows_per)
    a = A[k] + 0.3 * rng.normal(size=(k.size, dim))
    rows = Dataset.from_dict({"a": a.astype(np.float32).tolist(), "b": (b[k] + 0.1 * rng.normal(size=k.size)).tolist(),
                              "k": k.tolist()}).with_format("torch")
    target = rng.normal(size=dim) * 2
    c = (target + rng.normal(size=(4096, dim))).astype(np.float32)
    train = Dataset.from_dict({"c": c.tolist()}).with_format("torch")
    return rows, train


def common_args(out: str, steps: int, batch: int) -> dict:
    return dict(output_dir=out, per_device_train_batch_size=batch, max_steps=steps, learning_rate=0.05, optim="sgd",
                lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, use_cpu=True, report_to=[],
                save_strategy="no", logging_steps=50, disable_tqdm=True, dataloader_num_workers=0, seed=0)


def build(key: str, cons: list[Constraint], train: Dataset, a: argparse.Namespace):
    out = os.path.join(a.workdir, f"linsys_{key}")
    if key.startswith("plain"):
        batch = a.batch if key == "plain" else a.batch + a.per_step * a.constraint_batch
        return Trainer(model=Point(a.dim), args=TrainingArguments(**common_args(out, a.steps, batch)),
                       train_dataset=train)
    if key == "per_constraint":
        cons = [Constraint(c.name, fn=c._reduced_row_fn, dataset=c.dataset, tolerance=c.tolerance) for c in cons]
    args = ConstrainedTrainingArguments(**common_args(out, a.steps, a.batch), penalty_beta=5.0, msvr_gamma=0.8,
                                        msvr_gamma_prime=0.1, constraints_per_step=a.per_step,
                                        constraint_batch_size=a.constraint_batch)
    return ConstrainedTrainer(model=Point(a.dim), args=args, train_dataset=train, constraints=cons)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, default=200)
    parser.add_argument("--rows-per-constraint", type=int, default=50)
    parser.add_argument("--dim", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--per-step", type=int, default=20)
    parser.add_argument("--constraint-batch", type=int, default=10)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/hf_constrained_bench")
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    torch.set_num_threads(1)
    rows, train = make_data(a.m, a.rows_per_constraint, a.dim)
    start = time.process_time()
    cons = constraints_per_value(rows, "k", row_fn=row_values, name="row{value}")
    setup_s = time.process_time() - start
    keys = ["plain", "plain_same_rows", "fused", "per_constraint"]
    times: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(a.rounds):
        for key in keys:
            trainer = build(key, cons, train, a)
            timer = StepTimer(a.warmup)
            trainer.add_callback(timer)
            trainer.train()
            times[key] += timer.cpu_times
            print(f"round {r} {key}: median so far {summary(times[key])['median_s'] * 1e3:.3f} ms", file=sys.stderr)
            del trainer
            gc.collect()
    stats = {k: summary(v) for k, v in times.items()}
    result = {
        "benchmark": "linear_system_step_fused",
        "command": "python benchmarks/linear_system_step.py " + " ".join(sys.argv[1:]),
        "clock": "cpu", "num_constraints": a.m, "rows_per_constraint": a.rows_per_constraint, "dim": a.dim,
        "objective_batch": a.batch, "constraints_per_step": a.per_step, "constraint_batch": a.constraint_batch,
        "steps_timed_per_round": a.steps - a.warmup, "rounds": a.rounds,
        "constraints_per_value_setup_s": setup_s,
        "step_time": stats,
        "ratio_to_plain": {k: stats[k]["median_s"] / stats["plain"]["median_s"] for k in keys if k != "plain"},
        "ratio_to_plain_same_rows": {k: stats[k]["median_s"] / stats["plain_same_rows"]["median_s"]
                                     for k in ("fused", "per_constraint")},
        "per_constraint_over_fused": stats["per_constraint"]["median_s"] / stats["fused"]["median_s"],
        "machine": machine(),
    }
    write_json(a.out, result)


if __name__ == "__main__":
    main()
