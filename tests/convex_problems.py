"""Small convex problems with an independently computed KKT point (scipy), shared by tests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import minimize, nnls
from torch import nn


@dataclass
class ProjectionQP:
    """min_x ||x - a||^2  s.t.  A x <= b  (m rows), solved by scipy; KKT multipliers by NNLS."""

    A: np.ndarray
    b: np.ndarray
    a: np.ndarray
    x_star: np.ndarray
    lam: np.ndarray  # KKT multipliers of the active rows (0 elsewhere)

    @property
    def m(self) -> int:
        return self.A.shape[0]

    @property
    def exact_penalty_threshold(self) -> float:
        """Phi = F + (beta/m) sum [h_k]_+ is exact iff beta/m > max_k lambda_k."""
        return self.m * float(self.lam.max())


def make_projection_qp(m: int = 24, d: int = 5, seed: int = 0) -> ProjectionQP:
    rng = np.random.default_rng(seed)
    A = rng.normal(size=(m, d))
    A /= np.linalg.norm(A, axis=1, keepdims=True)
    b = rng.uniform(0.5, 1.5, size=m)  # x = 0 is strictly feasible (Slater)
    a = rng.normal(size=d)
    a *= 3.0 / np.linalg.norm(a)  # outside the polytope
    res = minimize(lambda x: np.sum((x - a) ** 2), np.zeros(d), jac=lambda x: 2 * (x - a),
                   constraints=[{"type": "ineq", "fun": lambda x: b - A @ x, "jac": lambda x: -A}],
                   method="SLSQP", options={"ftol": 1e-14, "maxiter": 1000})
    assert res.success, res.message
    x_star = res.x
    active = np.where(A @ x_star - b > -1e-7)[0]
    # stationarity 2 (x* - a) + A_act^T lam = 0 with lam >= 0
    lam_act, resid = nnls(A[active].T, -2 * (x_star - a))
    assert resid < 1e-6, resid
    lam = np.zeros(m)
    lam[active] = lam_act
    return ProjectionQP(A, b, a, x_star, lam)


class ProjectionModel(nn.Module):
    """A model whose only parameter is x; its loss is ||x - a||^2 (+ optional noise from the batch)."""

    def __init__(self, d: int, a: np.ndarray) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.zeros(d, dtype=torch.float64))
        self.register_buffer("a", torch.as_tensor(a, dtype=torch.float64))

    def forward(self, noise: torch.Tensor | None = None, **_) -> dict:
        loss = ((self.x - self.a) ** 2).sum()
        if noise is not None:  # unbiased noisy objective: E[noise] = 0
            loss = loss + (noise.to(self.x) @ self.x).mean() if noise.dim() == 2 else loss
        return {"loss": loss}
