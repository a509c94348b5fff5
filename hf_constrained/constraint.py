"""Declaring constraints h_k(w) <= tolerance (the problem, not how it is solved).

A :class:`Constraint` is a name, its own data, and a function that returns the
mini-batch estimate h_k(w; B_k) as a scalar tensor with grad. The trainer draws B_k
from the constraint's data (see :mod:`hf_constrained.method.sampling`), so a constraint knows
nothing about estimators or penalties.

Compositional constraints (ROC fairness, the paper's application "AUC maximization with ROC
fairness constraints") set ``outer``: the
function then returns the INNER value (the one the MSVR estimator tracks) and the
constraint is ``outer(inner) <= tolerance``; the gradient weight is chained through
``outer'`` at the estimate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from .batches import ROW_SOURCE_ATTR, collate_examples, fetch_rows  # noqa: F401  (re-exported)
from .margin import CalibratedMargin, Margin, as_margin
from .row_sums import reduce_rows

ConstraintFn = Callable[[torch.nn.Module, Any], torch.Tensor]
"""``fn(model, batch) -> scalar tensor``; ``batch`` is ``None`` for a data-free constraint."""

RowFn = Callable[[torch.nn.Module, Any], torch.Tensor]
"""``row_fn(model, batch) -> tensor`` with one entry per row of ``batch`` (dim 0): the
model call of a row-wise constraint. Constraints that share one ``row_fn`` object form a
group that the trainer evaluates in one call on the rows of all of them."""

RowTransform = Callable[[torch.Tensor], torch.Tensor]
"""``row_transform(outputs) -> per-row values``: the per-constraint part of a row-wise
constraint, applied to the rows ``row_fn`` produced for it (e.g. ``sigmoid(s - tau)``)."""


@dataclass(frozen=True)
class CertifyStatistic:
    """What the certificate measures for a constraint when it is not the training surrogate
    (a proxy constraint: the measured quantity decides, the surrogate only gives the gradient).

    Args:
        row_fn: ``row_fn(model, batch)`` returning one value per row of a batch of the
            constraint's certification split (e.g. ``old_correct - new_correct`` in {-1, 0, 1},
            so that "accuracy on class k falls by at most eps" is a bounded mean).
        tolerance: the statistic must be <= tolerance on the population.
        value_range: (low, high) every per-row value lies in (a value outside is an error).
        bound: the finite-sample bound (:data:`hf_constrained.certification.bounds.BOUNDS`):
            ``"hoeffding_bentkus"`` by default (any values in the range), ``"clopper_pearson"``
            for 0/1 rates, ``"paired_change"`` for changes in {-1, 0, 1}.
        description: how reports and cards name the statistic.
        group_key: the statistic is a difference of two group means (group 0 minus group 1,
            each row's group in ``batch[group_key]``), e.g. a TPR gap between two groups.
        absolute: with ``group_key``, the statistic is the absolute difference.
        old_model_value: the old model's value of the statistic when it is fixed by construction
            (0 for the share of examples forgotten, which is relative to the old model's answers);
            reports show it in the old model's column.
    """

    row_fn: RowFn
    tolerance: float
    value_range: tuple[float, float]
    bound: str = "hoeffding_bentkus"
    description: str = ""
    group_key: Optional[str] = None
    absolute: bool = False
    old_model_value: Optional[float] = None


@dataclass(frozen=True)
class Certification:
    """How a constraint is certified, as one value: on which rows, what is measured there and the
    range of the values measured (the three vary together: a statistic's range is the statistic's,
    and both mean nothing without rows).

    Args:
        dataset: the certification split: rows of the constraint's population that only the
            certificate reads (never a gradient, a look-ahead, an evaluation during training,
            checkpoint selection or a default). A trainer whose certification rows coincide with
            any training or selection rows refuses to start. ``None`` declares the statistic
            before the rows are carved (e.g. ``dataclasses.replace(cert, dataset=rows)`` later);
            such a constraint is not certified.
        statistic: a :class:`CertifyStatistic` when the certificate should measure something
            other than the training surrogate (it carries its own tolerance and range).
        value_range: (low, high) of the constraint's own per-row values, when ``statistic`` is
            ``None`` (e.g. ``(0, 1)`` for a rate); the certificate's finite-sample bounds need it.

    ``Constraint(certify=Certification(dataset=rows, value_range=(0, 1)))`` certifies the
    constraint's own per-row values; ``Certification(dataset=rows, statistic=stat)`` a proxy
    statistic (e.g. the share of examples forgotten for a loss constraint).
    """

    dataset: Optional[Any] = None
    statistic: Optional[CertifyStatistic] = None
    value_range: Optional[tuple[float, float]] = None


class ConstraintValueError(RuntimeError):
    """A constraint function returned something the method cannot use."""


class EmptyGroupError(ConstraintValueError, ValueError):
    """A ``group_key`` constraint (a difference of two group means) got rows of one group only."""


@dataclass
class Constraint:
    """One inequality constraint ``h(w) <= tolerance``.

    Args:
        name: unique name, used in logs and reports (``constraint/<name>``).
        fn: ``fn(model, batch)`` returning h(w; batch) (or the inner value when
            ``outer`` is set) as a 0-dim tensor that requires grad.
        dataset: the constraint's training data (a ``datasets.Dataset``, a torch
            ``Dataset`` or any indexable sequence); ``None`` for a data-free constraint.
        tolerance: the constraint holds when h <= tolerance (default 0).
        eval_dataset: held-out data for exact evaluation; defaults to ``dataset``.
        collate_fn: turns a list of examples into ``batch``; default: the trainer's
            ``data_collator`` when one other than ``default_data_collator`` is set, else
            :func:`collate_examples`. The trainer adds ``batch["sample_index"]`` (the
            examples' positions in ``dataset``) when batches are dicts. Row-wise constraints
            of one group are collated together, so their examples must collate as one batch.
        outer: optional scalar map for compositional constraints, h = outer(inner).
        exact_fn: optional ``exact_fn(model, dataset) -> float`` for the exact value on
            a whole dataset when h is not a per-sample mean (the default exact
            evaluation averages batch values weighted by batch size).
        row_fn: the row-wise form, instead of ``fn``: ``row_fn(model, batch)`` returns one
            output per row of the batch; h(w; B) is the mean of the per-row values (or,
            with ``group_key``, a difference of two group means). Constraints sharing one
            ``row_fn`` object are evaluated together in one model call, and the per-row
            values give the sampling uncertainty of the exact value.
        row_transform: optional per-constraint map from ``row_fn``'s outputs to per-row
            values (default: the outputs themselves).
        group_key: optional batch key holding each row's group (0 or 1); h is then the
            mean over group 0 minus the mean over group 1. A batch (or evaluation set) without
            rows of one group has no value: :class:`EmptyGroupError`, naming the constraint.
        margin: this constraint's margin rule, overriding the run's (``constraint_margin``,
            ``constraint_confidence``, ``constraint_certificate_delta``): the hinge acts when the
            estimate exceeds ``tolerance - margin`` (on the inner value when ``outer`` is set). A
            :class:`~hf_constrained.margin.Margin`: ``FixedMargin(value)``,
            ``CalibratedMargin(confidence)`` (row-wise only: ``z_c * s / sqrt(|dataset|)`` from the
            running spread ``s`` of the per-row values, so that h holds on unseen data of the same
            population with about that one-sided confidence) or ``CertificateMargin(delta)``; a plain
            number is a ``FixedMargin``. Read back as the rule.
        independent_rows: for a calibrated constraint, the number of independent rows the
            margin counts instead of ``len(dataset)`` (e.g. the number of original images
            when ``dataset`` holds several augmented copies of each: correlated copies do
            not shrink the standard error ``s / sqrt(n)``). Default: ``len(dataset)``.
        certify: how the constraint is certified, a :class:`Certification` (its split, the
            statistic measured there and the range of the values); ``None``: not certified.
    """

    name: str
    fn: Optional[ConstraintFn] = None
    dataset: Optional[Any] = None
    tolerance: float = 0.0
    eval_dataset: Optional[Any] = None
    collate_fn: Optional[Callable[[Sequence[Any]], Any]] = None
    outer: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    exact_fn: Optional[Callable[[torch.nn.Module, Any], float]] = None
    metadata: dict = field(default_factory=dict)
    row_fn: Optional[RowFn] = None
    row_transform: Optional[RowTransform] = None
    group_key: Optional[str] = None
    margin: Optional[Margin | float] = None
    independent_rows: Optional[int] = None
    certify: Optional[Certification] = None

    def __post_init__(self) -> None:
        if self.certify is not None and not isinstance(self.certify, Certification):
            raise TypeError(f"constraint {self.name!r}: certify must be a Certification, got "
                            f"{type(self.certify).__name__}")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a constraint needs a non-empty string name, got {self.name!r}")
        if self.row_fn is not None:
            if self.fn is not None:
                raise ValueError(f"constraint {self.name!r}: give fn (a scalar per batch) or row_fn (per-row "
                                 "values), not both")
            if not callable(self.row_fn):
                raise TypeError(f"constraint {self.name!r}: row_fn must be callable, got {type(self.row_fn).__name__}")
            if self.dataset is None:
                raise ValueError(f"constraint {self.name!r}: a row-wise constraint (row_fn) needs a dataset")
            self.fn = self._reduced_row_fn
        elif self.row_transform is not None or self.group_key is not None:
            raise ValueError(f"constraint {self.name!r}: row_transform and group_key need row_fn")
        if not callable(self.fn):
            raise TypeError(f"constraint {self.name!r}: fn must be callable, got {type(self.fn).__name__}")
        if isinstance(self.tolerance, torch.Tensor) and self.tolerance.numel() == 1:
            self.tolerance = float(self.tolerance.item())
        if isinstance(self.tolerance, bool) or not isinstance(self.tolerance, numbers.Real):
            raise TypeError(f"constraint {self.name!r}: tolerance must be a number, got "
                            f"{type(self.tolerance).__name__} {self.tolerance!r}")
        self.tolerance = float(self.tolerance)
        if not math.isfinite(self.tolerance):
            raise ValueError(f"constraint {self.name!r}: tolerance must be finite, got {self.tolerance}")
        try:
            self.margin = as_margin(self.margin)
        except (TypeError, ValueError) as error:
            raise type(error)(f"constraint {self.name!r}: {error}") from None
        if isinstance(self.margin, CalibratedMargin):  # what the rule needs of the declaration itself
            reason = self.margin.unusable_for(self)
            if reason is not None:
                raise ValueError(f"constraint {self.name!r}: {reason}")
        if self.independent_rows is not None:
            if self.row_fn is None:
                raise ValueError(f"constraint {self.name!r}: independent_rows needs per-row values (declare it with "
                                 "row_fn)")
            if isinstance(self.independent_rows, bool) or not isinstance(self.independent_rows, numbers.Integral) \
                    or self.independent_rows < 1:
                raise ValueError(f"constraint {self.name!r}: independent_rows must be an integer >= 1, got "
                                 f"{self.independent_rows!r}")
            if hasattr(self.dataset, "__len__") and self.independent_rows > len(self.dataset):
                raise ValueError(f"constraint {self.name!r}: independent_rows={self.independent_rows} exceeds the "
                                 f"dataset's {len(self.dataset)} rows")
        self._check_certification()
        for attr, data in (("dataset", self.dataset), ("eval_dataset", self.eval_dataset),
                           ("certify.dataset", None if self.certify is None else self.certify.dataset)):
            if data is not None:
                try:
                    size = len(data)
                except TypeError:
                    raise TypeError(
                        f"constraint {self.name!r}: {attr} must be indexable with a length "
                        f"(a datasets.Dataset, a torch map-style Dataset or a list), got {type(data).__name__}"
                    ) from None
                if size == 0:
                    raise ValueError(f"constraint {self.name!r}: {attr} is empty (no data to estimate it on)")

    def _check_certification(self) -> None:
        def checked_range(value: Any, what: str) -> tuple[float, float]:
            try:
                low, high = (float(v) for v in value)
            except (TypeError, ValueError):
                raise ValueError(
                    f"constraint {self.name!r}: {what} must be a pair (low, high), got {value!r}") from None
            if not (math.isfinite(low) and math.isfinite(high) and low < high):
                raise ValueError(f"constraint {self.name!r}: {what} must be finite with low < high, got {value!r}")
            return low, high

        cert = self.certify
        if cert is None:
            return
        if cert.value_range is not None:
            cert = self.certify = dataclasses.replace(cert, value_range=checked_range(cert.value_range,
                                                                                       "certify.value_range"))
        stat = cert.statistic
        if stat is not None:
            if not isinstance(stat, CertifyStatistic):
                raise TypeError(f"constraint {self.name!r}: certify.statistic must be a CertifyStatistic, got "
                                f"{type(stat).__name__}")
            if not callable(stat.row_fn):
                raise TypeError(f"constraint {self.name!r}: certify.statistic.row_fn must be callable")
            checked_range(stat.value_range, "certify.statistic.value_range")
            if not math.isfinite(float(stat.tolerance)):
                raise ValueError(f"constraint {self.name!r}: certify.statistic.tolerance must be finite")
        if cert.dataset is not None:
            if self.dataset is None:
                raise ValueError(f"constraint {self.name!r}: a data-free constraint has no certification split")
            if stat is None and self.row_fn is None:
                raise ValueError(f"constraint {self.name!r}: certification needs per-row values: declare the "
                                 "constraint with row_fn, or give certify=Certification(statistic=...)")
            if stat is None and cert.value_range is None:
                raise ValueError(f"constraint {self.name!r}: certify=Certification(dataset=...) needs "
                                 "value_range=(low, high), the range of its per-row values (e.g. (0, 1) for a rate), "
                                 "or a statistic: the certificate's finite-sample bound depends on it")

    @property
    def data_free(self) -> bool:
        return self.dataset is None

    @property
    def certifiable(self) -> bool:
        """It has a certification split and per-row values to bound there."""
        return self.certify is not None and self.certify.dataset is not None

    def certification_tolerance(self) -> float:
        """The tolerance the certificate tests (the statistic's, else the constraint's)."""
        stat = self._statistic()
        return float(stat.tolerance) if stat is not None else self.tolerance

    def certification_range(self) -> Optional[tuple[float, float]]:
        """The range of the per-row values the certificate bounds (``None`` if undeclared)."""
        stat = self._statistic()
        if stat is not None:
            return (float(stat.value_range[0]), float(stat.value_range[1]))
        return None if self.certify is None else self.certify.value_range

    def _statistic(self) -> Optional[CertifyStatistic]:
        return None if self.certify is None else self.certify.statistic

    def certification_bound(self) -> str:
        stat = self._statistic()
        return stat.bound if stat is not None else "hoeffding_bentkus"  # bounds.DEFAULT_BOUND

    def apply_outer(self, inner: torch.Tensor) -> torch.Tensor:
        return inner if self.outer is None else self.outer(inner)

    # ------------------------------------------------------------------ row-wise form
    @property
    def rowwise(self) -> bool:
        return self.row_fn is not None

    def row_values(self, outputs: torch.Tensor) -> torch.Tensor:
        """Per-row values of this constraint from the rows ``row_fn`` returned for it."""
        values = outputs if self.row_transform is None else self.row_transform(outputs)
        if values.dim() != 1:
            raise ValueError(f"constraint {self.name!r}: per-row values must be a 1-d tensor (one value per row), "
                             f"got shape {tuple(values.shape)}")
        return values

    def row_groups(self, batch: Any, num_rows: int, device: torch.device) -> torch.Tensor:
        """Each row's group (0 or 1) for a difference of two group means; all 0 for a plain mean."""
        if self.group_key is None:
            return torch.zeros(num_rows, dtype=torch.long, device=device)
        try:
            groups = batch[self.group_key]
        except (KeyError, TypeError, IndexError):
            raise KeyError(
                f"constraint {self.name!r}: its batches have no {self.group_key!r} entry (group_key)") from None
        groups = torch.as_tensor(groups, device=device).long().reshape(-1)
        if groups.numel() != num_rows:
            raise ValueError(f"constraint {self.name!r}: batch[{self.group_key!r}] has {groups.numel()} entries for "
                             f"{num_rows} rows")
        return groups

    def check_group_counts(self, rows_0: int, rows_1: int) -> None:
        """A difference of group means needs rows of both groups: the same :class:`EmptyGroupError`
        in the fused step, the scalar form and the exact evaluation."""
        if self.group_key is not None and (rows_0 == 0 or rows_1 == 0):
            raise EmptyGroupError(
                f"constraint {self.name!r}: a difference of group means needs rows of both groups of "
                f"{self.group_key!r}, got {rows_0} of group 0 and {rows_1} of group 1 (raise constraint_batch_size "
                "or balance the constraint's dataset between the groups)")

    def reduce_rows(self, values: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """The mini-batch value h(w; B) from per-row values: their mean, or with ``group_key``
        the mean over group 0 minus the mean over group 1 (e.g. a TPR gap between two groups)."""
        if self.group_key is None:
            return reduce_rows(values)
        self.check_group_counts(int((groups == 0).sum()), int((groups == 1).sum()))
        return reduce_rows(values, groups)

    def _reduced_row_fn(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """The scalar form of a row-wise constraint (one model call per constraint)."""
        outputs = self.row_fn(model, batch)
        values = self.row_values(outputs)
        return self.reduce_rows(values, self.row_groups(batch, values.shape[0], values.device))


def _hashable(value: Any) -> Any:
    """A one-element tensor or numpy scalar as the Python number it holds (tensors hash by identity)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _column_values(dataset: Any, column: str) -> list:
    """The column as a list, read in one call for a ``datasets.Dataset`` (through Arrow: row-by-row
    formatting of a 100k-row column costs seconds)."""
    if hasattr(dataset, "column_names"):  # datasets.Dataset
        if column not in dataset.column_names:
            raise ValueError(f"column {column!r} not in dataset columns {dataset.column_names}")
        try:
            return dataset.with_format("arrow")[column].to_pylist()
        except Exception:  # an object that looks like a Dataset without Arrow formatting
            return [_hashable(v) for v in dataset[column]]
    return [_hashable(dataset[i][column]) for i in range(len(dataset))]


def _subset(dataset: Any, indices: list[int], tag: str = "") -> Any:
    if hasattr(dataset, "select"):
        fingerprint = getattr(dataset, "_fingerprint", None)
        if isinstance(fingerprint, str) and tag:
            # a fingerprint from (parent, column, value, rows) instead of hashing the index list (28 ms each)
            new = hashlib.sha256(f"{fingerprint}|{tag}|{len(indices)}|{indices[:8]}".encode()).hexdigest()[:32]
            subset = dataset.select(indices, new_fingerprint=new)
        else:
            subset = dataset.select(indices)
        try:  # lets the step read the rows of many such subsets in one call of the parent
            setattr(subset, ROW_SOURCE_ATTR, (dataset, np.asarray(indices, dtype=np.int64)))
        except AttributeError:
            pass
        return subset
    return torch.utils.data.Subset(dataset, indices)


def _rows_by_value(column_values: Sequence[Any]) -> dict[Any, list[int]]:
    """Row indices of each value, in one pass (not one scan of the column per value)."""
    rows: dict[Any, list[int]] = {}
    for i, v in enumerate(column_values):
        rows.setdefault(v, []).append(i)
    return rows


def constraints_per_value(
    dataset: Any,
    column: str,
    fn: Optional[ConstraintFn | Callable[[Any], ConstraintFn]] = None,
    *,
    values: Optional[Sequence[Any]] = None,
    name: str = "{column}={value}",
    tolerance: float | Mapping[Any, float] = 0.0,
    eval_dataset: Optional[Any] = None,
    per_value_fn: bool = False,
    **kwargs: Any,
) -> list[Constraint]:
    """One constraint per value of ``dataset[column]`` (per class, per group), in one call.

    Args:
        dataset: the data to split; each constraint gets the rows with its value.
        column: the column (or dict key of each example) to split on.
        fn: the constraint function shared by all, or, with ``per_value_fn=True``, a
            factory ``fn(value) -> constraint function``. Leave it out and pass ``row_fn=``
            (row-wise form): the constraints then share that one ``row_fn`` and the trainer
            evaluates all sampled ones in one model call per step.
        values: which values get a constraint (default: every value present, sorted).
        name: a format string with ``{column}`` and ``{value}``.
        tolerance: one tolerance for all, or a mapping value -> tolerance.
        eval_dataset: held-out data split on the same column.
        **kwargs: passed on to :class:`Constraint` (``row_fn``, ``collate_fn``, ``outer``, ...).

    The column is read once and split in one pass, so m values cost O(rows + m) to set up.
    """
    if fn is None and kwargs.get("row_fn") is None:
        raise ValueError("constraints_per_value needs fn (a scalar per batch) or row_fn= (per-row values)")
    extra_metadata = dict(kwargs.pop("metadata", None) or {})
    rows_of = _rows_by_value(_column_values(dataset, column))
    present = sorted(rows_of, key=lambda v: (str(type(v)), v))
    if values is None:
        values = present
    eval_rows_of = _rows_by_value(_column_values(eval_dataset, column)) if eval_dataset is not None else None
    out = []
    for value in values:
        rows = rows_of.get(value)
        if not rows:
            raise ValueError(f"no rows with {column} == {value!r} in the dataset (present: {present[:20]})")
        eval_part = None
        if eval_rows_of is not None:
            eval_rows = eval_rows_of.get(value)
            if not eval_rows:
                raise ValueError(f"no rows with {column} == {value!r} in eval_dataset")
            eval_part = _subset(eval_dataset, eval_rows, f"eval|{column}|{value!r}")
        tol = tolerance[value] if isinstance(tolerance, Mapping) else tolerance
        metadata = {**extra_metadata, "column": column, "value": value}
        out.append(
            Constraint(
                name=name.format(column=column, value=value),
                fn=None if fn is None else (fn(value) if per_value_fn else fn),
                dataset=_subset(dataset, rows, f"train|{column}|{value!r}"),
                tolerance=float(tol),
                eval_dataset=eval_part,
                metadata=metadata,
                **kwargs,
            )
        )
    return out


def checked_constraints(constraints: Sequence[Constraint]) -> list[Constraint]:
    """``constraints`` as a list, each a :class:`Constraint` and every name used once."""
    constraints = list(constraints)
    for c in constraints:
        if not isinstance(c, Constraint):
            raise TypeError(f"constraints must be Constraint objects, got {type(c).__name__}")
    names = [c.name for c in constraints]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"duplicate constraint names: {duplicates}")
    return constraints
