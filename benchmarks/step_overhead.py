"""Overhead of a constrained step over a plain Trainer step on the same samples.

Constrained: objective batch ``b`` (CLIP's contrastive loss) plus ``|B_c|`` sampled
non-forgetting constraints of ``|B_k|`` images each (per-sample zero-shot cross-entropy
minus the old model's, :mod:`rowwise_clip`), gamma' = 0.1 (the look-ahead evaluates the
next step's constraint batches under no_grad). Plain: a Trainer step on
``b + |B_c| |B_k|`` pairs in one forward. Variants, all in this one process, alternating
for ``--rounds`` rounds; each ratio is of the median step times:

* ``fused_gp0.1``: the constraints in the row-wise form (one shared ``row_fn``): ONE model
  call with grad for all sampled constraints and ONE without for the look-ahead;
* ``per_constraint_gp0.1``: the same constraints as scalar ``fn``s (one call per sampled
  constraint and per look-ahead): the path every constraint took before the fused step;
* ``fused_gp0``: row-wise, gamma' = 0 (no look-ahead call).

The look-ahead runs after the step's backward (the library's one placement). ``--variants``
picks the constrained variants (the plain step always runs). On CUDA each variant's peak
``torch.cuda.max_memory_allocated`` during training is recorded.

It also counts the aten operators one step dispatches (``torch.profiler``, CPU), for the
plain step and both constrained paths.

    python benchmarks/step_overhead.py --threads 1 --out benchmarks/results/step_overhead_fused_cpu.json
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

import torch
from transformers import TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    add_common_arguments,
    default_clock,
    machine,
    make_plain,
    setup_threads,
    summary,
    timed_train,
    write_json,
)
from rowwise_clip import make_rowwise_constrained  # noqa: E402


class CountOps(TrainerCallback):
    """Counts the aten operators dispatched in each of ``steps`` optimizer steps after ``start``
    (profiled one step at a time; the median is robust to a step that starts a new data epoch)."""

    def __init__(self, start: int, steps: int) -> None:
        self.start, self.steps = start, steps
        self.prof: torch.profiler.profile | None = None
        self.counts: list[int] = []

    def on_step_begin(self, args, state, control, **kwargs):
        if self.start <= state.global_step < self.start + self.steps:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            self.counts.append(sum(1 for e in self.prof.events() if e.name.startswith("aten::")))
            self.prof = None


VARIANTS = ("fused_gp0.1", "per_constraint_gp0.1", "fused_gp0")


def build(key: str, a: argparse.Namespace, steps: int):
    cpu = a.device == "cpu"
    out = os.path.join(a.workdir, f"overhead_{key}")
    common = dict(steps=steps, bf16=a.bf16, cpu=cpu, bank_size=a.bank_size)
    if key == "plain":
        return make_plain(a.model, out, batch=a.batch + a.per_step * a.constraint_batch, **common)
    gp = 0.1 if key.endswith("0.1") else 0.0
    form = "scalar" if key.startswith("per_constraint") else "rowwise"
    return make_rowwise_constrained(a.model, out, batch=a.batch, m=a.m, per_step=a.per_step,
                                    constraint_batch=a.constraint_batch, gamma_prime=gp, form=form,
                                    data=a.constraint_data, **common)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    parser.set_defaults(model="tiny")
    parser.add_argument("--batch", type=int, default=256, help="objective batch b")
    parser.add_argument("--m", type=int, default=10, help="number of constraints m")
    parser.add_argument("--per-step", type=int, default=5, help="|B_c|")
    parser.add_argument("--constraint-batch", type=int, default=10, help="|B_k|")
    parser.add_argument("--constraint-data", choices=["rows", "dataset"], default="rows",
                        help="the constraints' data: per-row tensors in a torch Dataset per constraint (rows), or "
                        "one torch-formatted datasets.Dataset split by constraints_per_value (dataset)")
    parser.add_argument("--steps", type=int, default=23)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--op-steps", type=int, default=5,
                        help="steps profiled (one at a time) for the aten operator counts; the median is reported "
                        "(0: no operator counts)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated constrained variants, of {', '.join(VARIANTS)} (the plain step always "
                        "runs; fused_gp0.1 is the library's default step)")
    a = parser.parse_args()
    setup_threads(a.threads)
    clock = default_clock(a.device, a.threads) if a.clock == "auto" else a.clock
    unknown = sorted(set(a.variants.split(",")) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    keys = ["plain"] + [k for k in VARIANTS if k in a.variants.split(",")]
    times: dict[str, list[float]] = {k: [] for k in keys}
    peak: dict[str, int] = {}
    cuda = a.device == "cuda"
    for r in range(a.rounds):
        for key in keys:
            trainer = build(key, a, a.steps)
            if cuda:  # this variant's peak: the model, its optimizer state and the step's activations
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            times[key] += timed_train(trainer, a.warmup, clock)
            if cuda:
                peak[key] = max(peak.get(key, 0), torch.cuda.max_memory_allocated())
            print(f"round {r} {key}: median so far {summary(times[key])['median_s']:.4f} s", file=sys.stderr)
            del trainer
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    ops: dict[str, float] = {}
    for key in [k for k in ["plain", "fused_gp0.1", "per_constraint_gp0.1"] if k in keys and a.op_steps > 0]:
        trainer = build(key, a, a.warmup + a.op_steps + 1)
        counter = CountOps(a.warmup, a.op_steps)
        trainer.add_callback(counter)
        trainer.train()
        ops[key] = float(statistics.median(counter.counts))
        del trainer
        gc.collect()
    stats = {k: summary(v) for k, v in times.items()}
    plain = stats["plain"]["median_s"]
    result = {
        "benchmark": "step_overhead_fused",
        "command": "python benchmarks/step_overhead.py " + " ".join(sys.argv[1:]),
        "model": a.model, "device": a.device, "bf16": a.bf16, "clock": clock,
        "objective_batch": a.batch, "num_constraints": a.m, "constraints_per_step": a.per_step,
        "constraint_batch": a.constraint_batch, "constraint_data": a.constraint_data,
        "plain_batch": a.batch + a.per_step * a.constraint_batch,
        "steps_timed_per_round": a.steps - a.warmup, "rounds": a.rounds,
        "step_time": stats,
        "ratio_to_plain": {k: stats[k]["median_s"] / plain for k in keys if k != "plain"},
        "min_ratio_to_plain": {k: stats[k]["min_s"] / stats["plain"]["min_s"] for k in keys if k != "plain"},
        "target_ratio": 1.15,
        "peak_allocated_bytes": peak or None,  # CUDA only
        "peak_ratio_to_plain": {k: v / peak["plain"] for k, v in peak.items() if k != "plain"} or None,
        "aten_ops_per_step": ops,
        "aten_ops_ratio_to_plain": {k: v / ops["plain"] for k, v in ops.items() if k != "plain"},
        "target_aten_ops_ratio": 1.25,
        "machine": machine(),
    }
    write_json(a.out, result)


if __name__ == "__main__":
    main()
