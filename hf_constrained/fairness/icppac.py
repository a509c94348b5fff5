"""ICPPAC (Boob, Deng & Lan, Math. Programming 2023, Algorithm 4): the double-loop baseline.

Outer step k (every ``inner_steps`` iterations): anchor w_k = w and solve, approximately,

    min_w F(w) + mu ||w - w_k||^2   s.t.   h_j(w) + mu ||w - w_k||^2 <= 0,  j = 1..m,

with ConEx (the inner loop), one iteration per mini-batch:

1. every constraint's value and gradient at w_t on its own batch B_j (m backward passes:
   the cost the hinge method avoids);
2. linearisation at the previous inner iterate, evaluated at w_t:
   l_j(w_t) = g_j(w_{t-1}) + <grad g_j(w_{t-1}), w_t - w_{t-1}>;
3. extrapolation s = (1 + theta) l(w_t) - theta l(w_{t-1});
4. dual ascent y <- [y + s / tau]_+;
5. primal step w <- w - eta (grad F~(w_t) + sum_j y_j grad g_j(w_t)).

The outer step's output, the next proximal centre w_{k+1}, is the mean of its ConEx
iterates (``inner_output="average"``; ConEx returns an average of its iterates), or the
last iterate (``"last"``, what this module did before). The dual variables y and the
previous-iterate linearisation carry over from one outer step to the next (a warm start).
The constraints are the same :class:`~hf_constrained.Constraint` objects the hinge method
trains on, with the same batches; a compositional constraint's value is
``outer(inner) - tolerance`` on the mini-batch.

The paper (section 5.1) tunes eta in {0.1, 0.01}, tau in {1, 10, 100}, mu in {1e-2, 1e-3,
1e-4} and fixes theta = 0.1. Where this implementation differs from Algorithm 4 of Boob,
Deng & Lan as published:

* constant eta, tau, theta (the paper's tuned constants) instead of the theory's
  iteration-dependent ConEx parameters;
* eta is the primal STEP SIZE, while in ConEx the primal parameter weighs the proximal
  term (1/2)||w - w_t||^2, i.e. the step is its inverse; tau is used as in ConEx, a dual
  proximal weight (y += s / tau). Read as an inverse step, the paper's eta grid would
  mean steps of 10 and 100;
* the quadratic mu ||w - w_k||^2 enters through its gradient in the primal step (an
  explicit step) rather than inside the proximal step; the difference is of order
  eta^2 mu (1 + sum y) per step;
* uniform weights in the average of the inner iterates;
* the final model is the last outer step's output, not an outer iterate drawn at random.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from tqdm.auto import tqdm

from ..batches import BatchMaker
from ..constraint import Constraint
from ..method.sampling import ConstraintBatchStream

logger = logging.getLogger(__name__)


@dataclass
class ICPPACConfig:
    """Step sizes of ICPPAC/ConEx: primal step size ``eta``, dual proximal weight ``tau``
    (y += s/tau), proximal weight ``mu``, extrapolation ``theta``; ``inner_steps`` ConEx
    iterations per outer (proximal) step; ``inner_output``: what an outer step returns,
    ``"average"`` (the mean of its ConEx iterates, as ConEx outputs an average of its
    iterates) or ``"last"`` (the last iterate)."""

    eta: float = 0.1
    tau: float = 10.0
    mu: float = 1e-3
    theta: float = 0.1
    inner_steps: int = 100
    inner_output: str = "average"

    def __post_init__(self) -> None:
        for name in ("eta", "tau"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ICPPAC {name} must be > 0, got {getattr(self, name)}")
        if self.mu < 0 or self.theta < 0:
            raise ValueError(f"ICPPAC mu and theta must be >= 0, got mu={self.mu}, theta={self.theta}")
        if self.inner_steps < 1:
            raise ValueError(f"ICPPAC inner_steps must be >= 1, got {self.inner_steps}")
        if self.inner_output not in ("average", "last"):
            raise ValueError(f"ICPPAC inner_output must be 'average' or 'last', got {self.inner_output!r}")


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


class ICPPACTrainer:
    """Runs ICPPAC on ``model`` with objective ``objective_fn(model, batch)`` over
    ``train_loader`` and the given constraints (drawn ``constraint_batch_size`` items each).

    Args:
        lr_factor: ``lr_factor(step) -> multiplier`` of eta (the shared step-decay schedule).
        callbacks: ``fn(epoch, model, train_seconds)`` after each epoch (history).

    Batches and the dual variables go to the model's device (where its parameters are).
    """

    def __init__(self, model: nn.Module, objective_fn: Callable[[nn.Module, Any], torch.Tensor],
                 train_loader: Any, constraints: Sequence[Constraint], config: ICPPACConfig, *,
                 constraint_batch_size: int, seed: int = 0, lr_factor: Optional[Callable[[int], float]] = None,
                 callbacks: Sequence[Callable[[float, nn.Module, float], None]] = (),
                 disable_tqdm: bool = True) -> None:
        if not constraints:
            raise ValueError("ICPPAC needs at least one constraint")
        self.model = model
        self.objective_fn = objective_fn
        self.train_loader = train_loader
        self.constraints = list(constraints)
        self.config = config
        self.batch_size = int(constraint_batch_size)
        self.streams = [ConstraintBatchStream(len(c.dataset), seed, k) for k, c in enumerate(self.constraints)]
        self.batches = BatchMaker(None, self._to_device)
        self.lr_factor = lr_factor or (lambda step: 1.0)
        self.callbacks = list(callbacks)
        self.device = next(model.parameters()).device
        self.disable_tqdm = disable_tqdm
        self.params = [p for p in model.parameters() if p.requires_grad]
        m = len(self.constraints)
        self.y = torch.zeros(m, device=self.device)  # dual variables
        self.step = 0
        self.train_seconds = 0.0
        self._prev: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # (w, g(w), grad g(w))
        self._prev_lin: Optional[torch.Tensor] = None
        self._inner_sum: Optional[torch.Tensor] = None
        self._inner_count = 0

    def _to_device(self, batch: Any) -> Any:
        return {key: v.to(self.device) for key, v in batch.items()} if isinstance(batch, dict) else batch

    def _batch(self, k: int) -> Any:
        c = self.constraints[k]
        rows = self.streams[k].next_indices(self.batch_size)
        return self.batches.constraint_rows(c, rows)

    def _constraint_values_and_grads(self, anchor: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """g_j(w_t) = h_j(w_t; B_j) + mu ||w_t - w_k||^2 and its gradient, one backward per constraint."""
        prox_value = self.config.mu * float((w - anchor).pow(2).sum())
        prox_grad = 2.0 * self.config.mu * (w - anchor)
        values, grads = [], []
        for k, c in enumerate(self.constraints):
            inner = c.fn(self.model, self._batch(k))
            h = c.apply_outer(inner.float()) - c.tolerance
            g = torch.autograd.grad(h, self.params, allow_unused=True)
            g = [torch.zeros_like(p) if gi is None else gi for gi, p in zip(g, self.params)]
            values.append(float(h.detach()) + prox_value)
            grads.append(_flat(g) + prox_grad)
        return torch.tensor(values, device=self.device), torch.stack(grads)

    def _iteration(self, batch: Any, anchor: torch.Tensor) -> float:
        cfg = self.config
        w = _flat([p.detach() for p in self.params])
        values, grads = self._constraint_values_and_grads(anchor, w)
        if self._prev is None:
            lin = values  # first iteration: no previous iterate to linearise at
        else:
            w_prev, v_prev, g_prev = self._prev
            lin = v_prev + g_prev @ (w - w_prev)
        prev_lin = lin if self._prev_lin is None else self._prev_lin
        s = (1.0 + cfg.theta) * lin - cfg.theta * prev_lin
        self.y = torch.clamp(self.y + s / cfg.tau, min=0.0)
        self._prev, self._prev_lin = (w, values, grads), lin

        loss = self.objective_fn(self.model, batch)
        g_obj = torch.autograd.grad(loss, self.params, allow_unused=True)
        g_obj = _flat([torch.zeros_like(p) if gi is None else gi for gi, p in zip(g_obj, self.params)])
        direction = g_obj + 2.0 * cfg.mu * (w - anchor) + self.y @ grads
        eta = cfg.eta * self.lr_factor(self.step)
        with torch.no_grad():
            offset = 0
            for p in self.params:
                n = p.numel()
                p.add_(direction[offset:offset + n].view_as(p), alpha=-eta)
                offset += n
        self.step += 1
        return float(loss.detach())

    def _set_params(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            offset = 0
            for p in self.params:
                n = p.numel()
                p.copy_(flat[offset:offset + n].view_as(p))
                offset += n

    def _end_outer_step(self) -> torch.Tensor:
        """The outer step's output (the next proximal centre w_k): the mean of this inner
        loop's iterates (``inner_output="average"``) or its last iterate."""
        if self.config.inner_output == "average" and self._inner_count > 0:
            self._set_params(self._inner_sum / self._inner_count)
        anchor = _flat([p.detach() for p in self.params]).clone()
        self._inner_sum = torch.zeros_like(anchor)
        self._inner_count = 0
        return anchor

    def train(self, num_epochs: int) -> dict[str, Any]:
        """Run ``num_epochs`` passes over ``train_loader``; returns a summary. The model
        after the last epoch is the output of the last (possibly shorter) outer step."""
        self.model.train()
        anchor = self._end_outer_step()
        for epoch in range(num_epochs):
            t0 = time.perf_counter()
            bar = tqdm(self.train_loader, desc=f"ICPPAC epoch {epoch + 1}", disable=self.disable_tqdm, leave=False)
            for batch in bar:
                if self.step % self.config.inner_steps == 0 and self.step > 0:  # outer (proximal) step
                    anchor = self._end_outer_step()
                batch = {k: v.to(self.device) for k, v in batch.items()}
                self._iteration(batch, anchor)
                self._inner_sum += _flat([p.detach() for p in self.params])
                self._inner_count += 1
            if epoch == num_epochs - 1:
                self._end_outer_step()
            self.train_seconds += time.perf_counter() - t0
            for cb in self.callbacks:
                cb(float(epoch + 1), self.model, self.train_seconds)
        return {"steps": self.step, "train_seconds": self.train_seconds, "dual": self.y.tolist()}
