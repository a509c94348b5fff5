"""The cost of a constrained run's steps: wall and CPU seconds per optimizer step, and rows per step.

:class:`StepClock` times every optimizer step from its start to its end (a callback given to the trainer before
a checkpoint selection's, so the selection's evaluations are left out). :func:`rows_per_step` counts the rows a
step of a :class:`~hf_constrained.ConstrainedTrainer` forwards and backpropagates, a machine-independent cost: the
step's own rows, the sampled constraints' rows (|B_c| x |B_k|, Algorithm 1, line 4), two-split estimation's
indicator rows, the MSVR look-ahead's (line 6's previous-iterate term), and a baseline's replayed, KL or A-GEM
reference rows. The forgetting benchmarks compare methods at equal cost by it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional

from transformers import TrainerCallback

from .method.projection import AGEM, ReplayAGEM
from .method.regularisers import KLToOld, Replay

__all__ = ["StepClock", "rows_per_step", "step_cost"]


class StepClock(TrainerCallback):
    """Wall and CPU seconds from the start to the end of every optimizer step."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._start: Optional[tuple[float, float]] = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._start = (time.perf_counter(), time.process_time())

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._start is not None:
            self.wall.append(time.perf_counter() - self._start[0])
            self.cpu.append(time.process_time() - self._start[1])
            self._start = None


def statistic_in_the_gradients_forward(engine: Any) -> bool:
    """Whether a one-split proxy indicator, if any, scores its statistic in the gradient rows' forward (else it
    takes a forward of its own over the same rows: :class:`~hf_constrained.method.statistic_rows.RowsWithStatistic`)."""
    return all(getattr(view.row_fn, "one_forward", True) for view in engine.gradient_rows.views)


def rows_per_step(trainer: Any) -> dict[str, int]:
    """Rows through a forward of the trained model (with or without grad) and through its backward per optimizer
    step, and where they come from (``new``: the step's pairs; ``constraint``, ``indicator``, ``look_ahead``: the
    sampled constraints'; ``replay``, ``kl``: a baseline's old rows; ``agem_reference``: A-GEM's reference batch)."""
    args, engine, reg = trainer.args, trainer.engine, trainer.regularised
    new = args.per_device_train_batch_size * args.gradient_accumulation_steps
    parts = {"new": new, "constraint": 0, "indicator": 0, "look_ahead": 0, "replay": 0, "kl": 0}
    if trainer.constraint_part_runs:
        sampled = engine.sampler.num_per_step
        parts["constraint"] = sampled * engine.batch_size
        estimate_rows = sampled * engine.estimate_rows.values.batch_size
        # a one-split proxy whose statistic cannot read the gradient's forward scores it in a pass of its own, at the
        # step's rows and at the look-ahead's (every sampled constraint counted: an upper bound where only some
        # constraints carry a statistic)
        statistic_pass = not statistic_in_the_gradients_forward(engine)
        if (engine.separate_estimate and trainer.penalty.active) or statistic_pass:
            parts["indicator"] = estimate_rows
        if trainer.penalty.active and engine.estimator.gamma_prime > 0:
            parts["look_ahead"] = estimate_rows * (2 if statistic_pass else 1)
    own = None if reg is None else reg.regulariser
    if isinstance(own, Replay):
        parts["replay"] = args.gradient_accumulation_steps * own.old_rows_for(args.per_device_train_batch_size)
    elif isinstance(own, KLToOld):
        parts["kl"] = args.gradient_accumulation_steps * own.rows_per_step
    projection = None if trainer.projected is None else trainer.projected.projection
    if isinstance(projection, AGEM):
        parts["agem_reference"] = projection.settings()["rows_per_step"]
    elif isinstance(projection, ReplayAGEM):
        parts["agem_reference"] = parts["replay"]
    backward = parts["new"] + parts["constraint"] + parts["replay"] + parts["kl"] + parts.get("agem_reference", 0)
    forward = backward + parts["indicator"] + parts["look_ahead"] + parts["kl"]  # the KL's old model forwards too
    return {"forward": forward, "backward": backward, **parts}


def step_cost(trainer: Any, clock: StepClock) -> dict[str, Any]:
    """A run's cost for its record: mean wall and CPU seconds per step (``clock``) and :func:`rows_per_step`."""
    return {"seconds_per_step": statistics.fmean(clock.wall) if clock.wall else None,
            "cpu_seconds_per_step": statistics.fmean(clock.cpu) if clock.cpu else None,
            "rows_per_step": rows_per_step(trainer)}
