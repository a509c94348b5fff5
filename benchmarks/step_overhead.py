"""Overhead of a constrained step over a plain Trainer step on the same samples.

Constrained: objective batch ``b`` plus ``|B_c|`` constraint batches of ``|B_k|`` pairs
(Algorithm 1: one MSVR update, the hinge penalty, one backward). Plain: a Trainer step
on ``b + |B_c| |B_k|`` pairs in one forward. Both run in this one process, alternating
for ``--rounds`` rounds; the ratio is of the median step times.

Two constrained variants: ``gamma' = 0.1`` (the paper's setting; the previous-iterate
term evaluates the next step's constraint batches once more under no_grad, an extra
forward of ``|B_c| |B_k|`` pairs per step) and ``gamma' = 0`` (plain moving average, no
extra forward).

    python benchmarks/step_overhead.py --out benchmarks/results/step_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (add_common_arguments, default_clock, machine, make_constrained, make_plain, setup_threads,  # noqa: E402
                    summary, timed_train, write_json)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    parser.add_argument("--batch", type=int, default=64, help="objective batch b")
    parser.add_argument("--per-step", type=int, default=4, help="|B_c| (= m here: every constraint each step)")
    parser.add_argument("--constraint-batch", type=int, default=8, help="|B_k|")
    parser.add_argument("--steps", type=int, default=23)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    a = parser.parse_args()
    setup_threads(a.threads)
    clock = default_clock(a.device, a.threads) if a.clock == "auto" else a.clock
    cpu = a.device == "cpu"
    plain_batch = a.batch + a.per_step * a.constraint_batch
    common = dict(steps=a.steps, bf16=a.bf16, cpu=cpu, bank_size=a.bank_size)
    times: dict[str, list[float]] = {"plain": [], "constrained_gp0.1": [], "constrained_gp0": []}
    cuda_memory: dict[str, dict[str, int]] = {}
    param_bytes = 0
    for r in range(a.rounds):
        for key in times:
            out = os.path.join(a.workdir, f"overhead_{key}")
            if key == "plain":
                trainer = make_plain(a.model, out, batch=plain_batch, **common)
            else:
                gp = 0.1 if key.endswith("0.1") else 0.0
                trainer = make_constrained(a.model, out, batch=a.batch, m=a.per_step, per_step=a.per_step,
                                           constraint_batch=a.constraint_batch, gamma_prime=gp, **common)
            if not cpu:  # exact peak tensor memory of each configuration (reset per run)
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            times[key] += timed_train(trainer, a.warmup, clock)
            if not cpu:
                peak = torch.cuda.max_memory_allocated()
                cuda_memory[key] = {"allocated_before_train": before, "peak_allocated": peak,
                                    "peak_growth": peak - before}
                param_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
            print(f"round {r} {key}: median so far {summary(times[key])['median_s']:.4f} s", file=sys.stderr)
            del trainer
            gc.collect()
    stats = {k: summary(v) for k, v in times.items()}
    plain = stats["plain"]["median_s"]
    result = {
        "benchmark": "step_overhead",
        "model": a.model, "device": a.device, "bf16": a.bf16, "clock": clock,
        "objective_batch": a.batch, "constraints_per_step": a.per_step, "constraint_batch": a.constraint_batch,
        "plain_batch": plain_batch, "steps_timed_per_round": a.steps - a.warmup, "rounds": a.rounds,
        "step_time": stats,
        "ratio_gamma_prime_0.1": stats["constrained_gp0.1"]["median_s"] / plain,
        "ratio_gamma_prime_0": stats["constrained_gp0"]["median_s"] / plain,
        "target_ratio": 1.15,
        "min_ratio_gamma_prime_0.1": stats["constrained_gp0.1"]["min_s"] / stats["plain"]["min_s"],
        "min_ratio_gamma_prime_0": stats["constrained_gp0"]["min_s"] / stats["plain"]["min_s"],
        "machine": machine(),
    }
    if cuda_memory:
        params = param_bytes
        result["cuda_memory"] = cuda_memory
        result["param_bytes"] = params
        result["peak_ratio_gamma_prime_0.1"] = (cuda_memory["constrained_gp0.1"]["peak_allocated"]
                                                / cuda_memory["plain"]["peak_allocated"])
        result["peak_ratio_gamma_prime_0"] = (cuda_memory["constrained_gp0"]["peak_allocated"]
                                              / cuda_memory["plain"]["peak_allocated"])
        result["extra_peak_over_plain_in_param_copies_gamma_prime_0.1"] = (
            cuda_memory["constrained_gp0.1"]["peak_allocated"] - cuda_memory["plain"]["peak_allocated"]) / params
    write_json(a.out, result)


if __name__ == "__main__":
    main()
