"""Multi-process settings the constrained step needs, checked before training.

The step of Algorithm 1 runs the objective forward and each sampled constraint's forward
through the same (DDP-wrapped) model before ONE backward (lines 5-10). Two consequences
for ``DistributedDataParallel``:

* With ``find_unused_parameters=True`` DDP searches the graph of the LAST forward for
  unused parameters and marks them ready at once. A constraint that uses part of the model
  (the last forward) makes DDP mark ready parameters the objective's gradient then reaches
  again: "Expected to mark a variable ready only once". The step therefore needs
  ``ddp_find_unused_parameters=False`` (the default the trainer picks when it is unset).
* With ``find_unused_parameters=False`` every trainable parameter must receive a gradient
  at every optimizer step. A parameter that only a constraint uses, with
  ``constraints_per_step`` < m, gets none at the steps where that constraint is not
  sampled. :class:`GradientCoverageCallback` stops before the optimizer step with the
  parameters' names (DDP itself would fail one step later with a message that names none).

``ddp_static_graph=True`` is refused: the sampled constraints change the graph from step
to step.

FSDP2 (``torch.distributed.fsdp.fully_shard``) runs on CPU processes with the gloo backend,
but Accelerate sets up FSDP only for accelerator devices: with ``use_cpu`` it falls back to
unsharded multi-CPU training. :func:`fsdp2_on_cpu` (used by the trainer while it builds its
Accelerator) turns an FSDP2 request on CPU into FSDP, so the launch users take on GPUs
(``accelerate launch --config_file recipes/accelerate_configs/fsdp.yaml``) also shards on a
CPU machine, where the tests check it (``tests/trainer/test_fsdp.py``).

:func:`exit_after_all_ranks` ends a recipe's script: every rank leaves the launcher's process group, then exits.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any, NoReturn

from torch import nn
from transformers import TrainerCallback, TrainingArguments
from transformers.training_args import ParallelMode

logger = logging.getLogger(__name__)


def uses_ddp(args: TrainingArguments) -> bool:
    """Whether the Trainer will wrap the model in ``DistributedDataParallel``."""
    return (args.parallel_mode == ParallelMode.DISTRIBUTED and args.world_size > 1
            and not args.fsdp and not fsdp_requested(args) and args.deepspeed is None)


def fsdp_requested(args: TrainingArguments) -> bool:
    """FSDP asked for through the arguments (``--fsdp``) or an Accelerate config / environment."""
    return bool(args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("true", "1")


def _fsdp_version_requested(args: TrainingArguments) -> int:
    """The FSDP version asked for: ``fsdp_config["version"]`` (``--fsdp``) or ``FSDP_VERSION`` (Accelerate config)."""
    config = getattr(args, "fsdp_config", None) or {}
    version = config.get("version", config.get("fsdp_version")) if args.fsdp else None
    return int(version if version is not None else os.environ.get("FSDP_VERSION", "1"))


@contextlib.contextmanager
def fsdp2_on_cpu(args: TrainingArguments) -> Iterator[None]:
    """While the Trainer builds its ``Accelerator``: a multi-process CPU run (``use_cpu``, or a
    machine without accelerators) with FSDP version 2 requested becomes an FSDP run (Accelerate
    itself leaves it as unsharded multi-CPU). Runs on accelerators are left to Accelerate.

    The FSDP plugin is the one the Trainer passes (``--fsdp`` / ``fsdp_config``) or, from an
    Accelerate config, the one its environment describes, as Accelerate builds it on GPUs; with
    ``mixed_precision`` set it is applied to the plugin as Accelerate does. FSDP version 1 on CPU
    is left alone (the trainer then refuses the run)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if not (fsdp_requested(args) and _fsdp_version_requested(args) == 2):
        yield
        return
    original = AcceleratorState.__init__

    def init(state: Any, *a: Any, **kw: Any) -> None:
        original(state, *a, **kw)
        if state.distributed_type == DistributedType.MULTI_CPU:
            plugin = kw.get("fsdp_plugin") or FullyShardedDataParallelPlugin()
            if plugin.fsdp_version == 2:
                if state.mixed_precision != "no":
                    plugin.set_mixed_precision(state.mixed_precision)
                state.distributed_type = DistributedType.FSDP
                state.fsdp_plugin = plugin
                # as Accelerate does for FSDP on GPUs: later AcceleratorState() calls copy PartialState's type
                PartialState._shared_state["distributed_type"] = DistributedType.FSDP
                logger.info("FSDP2 on %d CPU processes (gloo)", state.num_processes)

    AcceleratorState.__init__ = init
    try:
        yield
    finally:
        AcceleratorState.__init__ = original


