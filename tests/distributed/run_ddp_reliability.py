"""One rank of the DDP reliability checks (tests/trainer/test_ddp_reliability.py).

Launched like ``run_ddp_check.py`` (``accelerate launch --config_file
recipes/accelerate_configs/multi_gpu.yaml --num_processes 2``, CPU/gloo). Runs each case,
records "ok" or the exception (type and message) and, for runs that finished, a hash of the
parameters, into ``OUT/reliability_rank<r>.json``:

* ``partial``: a constraint that calls the model on part of it (the hidden layer only);
* ``extra_all``: a parameter used only by a constraint, all constraints sampled each step;
* ``extra_sampled``: the same with ``constraints_per_step`` < m (must stop, naming it);
* ``find_unused``: ``ddp_find_unused_parameters=True`` (must be refused before training);
* ``resume_1to2``: resume the 1-process checkpoint ``--checkpoint`` with 2 processes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from scale_tiny import make_data, make_trainer, tiny_args  # noqa: E402

from hf_constrained import ConstrainedTrainer, Constraint  # noqa: E402


class Parts(nn.Module):
    """``part="hidden"`` runs the first layer only; ``part="extra"`` a head no objective uses."""

    def __init__(self, extra: bool) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 2)
        self.extra = nn.Linear(6, 1) if extra else None

    def forward(self, x: torch.Tensor, labels: Any = None, part: Any = None) -> dict:
        if part == "hidden":
            return {"out": torch.tanh(self.fc1(x))}
        if part == "extra":
            return {"out": self.extra(x)}
        logits = self.fc2(torch.tanh(self.fc1(x)))
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


def hidden_energy(model, batch):
    return model(x=batch["x"], part="hidden")["out"].pow(2).mean()


def extra_score(model, batch):
    return model(x=batch["x"], part="extra")["out"].mean()


def run_case(name: str, out: str, checkpoint: str) -> dict:
    if name == "resume_1to2":
        trainer = make_trainer(os.path.join(out, name), max_steps=6, save_strategy="steps", save_steps=3)
        trainer.train(resume_from_checkpoint=checkpoint)
    else:
        torch.manual_seed(0)
        train, cons = make_data(0)
        extra = name.startswith("extra")
        fn = extra_score if extra else hidden_energy
        cons = cons + [Constraint(name, fn=fn, dataset=cons[0].dataset, tolerance=-5.0)]
        kw: dict = dict(constraints_per_step=None if name != "extra_sampled" else 2)
        if name == "find_unused":
            kw["ddp_find_unused_parameters"] = True
        trainer = ConstrainedTrainer(model=Parts(extra), args=tiny_args(os.path.join(out, name), max_steps=4, **kw),
                                     train_dataset=train, constraints=cons)
        trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {"status": "ok", "step": trainer.state.global_step,
            "params": {n: p.detach().double().sum().item() for n, p in model.named_parameters()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoint", required=True)
    a = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    results = {}
    for name in ("partial", "extra_all", "extra_sampled", "find_unused", "resume_1to2"):
        try:
            results[name] = run_case(name, a.out, a.checkpoint)
        except Exception as e:  # noqa: BLE001 - the test asserts on the recorded error
            results[name] = {"status": type(e).__name__, "message": str(e)}
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # a failed case on one rank must not desynchronise the next
    with open(os.path.join(a.out, f"reliability_rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
