"""The paper's core claim on convex problems with a known KKT point.

min ||x - a||^2 s.t. Ax <= b (24 rows). The hinge exact penalty with beta above the
threshold m * max_k lambda_k reaches x* and is feasible; below it, it is not; the
squared hinge at the same (exact-for-hinge) beta stays infeasible by a margin.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

# the toy problem lives with the benchmarks (benchmarks/toy_problems.py), not in the package
_spec = importlib.util.spec_from_file_location(
    "toy_problems",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "toy_problems.py"))
toy_problems = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(toy_problems)
make_projection_qp, train_projection = toy_problems.make_projection_qp, toy_problems.train_projection

QP = make_projection_qp()


def run_projection(penalty: str, beta: float, tmp_path, **kw) -> np.ndarray:
    return train_projection(QP, penalty, beta, output_dir=str(tmp_path / penalty), **kw)


def max_violation(x: np.ndarray) -> float:
    return QP.max_violation(x)


def test_problem_is_nontrivial():
    assert max_violation(QP.a) > 0.5  # the unconstrained optimum is infeasible
    assert (QP.lam > 1e-3).sum() >= 2  # several active constraints at x*


def test_hinge_above_threshold_reaches_kkt_point(tmp_path):
    x = run_projection("hinge", 2.0 * QP.exact_penalty_threshold, tmp_path)
    assert np.linalg.norm(x - QP.x_star) < 2e-2
    assert max_violation(x) < 1e-2


def test_hinge_below_threshold_is_infeasible(tmp_path):
    x = run_projection("hinge", 0.5 * QP.exact_penalty_threshold, tmp_path)
    assert max_violation(x) > 0.1


def test_squared_hinge_at_same_beta_stays_infeasible(tmp_path):
    beta = 2.0 * QP.exact_penalty_threshold
    x = run_projection("squared_hinge", beta, tmp_path)
    # its minimiser violates by about lambda_k * m / beta = 0.5 on the largest-multiplier row
    assert max_violation(x) > 0.2


@pytest.mark.slow
def test_stochastic_sampled_constraints_end_feasible_with_msvr(tmp_path):
    """Noisy objective, noisy constraints, 6 of 24 constraints sampled per step, gamma' = 0.1.

    The gamma' = 0 comparison over several seeds is `benchmarks/stochastic_convex.py`.
    """
    x = run_projection("hinge", 4.0 * QP.exact_penalty_threshold, tmp_path, noisy=True, per_step=6,
                       gamma_prime=0.1, steps=1000, lr=0.02)
    assert max_violation(x) < 2e-2
    # the objective's gradient noise (std 0.15 per step) keeps x within about 0.15-0.2 of x*
    assert np.linalg.norm(x - QP.x_star) < 0.25
    # and far from the unconstrained optimum, which violates by > 0.5
    assert np.linalg.norm(x - QP.a) > 0.5
