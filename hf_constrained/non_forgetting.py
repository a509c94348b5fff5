"""Non-forgetting constraints for any model and any per-sample loss.

The problem of the paper's section 5.2 ("Continual learning with non-forgetting
constraints"), for any model::

    min_w F(w, D_target)   s.t.   h_k(w) = L_k(w, D_k) - L_k(w_old, D_k) <= tol_k,   k = 1..m

with L_k(w, D_k) the mean of a per-sample loss l(w, x) over the rows x of the protected
data D_k: the causal-LM token loss of each example
(:func:`~hf_constrained.per_sample_loss.causal_lm_per_example_loss`), a classifier's
cross-entropy (:func:`~hf_constrained.per_sample_loss.sequence_classification_per_example_loss`),
CLIP's zero-shot cross-entropy (:class:`hf_constrained.clip.ZeroShotLoss`), or any
``loss(model, batch) -> (rows,)``.

The old model's per-sample losses are computed ONCE, before training (eval mode, no grad,
batched, with a progress bar), and stored with the rows: the reference pass,
:mod:`hf_constrained.reference_pass` (:func:`~hf_constrained.reference_pass.reference_losses`;
:class:`~hf_constrained.reference_pass.ReferenceLossDataset` adds ``reference_loss``). The
mini-batch value the MSVR estimator tracks (Algorithm 1, line 6) is then h_k(w; B_k) = mean
over B_k of l(w, x) - l(w_old, x), computed without the old model.

The settings (tolerances, the old model's passes, the certificate's statement) are one value,
:class:`NonForgettingConfig`.

**Certificates in the user's units.** With certification rows, the user states the loss they
accept before training, at ``delta``, in one of two units (fields of :class:`NonForgettingConfig`):

* ``accuracy_drop_tolerance=0.02``: "each old task loses at most 2 points of accuracy", the mean
  of the paired change ``old_correct - new_correct`` per row (in {-1, 0, 1}; rows newly right
  count against rows forgotten), bounded by the ``"paired_change"`` bound
  (:func:`points_lost_statistic`);
* ``forget_tolerance=0.02``: "at most 2% of the task's examples are forgotten" (right under the
  old model, wrong now), a 0/1 rate with an exact Clopper-Pearson bound
  (:func:`forgetting_statistic`).

A tolerance the statistic cannot express (a negative share, a drop above 100 points) is an
error naming the task; a certification split too small to certify it even with nothing
forgotten is a warning before training (:func:`hf_constrained.safety.split_checks.check_certifiable`,
run when the trainer starts). With ``old_correct_on_rows`` (the proxy indicator, whose estimate
tracks the statistic on training rows) the training margin is sized from the statement: the
hinge aims at the largest value of the statistic that the certificate's bound, on the
certification split's size at the first look's delta, would still certify
(:func:`certifiable_target`), so a run that meets its training target is one the split can certify.

All constraints built by one :func:`non_forgetting_constraints` call share ONE row function
(:class:`ReferenceGap`: ``l(w, x) - reference_loss`` per row) and one collate function, so a
trainer that fuses row-wise constraints evaluates every sampled protected task in one model
call. With a PEFT (LoRA) model the adapter-disabled base serves as the old model
(``with model.disable_adapter():``), so no second copy of the weights is needed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import numpy as np
import torch
from torch import nn

from .batches import collate_examples
from .certification.bounds import clopper_pearson_upper_bounds, paired_change_upper_bounds
from .certification.certify import DEFAULT_DELTA, certifiability, first_look_delta
from .constraint import Certification, CertifyStatistic, Constraint
from .method.shared_forward import MergedForward
from .per_sample_loss import (
    PaddingCollator,
    causal_lm_correct_from_logits,
    causal_lm_labels,
    causal_lm_losses_from_logits,
    causal_lm_per_example_correct,
    causal_lm_per_example_loss,
    sequence_classification_per_example_loss,
)
from .reference_pass import (
    CORRECT_KEY,
    REFERENCE_KEY,
    PerSampleCorrect,
    PerSampleLoss,
    ReferenceCorrectDataset,
    ReferenceLossDataset,
    as_per_sample_loss,
    iterate_batches,
    old_model_context,
    reference_losses,
    row_subset,
    rows_answered,
    to_device,
    with_old_correctness,
)

logger = logging.getLogger(__name__)

ROWS_KEPT = ("all", "old_correct")
"""Which training rows a non-forgetting constraint keeps (:attr:`NonForgettingConfig.rows_kept`): all, or the rows the
old model answers right."""

__all__ = [
    "CORRECT_KEY",
    "ROWS_KEPT",
    "ForgottenRows",
    "PairedChange",
    "certifiable_target",
    "points_lost_statistic",
    "NonForgettingConfig",
    "NonForgettingConstraint",
    "PerSampleCorrect",
    "ReferenceCorrectDataset",
    "forgetting_statistic",
    "PaddingCollator",
    "PerSampleLoss",
    "ReferenceGap",
    "ReferenceLossDataset",
    "causal_lm_per_example_loss",
    "iterate_batches",
    "largest_share_forgotten",
    "non_forgetting_constraints",
    "old_model_context",
    "old_model_values",
    "reference_losses",
    "sequence_classification_per_example_loss",
    "shares_forgotten",
    "to_device",
    "with_old_correctness",
]


class ForgottenRows:
    """Per row, 1 when the old model got it right and the model now gets it wrong, else 0: the
    statistic a non-forgetting certificate bounds ("at most eps of task k's examples forgotten"),
    a 0/1 rate with an exact (Clopper-Pearson) bound. Its mean bounds the accuracy drop from
    above (rows newly right are not subtracted)."""

    def __init__(self, correct: PerSampleCorrect) -> None:
        self.correct = correct

    @property
    def reads_logits(self) -> bool:
        """Whether :meth:`values_from_logits` can score rows from a causal LM's logits (a proxy indicator then
        reads the statistic from the constraint rows' own forward:
        :class:`~hf_constrained.method.statistic_rows.RowsWithStatistic`)."""
        return self.correct is causal_lm_per_example_correct

    def __call__(self, model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        self._check(batch)
        return self._per_row(self.correct(model, batch).double(), batch)

    def values_from_logits(self, logits: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
        """The per-row statistic from the logits of the batch's rows (possibly wider), as :meth:`__call__` scores it."""
        self._check(batch)
        return self._per_row(causal_lm_correct_from_logits(logits, causal_lm_labels(batch)), batch)

    @staticmethod
    def _check(batch: Mapping[str, Any]) -> None:
        if CORRECT_KEY not in batch:
            raise KeyError(f"batch has no {CORRECT_KEY!r} (the old model's 0/1 correctness per row): wrap the rows in "
                           "ReferenceCorrectDataset (non_forgetting_constraints(certify_datasets=...) does for the "
                           "certification rows; NonForgettingConfig(old_correct_on_rows=True) for the training rows a "
                           "proxy indicator scores)")

    @staticmethod
    def _per_row(now: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
        old = torch.as_tensor(batch[CORRECT_KEY]).to(now)
        return old * (1.0 - now)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({getattr(self.correct, '__name__', type(self.correct).__name__)})"


@functools.lru_cache(maxsize=None)
def _shared(row_class: type, correct: PerSampleCorrect) -> Any:
    """One row function per (statistic, ``correct``): the statistics of every protected task share it, so a proxy
    indicator (two-split estimation) scores all sampled tasks' rows in one model call (one row group)."""
    return row_class(correct)


def forgetting_statistic(correct: PerSampleCorrect, tolerance: float) -> CertifyStatistic:
    """The certification statistic of a non-forgetting constraint: the share of its certification
    rows the old model got right and the new one gets wrong, at most ``tolerance``."""
    return CertifyStatistic(_shared(ForgottenRows, correct), tolerance=float(tolerance), value_range=(0.0, 1.0),
                            bound="clopper_pearson", description="share of the task's examples forgotten",
                            old_model_value=0.0)


def shares_forgotten(model: nn.Module, datasets: Mapping[str, Any], correct: PerSampleCorrect,
                     collate_fn: Optional[Callable] = None, batch_size: int = 64) -> dict[str, float]:
    """Per task, the share of its rows that the old model got right and ``model`` gets wrong: the mean of
    :class:`ForgottenRows`, the statistic of :func:`forgetting_statistic`, as a point value on any rows that
    carry the old model's correctness (:func:`with_old_correctness`; e.g. a checkpoint-selection split).

    A diagnostic or a feasibility check (:func:`largest_share_forgotten`),
    never a certificate: rows that chose a model cannot certify it. One eval-mode pass per task, in row order.
    """
    forgotten = ForgottenRows(correct)
    return {task: float(reference_losses(model, rows, forgotten, collate_fn, batch_size,
                                         desc=f"forgotten rows {task}").double().mean())
            for task, rows in datasets.items()}


def largest_share_forgotten(datasets: Mapping[str, Any], correct: PerSampleCorrect, rate: float,
                            collate_fn: Optional[Callable] = None,
                            batch_size: int = 64) -> Callable[[nn.Module], float]:
    """``model -> max_k share_k - rate``: the largest share of a protected task's rows forgotten
    (:func:`shares_forgotten`) above ``rate``, a largest violation for feasible-checkpoint selection
    (:class:`~hf_constrained.safety.in_memory_selection.InMemoryFeasibleSelection`: feasible when every task
    forgot at most ``rate`` of its selection rows). ``datasets``: task -> rows carrying the old model's
    correctness (:func:`with_old_correctness`, computed once, before training)."""
    if not 0 <= rate < 1:
        raise ValueError(f"the largest share of a task's rows forgotten must be in [0, 1), got {rate}")
    if not datasets:
        raise ValueError("largest_share_forgotten: no protected task's rows")

    def largest(model: nn.Module) -> float:
        return max(shares_forgotten(model, datasets, correct, collate_fn, batch_size).values()) - rate

    return largest


class PairedChange(ForgottenRows):
    """Per row, ``old_correct - new_correct`` in {-1, 0, 1}: 1 forgotten, -1 newly right, 0 unchanged.
    Its mean is the accuracy lost on the task (old accuracy minus new accuracy, on the same rows)."""

    @staticmethod
    def _per_row(now: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
        return torch.as_tensor(batch[CORRECT_KEY]).to(now) - now


def points_lost_statistic(correct: PerSampleCorrect, tolerance: float) -> CertifyStatistic:
    """The certification statistic "the task loses at most ``tolerance`` of accuracy" (0.02 = 2
    points): the mean paired change ``old_correct - new_correct``, value range (-1, 1), with the
    ``"paired_change"`` bound."""
    return CertifyStatistic(_shared(PairedChange, correct), tolerance=float(tolerance), value_range=(-1.0, 1.0),
                            bound="paired_change",
                            description="accuracy lost on the task (old correct - new correct per example)")


def certifiable_target(statistic: CertifyStatistic, rows: int, delta: float = DEFAULT_DELTA) -> Optional[float]:
    """The largest value of a non-forgetting statistic (share forgotten, or accuracy lost with no row
    newly right) that its bound on ``rows`` certification rows, at the first look's delta, still
    certifies: ``k / rows`` for the largest count ``k`` of forgotten rows whose bound is within the
    tolerance. ``None`` when not even ``k = 0`` certifies."""
    level = first_look_delta(delta)
    k = np.arange(rows + 1)
    if statistic.bound == "clopper_pearson":
        ok = clopper_pearson_upper_bounds(k, rows, level) <= statistic.tolerance
    elif statistic.bound == "paired_change":
        ok = paired_change_upper_bounds(k, np.zeros_like(k), rows, level) <= statistic.tolerance
    else:
        raise ValueError(f"certifiable_target: no target for bound {statistic.bound!r}")
    return None if not ok[0] else float(np.flatnonzero(ok)[-1]) / rows


class ReferenceGap:
    """The shared row function of non-forgetting constraints: ``l(w, x) - l(w_old, x)`` per row.

    ``row_fn(model, batch)`` for :class:`~hf_constrained.Constraint`: the mean over a
    batch B_k is h_k(w; B_k) of section 5.2. One object serves every protected task,
    so a fused trainer step computes all of them in one model call.

    For a surrogate that follows only the rows whose loss rose, ``max(0, l(w, x) - l(w_old, x))`` (rows
    whose loss fell then cannot offset rows at risk of being forgotten), give the constraints
    ``row_transform=torch.relu``: the CLIP demo's ``--forgetting increase`` and the LLM example's
    ``--constraint_surrogate loss_increase`` do.
    """

    # each row's value is a training loss minus a constant, so its gradient is the loss's: replay can read these
    # rows in the same forward (:class:`~hf_constrained.method.regularisers.ConstraintRowReplay`)
    rows_are_loss_gaps = True

    def __init__(self, loss: Union[PerSampleLoss, Any]) -> None:
        self.loss = loss
        self.per_sample = as_per_sample_loss(loss)

    @property
    def reads_logits(self) -> bool:
        """Whether :meth:`values_from_logits` applies: the rows are a causal LM's token rows."""
        return self.per_sample is causal_lm_per_example_loss

    def __call__(self, model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        self._check(batch)
        return self._gap(self.per_sample(model, batch), batch)

    @property
    def merged_forward(self) -> Optional[Callable[[nn.Module, Mapping[str, Any]], Any]]:
        """How these rows join the objective's forward (:mod:`hf_constrained.method.shared_forward`), or ``None``:
        a causal LM's token rows merge with the objective's tokens; a loss that names a merge of its own (CLIP's
        zero-shot loss: ``merged_forward``) merges its way."""
        if self.per_sample is causal_lm_per_example_loss:
            return MergedForward.for_rows
        return getattr(self.loss, "merged_forward", None)

    def values_from_merged(self, merged: Any, batch: Mapping[str, Any]) -> torch.Tensor:
        """``l(w, x) - l(w_old, x)`` per row from a merged forward's outputs (``merged.row_losses``)."""
        self._check(batch)
        return self._gap(merged.row_losses(batch), batch)

    def values_from_logits(self, logits: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
        """``l(w, x) - l(w_old, x)`` per row from the logits of the batch's rows (possibly wider)."""
        self._check(batch)
        return self._gap(causal_lm_losses_from_logits(logits, causal_lm_labels(batch)), batch)

    @staticmethod
    def _check(batch: Mapping[str, Any]) -> None:
        if REFERENCE_KEY not in batch:
            raise KeyError(f"constraint batch has no {REFERENCE_KEY!r}: wrap the data in ReferenceLossDataset "
                           "(non_forgetting_constraints does)")

    @staticmethod
    def _gap(current: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
        return current - torch.as_tensor(batch[REFERENCE_KEY]).to(current)

    def __repr__(self) -> str:
        return f"ReferenceGap({getattr(self.loss, '__name__', type(self.loss).__name__)})"


Tolerance = Union[float, Mapping[str, float]]


def _for_task(value: Optional[Tolerance], task: str, what: str) -> float:
    if value is None:
        return 0.0
    if isinstance(value, Mapping):
        if task not in value:
            raise KeyError(f"{what} has no entry for protected task {task!r} (it has {sorted(value)})")
        return float(value[task])
    return float(value)


@dataclass(frozen=True)
class NonForgettingConfig:
    """The settings of non-forgetting constraints (section 5.2). Fields marked "per task" take one value for
    every protected task or a mapping task name -> value.

    Args:
        tolerance: absolute tolerance on h_k (per task).
        relative_tolerance: added tolerance as a fraction of the old model's mean loss on the task's
            rows, tol_k = tolerance + relative_tolerance * L_k(w_old, D_k) (per task).
        name: the constraint's name, a format string with ``{task}``.
        batch_size: rows per batch of the old model's passes (reference losses, correctness).
        use_base_of_adapter: for a PEFT model, the old model is the base (adapters disabled during
            the old model's passes). ``False`` when the old model is base + a previously trained adapter.
        forget_tolerance: the certificate bounds the share of the task's certification rows forgotten
            (:class:`ForgottenRows`; per task).
        accuracy_drop_tolerance: the certificate bounds the accuracy the task loses (:class:`PairedChange`;
            0.02 = 2 points; per task). Give at most one of the two statements.
        delta: the certificate's error level the statement is made at (the margin is sized for the first
            look at the split, :func:`~hf_constrained.certification.certify.first_look_delta`).
        old_correct_on_rows: with a certification split, also give the training rows the old model's
            correctness, so that a proxy indicator (``constraint_proxy_indicator``) can evaluate the
            certificate's statistic on them (one more old-model pass). The constraint's ``margin`` is then
            sized from the statement (module docstring), in the statistic's units.
        rows_kept: ``"all"`` the training rows; ``"old_correct"``: only those the old model answers right
            (``correct``, one more old-model pass), the rows the certificate can count as forgotten. On a task
            the old model answers only in part, the other rows' gradient pulls toward answers it never gave
            (docs/many_tasks.md: on 24 string tasks it kept 4-7 points more of the worst task for replay of the
            constraint rows, and for the hinge on the tuning seeds; on 31 image classes it was not a measured gain).
    """

    # the training constraint h_k(w) = L_k(w) - L_k(w_old) <= tol_k
    tolerance: Tolerance = 0.0
    relative_tolerance: Optional[Tolerance] = None
    name: str = "non_forgetting/{task}"
    # the old model's passes
    batch_size: int = 64
    use_base_of_adapter: bool = True
    # the certificate's statement, in the user's units (with certification rows and ``correct``)
    forget_tolerance: Optional[Tolerance] = None
    accuracy_drop_tolerance: Optional[Tolerance] = None
    delta: float = DEFAULT_DELTA
    old_correct_on_rows: bool = False
    rows_kept: str = "all"

    def __post_init__(self) -> None:
        if self.rows_kept not in ROWS_KEPT:
            raise ValueError(f"rows_kept must be 'all' or 'old_correct', got {self.rows_kept!r}")
        if self.forget_tolerance is not None and self.accuracy_drop_tolerance is not None:
            raise ValueError("give forget_tolerance or accuracy_drop_tolerance, not both (the certificate bounds "
                             "one statistic per constraint)")

    @property
    def states_a_certificate(self) -> bool:
        return self.forget_tolerance is not None or self.accuracy_drop_tolerance is not None

    def for_task(self, task: str, certified: bool = True) -> "NonForgettingConfig":
        """These settings with one task's numbers in place of mappings. For a task without certification rows
        (``certified=False``) the statement is left out, so its mappings need entries for certified tasks only."""
        def statement(value: Optional[Tolerance], what: str) -> Optional[float]:
            return None if value is None or not certified else _for_task(value, task, what)

        return dataclasses.replace(
            self, tolerance=_for_task(self.tolerance, task, "tolerance"),
            relative_tolerance=_for_task(self.relative_tolerance, task, "relative_tolerance"),
            forget_tolerance=statement(self.forget_tolerance, "forget_tolerance"),
            accuracy_drop_tolerance=statement(self.accuracy_drop_tolerance, "accuracy_drop_tolerance"))


def _statement_statistic(task: str, name: str, certify_dataset: Optional[Any], correct: Optional[PerSampleCorrect],
                         config: NonForgettingConfig) -> Optional[CertifyStatistic]:
    """The certificate's statistic from the user's statement (``None`` without certification rows), checked
    before the old model's pass over those rows: a tolerance the statistic cannot express is an error now."""
    if certify_dataset is None:
        return None
    if correct is None or not config.states_a_certificate:
        raise ValueError(f"protected task {task!r}: certify_dataset needs correct= (per-row 0/1 correctness) "
                         "and, in config=NonForgettingConfig(...), forget_tolerance= (the largest share of examples "
                         "that may be forgotten) or accuracy_drop_tolerance= (the most accuracy the task may lose, "
                         "0.02 = 2 points)")
    statistic = (forgetting_statistic(correct, config.forget_tolerance) if config.forget_tolerance is not None
                 else points_lost_statistic(correct, config.accuracy_drop_tolerance))
    check = certifiability(name, statistic.bound, statistic.value_range, statistic.tolerance,
                           [len(certify_dataset)], first_look_delta(config.delta))
    if check.never:
        raise ValueError(check.message())
    return statistic


class NonForgettingConstraint(Constraint):
    """h_k(w) = L_k(w, D_k) - L_k(w_old, D_k) <= tolerance for one protected task (section 5.2).

    Built by :meth:`from_old_model` (one task) or :func:`non_forgetting_constraints`
    (several tasks sharing one row function). ``metadata`` holds ``old_loss`` (the old
    model's mean loss on the constraint data) and, with held-out data, ``old_eval_loss``.
    """

    @classmethod
    def from_old_model(cls, task: str, old_model: nn.Module, loss: Union[PerSampleLoss, Any], dataset: Any,
                       collate_fn: Optional[Callable] = None, *, eval_dataset: Optional[Any] = None,
                       certify_dataset: Optional[Any] = None, correct: Optional[PerSampleCorrect] = None,
                       row_fn: Optional[ReferenceGap] = None,
                       config: Optional[NonForgettingConfig] = None) -> "NonForgettingConstraint":
        """Run the reference pass of ``old_model`` on ``dataset`` (and ``eval_dataset``) and
        return the constraint over those rows.

        Args:
            task: the protected task's name (the constraint is ``config.name.format(task=task)``).
            old_model: the model before fine-tuning. For a PEFT model with
                ``config.use_base_of_adapter`` (default) the reference pass runs with the adapters
                disabled: the base model is the old model.
            loss: the per-sample loss l(w, x).
            dataset / eval_dataset: the protected rows for training / held-out evaluation.
            collate_fn: rows -> batch, shared by the reference pass and the trainer.
            certify_dataset: the task's certification rows (read only by the certificate); needs
                ``correct`` (per-row 0/1 correctness) and the user's statement in ``config``:
                ``forget_tolerance`` or ``accuracy_drop_tolerance``.
            row_fn: a :class:`ReferenceGap` to share with other constraints (default: a new one).
            config: tolerances, the old model's passes and the statement (:class:`NonForgettingConfig`).
        """
        config = (config or NonForgettingConfig()).for_task(task)
        if config.relative_tolerance < 0:
            raise ValueError(f"protected task {task!r}: relative_tolerance must be >= 0, got "
                             f"{config.relative_tolerance}")
        collate_fn, name = collate_fn or collate_examples, config.name.format(task=task)

        def old_pass(fn: Callable, rows: Any, per_row: Callable, desc: str) -> Any:
            """One pass of the old model (a PEFT model's base, unless configured otherwise) over ``rows``."""
            with old_model_context(old_model, config.use_base_of_adapter):
                return fn(old_model, rows, per_row, collate_fn, config.batch_size, desc=desc)

        if config.rows_kept == "old_correct":
            if correct is None:
                raise ValueError(f"protected task {task!r}: rows_kept='old_correct' needs correct (per-row 0/1 "
                                 "correctness, e.g. causal_lm_per_example_correct)")
            dataset = row_subset(dataset, old_pass(
                functools.partial(rows_answered, name=f"protected task {task!r} (rows_kept='old_correct')"), dataset,
                correct, f"old model's correctness {task} (rows kept)"))
        train = ReferenceLossDataset(dataset, old_pass(reference_losses, dataset, loss, f"reference losses {task}"))
        held_out = None if eval_dataset is None else ReferenceLossDataset(eval_dataset, old_pass(
            reference_losses, eval_dataset, loss, f"reference losses {task} (eval)"))
        statistic = _statement_statistic(task, name, certify_dataset, correct, config)
        certify_rows = None if statistic is None else old_pass(
            with_old_correctness, certify_dataset, correct, f"old model's correctness {task} (certification)")
        metadata = {"task": task, "old_loss": train.mean_loss, "absolute_tolerance": config.tolerance,
                    "relative_tolerance": config.relative_tolerance}
        if held_out is not None:
            metadata["old_eval_loss"] = held_out.mean_loss
        margin = None
        if config.old_correct_on_rows:
            if statistic is None:
                raise ValueError(f"protected task {task!r}: old_correct_on_rows serves the certificate's statistic: "
                                 "give certify_dataset, correct and forget_tolerance")
            train = (ReferenceCorrectDataset(train, torch.ones(len(train)))  # kept rows: each one answered
                     if config.rows_kept == "old_correct"
                     else old_pass(with_old_correctness, train, correct, f"old model's correctness {task}"))
            # the proxy indicator tracks the statistic: aim it at what the certification split can still certify
            target = certifiable_target(statistic, len(certify_rows), config.delta)
            margin = statistic.tolerance - (0.0 if target is None else target)
            metadata.update(certifiable_target=target, statement_delta=float(config.delta))
        return cls(name=name, row_fn=row_fn if row_fn is not None else ReferenceGap(loss), dataset=train,
                   tolerance=config.tolerance + config.relative_tolerance * metadata["old_loss"],
                   eval_dataset=held_out, collate_fn=collate_fn, metadata=metadata,
                   certify=None if statistic is None else Certification(dataset=certify_rows, statistic=statistic),
                   margin=margin)


def non_forgetting_constraints(old_model: nn.Module, loss: Union[PerSampleLoss, Any], datasets: Mapping[str, Any],
                               collate_fn: Optional[Callable] = None, *,
                               eval_datasets: Optional[Mapping[str, Any]] = None,
                               certify_datasets: Optional[Mapping[str, Any]] = None,
                               correct: Optional[PerSampleCorrect] = None, row_fn: Optional[ReferenceGap] = None,
                               config: Optional[NonForgettingConfig] = None) -> list[NonForgettingConstraint]:
    """One :class:`NonForgettingConstraint` per protected task, all sharing one row function.

    Args:
        old_model: the model before fine-tuning (a PEFT model: its base, see
            :attr:`NonForgettingConfig.use_base_of_adapter`).
        loss: the per-sample loss, e.g. :func:`causal_lm_per_example_loss`.
        datasets: task name -> protected rows (tokenised for language models).
        collate_fn: rows -> batch, shared by all tasks (for text: a padding collator).
        eval_datasets: task name -> held-out rows (optional, per task).
        certify_datasets: task name -> certification rows (read only by the certificate), with
            ``correct`` (per-row 0/1 correctness, e.g.
            :func:`~hf_constrained.per_sample_loss.causal_lm_per_example_correct`) and the user's
            statement in ``config``: ``forget_tolerance`` (the certificate bounds the share of each
            task's examples forgotten) or ``accuracy_drop_tolerance`` (the accuracy each task loses,
            paired per example; 0.02 = 2 points).
        row_fn: a :class:`ReferenceGap` of the same loss to share with constraints built
            elsewhere (e.g. a safety set), so that all form one group.
        config: the tolerances, the old model's passes and the certificate's statement
            (:class:`NonForgettingConfig`; each tolerance one for all tasks or per task name).
    """
    if not datasets:
        raise ValueError("no protected tasks: pass at least one task's data")
    for what, given in (("eval_datasets", eval_datasets), ("certify_datasets", certify_datasets)):
        unknown = sorted(set(given or ()) - set(datasets))
        if unknown:
            raise KeyError(f"{what} has tasks {unknown} that are not in datasets ({sorted(datasets)})")
    config = config or NonForgettingConfig()
    row_fn = row_fn if row_fn is not None else ReferenceGap(loss)
    collate_fn = collate_fn or collate_examples
    out = []
    for task, data in datasets.items():
        certify_rows = None if certify_datasets is None else certify_datasets.get(task)
        constraint = NonForgettingConstraint.from_old_model(
            task, old_model, loss, data, collate_fn, eval_dataset=None if eval_datasets is None
            else eval_datasets.get(task), certify_dataset=certify_rows, correct=correct, row_fn=row_fn,
            config=config.for_task(task, certified=certify_datasets is not None and task in certify_datasets))
        out.append(constraint)
        logger.info("non-forgetting constraint %s: %d rows, old loss %.4f, tolerance %.4g", constraint.name,
                    len(constraint.dataset), constraint.metadata["old_loss"], constraint.tolerance)
    return out


def old_model_values(constraints: Sequence[Constraint]) -> dict[str, float]:
    """h_k(w_old) of non-forgetting constraints: 0 by definition (for the safety report's old-model column)."""
    return {c.name: 0.0 for c in constraints}
