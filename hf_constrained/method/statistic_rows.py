"""The certificate's statistic read from the gradient rows' own forward: a proxy indicator at no extra pass.

A proxy indicator (Cooper's proxy constraints) lets line 9's indicator ``1[u_k > tol_k]`` follow the
certificate's statistic (for a non-forgetting constraint the share of the task's rows forgotten) while
the gradient follows the differentiable surrogate (the per-row loss change). Two-split estimation scores
the statistic on indicator rows of its own, one more forward pass without grad per step. Under one split
(:class:`~hf_constrained.method.strategies.OneSplit` with ``proxy_statistic``) the statistic is scored on
the gradient's own rows B_k^t, and :class:`RowsWithStatistic` reads it from the logits of the forward the
surrogate already makes (the constraint rows' own call, or the objective's merged call:
:mod:`~hf_constrained.method.shared_forward`), so the indicator costs no pass at all.

Why the estimate stays honest: the engine weighs step t's gradient by ``u_k^t``, the estimate *before*
step t's values enter it (:meth:`~hf_constrained.method.engine.ConstraintEngine.penalty_loss`; on a
constraint's first visit, with no estimate yet, the step's own value stands in, as under any estimate source),
and step t's rows are scored at w_t, before the update they contribute to. In a stream's first epoch every row
is scored before any gradient has used it (prequential evaluation); from the second epoch on the rows
were trained on once, and the statistic on them can read lower than on unseen rows.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..per_sample_loss import model_inputs
from .rows import same_callable

logger = logging.getLogger(__name__)


class RowsWithStatistic:
    """A row function (``row_fn``) that also scores the certificate's per-row statistic on the same rows.

    Called as ``row_fn(model, batch)`` it returns the surrogate's per-row values (with grad) and keeps the
    statistic's per-row values (detached) for :meth:`take_statistic`, which the caller reads right after.
    When both functions read a causal LM's logits (``reads_logits``:
    :class:`~hf_constrained.non_forgetting.ReferenceGap` and :class:`~hf_constrained.non_forgetting.ForgottenRows`
    over the causal-LM loss and exact match) ONE
    forward serves both, and the rows may join the objective's forward (``merged_forward``); otherwise the
    statistic takes a forward of its own without grad on the same rows (logged once).
    """

    def __init__(self, row_fn: Callable[..., torch.Tensor], statistic_fn: Callable[..., torch.Tensor]) -> None:
        self.row_fn, self.statistic_fn = row_fn, statistic_fn
        self.one_forward = bool(getattr(row_fn, "reads_logits", False) and getattr(statistic_fn, "reads_logits", False))
        # replay may read these rows (ConstraintRowReplay) exactly when it may read the surrogate's
        self.rows_are_loss_gaps = bool(getattr(row_fn, "rows_are_loss_gaps", False))
        self._pending: Optional[torch.Tensor] = None
        if not self.one_forward:
            logger.info("the proxy indicator's statistic %r is scored in a forward of its own on the gradient's rows: "
                        "%r and it do not both read a causal LM's logits", statistic_fn, row_fn)

    def __call__(self, model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        if not self.one_forward:
            values = self.row_fn(model, batch)
            with torch.no_grad():
                self._pending = self.statistic_fn(model, batch).detach()
            return values
        logits = model(**model_inputs(batch)).logits
        self._pending = self.statistic_fn.values_from_logits(logits.detach(), batch)
        return self.row_fn.values_from_logits(logits, batch)

    @property
    def merged_forward(self) -> Optional[Callable[[nn.Module, Mapping[str, Any]], Any]]:
        """The surrogate's merge with the objective's forward, where the statistic can read the merged logits."""
        return getattr(self.row_fn, "merged_forward", None) if self.one_forward else None

    def values_from_merged(self, merged: Any, batch: Mapping[str, Any]) -> torch.Tensor:
        """The surrogate's values from a merged forward; the statistic from its rows' logits (``merged.row_logits``)."""
        self._pending = self.statistic_fn.values_from_logits(merged.row_logits.detach(), batch)
        return self.row_fn.values_from_merged(merged, batch)

    def take_statistic(self) -> torch.Tensor:
        """The statistic's per-row values of the last call (each call's values are read once)."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError(f"{self!r}: no rows were scored since the statistic was last read")
        return pending

    def __repr__(self) -> str:
        return f"RowsWithStatistic({self.row_fn!r}, {self.statistic_fn!r})"


def statistic_wrappers() -> Callable[[Any, Any], RowsWithStatistic]:
    """``wrap(row_fn, statistic_fn)``: one :class:`RowsWithStatistic` per (row function, statistic) among the calls to
    the same ``wrap``, so that the constraints sharing both (every protected task of a non-forgetting run) stay one row
    group, scored in one model call (bound methods compare equal, as :func:`~.rows.same_callable` compares them)."""
    made: list[RowsWithStatistic] = []

    def wrap(row_fn: Any, statistic_fn: Any) -> RowsWithStatistic:
        for wrapper in made:
            if same_callable(wrapper.row_fn, row_fn) and same_callable(wrapper.statistic_fn, statistic_fn):
                return wrapper
        made.append(RowsWithStatistic(row_fn, statistic_fn))
        return made[-1]

    return wrap


__all__ = ["RowsWithStatistic", "statistic_wrappers"]
