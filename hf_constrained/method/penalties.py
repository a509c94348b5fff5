"""How constraint violations become a penalty (the formulation).

* :class:`HingePenalty`, the exact penalty of the paper, eq. (eqn:hinge):
  ``Phi(w) = F(w) + (beta/m) sum_k [h_k(w)]_+``; its stochastic gradient weighs
  grad h_k by ``beta * [u_k]'_+ = beta * 1[u_k > 0]`` (Algorithm 1, line 9).
* :class:`SquaredHingePenalty`, the baseline of Li et al. (2024), eq. (eqn:sqhinge):
  weight ``beta * [u_k]_+`` (the gradient of ``(beta/2) [h]_+^2``).
* :class:`NoPenalty`: unconstrained training.

A penalty only maps estimates u to per-constraint weights (and to the penalty's value
for logging); the trainer multiplies the weights, detached, with the constraint's
mini-batch value so one backward yields ``G_2``.
"""

from __future__ import annotations

import torch


class Penalty:
    """Interface: ``weight(u)`` is d penalty / d h at the estimate u; ``value(u)`` the penalty."""

    name: str = "penalty"
    active: bool = True

    def __init__(self, beta: float) -> None:
        if self.active and not beta > 0:
            raise ValueError(f"the {self.name} penalty needs beta > 0, got {beta}")
        self.beta = float(beta)

    def weight(self, u: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def value(self, u: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(beta={self.beta})"


class HingePenalty(Penalty):
    """``beta [h]_+``: subgradient weight ``beta * 1[u > 0]`` (Algorithm 1, line 9)."""

    name = "hinge"

    def weight(self, u: torch.Tensor) -> torch.Tensor:
        return self.beta * (u > 0).to(u.dtype)

    def value(self, u: torch.Tensor) -> torch.Tensor:
        return self.beta * torch.clamp(u, min=0)


class SquaredHingePenalty(Penalty):
    """``(beta/2) [h]_+^2``: weight ``beta * [u]_+`` (Li et al. 2024; the paper's eq. (eqn:sqhinge))."""

    name = "squared_hinge"

    def weight(self, u: torch.Tensor) -> torch.Tensor:
        return self.beta * torch.clamp(u, min=0)

    def value(self, u: torch.Tensor) -> torch.Tensor:
        return 0.5 * self.beta * torch.clamp(u, min=0) ** 2


class NoPenalty(Penalty):
    """No constraint term: training is exactly the plain objective."""

    name = "none"
    active = False

    def weight(self, u: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(u)

    def value(self, u: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(u)


PENALTIES: dict[str, type[Penalty]] = {
    "hinge": HingePenalty,
    "squared_hinge": SquaredHingePenalty,
    "none": NoPenalty,
}


def make_penalty(name: str, beta: float) -> Penalty:
    """Build a penalty by name (``hinge``, ``squared_hinge`` or ``none``)."""
    try:
        cls = PENALTIES[name]
    except KeyError:
        raise ValueError(f"unknown penalty {name!r}; choose one of {sorted(PENALTIES)}") from None
    return cls(beta)
