"""Training arguments of :class:`~hf_constrained.ConstrainedTrainer`."""

from __future__ import annotations

import contextlib
import copy
import math
import numbers
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from transformers import TrainingArguments

from .launch import accelerator_available
from .margin import Margin, run_margin
from .method.estimators import parse_gamma_prime
from .method.penalties import PENALTIES
from .method.strategies import EstimateSource, check_indicator_fraction, estimate_source
from .publishable import is_secret_flag, publishable_path

if TYPE_CHECKING:
    from .method.engine import StepConfig


@dataclass
class ConstrainedTrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus the settings of the hinge exact-penalty method.

    The three settings to choose (:data:`USER_SETTINGS`, first in ``--help``):

    * ``penalty_beta``: the penalty parameter beta (section 4: any constant above the
      exact-penalty threshold; 10-20 in the paper's experiments);
    * ``constraints_per_step``: |B_c|, the constraints visited per step (Algorithm 1, line 3);
    * ``constraint_batch_size``: |B_k|, rows per visited constraint and step (line 5).

    The method's other settings keep the paper's values: ``constraint_penalty`` (hinge),
    ``msvr_gamma`` 0.8 and ``msvr_gamma_prime`` 0.1 (line 6), ``objective_msvr_gamma*`` for
    Algorithm 2. Calibrated constraints: ``constraint_confidence`` or ``constraint_margin``.
    Evaluation, logging and checks: ``constraint_eval_batch_size``, ``constraint_seed``,
    ``log_constraint_estimates_max``, ``check_constraint_finite``; a sampling choice:
    ``share_constraint_batches``. Every field can be set from the command line through
    ``HfArgumentParser``.
    """

    USER_SETTINGS = ("penalty_beta", "constraints_per_step", "constraint_batch_size")

    # the Trainer's default is true; pinned memory only speeds copies to an accelerator, and without one torch
    # warns at every data loader, so the default follows the machine (an explicit value is kept)
    dataloader_pin_memory: Optional[bool] = field(
        default=None,
        metadata={"help": "Pin the data loaders' memory (default: true where an accelerator is available)."},
    )

    penalty_beta: float = field(
        default=10.0,
        metadata={"help": "Penalty parameter beta > 0. The hinge needs only a constant above the exact-penalty "
                  "threshold (10-20 in the paper); the squared hinge needs a large one (~800)."},
    )
    constraints_per_step: Optional[int] = field(
        default=None,
        metadata={"help": "|B_c|: constraints sampled each optimizer step, in [1, m]. Default: all m."},
    )
    constraint_batch_size: int = field(
        default=10,
        metadata={"help": "|B_k|: samples drawn per sampled constraint and step, per device "
                  "(the global constraint batch is this times the number of processes)."},
    )
    constraint_penalty: str = field(
        default="hinge",
        metadata={
            "help": "How violations enter the loss: 'hinge' (beta*[h]_+, the exact penalty of the paper), "
            "'squared_hinge' ((beta/2)*[h]_+^2, the baseline of Li et al. 2024) or 'none' (plain Trainer).",
            "choices": sorted(PENALTIES),
        },
    )
    msvr_gamma: float = field(
        default=0.8,
        metadata={"help": "MSVR moving-average weight gamma in (0, 1] for the constraint estimators "
                  "(Algorithm 1, line 6)."},
    )
    # typed str so that HfArgumentParser passes "theory" through (a Union[str, float] becomes float);
    # __post_init__ turns it into a float or "theory", and Python callers may pass a float
    msvr_gamma_prime: str = field(
        default="0.1",
        metadata={"help": "MSVR variance-reduction weight gamma' >= 0, or 'theory' for "
                  "(m-|B_c|)/(|B_c|(1-gamma)) + (1-gamma). 0 gives a plain moving average."},
    )
    constraint_eval_batch_size: Optional[int] = field(
        default=None,
        metadata={"help": "Batch size of the exact constraint evaluation pass. Default: per_device_eval_batch_size."},
    )
    constraint_seed: Optional[int] = field(
        default=None,
        metadata={"help": "Seed of the constraint sampler and of the constraint data streams. Default: seed."},
    )
    objective_msvr_gamma: float = field(
        default=0.8,
        metadata={"help": "Setting II only: MSVR gamma of the per-sample inner-function estimators u_{1,i}."},
    )
    objective_msvr_gamma_prime: str = field(
        default="0.1",
        metadata={"help": "Setting II only: MSVR gamma' of the per-sample estimators, or 'theory'."},
    )
    log_constraint_estimates_max: int = field(
        default=100,
        metadata={"help": "Log each constraint's estimate when there are at most this many constraints "
                  "(summaries are always logged)."},
    )
    check_constraint_finite: bool = field(
        default=True,
        metadata={"help": "Stop with an error naming the constraint and step when a constraint value is NaN/inf "
                  "(costs one host sync per step)."},
    )
    share_constraint_batches: bool = field(
        default=False,
        metadata={"help": "Row-wise constraints with one row_fn, one collate function and the SAME dataset object "
                  "draw ONE batch per step from one stream and are scored once (e.g. every TPR constraint on one "
                  "batch of positives). A different sampling: their batches are no longer independent."},
    )
    constraint_confidence: Optional[float] = field(
        default=None,
        metadata={"help": "Calibrated constraints: enforce h_k <= tol_k with the margin z_c * s_k / sqrt(|D_k|) "
                  "(s_k the running spread of the per-row values, z_c the one-sided normal quantile at this "
                  "confidence, in [0.5, 1)), so the constraint also holds on unseen data of the same population "
                  "with about this confidence. Row-wise constraints only. In Python: CalibratedMargin; "
                  "Constraint.margin overrides it."},
    )
    constraint_margin: Optional[float] = field(
        default=None,
        metadata={"help": "An explicit margin >= 0 for every constraint: the hinge acts when the estimate exceeds "
                  "tol_k - margin (on the inner value of a compositional constraint). In Python: FixedMargin; "
                  "Constraint.margin overrides it. At most one of constraint_margin, constraint_confidence and "
                  "constraint_certificate_delta."},
    )
    constraint_certificate_delta: Optional[float] = field(
        default=None,
        metadata={"help": "Margins sized to the certificate: every constraint whose certify has a dataset and a "
                  "value_range is trained to tol_k minus the width its certificate's bound will need at that delta "
                  "and the certification split's size (empirical Bernstein, from the running spread of the per-row "
                  "values), so that a run feasible in training is likely to certify. In (0, 1); exclusive with "
                  "constraint_confidence and constraint_margin. In Python: CertificateMargin; Constraint.margin "
                  "overrides it."},
    )
    constraint_proxy_indicator: bool = field(
        default=False,
        metadata={"help": "The estimate (and the hinge's indicator) of every constraint that declares a "
                  "certification statistic (Certification.statistic) tracks that statistic, against its tolerance, "
                  "while the gradient follows the constraint's differentiable surrogate. With two-split estimation "
                  "on the indicator rows; with one split on the gradient's own rows, scored at the step's parameters "
                  "before its update and, for a causal LM's non-forgetting constraints, in the forward the gradient "
                  "already makes (no pass of its own)."},
    )
    constraint_indicator_fraction: Optional[float] = field(
        default=None,
        metadata={"help": "Two-split estimation (a deviation from the paper): this share of each "
                  "constraint's rows, split off once by a seeded permutation, drives the MSVR estimate u_k and so "
                  "the hinge's indicator 1[u_k > 0]; the rest drives the constraint's gradient. No indicator row "
                  "ever reaches a gradient, so the penalty acts on an estimate of rows the model is not fitted to. "
                  "In (0, 1); one extra forward without grad per step. 0 (or unset): one split, the paper's "
                  "estimate (the library's default; a recipe may set another, e.g. the LLM recipe's 0.25)."},
    )
    constraint_indicator_batch_size: Optional[int] = field(
        default=None,
        metadata={"help": "With two-split estimation: rows of the indicator part per sampled constraint and step, per "
                  "device (default: constraint_batch_size). They are evaluated without grad, so a larger batch costs "
                  "a forward and no activations, and lowers the noise the estimate keeps (constraint_std)."},
    )

    def __post_init__(self) -> None:
        if self.dataloader_pin_memory is None:
            self.dataloader_pin_memory = accelerator_available()
        super().__post_init__()
        _check_types(self)
        if self.constraint_penalty not in PENALTIES:
            raise ValueError(
                f"constraint_penalty must be one of {sorted(PENALTIES)}, got {self.constraint_penalty!r}"
            )
        if self.constraint_penalty != "none" and not (math.isfinite(self.penalty_beta) and self.penalty_beta > 0):
            raise ValueError(f"penalty_beta must be > 0 and finite, got {self.penalty_beta}")
        for name in ("msvr_gamma", "objective_msvr_gamma"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        for name in ("msvr_gamma_prime", "objective_msvr_gamma_prime"):
            setattr(self, name, parse_gamma_prime(getattr(self, name), name))
        if self.constraint_indicator_fraction == 0 and not isinstance(self.constraint_indicator_fraction, bool):
            # 0 is how a command line or a config file turns two-split estimation off (it cannot pass None):
            # one split, as documented in the field's help
            self.constraint_indicator_fraction = None
        if self.constraint_indicator_fraction is not None:
            check_indicator_fraction(self.constraint_indicator_fraction)
        self.margin_rule()  # the flags' errors now, before training
        self.estimate_source()
        if self.max_steps == 0:
            # the Trainer checks its bound after a step: max_steps=0 would train one step
            raise ValueError("max_steps=0 trains nothing; give max_steps >= 1, or -1 (the default) to train "
                             "num_train_epochs epochs")
        if self.constraints_per_step is not None and self.constraints_per_step < 1:
            raise ValueError(f"constraints_per_step must be >= 1, got {self.constraints_per_step}")
        if self.constraint_batch_size < 1:
            raise ValueError(f"constraint_batch_size must be >= 1, got {self.constraint_batch_size}")
        if self.constraint_eval_batch_size is not None and self.constraint_eval_batch_size < 1:
            raise ValueError(f"constraint_eval_batch_size must be >= 1, got {self.constraint_eval_batch_size}")
        if self.log_constraint_estimates_max < 0:
            raise ValueError(f"log_constraint_estimates_max must be >= 0, got {self.log_constraint_estimates_max}")

    def step_config(self, num_sampled: int) -> "StepConfig":
        """The constraint step's settings (Algorithm 1, lines 3-6) from ``msvr_gamma``, ``msvr_gamma_prime``,
        ``constraint_batch_size``, the sampling seed, ``share_constraint_batches`` and ``check_constraint_finite``;
        ``num_sampled`` is |B_c|, resolved by the trainer from ``constraints_per_step`` and m."""
        from .method.engine import StepConfig  # on use: the arguments stay importable without the engine's modules

        return StepConfig(gamma=self.msvr_gamma, gamma_prime=self.msvr_gamma_prime, num_sampled=num_sampled,
                          batch_size=self.constraint_batch_size, seed=self.constraint_sampling_seed,
                          share_constraint_batches=self.share_constraint_batches,
                          check_finite=self.check_constraint_finite)

    def margin_rule(self) -> Optional[Margin]:
        """The run's margin rule from ``constraint_margin``, ``constraint_confidence`` and
        ``constraint_certificate_delta`` (at most one): :func:`hf_constrained.margin.run_margin`."""
        return run_margin(self.constraint_margin, self.constraint_confidence, self.constraint_certificate_delta)

    def estimate_source(self) -> EstimateSource:
        """Which rows drive the estimates and which the gradient, from ``constraint_indicator_fraction``,
        ``constraint_indicator_batch_size`` and ``constraint_proxy_indicator``:
        :func:`hf_constrained.method.strategies.estimate_source`."""
        return estimate_source(self.constraint_indicator_fraction, self.constraint_indicator_batch_size,
                               self.constraint_proxy_indicator)

    @property
    def constraint_sampling_seed(self) -> int:
        return self.seed if self.constraint_seed is None else self.constraint_seed

    # ------------------------------------------------------------------ what a pickle keeps
    def __getstate__(self) -> dict[str, Any]:
        """The state a pickle keeps: every setting except secrets and local paths.

        The Trainer pickles its arguments into ``training_args.bin`` in every checkpoint (and
        checkpoint pushes upload it): the Hub token (``hub_token``, any field named like a
        secret) is left out (``None``), and an absolute path becomes ``<output_dir>``,
        ``<output_dir>/...`` inside the output folder, relative under the current folder, else
        ``<local>/<name>`` (see :func:`hf_constrained.publishable.publishable_path`). Copies
        (``copy.copy``, ``copy.deepcopy``) keep everything.
        """
        state = dict(self.__dict__)
        output_dir = state.get("output_dir")
        for key, value in state.items():
            if value is None:
                continue
            if is_secret_flag(key) and isinstance(value, str):
                state[key] = None
            elif isinstance(value, str):
                state[key] = publishable_path(value, output_dir)
        return state

    def __copy__(self) -> "ConstrainedTrainingArguments":
        new = self.__class__.__new__(self.__class__)
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> "ConstrainedTrainingArguments":
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new


# fields that must hold Python numbers when set from Python (the command line converts them already)
_REAL_FIELDS = ("penalty_beta", "msvr_gamma", "objective_msvr_gamma")
_INT_FIELDS = ("constraint_batch_size", "log_constraint_estimates_max")
_OPTIONAL_INT_FIELDS = ("constraints_per_step", "constraint_eval_batch_size", "constraint_seed",
                        "constraint_indicator_batch_size")


@contextlib.contextmanager
def arguments_set(args: TrainingArguments, **values: Any) -> Iterator[TrainingArguments]:
    """``args`` with ``values`` for the time of the block, each restored after it (also on an error): how the
    trainer hides one of the user's settings from a Trainer step that must not act on it."""
    saved = {name: getattr(args, name) for name in values}
    for name, value in values.items():
        setattr(args, name, value)
    try:
        yield args
    finally:
        for name, value in saved.items():
            setattr(args, name, value)


def _check_types(args: ConstrainedTrainingArguments) -> None:
    """A setting of the wrong Python type (``penalty_beta="10"``, ``constraint_batch_size=2.5``)
    is a :class:`TypeError` naming the field, not a failed comparison deep inside training."""
    for name in _REAL_FIELDS:
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS:
        value = getattr(args, name)
        if value is None and name in _OPTIONAL_INT_FIELDS:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    for name in ("check_constraint_finite", "share_constraint_batches"):
        if not isinstance(getattr(args, name), bool):
            raise TypeError(f"{name} must be True or False, got {getattr(args, name)!r}")
