"""A small convex constrained problem with an independently computed KKT point.

``min_x ||x - a||^2  s.t.  A x <= b`` is solved by scipy (SLSQP) and its KKT multipliers
by non-negative least squares, so the exact-penalty threshold of Theorem 1 is known:
the hinge penalty ``(beta/m) sum_k [h_k]_+`` is exact iff ``beta/m > max_k lambda_k``.
Used by ``benchmarks/stochastic_convex.py`` and by the test suite (``tests/method/test_convex_kkt.py``
loads it from this file).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch
from datasets import Dataset
from scipy.optimize import minimize, nnls
from torch import nn
from transformers import PrinterCallback

from hf_constrained import ConstrainedTrainer, ConstrainedTrainingArguments, Constraint


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

    def max_violation(self, x: np.ndarray) -> float:
        return float(np.max(self.A @ x - self.b))

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
    if not res.success:
        raise RuntimeError(f"scipy could not solve the projection problem: {res.message}")
    x_star = res.x
    active = np.where(A @ x_star - b > -1e-7)[0]
    # stationarity 2 (x* - a) + A_act^T lam = 0 with lam >= 0
    lam_act, resid = nnls(A[active].T, -2 * (x_star - a))
    if resid > 1e-6:
        raise RuntimeError(f"no non-negative KKT multipliers found (residual {resid})")
    lam = np.zeros(m)
    lam[active] = lam_act
    return ProjectionQP(A, b, a, x_star, lam)


class ProjectionModel(nn.Module):
    """A model whose only parameter is x; its loss is ||x - a||^2 (+ optional noise from the batch)."""

    def __init__(self, d: int, a: np.ndarray) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.zeros(d, dtype=torch.float64))
        self.register_buffer("a", torch.as_tensor(a, dtype=torch.float64))

    def forward(self, noise: Optional[torch.Tensor] = None, **_) -> dict:
        loss = ((self.x - self.a) ** 2).sum()
        if noise is not None:  # unbiased noisy objective: E[noise] = 0
            loss = loss + (noise.to(self.x) @ self.x).mean()
        return {"loss": loss}


def _row_constraint(A_k: np.ndarray, b_k: float):
    A_k = torch.as_tensor(A_k)

    def h(model: ProjectionModel, batch: Optional[dict]) -> torch.Tensor:
        value = A_k.to(model.x) @ model.x - b_k
        if batch is not None:  # noisy constraint: mean-zero noise from the constraint's data
            value = value + batch["noise"].to(model.x).mean()
        return value

    return h


def train_projection(qp: ProjectionQP, penalty: str, beta: float, *, noisy: bool = False,
                     per_step: Optional[int] = None, gamma: Optional[float] = None,
                     gamma_prime: Union[float, str] = 0.0, steps: int = 600, lr: float = 0.02, seed: int = 0,
                     objective_noise: float = 0.3, constraint_noise: float = 0.3,
                     output_dir: Optional[str] = None) -> np.ndarray:
    """Solve ``qp`` with :class:`~hf_constrained.ConstrainedTrainer` (SGD, linearly decaying lr).

    Deterministic by default (gamma = 1, the estimate is the exact value); ``noisy=True``
    adds mean-zero noise to the objective's gradient and to every constraint's mini-batch
    value and uses gamma = 0.8. Returns the final x.
    """
    rng = np.random.default_rng(seed)
    d = qp.A.shape[1]
    n_obj = steps * 4
    obj_noise = rng.normal(scale=objective_noise, size=(n_obj, d)) if noisy else np.zeros((n_obj, d))
    train = Dataset.from_dict({"noise": obj_noise.tolist()})
    constraints = []
    for k in range(qp.m):
        data = Dataset.from_dict({"noise": rng.normal(scale=constraint_noise, size=200).tolist()}) if noisy else None
        constraints.append(Constraint(f"row{k}", _row_constraint(qp.A[k], qp.b[k]), dataset=data))
    with tempfile.TemporaryDirectory() as tmp:
        args = ConstrainedTrainingArguments(
            output_dir=output_dir or tmp, max_steps=steps, per_device_train_batch_size=4,
            learning_rate=lr, lr_scheduler_type="linear", optim="sgd", weight_decay=0.0, max_grad_norm=0.0,
            constraint_penalty=penalty, penalty_beta=beta, msvr_gamma=gamma or (0.8 if noisy else 1.0),
            msvr_gamma_prime=gamma_prime, constraints_per_step=per_step, constraint_batch_size=8,
            report_to=[], save_strategy="no", logging_steps=steps, disable_tqdm=True, use_cpu=True, seed=seed,
        )
        model = ProjectionModel(d, qp.a)
        trainer = ConstrainedTrainer(model=model, args=args, train_dataset=train, constraints=constraints)
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    return model.x.detach().numpy()
