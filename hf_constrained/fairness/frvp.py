"""The FRVP diagnostic (paper Lemma 3.3).

FRVP (Full Rank at Violating Points): if, wherever some constraint is violated, the
Jacobian of the violated constraints has smallest singular value sigma > 0, the
constraint qualification of the exact-penalty theory holds with delta = sigma / m (so
a constant beta > (eps + L_F) / delta works). The paper reports sigma on Adult at the
initial, two intermediate and the final model (6.5e-4 .. 1.0e-4, Table
``tab:min_singular_values``).

:func:`constraint_jacobian` stacks the full-data gradients grad h_k(w) (one backward per
constraint, the rows of the m x d Jacobian); :func:`min_singular_value` takes sigma from
the m x m Gram matrix J J^T (sigma_min(J) = sqrt(lambda_min(J J^T))), which is cheap
when m << d.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn

from ..batches import BatchMaker
from ..constraint import Constraint


def _full_batch(c: Constraint, data: Any) -> Any:
    """The whole of ``data`` as one batch (the exact h_k, not a mini-batch estimate)."""
    return BatchMaker(None, lambda batch: batch).collate_of(c)([data[i] for i in range(len(data))])


def constraint_jacobian(model: nn.Module, constraints: Sequence[Constraint], *, split: str = "train",
                        batch_fn: Optional[Callable[[Constraint, Any], Any]] = None) -> tuple[np.ndarray, np.ndarray]:
    """Values h_k(w) - tol_k and the Jacobian rows grad h_k(w) of every constraint on its full data.

    ``h_k = outer(fn(model, all of its data))``: for the ROC constraints this is
    |group-rate gap| - kappa, whose gradient is sign(gap) * grad gap. ``batch_fn``
    overrides how a constraint's whole data becomes one batch (default: collate all
    items; :class:`~hf_constrained.fairness.roc.PairedRows` data use
    :func:`paired_full_batch`, every row of each side once).
    Returns ``(values (m,), jacobian (m, d))`` as float64 numpy arrays.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    was_training = model.training
    model.eval()  # no dropout: the gradient of the deterministic h_k
    values, rows = [], []
    try:
        for c in constraints:
            data = c.dataset if split == "train" or c.eval_dataset is None else c.eval_dataset
            batch = (batch_fn or _default_batch)(c, data)
            if isinstance(batch, dict):
                batch = {k: v.to(params[0].device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            with torch.enable_grad():
                h = c.apply_outer(c.fn(model, batch).float()) - c.tolerance
                grads = torch.autograd.grad(h, params, allow_unused=True)
            rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1).double()
                                   for g, p in zip(grads, params)]).cpu().numpy())
            values.append(float(h.detach()))
    finally:
        model.train(was_training)
    return np.asarray(values), np.stack(rows)


def paired_full_batch(c: Constraint, data: Any) -> dict[str, torch.Tensor]:
    """Every row of both sides of a :class:`~hf_constrained.fairness.roc.PairedRows` (or
    ``GroupRows``) once, as a row-wise batch: side A is group 0, side B group 1.

    The ROC constraints take the mean over each group separately, so sides of different
    sizes are fine: the result is the exact full-data group-rate gap.
    """
    rows = np.concatenate([data.rows_a, data.rows_b])
    groups = np.concatenate([np.zeros(len(data.rows_a), np.int64), np.ones(len(data.rows_b), np.int64)])
    return {"inputs": data.source.fetch(rows), c.group_key or "roc_group": torch.from_numpy(groups)}


def _default_batch(c: Constraint, data: Any) -> Any:
    if hasattr(data, "rows_a") and hasattr(data, "rows_b") and hasattr(data, "source"):
        return paired_full_batch(c, data)
    return _full_batch(c, data)


def min_singular_value(jacobian: np.ndarray) -> float:
    """sigma_min of an m x d Jacobian (m <= d) from its m x m Gram matrix."""
    if jacobian.ndim != 2 or jacobian.shape[0] == 0:
        raise ValueError(f"need a non-empty m x d Jacobian, got shape {jacobian.shape}")
    gram = jacobian @ jacobian.T
    lam = np.linalg.eigvalsh(gram).min()
    return float(np.sqrt(max(lam, 0.0)))


def frvp_report(model: nn.Module, constraints: Sequence[Constraint], *, split: str = "train") -> dict[str, Any]:
    """sigma of the violated constraints' Jacobian (the FRVP quantity), and of all constraints.

    ``sigma_violated`` is None when no constraint is violated (FRVP asks nothing there);
    ``delta = sigma_violated / m`` is the constant of Lemma 3.3.
    """
    values, jac = constraint_jacobian(model, constraints, split=split)
    violated = np.flatnonzero(values > 0)
    sigma_v = min_singular_value(jac[violated]) if len(violated) else None
    return {
        "num_constraints": len(constraints),
        "violated": [constraints[i].name for i in violated],
        "max_violation": float(values.max()),
        "sigma_violated": sigma_v,
        "delta": None if sigma_v is None else sigma_v / len(constraints),
        "sigma_all": min_singular_value(jac),
    }
