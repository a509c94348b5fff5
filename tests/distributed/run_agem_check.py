"""One rank of the A-GEM multi-process check (tests/trainer/test_projection_distributed.py).

Launched with ``accelerate launch --config_file recipes/accelerate_configs/multi_gpu.yaml --num_processes 2`` on
CPU (gloo). Trains the tiny constrained set-up of ``tests/scale_tiny.py`` with A-GEM (2 reference rows of each old
task per process) and with replay + A-GEM, 4 objective rows per process, plus A-GEM under gradient accumulation
(2 micro-batches of 2 rows) and stopped after step 3's checkpoint and resumed to 6; writes this rank's parameters
and projection counts to ``OUT/rank<r>_agem.pt``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from scale_tiny import StopAt, make_projection, make_trainer, snapshot  # noqa: E402

from hf_constrained.distributed import exit_after_all_ranks  # noqa: E402


def run(out: str, kind: str, steps: int, stop: int = 0, resume: str = "", **kw) -> dict:
    projection, regulariser = make_projection(kind, rows_per_task=2)
    trainer = make_trainer(out, regulariser=regulariser, gradient_projection=projection, max_steps=steps,
                           constraint_batch_size=3, **kw)  # 3 constraint rows per process: 6 per step
    if stop:
        trainer.add_callback(StopAt(stop))
    trainer.train(resume_from_checkpoint=resume or None)
    trainer.accelerator.wait_for_everyone()
    return {**snapshot(trainer), "projected": trainer.projected.projected_steps, "steps": trainer.projected.steps}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    a = parser.parse_args()
    result = {"agem": run(os.path.join(a.out, "agem"), "agem", a.steps, per_device_train_batch_size=4),
              "replay_agem": run(os.path.join(a.out, "replay_agem"), "replay_agem", a.steps,
                                 per_device_train_batch_size=4),
              "agem_ga": run(os.path.join(a.out, "agem_ga"), "agem", a.steps, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2)}
    common = dict(per_device_train_batch_size=4, save_strategy="steps", save_steps=3)
    run(os.path.join(a.out, "stopped"), "agem", a.steps, stop=3, **common)
    result["agem_resumed"] = run(os.path.join(a.out, "resumed"), "agem", a.steps,
                                 resume=os.path.join(a.out, "stopped", "checkpoint-3"), **common)
    result["num_processes"] = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    tmp = os.path.join(a.out, f"rank{rank}_agem.pt.tmp")
    torch.save(result, tmp)
    os.replace(tmp, os.path.join(a.out, f"rank{rank}_agem.pt"))


if __name__ == "__main__":
    main()
    exit_after_all_ranks(0)  # every rank done, then out without the teardown gloo can abort
