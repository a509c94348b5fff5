"""MSVR estimators: one variance-reduced running estimate per constraint or per sample.

Implements the MSVR recurrence of Jiang et al. (2022) as used by the paper:

* Algorithm 1, line 6 (constraint values, Setting I)::

      u_k <- (1 - g) u_k + g h_k(w_t; B_k) + g' (h_k(w_t; B_k) - h_k(w_{t-1}; B_k))

* Algorithm 2, line 6 (inner functions of a compositional objective, Setting II),
  the same recurrence with one estimator u_{1,i} per training sample i.

Indices that are not updated keep their value (Algorithm 1, line 8). The state of
all m estimators is one tensor of m values plus one boolean tensor of "visited"
flags, so memory is m floats whatever the model size, and the whole state travels
through :meth:`state_dict` into checkpoints.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Union

import torch

GammaPrime = Union[float, str]


def theory_gamma_prime(num_total: int, num_sampled: int, gamma: float) -> float:
    """The MSVR coefficient g' that the paper's analysis prescribes.

    ``g' = (m - |B_c|) / (|B_c| (1 - g)) + (1 - g)`` (Section 4, after Algorithm 1;
    Lemma in Appendix B). With every constraint sampled (|B_c| = m) it reduces to
    ``1 - g``. Requires ``g < 1``.
    """
    if num_sampled < 1 or num_sampled > num_total:
        raise ValueError(f"num_sampled must be in [1, {num_total}], got {num_sampled}")
    if not 0.0 < gamma < 1.0:
        raise ValueError(f"the theory formula for gamma' needs 0 < gamma < 1, got {gamma}")
    return (num_total - num_sampled) / (num_sampled * (1.0 - gamma)) + (1.0 - gamma)


def parse_gamma_prime(value: GammaPrime, name: str = "gamma'") -> GammaPrime:
    """A configured g' (Algorithm 1, line 6) as a finite number >= 0 or ``"theory"``; ``name``
    names the setting in the error."""
    if isinstance(value, str):
        if value.strip().lower() == "theory":
            return "theory"
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{name} must be a number >= 0 or 'theory', got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number >= 0 or 'theory', got {type(value).__name__} {value!r}")
    if not (math.isfinite(float(value)) and float(value) >= 0):
        raise ValueError(f"{name} must be >= 0 and finite, or 'theory', got {value}")
    return float(value)


def resolve_gamma_prime(gamma_prime: GammaPrime, num_total: int, num_sampled: int, gamma: float) -> float:
    """Turn a configured g' (a number or ``"theory"``) into a number."""
    parsed = parse_gamma_prime(gamma_prime)
    return theory_gamma_prime(num_total, num_sampled, gamma) if parsed == "theory" else float(parsed)


def run_precision(model: Optional[torch.nn.Module]) -> torch.dtype:
    """The precision the estimators of a run are kept in: float64 when the model's parameters
    are float64, else float32 (also for half-precision models: a moving average of many small
    steps needs at least float32)."""
    if model is not None and any(p.dtype == torch.float64 for p in model.parameters()):
        return torch.float64
    return torch.float32


class MSVREstimator:
    """``size`` MSVR estimators held as one tensor (float32, or the run's precision).

    Args:
        size: number of estimators (m constraints, or n training samples).
        gamma: the moving-average weight g in (0, 1].
        gamma_prime: the variance-reduction weight g' >= 0 (0 gives a plain moving
            average, what the squared-hinge baseline's code does).
        device: where the state lives (the model's device, so updates need no copy).
        dtype: the precision of the state (:func:`run_precision`: float64 in a float64 run).

    An estimator is initialised on its first visit with the current mini-batch value
    (there is no earlier value to average with).
    """

    def __init__(self, size: int, gamma: float = 0.8, gamma_prime: float = 0.1,
                 device: Union[str, torch.device, None] = None, dtype: torch.dtype = torch.float32) -> None:
        if size < 1:
            raise ValueError(f"an MSVREstimator needs size >= 1, got {size}")
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        if gamma_prime < 0:
            raise ValueError(f"gamma' must be >= 0, got {gamma_prime}")
        self.size = int(size)
        self.gamma = float(gamma)
        self.gamma_prime = float(gamma_prime)
        self.values = torch.zeros(self.size, dtype=dtype, device=device)
        self.visited = torch.zeros(self.size, dtype=torch.bool, device=device)

    # ------------------------------------------------------------------ access
    def get(self, index: torch.Tensor, fallback: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Current estimates u^t at ``index``; unvisited entries take ``fallback``.

        The fallback is how Algorithm 1 reads u_k^t on a first visit: the estimator
        is then initialised with the current mini-batch value.
        """
        index = index.to(self.values.device)
        u = self.values[index]
        if fallback is not None:
            u = torch.where(self.visited[index], u, fallback.detach().to(u))
        return u

    # ------------------------------------------------------------------ update
    @torch.no_grad()
    def update(self, index: torch.Tensor, current: torch.Tensor,
               previous: Optional[torch.Tensor] = None, *, check_unique: bool = True) -> torch.Tensor:
        """Apply the MSVR recurrence at ``index`` and return the new values there.

        Args:
            index: long tensor of estimator indices (no duplicates).
            check_unique: check that (a sync on a GPU); off where unique by construction.
            current: h(w_t; B) at those indices.
            previous: h(w_{t-1}; B) on the SAME batches B; ``None`` (or NaN entries)
                means "not available", which drops the correction term.
        """
        index = index.to(self.values.device).long()
        # on a GPU this check is a host sync (unique's size): callers whose indices are unique by
        # construction (B_c is drawn without replacement) pass check_unique=False
        if check_unique and index.numel() != torch.unique(index).numel():
            raise ValueError("MSVREstimator.update got duplicate indices")
        current = current.detach().to(self.values)
        if previous is None:
            previous = current
        else:
            previous = previous.detach().to(self.values)
            previous = torch.where(torch.isnan(previous), current, previous)
        old = self.values[index]
        g, gp = self.gamma, self.gamma_prime
        new = (1.0 - g) * old + g * current + gp * (current - previous)
        new = torch.where(self.visited[index], new, current)  # first visit: initialise
        self.values[index] = new
        self.visited[index] = True
        return new

    # ------------------------------------------------------------------ state
    def to(self, device: Union[str, torch.device]) -> "MSVREstimator":
        self.values = self.values.to(device)
        self.visited = self.visited.to(device)
        return self

    def state_dict(self) -> dict[str, Any]:
        return {
            "values": self.values.detach().cpu().clone(),
            "visited": self.visited.detach().cpu().clone(),
            "gamma": self.gamma,
            "gamma_prime": self.gamma_prime,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        values, visited = state["values"], state["visited"]
        if values.shape != (self.size,) or visited.shape != (self.size,):
            raise ValueError(
                f"estimator state has {tuple(values.shape)} values, this estimator holds {self.size}: "
                "was the checkpoint written with a different set of constraints or dataset?"
            )
        self.values.copy_(values.to(self.values))
        self.visited.copy_(visited.to(self.visited))

    def __repr__(self) -> str:
        return f"MSVREstimator(size={self.size}, gamma={self.gamma}, gamma_prime={self.gamma_prime})"
