"""Which constraints a step visits (B_c) and which of their samples it uses (B_k).

Both are deterministic functions of the run's seed, so every rank of a distributed run
makes the same choice without communicating and a resumed run repeats it exactly:

* :class:`ConstraintSampler` draws B_c^t (Algorithm 1, line 3) from a generator
  seeded by ``(seed, t)``: nothing to save, nothing to synchronise.
* :class:`ConstraintBatchStream` walks one constraint's data in shuffled epochs
  (Algorithm 1, line 5); its position (epoch, offset) is its whole state.
"""

from __future__ import annotations

from typing import Any

import torch

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads nearby seeds apart


def _mixed_seed(*parts: int) -> int:
    h = 0
    for p in parts:
        h = (h * 6364136223846793005 + (int(p) ^ _MIX)) % (1 << 63)
    return h


class ConstraintSampler:
    """Draws ``num_per_step`` of ``num_constraints`` indices per step, without replacement.

    Args:
        num_constraints: m.
        num_per_step: |B_c|, in [1, m]. With |B_c| = m every constraint is visited.
        seed: the sampling seed; the subset at step t depends only on (seed, t).
    """

    def __init__(self, num_constraints: int, num_per_step: int, seed: int) -> None:
        if not 1 <= num_per_step <= max(num_constraints, 1):
            raise ValueError(
                f"constraints per step must be in [1, {num_constraints}] (the number of constraints), "
                f"got {num_per_step}"
            )
        self.num_constraints = num_constraints
        self.num_per_step = num_per_step
        self.seed = int(seed)

    def sample(self, step: int) -> torch.Tensor:
        """Sorted long tensor of the constraint indices visited at ``step``."""
        if self.num_per_step == self.num_constraints:
            return torch.arange(self.num_constraints)
        gen = torch.Generator().manual_seed(_mixed_seed(self.seed, step, 1))
        return torch.randperm(self.num_constraints, generator=gen)[: self.num_per_step].sort().values


class ConstraintBatchStream:
    """An endless shuffled pass over the ``size`` samples of constraint ``key``.

    Each epoch is a fresh permutation seeded by ``(seed, key, epoch)``; a batch that runs
    past an epoch's end continues into the next, so every batch has exactly
    ``batch_size`` samples even when the data is smaller.
    """

    def __init__(self, size: int, seed: int, key: int) -> None:
        if size < 1:
            raise ValueError("a constraint batch stream needs at least one sample")
        self.size = size
        self.seed = int(seed)
        self.key = int(key)
        self.epoch = 0
        self.position = 0
        self._perm: torch.Tensor | None = None

    def _permutation(self) -> torch.Tensor:
        if self._perm is None:
            gen = torch.Generator().manual_seed(_mixed_seed(self.seed, self.key, self.epoch, 2))
            self._perm = torch.randperm(self.size, generator=gen)
        return self._perm

    def next_indices(self, batch_size: int) -> list[int]:
        out: list[int] = []
        while len(out) < batch_size:
            perm = self._permutation()
            take = min(batch_size - len(out), self.size - self.position)
            out.extend(perm[self.position : self.position + take].tolist())
            self.position += take
            if self.position == self.size:
                self.epoch, self.position, self._perm = self.epoch + 1, 0, None
        return out

    def reseed(self, seed: int) -> None:
        """Continue with another seed's shuffles from the current position (a resumed run keeps
        its checkpoint's sampling sequence)."""
        self.seed, self._perm = int(seed), None

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "size": self.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["size"] != self.size:
            raise ValueError(
                f"constraint data stream {self.key}: checkpoint saw {state['size']} samples, now {self.size}"
            )
        self.epoch, self.position, self._perm = int(state["epoch"]), int(state["position"]), None
