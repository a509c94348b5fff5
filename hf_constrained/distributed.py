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
"""

from __future__ import annotations

import logging
import os
from typing import Any

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


__all__ = ["GradientCoverageCallback", "configure_ddp_for_constraints", "fsdp_requested", "uses_ddp"]
