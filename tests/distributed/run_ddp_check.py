"""One rank of the multi-process consistency check (tests/test_distributed.py).

Launched with ``accelerate launch --multi_gpu --num_processes N`` on CPU (gloo backend,
``use_cpu=True`` in the training arguments). Trains the tiny constrained set-up of
``tests/scale_tiny.py`` with ``--per-device-batch`` objective rows and
``--constraint-batch`` constraint rows per process, then writes this rank's
parameters, estimator state and stream positions to ``OUT/rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from scale_tiny import contrastive_snapshot, make_contrastive_trainer, make_trainer, record_constraint_calls, snapshot  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--per-device-batch", type=int, default=4)
    parser.add_argument("--constraint-batch", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--contrastive", action="store_true",
                        help="also run the Setting II check (ContrastiveConstrainedTrainer, per-sample estimators)")
    a = parser.parse_args()
    trainer = make_trainer(os.path.join(a.out, "run"), max_steps=a.steps,
                           per_device_train_batch_size=a.per_device_batch, constraint_batch_size=a.constraint_batch)
    calls = record_constraint_calls(trainer)
    trainer.train()
    rank = trainer.accelerator.process_index
    snap = snapshot(trainer)
    snap["constraint_calls"] = calls
    snap["num_processes"] = trainer.accelerator.num_processes
    snap["distributed_type"] = str(trainer.accelerator.distributed_type)
    tmp = os.path.join(a.out, f"rank{rank}.pt.tmp")
    torch.save(snap, tmp)
    os.replace(tmp, os.path.join(a.out, f"rank{rank}.pt"))

    if a.contrastive:  # Setting II: 4 rows per process, the 1-process reference uses 8
        clip_trainer = make_contrastive_trainer(os.path.join(a.out, "clip"), per_device_train_batch_size=4)
        clip_trainer.train()
        snap = contrastive_snapshot(clip_trainer)
        tmp = os.path.join(a.out, f"rank{rank}_contrastive.pt.tmp")
        torch.save(snap, tmp)
        os.replace(tmp, os.path.join(a.out, f"rank{rank}_contrastive.pt"))


if __name__ == "__main__":
    main()
