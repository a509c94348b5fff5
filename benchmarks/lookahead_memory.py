"""Peak memory of the MSVR look-ahead (after the step's backward) on a model whose activations dominate its memory.

The MSVR look-ahead h_k(w_t; B_k^{t+1}) (gamma' > 0) is a forward pass over the next step's
constraint rows at the step's parameters. Its activations are transient (no graph is kept),
but where it runs decides what they coexist with:

* ``before_backward``: right after the constraint call, while the step's graph (every saved
  activation of the objective and constraint rows) is alive: its transient adds to the peak;
* ``after_backward``: after the step's backward freed the graph, before the optimizer step;
* ``in_call``: its rows ride in the step's call with grad, so their activations are SAVED for
  the backward like the others (outputs detached): the peak grows by their saved activations.

Each configuration runs in a fresh child process (one run's allocator state cannot leak into
another's). CPU: peak resident set size (``ru_maxrss``) minus the RSS just before ``train()``
(large tensors are ``mmap``-ed and returned on free, so the RSS follows tensor memory);
CUDA: ``torch.cuda.max_memory_allocated``. The model: an MLP of ``--depth`` layers of width
``--width`` (tanh), SGD without momentum (no optimizer state), so the activations of
``b + |B_c| |B_k|`` rows dominate.

    python benchmarks/lookahead_memory.py --out benchmarks/results/lookahead_memory_fused_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
from datasets import Dataset
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, train_measuring_memory, write_json  # noqa: E402

from hf_constrained import ConstrainedTrainer, ConstrainedTrainingArguments, constraints_per_value  # noqa: E402

PLACEMENTS = ("after_backward",)


class WideMLP(nn.Module):
    def __init__(self, dim: int, width: int, depth: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(dim, width), nn.Tanh()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.Tanh()]
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, **_) -> dict:
        out = self.net(x).squeeze(-1)
        return {"loss": None if y is None else ((out - y) ** 2).mean(), "scores": out}


def row_scores(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(batch["x"])["scores"]


def child(a: argparse.Namespace) -> None:
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    n = 4 * a.batch
    train = Dataset.from_dict({"x": torch.randn(n, a.dim, generator=g).tolist(),
                               "y": torch.randn(n, generator=g).tolist()}).with_format("torch")
    m = a.per_step
    rows = max(4 * a.constraint_batch, 64)
    data = Dataset.from_dict({"x": torch.randn(m * rows, a.dim, generator=g).tolist(),
                              "c": [k for k in range(m) for _ in range(rows)]}).with_format("torch")
    gp = 0.1 if a.child in PLACEMENTS else 0.0
    args = ConstrainedTrainingArguments(
        output_dir=os.path.join(a.workdir, f"lookahead_{a.child}"), per_device_train_batch_size=a.batch,
        max_steps=a.steps, learning_rate=1e-4, optim="sgd", weight_decay=0.0, max_grad_norm=0.0,
        lr_scheduler_type="constant", report_to=[], save_strategy="no", disable_tqdm=True,
        use_cpu=a.device == "cpu", seed=0, logging_steps=1000, dataloader_num_workers=0,
        constraint_penalty="hinge", penalty_beta=10.0, msvr_gamma_prime=gp, constraints_per_step=m,
        constraint_batch_size=a.constraint_batch, remove_unused_columns=False)
    model = WideMLP(a.dim, a.width, a.depth)
    constraints = constraints_per_value(data, "c", row_fn=row_scores, tolerance=-1.0)  # always active
    trainer = ConstrainedTrainer(model=model, args=args, train_dataset=train, constraints=constraints)
    res: dict = {"param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    res.update(train_measuring_memory(trainer, cpu=a.device == "cpu", gpu_peak_key="max_allocated"))
    res["cpu_seconds_per_step"] = res.pop("train_cpu_seconds") / a.steps
    print(json.dumps(res))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--batch", type=int, default=2048, help="objective batch b")
    p.add_argument("--per-step", type=int, default=4, help="|B_c| (= m)")
    p.add_argument("--constraint-batch", type=int, default=512, help="|B_k|")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2, help="child processes per configuration (the median is kept)")
    p.add_argument("--workdir", default="/tmp/hf_constrained_bench")
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a)
        return
    configs = list(PLACEMENTS) + ["gamma_prime_0"]
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for _ in range(a.repeats):
        for c in configs:  # interleaved
            cmd = [sys.executable, os.path.abspath(__file__), "--child", c] + [
                x for k, v in vars(a).items() if k not in ("child", "out", "repeats")
                for x in (f"--{k.replace('_', '-')}", str(v))]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            runs[c].append(json.loads(out))
            print(c, runs[c][-1], file=sys.stderr)

    def med(c: str, key: str) -> float:
        vals = sorted(r[key] for r in runs[c])
        return vals[len(vals) // 2]

    growth = {c: med(c, "peak_growth") for c in configs}
    act_rows = a.batch + a.per_step * a.constraint_batch
    result = {
        "benchmark": "lookahead_memory",
        "command": "python benchmarks/lookahead_memory.py " + " ".join(sys.argv[1:]),
        "device": a.device, "model": f"MLP {a.dim}-{'-'.join([str(a.width)] * a.depth)}-1, tanh, SGD",
        "objective_batch": a.batch, "constraints_per_step": a.per_step, "constraint_batch": a.constraint_batch,
        "rows_with_grad_per_step": act_rows, "steps": a.steps, "repeats": a.repeats,
        "param_bytes": runs[configs[0]][0]["param_bytes"],
        "peak_growth_bytes": growth,
        "peak_growth_over_gamma_prime_0": {c: growth[c] / growth["gamma_prime_0"] for c in PLACEMENTS},
        "cpu_seconds_per_step": {c: med(c, "cpu_seconds_per_step") for c in configs},
        "runs": runs,
        "machine": machine(),
    }
    write_json(a.out, result)


if __name__ == "__main__":
    main()
