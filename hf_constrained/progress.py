"""A progress bar for a training run whose own logging is turned off.

The recipes run some trainings quietly (``disable_tqdm=True``, no printed logs): the old model of
the LLM example, the demo's runs. Such a run can take minutes; :class:`StepProgressBar` shows its
steps in one tqdm bar, without the Trainer's log lines that its ``ProgressCallback`` would print.
"""

from __future__ import annotations

from typing import Any, Optional

from tqdm.auto import tqdm
from transformers import TrainerCallback


class StepProgressBar(TrainerCallback):
    """One tqdm bar over a run's optimizer steps (main process only); ``desc`` labels it."""

    def __init__(self, desc: str, *, leave: bool = False) -> None:
        self.desc, self.leave = desc, leave
        self.bar: Optional[Any] = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc=self.desc, leave=self.leave,
                            unit="step", dynamic_ncols=True)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


__all__ = ["StepProgressBar"]
