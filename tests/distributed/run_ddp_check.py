"""One rank of the multi-process consistency check (tests/trainer/test_distributed.py).

Launched with ``accelerate launch --config_file recipes/accelerate_configs/multi_gpu.yaml
--num_processes N`` on CPU (gloo backend, ``use_cpu=True`` in the training arguments). Trains
the tiny constrained set-up of ``tests/scale_tiny.py`` with ``--per-device-batch`` objective
rows and ``--constraint-batch`` constraint rows per process, then writes this rank's
parameters, estimator state, stream positions and the rows of every constraint call to
``OUT/rank<r>.pt``. ``--extra`` adds a gradient-accumulation run (``rank<r>_ga.pt``) and a
stop/resume run (``rank<r>_resumed.pt``); ``--fused`` the row-wise constraints through the fused
step (``rank<r>_fused.pt``); ``--contrastive`` the Setting II trainer
(``rank<r>_contrastive.pt``); ``--two-split`` two-split estimation (``constraint_indicator_fraction``
0.5) straight and stopped/resumed, with the rows this rank scored with and without grad
(``rank<r>_two_split.pt``); ``--replay`` the constrained run with replay of old rows (ratio 0.5), with the old
rows of every step on this rank (``rank<r>_replay.pt``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from scale_tiny import (  # noqa: E402
    Recorder,
    StopAt,
    contrastive_snapshot,
    disjoint_trainer,
    error_statistic,
    indicator_rows,
    make_contrastive_trainer,
    make_replay,
    make_rowwise_trainer,
    make_trainer,
    per_row_ce,
    record_constraint_calls,
    snapshot,
)

from hf_constrained.distributed import exit_after_all_ranks  # noqa: E402


def _save(out: str, name: str, obj: object) -> None:
    tmp = os.path.join(out, name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, os.path.join(out, name))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--per-device-batch", type=int, default=4)
    parser.add_argument("--constraint-batch", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--extra", action="store_true",
                        help="also run gradient accumulation (2 x 2 rows per process) and stop-at-3 / resume-to-6")
    parser.add_argument("--contrastive", action="store_true",
                        help="also run the Setting II check (ContrastiveConstrainedTrainer, per-sample estimators)")
    parser.add_argument("--fused", action="store_true",
                        help="also run the row-wise constraints through the fused step (rank<r>_fused.pt)")
    parser.add_argument("--two-split", action="store_true",
                        help="also run two-split estimation, straight and stop-at-3 / resume-to-6 "
                             "(rank<r>_two_split.pt)")
    parser.add_argument("--replay", action="store_true",
                        help="also run the constrained set-up with replay (rank<r>_replay.pt)")
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
    _save(a.out, f"rank{rank}.pt", snap)

    if a.extra:
        # gradient accumulation: 2 micro-batches of 2 rows per process = the same 8 global rows per step
        ga = make_trainer(os.path.join(a.out, "ga"), max_steps=a.steps, per_device_train_batch_size=2,
                          gradient_accumulation_steps=2, constraint_batch_size=a.constraint_batch)
        ga.train()
        _save(a.out, f"rank{rank}_ga.pt", snapshot(ga))
        # exact resume under DDP: stop after step 3's checkpoint, resume in a fresh trainer
        common = dict(max_steps=a.steps, per_device_train_batch_size=a.per_device_batch,
                      constraint_batch_size=a.constraint_batch, save_strategy="steps", save_steps=3)
        stopped = make_trainer(os.path.join(a.out, "stopped"), **common)
        stopped.add_callback(StopAt(3))
        stopped.train()
        stopped.accelerator.wait_for_everyone()  # rank 0 has written checkpoint-3
        resumed = make_trainer(os.path.join(a.out, "resumed"), **common)
        resumed.train(resume_from_checkpoint=os.path.join(a.out, "stopped", "checkpoint-3"))
        _save(a.out, f"rank{rank}_resumed.pt", snapshot(resumed))

    if a.fused:  # row-wise constraints: per-constraint sums and counts all-reduced
        fused = make_rowwise_trainer(os.path.join(a.out, "fused"), per_device_train_batch_size=a.per_device_batch,
                                     constraint_batch_size=a.constraint_batch)
        fused.train()
        _save(a.out, f"rank{rank}_fused.pt", snapshot(fused))

    if a.contrastive:  # Setting II: 4 rows per process, the 1-process reference uses 8
        clip_trainer = make_contrastive_trainer(os.path.join(a.out, "clip"), per_device_train_batch_size=4)
        clip_trainer.train()
        _save(a.out, f"rank{rank}_contrastive.pt", contrastive_snapshot(clip_trainer))

    if a.two_split:  # which rows reached a gradient on THIS rank, and exact resume, with indicator rows apart
        common = dict(max_steps=a.steps, per_device_train_batch_size=a.per_device_batch,
                      constraint_batch_size=a.constraint_batch, constraint_indicator_fraction=0.5)
        record = Recorder()
        straight = disjoint_trainer(os.path.join(a.out, "two_split"), record, **common)
        straight.train()
        result = snapshot(straight)
        result.update(with_grad=record.with_grad, without_grad=record.without_grad,
                      indicator=indicator_rows(straight, 0.5))
        resume_args = dict(common, save_strategy="steps", save_steps=3)
        stopped = disjoint_trainer(os.path.join(a.out, "two_split_stopped"), Recorder(), **resume_args)
        stopped.add_callback(StopAt(3))
        stopped.train()
        stopped.accelerator.wait_for_everyone()  # rank 0 has written checkpoint-3
        resumed_record = Recorder()
        resumed = disjoint_trainer(os.path.join(a.out, "two_split_resumed"), resumed_record, **resume_args)
        resumed.train(resume_from_checkpoint=os.path.join(a.out, "two_split_stopped", "checkpoint-3"))
        result["resumed"] = snapshot(resumed)
        result["resumed_with_grad"] = resumed_record.with_grad
        _save(a.out, f"rank{rank}_two_split.pt", result)
        # the proxy indicator on the gradient's own rows (one split): the statistic's sums and counts all-reduced
        proxy = disjoint_trainer(os.path.join(a.out, "one_split_proxy"), per_row_ce, statistic=error_statistic(),
                                 constraint_proxy_indicator=True, **{k: v for k, v in common.items()
                                                                     if k != "constraint_indicator_fraction"})
        proxy.train()
        _save(a.out, f"rank{rank}_one_split_proxy.pt", snapshot(proxy))


    if a.replay:  # each rank's old rows: its own, together the 1-process run's
        rows_seen: list[list[int]] = []
        replayed = make_trainer(os.path.join(a.out, "replay"), regulariser=make_replay(rows_seen),
                                max_steps=a.steps, per_device_train_batch_size=a.per_device_batch,
                                constraint_batch_size=a.constraint_batch)
        replayed.train()
        _save(a.out, f"rank{rank}_replay.pt", {**snapshot(replayed), "replay_rows": rows_seen})


if __name__ == "__main__":
    main()
    exit_after_all_ranks(0)  # every rank done, then out without the teardown gloo can abort
