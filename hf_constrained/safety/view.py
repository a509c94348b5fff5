"""What the safety loop reads of a run: one typed value (:class:`RunView`) and the trainer's typed operations.

The safety loop (:class:`~hf_constrained.safety.loop.SafetyLoop`) never reads a trainer's attributes by
name. What is fixed when the trainer is built (the constraints, the arguments, the certification splits'
fingerprints, the engine whose :meth:`~hf_constrained.method.engine.ConstraintEngine.settings` are the
settings the run used) is a frozen :class:`RunView`; what the loop asks of the live run (evaluate these
weights, give the per-row values of a certification split, the step and log history) is the
:class:`SafetyHost` protocol, which :class:`~hf_constrained.ConstrainedTrainer` implements. Cooper passes its
``CMPState`` around the same way: a typed value, not attributes looked up on an object.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from ..config import ConstrainedTrainingArguments
    from ..constraint import Constraint
    from ..method.engine import EngineSettings
    from ..statistics import ConstraintStatistic

METHOD_NAMES = {
    "hinge": "single-loop hinge exact penalty with MSVR constraint estimators (Algorithm 1)",
    "squared_hinge": "squared-hinge penalty (Li et al. 2024 baseline) with MSVR estimators",
    "none": "no penalty (unconstrained Trainer)",
}
# the Trainer's own settings a report records beside the method's
TRAINER_SETTINGS = ("learning_rate", "optim", "weight_decay", "lr_scheduler_type", "per_device_train_batch_size",
                    "gradient_accumulation_steps", "num_train_epochs", "max_steps", "seed")


class SettingsSource(Protocol):
    """What gives the settings a run used: the engine (:class:`~hf_constrained.method.engine.ConstraintEngine`)."""

    def settings(self) -> EngineSettings: ...


class SafetyHost(Protocol):
    """The live operations of a run the safety loop uses (``hf_constrained.ConstrainedTrainer`` has them all).

    The exact evaluations are the trainer's (:mod:`hf_constrained.exact`, with its batch sizes, autocast and
    distributed set-up); a subclass that overrides one of them (e.g. its own ``constraint_statistics``)
    changes what the loop reports.
    """

    model: Any
    state: Any  # transformers.TrainerState: global_step, log_history, best checkpoint
    accelerator: Any
    processing_class: Any
    hub_model_id: Optional[str]
    is_in_train: bool

    def evaluate(self) -> dict[str, float]: ...

    def evaluate_constraints(self, model: Any = None, split: str = "eval") -> dict[str, float]: ...

    def constraint_statistics(self, model: Any = None, split: str = "eval",
                              confidence: float = 0.95) -> Mapping[str, ConstraintStatistic]: ...

    def constraint_row_values(self, model: Any = None, split: str = "certify") -> dict[str, Any]: ...

    def constraint_margins(self) -> dict[str, float]: ...

    def is_world_process_zero(self) -> bool: ...

    def save_state(self) -> None: ...


def library_option_names() -> list[str]:
    """The options :class:`~hf_constrained.ConstrainedTrainingArguments` adds to ``TrainingArguments``."""
    from transformers import TrainingArguments

    from ..config import ConstrainedTrainingArguments

    trainer_fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    return [f.name for f in dataclasses.fields(ConstrainedTrainingArguments) if f.name not in trainer_fields]


def _plain(value: Any) -> Any:
    value = getattr(value, "value", value)  # enums (optim, lr_scheduler_type) as their strings
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


@dataclass(frozen=True)
class RunView:
    """The run as the safety loop sees it, fixed when the trainer is built.

    Attributes:
        constraints: the trainer's constraints, in order.
        args: the run's :class:`~hf_constrained.ConstrainedTrainingArguments` (the trainer's own object: a
            field the Trainer changes, e.g. ``output_dir``, is seen as it is now).
        engine: the method engine (``None`` without constraints); its ``settings()`` are read when a report
            is built, because a resumed run continues its checkpoint's sampling seed.
        certification_fingerprints: name -> fingerprint of each constraint's certification split (the key of
            its ledger of looks, :mod:`hf_constrained.certification.ledger`).
    """

    constraints: tuple[Constraint, ...]
    args: ConstrainedTrainingArguments
    engine: Optional[SettingsSource] = None
    certification_fingerprints: Mapping[str, str] = field(default_factory=dict)

    @property
    def output_dir(self) -> str:
        return self.args.output_dir

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.constraints]

    def certifiable(self) -> list[Constraint]:
        """The constraints with a certification split (``certify.dataset``)."""
        return [c for c in self.constraints if c.certifiable]

    def method_settings(self) -> dict[str, Any]:
        """The method and its settings as recorded in reports and cards (Algorithm 1 and its parameters,
        section 4): the engine's :class:`~hf_constrained.method.engine.EngineSettings` (what the run used,
        resolved), then every other option of the library's arguments as configured, then the Trainer's
        optimisation settings."""
        args = self.args
        settings: dict[str, Any] = {"method": METHOD_NAMES.get(args.constraint_penalty, args.constraint_penalty)}
        if self.engine is not None:
            settings.update(self.engine.settings().to_dict())
        else:
            settings["num_constraints"] = len(self.constraints)
        for name in library_option_names() + list(TRAINER_SETTINGS):  # the arguments' own fields, by definition
            settings.setdefault(name, _plain(getattr(args, name)))
        return settings


__all__ = ["METHOD_NAMES", "TRAINER_SETTINGS", "RunView", "SafetyHost", "SettingsSource", "library_option_names"]
