"""One rank of the FSDP2 check on CPU (tests/trainer/test_fsdp.py).

Launched with ``accelerate launch --config_file recipes/accelerate_configs/fsdp.yaml --use_cpu
--mixed_precision no --num_processes 2`` (gloo). Trains the tiny constrained set-up of
``tests/scale_tiny.py`` (its linear layers are the FSDP units: ``_no_split_modules``) with
``--per-device-batch`` objective rows and ``--constraint-batch`` constraint rows per process, and
writes to ``OUT/rank<r>.pt``:

* ``straight``: 6 steps; the gathered parameters (``DTensor.full_tensor``), the estimators, the
  streams, and whether the parameters were sharded (``DTensor`` with half the rows here);
* ``resumed``: stopped after step 3's sharded checkpoint, resumed in a fresh trainer to step 6;
  the checkpoint's files;
* ``certified``: a run with non-forgetting constraints that have certification splits, saved with
  ``save_model`` (the full weights, gathered) and ended with ``finish_run`` (safety report,
  certificate, card) and the gate (``check_safe_to_push``); the report and the gathered parameters,
  so the test can compare with one process and recompute the certificate on an unsharded copy.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from fsdp_tiny import certified_trainer  # noqa: E402
from scale_tiny import StopAt, TinyClassifier, make_trainer  # noqa: E402

from hf_constrained.distributed import exit_after_all_ranks  # noqa: E402
from hf_constrained.safety import finish_run  # noqa: E402


def gathered(trainer) -> dict:
    """Parameters, estimators and streams; sharded parameters gathered into full tensors."""
    from torch.distributed.tensor import DTensor

    params, sharded = {}, {}
    for name, p in trainer.model.named_parameters():
        name = name.replace("_fsdp_wrapped_module.", "")
        sharded[name] = isinstance(p, DTensor) and tuple(p.to_local().shape) != tuple(p.shape)
        params[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
    return {
        "params": params, "sharded": sharded,
        "estimator_values": trainer.engine.estimator.values.detach().cpu().clone(),
        "estimator_visited": trainer.engine.estimator.visited.detach().cpu().clone(),
        "streams": [None if s is None else s.state_dict() for s in trainer.engine.streams],
        "global_step": trainer.state.global_step,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "num_processes": trainer.accelerator.num_processes,
        "model_class": type(trainer.model).__name__, "is_fsdp_enabled": trainer.is_fsdp_enabled,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--per-device-batch", type=int, default=4)
    parser.add_argument("--constraint-batch", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    a = parser.parse_args()
    TinyClassifier._no_split_modules = ["Linear"]  # each linear layer its own FSDP unit (TRANSFORMER_BASED_WRAP)
    common = dict(max_steps=a.steps, per_device_train_batch_size=a.per_device_batch,
                  constraint_batch_size=a.constraint_batch)
    result = {}
    straight = make_trainer(os.path.join(a.out, "straight"), **common)
    straight.train()
    result["straight"] = gathered(straight)
    rank = straight.accelerator.process_index

    # kill and resume from a sharded checkpoint: stop after step 3's checkpoint, resume in a fresh trainer
    resume = dict(common, save_strategy="steps", save_steps=3)
    stopped = make_trainer(os.path.join(a.out, "stopped"), **resume)
    stopped.add_callback(StopAt(3))
    stopped.train()
    stopped.accelerator.wait_for_everyone()
    checkpoint = os.path.join(a.out, "stopped", "checkpoint-3")
    resumed = make_trainer(os.path.join(a.out, "resumed"), **resume)
    resumed.train(resume_from_checkpoint=checkpoint)
    result["resumed"] = gathered(resumed)
    result["checkpoint_files"] = sorted(os.path.relpath(os.path.join(d, f), checkpoint)
                                        for d, _, files in os.walk(checkpoint) for f in files)

    # the certificate, report and gate on the sharded model (the forward gathers the parameters)
    trainer = certified_trainer(os.path.join(a.out, "certified"), **common)
    trainer.train()
    trainer.save_model()  # as the recipes do before finish_run: the release, with its full weights
    report = finish_run(trainer, old_model_values={c.name: 0.0 for c in trainer.constraints}, plots=False)
    try:
        trainer.safety.check_safe_to_push()
        gate = "open"
    except Exception as exc:  # the gate's refusal is part of the result
        gate = f"refused: {type(exc).__name__}: {exc}"
    result["certified"] = gathered(trainer)
    result["certified"].update(report=report.to_dict(), certified=report.certified,
                               bounds=report.certified_bounds(), gate=gate,
                               saved_files=sorted(os.listdir(os.path.join(a.out, "certified"))))
    tmp = os.path.join(a.out, f"rank{rank}.pt.tmp")
    torch.save(result, tmp)
    os.replace(tmp, os.path.join(a.out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
    exit_after_all_ranks(0)  # every rank done, then out without the teardown gloo can abort