@contextlib.contextmanager
def full_state_dict_save(trainer: Any, enabled: bool = True) -> Iterator[None]:
    """Within it, ``Trainer.save_model`` under FSDP2 with a sharded state dict writes the full
    (gathered) weights, as with ``FULL_STATE_DICT``; without it the Trainer writes no weights at
    all there, so the released model, its fingerprint and the gated push would have none.
    Checkpoints are unaffected (they are saved sharded by ``_save_checkpoint``). Every process
    must enter it: gathering the shards is a collective."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None) if trainer.is_fsdp_enabled else None
    if not enabled or plugin is None or plugin.fsdp_version != 2 or "FULL_STATE_DICT" in str(plugin.state_dict_type):
        yield
        return
    from torch.distributed.fsdp import StateDictType

    sharded, plugin.state_dict_type = plugin.state_dict_type, StateDictType.FULL_STATE_DICT
    try:
        yield
    finally:
        plugin.state_dict_type = sharded


def check_fsdp_set_up(trainer: Any) -> None:
    """Refuse a run where FSDP was requested but Accelerate set up something else: the model would
    silently train unsharded."""
    if fsdp_requested(trainer.args) and not trainer.is_fsdp_enabled:
        raise ValueError(
            "FSDP was requested (an Accelerate FSDP config, ACCELERATE_USE_FSDP or --fsdp), but Accelerate set up "
            f"{trainer.accelerator.distributed_type} without FSDP (on CPU only FSDP version 2 with several processes "
            "runs: fsdp_version: 2 in the Accelerate config), so the model would not be sharded. On CPU use "
            "recipes/accelerate_configs/fsdp.yaml with --use_cpu true, or multi_gpu.yaml (DDP)."
        )


def configure_ddp_for_constraints(args: TrainingArguments) -> None:
    """Pick or check the DDP settings of a constrained run (before the Trainer builds its
    Accelerator); a setting that cannot work is a :class:`ValueError` with the fix."""
    if not uses_ddp(args):
        return
    if args.ddp_static_graph:
        raise ValueError(
            "ddp_static_graph=True cannot train constraints: the sampled constraints change the autograd graph "
            "from step to step. Leave ddp_static_graph unset."
        )
    if args.ddp_find_unused_parameters is None:
        logger.info("DDP with constraints: ddp_find_unused_parameters=False (the objective and constraint forwards "
                    "share one backward)")
        args.ddp_find_unused_parameters = False
    elif args.ddp_find_unused_parameters:
        raise ValueError(
            "ddp_find_unused_parameters=True cannot train constraints under DDP: the objective and each constraint "
            "run a forward before one backward, and DDP's unused-parameter search looks at the last forward only, "
            "so a constraint over part of the model fails with 'Expected to mark a variable ready only once'. "
            "Use ddp_find_unused_parameters=False (the default with constraints) and freeze "
            "(requires_grad_(False)) parameters that neither the objective nor the constraints use."
        )


class GradientCoverageCallback(TrainerCallback):
    """Under DDP with ``find_unused_parameters=False``: every trainable parameter must have
    a gradient when the optimizer steps; stop before the step, naming those without one."""

    def on_pre_optimizer_step(self, args: TrainingArguments, state: Any, control: Any, model: nn.Module = None,
                              **kwargs: Any) -> None:
        if model is None:
            return
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        if missing:
            shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
            raise RuntimeError(
                f"DDP with constraints: {len(missing)} trainable parameter(s) received no gradient at step "
                f"{state.global_step + 1}: {shown}. Under DDP every trainable parameter must get a gradient at every "
                "step. If only some constraints use them, sample all constraints each step (constraints_per_step "
                "unset, i.e. m) or train them in a single process; if nothing uses them, freeze them "
                "(requires_grad_(False))."
            )




def exit_after_all_ranks(status: int) -> NoReturn:
    """End a recipe's script with ``status``. In a launched run (``accelerate launch``, ``torchrun``) every rank first
    waits for the others and leaves the process group. A gloo (CPU) rank then runs the exit hooks (``atexit``: a
    tracker's finish, for one), flushes its streams and logs, and exits without the interpreter's teardown, where
    gloo's threads can abort the process ("terminate called without an active exception") after the run's files are
    written, and the launcher would report the run as failed. Otherwise (one process, or another backend) it is
    ``sys.exit(status)``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gloo = dist.get_backend() == "gloo"
        dist.barrier()
        dist.destroy_process_group()
        if gloo:
            atexit._run_exitfuncs()  # the hooks the skipped teardown would have run
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    sys.exit(status)


__all__ = ["GradientCoverageCallback", "configure_ddp_for_constraints", "exit_after_all_ranks", "fsdp2_on_cpu",
           "fsdp_requested", "full_state_dict_save", "uses_ddp"]
