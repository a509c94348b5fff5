"""Step time as the number of constraints m grows, at a fixed |B_c|.

The method's per-step work touches only the |B_c| sampled constraints: their batches,
their forward/backward, their MSVR updates. What grows with m is the estimator state
(m floats plus m first-visit flags, plus the per-row spread: 2m variances and row counts
and m visit counts) and the O(m) bookkeeping at logging time. This script times steps with
m = 10, 100, 1000, 5000 (``--ms``) at a fixed |B_c|, alternating over ``--rounds`` rounds in
one process, and reports each median over m = 10's.

``--form rowwise`` (default): the row-wise CLIP non-forgetting constraints of
:mod:`rowwise_clip` (one shared ``row_fn``: the fused step, one model call per step for
all sampled constraints); ``--form contrastive``: the scalar contrastive-loss constraints
of :mod:`common` (one call per sampled constraint), as measured before the fused step.

    python benchmarks/constraint_scaling.py --threads 1 --ms 10,5000 --per-step 5 --constraint-batch 10 \
        --out benchmarks/results/constraint_scaling_fused_cpu.json
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    add_common_arguments,
    default_clock,
    machine,
    make_constrained,
    setup_threads,
    summary,
    timed_train,
    write_json,
)
from rowwise_clip import make_rowwise_constrained  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    parser.add_argument("--ms", default="10,100,1000,5000", help="comma-separated numbers of constraints m")
    parser.add_argument("--batch", type=int, default=64, help="objective batch b")
    parser.add_argument("--per-step", type=int, default=4, help="|B_c|, fixed")
    parser.add_argument("--constraint-batch", type=int, default=8, help="|B_k|")
    parser.add_argument("--gamma-prime", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=13)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--form", choices=["rowwise", "contrastive"], default="rowwise")
    a = parser.parse_args()
    setup_threads(a.threads)
    clock = default_clock(a.device, a.threads) if a.clock == "auto" else a.clock
    ms = [int(x) for x in a.ms.split(",")]
    times: dict[int, list[float]] = {m: [] for m in ms}
    state_bytes: dict[int, int] = {}
    for r in range(a.rounds):
        for m in ms:
            make = make_rowwise_constrained if a.form == "rowwise" else make_constrained
            trainer = make(a.model, os.path.join(a.workdir, f"scaling_{m}"), batch=a.batch, steps=a.steps,
                           bf16=a.bf16, cpu=a.device == "cpu", bank_size=a.bank_size, m=m,
                           per_step=a.per_step, constraint_batch=a.constraint_batch, gamma_prime=a.gamma_prime)
            times[m] += timed_train(trainer, a.warmup, clock)
            est = trainer.engine.estimator
            state_bytes[m] = (est.values.numel() * est.values.element_size()
                              + est.visited.numel() * est.visited.element_size())
            print(f"round {r} m={m}: median so far {summary(times[m])['median_s']:.4f} s", file=sys.stderr)
            del trainer
    stats = {str(m): summary(v) for m, v in times.items()}
    base = stats[str(ms[0])]["median_s"]
    result = {
        "benchmark": "constraint_scaling" if a.form == "contrastive" else "constraint_scaling_fused",
        "command": "python benchmarks/constraint_scaling.py " + " ".join(sys.argv[1:]),
        "form": a.form,
        "model": a.model, "device": a.device, "bf16": a.bf16, "clock": clock,
        "objective_batch": a.batch, "constraints_per_step": a.per_step, "constraint_batch": a.constraint_batch,
        "gamma_prime": a.gamma_prime, "steps_timed_per_round": a.steps - a.warmup, "rounds": a.rounds,
        "step_time": stats,
        "ratio_to_first_m": {str(m): stats[str(m)]["median_s"] / base for m in ms},
        "min_ratio_to_first_m": {str(m): stats[str(m)]["min_s"] / stats[str(ms[0])]["min_s"] for m in ms},
        "estimator_state_bytes": {str(m): b for m, b in state_bytes.items()},
        "target": f"m={ms[-1]} within 1.10x of m={ms[0]}",
        "machine": machine(),
    }
    write_json(a.out, result)


if __name__ == "__main__":
    main()
