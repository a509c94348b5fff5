"""Launch checks a recipe runs right after parsing its flags, before any model or data loads.

A multi-process launch (``accelerate launch`` with ``recipes/accelerate_configs/multi_gpu.yaml``,
``torchrun``) sets ``WORLD_SIZE`` in each process. On a machine without an accelerator and without
``--use_cpu``, the ``Trainer`` sees no process group it can use (``parallel_mode`` is not
distributed) and every process trains on its own: two copies of one run writing into one output
folder, every line printed twice. :func:`check_multi_process_launch` refuses that with one message
(from the first process; the others exit with the same status, silently). With ``--use_cpu true``
the processes form one DDP run over gloo, which is honoured.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Optional

import torch


def accelerator_available() -> bool:
    """Whether this machine has a device the ``Trainer`` runs DDP on besides the CPU (CUDA, XPU, ...)."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return bool(torch.cuda.is_available())


def multi_process_launch_problem(training_args: Any, environ: Optional[dict[str, str]] = None) -> Optional[str]:
    """Why a multi-process launch of a run with ``training_args`` would train independent copies, or
    ``None`` (one process, an accelerator present, or ``use_cpu``: DDP on gloo)."""
    env = os.environ if environ is None else environ
    try:
        world = int(env.get("WORLD_SIZE", "1"))
    except ValueError:
        return None
    if world <= 1 or getattr(training_args, "use_cpu", False) or accelerator_available():
        return None
    return (f"launched as {world} processes (WORLD_SIZE={world}: accelerate launch with a multi-GPU config, or "
            "torchrun), but this machine has no GPU, so they would train as independent copies writing into one "
            "output folder. Run one process (python ..., or accelerate launch --num_processes 1), or DDP on the "
            "CPU over gloo with --use_cpu true")


def check_multi_process_launch(training_args: Any, error: Callable[[str], Any],
                               environ: Optional[dict[str, str]] = None) -> None:
    """Refuse a multi-process launch that cannot form one run (:func:`multi_process_launch_problem`):
    the first process calls ``error(message)`` (a parser's usage error: exit status 2), every other
    process exits with status 2 without repeating it."""
    problem = multi_process_launch_problem(training_args, environ)
    if problem is None:
        return
    env = os.environ if environ is None else environ
    if env.get("RANK", env.get("LOCAL_RANK", "0")) not in ("0", ""):
        raise SystemExit(2)
    error(problem)
    raise SystemExit(2)  # ``error`` is expected not to return


__all__ = ["accelerator_available", "check_multi_process_launch", "multi_process_launch_problem"]
