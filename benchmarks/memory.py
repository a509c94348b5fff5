"""Peak memory of a constrained step against a plain Trainer step on the same samples.

Each configuration runs in a fresh child process (so one run's allocator state cannot
leak into another's): the plain Trainer on ``b + |B_c| |B_k|`` pairs, and the
constrained trainer with ``gamma' = 0.1`` (previous-iterate term on) and ``gamma' = 0``.

* CUDA: ``torch.cuda.max_memory_allocated`` over the training steps (exact tensor bytes);
* CPU: peak resident set size (``ru_maxrss``), and its growth from just before
  ``train()`` (gradients, optimizer state, activations). Allocator effects make this
  coarser than the CUDA number.

The previous-iterate term must not hold a copy of the parameters: the JSON reports the
constrained run's extra peak over the plain one next to the parameter bytes.

    python benchmarks/memory.py --out benchmarks/results/memory_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    add_common_arguments,
    machine,
    make_constrained,
    make_plain,
    setup_threads,
    train_measuring_memory,
    write_json,
)


def child(a: argparse.Namespace) -> None:
    setup_threads(a.threads)
    cpu = a.device == "cpu"
    common = dict(steps=a.steps, bf16=a.bf16, cpu=cpu, bank_size=a.bank_size)
    out = os.path.join(a.workdir, f"memory_{a.child}")
    if a.child == "plain":
        trainer = make_plain(a.model, out, batch=a.batch + a.per_step * a.constraint_batch, **common)
    else:
        gp = 0.1 if a.child == "constrained_gp0.1" else 0.0
        trainer = make_constrained(a.model, out, batch=a.batch, m=a.per_step, per_step=a.per_step,
                                   constraint_batch=a.constraint_batch, gamma_prime=gp, **common)
    res: dict = {"param_bytes": sum(p.numel() * p.element_size() for p in trainer.model.parameters())}
    res.update(train_measuring_memory(trainer, cpu=cpu))
    del res["train_cpu_seconds"]  # not part of this benchmark's result
    print("RESULT " + json.dumps(res), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--per-step", type=int, default=4)
    parser.add_argument("--constraint-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.child:
        child(a)
        return
    setup_threads(a.threads)
    runs = {}
    for key in ("plain", "constrained_gp0.1", "constrained_gp0"):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", key, "--model", a.model, "--device", a.device,
               "--bank-size", str(a.bank_size), "--batch", str(a.batch), "--per-step", str(a.per_step),
               "--constraint-batch", str(a.constraint_batch), "--steps", str(a.steps), "--workdir", a.workdir]
        if a.bf16:
            cmd.append("--bf16")
        if a.threads:
            cmd += ["--threads", str(a.threads)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"{key} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        runs[key] = json.loads(lines[-1][len("RESULT "):])
        print(f"{key}: {runs[key]}", file=sys.stderr)
    peak = "peak_rss" if a.device == "cpu" else "peak_allocated"
    params = runs["plain"]["param_bytes"]
    result = {
        "benchmark": "memory",
        "model": a.model, "device": a.device, "bf16": a.bf16, "measure": peak,
        "objective_batch": a.batch, "constraints_per_step": a.per_step, "constraint_batch": a.constraint_batch,
        "plain_batch": a.batch + a.per_step * a.constraint_batch,
        "runs": runs,
        "param_bytes": params,
        "peak_ratio_gamma_prime_0.1": runs["constrained_gp0.1"][peak] / runs["plain"][peak],
        "peak_ratio_gamma_prime_0": runs["constrained_gp0"][peak] / runs["plain"][peak],
        "extra_peak_over_plain_in_param_copies_gamma_prime_0.1":
            (runs["constrained_gp0.1"][peak] - runs["plain"][peak]) / params,
        "machine": machine(),
    }
    write_json(a.out, result)


if __name__ == "__main__":
    main()
