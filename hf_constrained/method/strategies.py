"""Margin dispatch and estimate sources: the variants of Algorithm 1's line 9 indicator, as strategy objects.

Algorithm 1 (section 4 of the paper) weighs each sampled constraint by the penalty's derivative at its
MSVR estimate u_k, whose indicator is ``1[u_k > tol_k]``, and u_k follows the same batches B_k^t as the
constraint's gradient. Two families of deviations change that line, each one variant behind one
dispatch point (PEFT's ``LoraVariant`` style), so that the engine calls a variant and never asks which
flag was set:

* **margins** (:class:`~hf_constrained.margin.Margin`, declared in :mod:`hf_constrained.margin`): the
  indicator acts on ``u_k + margin_k > tol_k``, training each constraint ``margin_k`` below its tolerance.
  :func:`margin_rules` decides, once per run, each constraint's rule from its own ``Constraint.margin``
  and the run's flags (:func:`~hf_constrained.margin.run_margin`).
* **estimate sources** (:class:`EstimateSource`): which rows drive u_k (and so the indicator) and
  which drive the gradient. :class:`OneSplit` is the paper's line 6 (the same B_k^t for both);
  :class:`TwoSplit` estimates on a held-apart indicator part of each constraint's rows, optionally
  tracking the certificate's statistic there (a proxy constraint). :func:`estimate_source` builds it
  from the run's flags.

Both are deviations from Algorithm 1 (off by default): its convergence analysis covers neither.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import numpy as np
import torch

from ..margin import Margin, describe, margin_flag
from .statistic_rows import statistic_wrappers

if TYPE_CHECKING:  # pragma: no cover
    from ..constraint import Constraint

logger = logging.getLogger(__name__)


def margin_rules(constraints: Sequence["Constraint"], run: Optional[Margin]) -> list[Optional[Margin]]:
    """Each constraint's margin rule: its own ``Constraint.margin`` when set (an error naming the constraint
    when that rule cannot apply to it), else the run's rule where it applies (a warning lists the constraints
    it cannot size: no margin for them), else none. The one dispatch point of margins."""
    rules: list[Optional[Margin]] = []
    skipped: list[str] = []
    for c in constraints:
        own = c.margin
        if own is not None:
            reason = own.unusable_for(c)
            if reason is not None:
                raise ValueError(f"constraint {c.name!r}: Constraint.margin={own.describe()}: {reason}")
            rules.append(own)
        elif run is not None and run.unusable_for(c) is None:
            rules.append(run)
        else:
            rules.append(None)
            if run is not None:
                skipped.append(c.name)
    if skipped:
        flag = margin_flag(run) or "the run's margin rule"
        logger.warning("%s (%s) sizes no margin for %d constraint(s): %s. %s; or give them Constraint(margin=...).",
                       flag, run.describe(), len(skipped), skipped[:10], run.skip_reason)
    return rules


# ---------------------------------------------------------------------------------------------- estimate sources
class EstimateSource(ABC):
    """Which rows drive the estimate u_k (so line 9's indicator) and which drive the gradient."""

    name: ClassVar[str]

    def describe(self) -> str:
        return describe(self)

    @abstractmethod
    def views(self, constraints: Sequence["Constraint"], seed: int
              ) -> tuple[list["Constraint"], Optional[list["Constraint"]]]:
        """(the constraints over the gradient's rows, the constraints over the estimate's rows; ``None`` when the
        gradient's batches drive the estimate too)."""

    def estimate_batch_size(self, batch_size: int) -> Optional[int]:
        """Rows per process of the estimate's own batches (``None``: it follows the gradient's)."""
        return None

    def estimated(self, constraints: Sequence["Constraint"], estimate_views: Optional[Sequence["Constraint"]]
                  ) -> list["Constraint"]:
        """What each estimate u_k tracks (its tolerance and ``outer``): the constraints themselves."""
        return list(constraints)

    @property
    def batch_setting(self) -> str:
        """The flag that sizes the batches the estimate follows (named by the noise warning)."""
        return "constraint_batch_size"

    @property
    def statistic_on_gradient_rows(self) -> bool:
        """Whether the estimate scores a statistic on the gradient's own rows, in their forward."""
        return False

    def settings(self, batch_size: int) -> dict[str, Any]:
        """The run flags this source stands for, resolved (``constraint_indicator_batch_size`` is |B_k| when unset)."""
        return {"constraint_indicator_fraction": None, "constraint_indicator_batch_size": None,
                "constraint_proxy_indicator": False}


@dataclass(frozen=True)
class OneSplit(EstimateSource):
    """The paper's Algorithm 1, line 6: u_k follows h_k on the same batch B_k^t as the gradient.

    With ``proxy_statistic`` (a deviation from Algorithm 1) the estimate of a constraint that declares
    ``certify.statistic`` tracks that statistic on the same batch, against its tolerance, while the gradient
    follows the surrogate: a proxy constraint in Cooper's sense, scored in the forward the surrogate already
    makes (:class:`~hf_constrained.method.statistic_rows.RowsWithStatistic`), before the step's update."""

    proxy_statistic: bool = False
    name: ClassVar[str] = "one_split"

    def describe(self) -> str:
        return "one_split(proxy_statistic=True)" if self.proxy_statistic else "one_split"

    def views(self, constraints: Sequence["Constraint"], seed: int
              ) -> tuple[list["Constraint"], Optional[list["Constraint"]]]:
        if not self.proxy_statistic:
            return list(constraints), None
        wrap = statistic_wrappers()
        return [c if _statistic_of(c, on_gradient_rows=True) is None
                else dataclasses.replace(c, **{**_view_fields(c, c.dataset),
                                               "row_fn": wrap(c.row_fn, c.certify.statistic.row_fn)})
                for c in constraints], None

    def estimated(self, constraints: Sequence["Constraint"], estimate_views: Optional[Sequence["Constraint"]]
                  ) -> list["Constraint"]:
        """With ``proxy_statistic`` the statistic's views over each constraint's own rows."""
        if not self.proxy_statistic:
            return list(constraints)
        return [c if _statistic_of(c, on_gradient_rows=True) is None else _statistic_view(c, c.dataset)
                for c in constraints]

    @property
    def statistic_on_gradient_rows(self) -> bool:
        return self.proxy_statistic

    def settings(self, batch_size: int) -> dict[str, Any]:
        return {**super().settings(batch_size), "constraint_proxy_indicator": self.proxy_statistic}


@dataclass(frozen=True)
class TwoSplit(EstimateSource):
    """Two-split estimation (a deviation from Algorithm 1): each constraint's rows are split once, by a seeded
    permutation, into an indicator part (``fraction`` of them) and a gradient part. u_k follows batches of the
    indicator part, evaluated without grad (``indicator_batch_size`` rows per process, default |B_k|); the
    gradient follows batches of the gradient part. No indicator row reaches a gradient, so u_k estimates the
    constraint on rows the model is not fitted to (Cotter et al., ICML 2019). With ``proxy_statistic`` the
    estimate of a constraint that declares ``certify.statistic`` tracks that statistic on the indicator rows,
    against its tolerance, while the gradient follows the surrogate (a proxy constraint in Cooper's sense)."""

    fraction: float
    indicator_batch_size: Optional[int] = None
    proxy_statistic: bool = False
    name: ClassVar[str] = "two_split"

    def __post_init__(self) -> None:
        check_indicator_fraction(self.fraction)
        if self.indicator_batch_size is not None and (isinstance(self.indicator_batch_size, bool)
                                                      or int(self.indicator_batch_size) != self.indicator_batch_size
                                                      or self.indicator_batch_size < 1):
            raise ValueError(f"constraint_indicator_batch_size must be >= 1, got {self.indicator_batch_size!r}")

    def views(self, constraints: Sequence["Constraint"], seed: int
              ) -> tuple[list["Constraint"], Optional[list["Constraint"]]]:
        return split_for_indicator(constraints, self.fraction, seed, proxy=self.proxy_statistic)

    def estimate_batch_size(self, batch_size: int) -> Optional[int]:
        return self.indicator_batch_size or batch_size

    def estimated(self, constraints: Sequence["Constraint"], estimate_views: Optional[Sequence["Constraint"]]
                  ) -> list["Constraint"]:
        """With ``proxy_statistic`` the indicator views (a certification statistic's row_fn and tolerance)."""
        return list(estimate_views) if self.proxy_statistic and estimate_views is not None else list(constraints)

    @property
    def batch_setting(self) -> str:
        return "constraint_indicator_batch_size"

    def settings(self, batch_size: int) -> dict[str, Any]:
        return {"constraint_indicator_fraction": self.fraction,
                "constraint_indicator_batch_size": self.estimate_batch_size(batch_size),
                "constraint_proxy_indicator": self.proxy_statistic}


def check_indicator_fraction(fraction: Any) -> float:
    """``constraint_indicator_fraction`` as a number in (0, 1), the share of each constraint's rows that drives the
    estimate under two-split estimation; else a ``ValueError`` naming the flag. The one check of the flag (the
    arguments' ``__post_init__``, :class:`TwoSplit` and :func:`split_for_indicator` call it)."""
    try:
        number = float(fraction)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(fraction, bool) or not 0.0 < number < 1.0:
        raise ValueError(f"constraint_indicator_fraction must be in (0, 1), got {fraction}")
    return number


def estimate_source(indicator_fraction: Optional[float] = None, indicator_batch_size: Optional[int] = None,
                    proxy_indicator: bool = False) -> EstimateSource:
    """The run's estimate source from its flags (``constraint_indicator_fraction``,
    ``constraint_indicator_batch_size``, ``constraint_proxy_indicator``): the one place they are read."""
    if not indicator_fraction:
        if indicator_batch_size is not None:
            raise ValueError("constraint_indicator_batch_size sizes the indicator part's batches of two-split "
                             "estimation: give constraint_indicator_fraction too")
        return OneSplit(bool(proxy_indicator))
    return TwoSplit(float(indicator_fraction), indicator_batch_size, bool(proxy_indicator))


def split_for_indicator(constraints: Sequence[Constraint], fraction: float, seed: int, *, proxy: bool = False
                        ) -> tuple[list[Constraint], list[Constraint]]:
    """Each dataset's rows split once into (gradient part, indicator part) by a permutation seeded by
    (``seed``, the position of the first constraint on it): views of the constraints over each part,
    for two-split estimation. Constraints on the same dataset object share its split (e.g. the TPR
    constraints of every threshold on one set of positives), so no row is an indicator row of one
    and a gradient row of another; datasets that merely hold copies of the same rows are split
    independently. The indicator part holds ``round(fraction * n)`` rows; both parts need one.
    With ``proxy``, the indicator view of a constraint with a ``certify.statistic`` evaluates that
    statistic (its ``row_fn``, tolerance, no ``outer``)."""
    check_indicator_fraction(fraction)
    grad_views, ind_views = [], []
    parts_of: dict[int, tuple[Any, Any]] = {}  # id(dataset) -> (gradient part, indicator part)
    for k, c in enumerate(constraints):
        if c.data_free:
            grad_views.append(c)
            ind_views.append(c)
            continue
        if id(c.dataset) not in parts_of:
            n = len(c.dataset)
            n_ind = int(round(fraction * n))
            if not 1 <= n_ind <= n - 1:
                raise ValueError(f"constraint {c.name!r}: {n} rows cannot be split into an indicator part of "
                                 f"{fraction:g} and a gradient part, both non-empty (constraint_indicator_fraction)")
            order = np.random.default_rng([int(seed), k, 0x5B17]).permutation(n)
            parts_of[id(c.dataset)] = tuple(
                c.dataset.select(rows.tolist()) if hasattr(c.dataset, "select")
                else torch.utils.data.Subset(c.dataset, rows.tolist())
                for rows in (np.sort(order[n_ind:]), np.sort(order[:n_ind])))
        gradient_part, indicator_part = parts_of[id(c.dataset)]
        grad_views.append(dataclasses.replace(c, **_view_fields(c, gradient_part)))
        ind_views.append(_statistic_view(c, indicator_part) if proxy and _statistic_of(c) is not None
                         else dataclasses.replace(c, **_view_fields(c, indicator_part)))
    return grad_views, ind_views


def _view_fields(c: "Constraint", data: Any) -> dict[str, Any]:
    """A view of ``c`` over ``data`` for drawing batches only (no held-out, certification or calibration data of
    its own)."""
    return dict(dataset=data, fn=None if c.rowwise else c.fn, eval_dataset=None,
                certify=None if c.certify is None else dataclasses.replace(c.certify, dataset=None),
                independent_rows=None, margin=None)


def has_statistic(c: "Constraint") -> bool:
    """Whether ``c`` declares a certification statistic a proxy indicator can follow (``certify.statistic`` on rows)."""
    return not c.data_free and c.certify is not None and c.certify.statistic is not None


def _statistic_of(c: "Constraint", *, on_gradient_rows: bool = False) -> Any:
    """``c``'s certification statistic, which a proxy indicator follows (``None`` without one); an error naming
    ``c`` where it cannot be followed."""
    if not has_statistic(c):
        return None
    stat = c.certify.statistic
    if c.outer is not None:
        raise ValueError(f"constraint {c.name!r}: a proxy indicator needs a constraint without outer (its "
                         "gradient weight is the indicator of the statistic alone)")
    if on_gradient_rows and not c.rowwise:
        raise ValueError(f"constraint {c.name!r}: a proxy indicator on the gradient's own rows (one split) scores "
                         "the statistic in the constraint's forward, which needs a row-wise constraint (row_fn); "
                         "give constraint_indicator_fraction for indicator rows of its own")
    return stat


def _statistic_view(c: "Constraint", data: Any) -> "Constraint":
    """The view of ``c`` over ``data`` whose value is its certification statistic (row_fn, tolerance, no outer)."""
    stat = _statistic_of(c)
    view = {**_view_fields(c, data), "fn": None, "row_fn": stat.row_fn, "row_transform": None, "group_key": None,
            "exact_fn": None, "tolerance": float(stat.tolerance), "certify": None}
    return dataclasses.replace(c, **view)


__all__ = ["EstimateSource", "OneSplit", "TwoSplit", "check_indicator_fraction", "estimate_source", "has_statistic",
           "margin_rules", "split_for_indicator"]
