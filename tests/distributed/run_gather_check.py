"""One rank of the differentiable all-gather check (tests/apps/test_gather_with_grad.py).

Launched with ``python -m torch.distributed.run --nproc_per_node 2`` on CPU (gloo). Each rank
holds its own rows ``x_r``, gathers them with :func:`hf_constrained.clip.gather_with_grad`,
computes a loss of its own on the gathered rows (the contrastive terms of Algorithm 2 plus a
rank-dependent weight, so the ranks' losses differ) and back-propagates. Written to
``OUT/rank<r>.pt``: the forward, the gradient of ``x_r``, the same through the hand-written
all-gather the package used before (kept here as the reference), and the gradient of the sum
of every rank's loss with respect to the full batch, computed on one process with no
collective at all (the definition).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from hf_constrained.clip.contrastive import contrastive_terms, contrastive_value, gather_with_grad
from hf_constrained.distributed import exit_after_all_ranks

ROWS, DIM, T = 6, 5, 0.1


class PreviousAllGather(torch.autograd.Function):
    """The package's former hand-written all-gather: all_reduce of the full gradient, then the slice."""

    @staticmethod
    def forward(ctx, x):
        world, rank = dist.get_world_size(), dist.get_rank()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        ctx.rank, ctx.rows = rank, x.shape[0]
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad[ctx.rank * ctx.rows: (ctx.rank + 1) * ctx.rows]


def rows_of(rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    image = torch.nn.functional.normalize(torch.randn(ROWS, DIM, generator=g, dtype=torch.float64), dim=1)
    text = torch.nn.functional.normalize(torch.randn(ROWS, DIM, generator=g, dtype=torch.float64), dim=1)
    return image.to(dtype), text.to(dtype)


def positives(world: int) -> torch.Tensor:
    return torch.tensor([i % 3 == 0 for i in range(world * ROWS)])


def loss_of(rank: int, image: torch.Tensor, text: torch.Tensor, world: int) -> torch.Tensor:
    """Rank ``rank``'s loss on the global batch: the contrastive value plus a rank-dependent term."""
    weight = torch.arange(1, world * ROWS + 1, dtype=image.dtype).unsqueeze(1) * (rank + 1)
    return contrastive_value(contrastive_terms(image, text, positives(world), T), T) + (weight * image * text).sum()


def grads(gather, rank: int, world: int, dtype: torch.dtype) -> dict:
    image, text = (t.clone().requires_grad_(True) for t in rows_of(rank, dtype))
    gi, gt = gather(image), gather(text)
    loss = loss_of(rank, gi, gt, world)
    loss.backward()
    return {"gathered_image": gi.detach(), "loss": loss.detach(), "image_grad": image.grad, "text_grad": text.grad}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=0,
                        help="timed forward+backward calls of each (0: no timing, as in the tests)")
    a = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for dtype in (torch.float32, torch.float64):
        name = str(dtype).split(".")[-1]
        out[f"library_{name}"] = grads(gather_with_grad, rank, world, dtype)
        out[f"previous_{name}"] = grads(PreviousAllGather.apply, rank, world, dtype)
        # the definition: d(sum_j loss_j)/d(all rows), one process, no collective
        parts = [rows_of(r, dtype) for r in range(world)]
        image = torch.cat([p[0] for p in parts]).requires_grad_(True)
        text = torch.cat([p[1] for p in parts]).requires_grad_(True)
        sum(loss_of(j, image, text, world) for j in range(world)).backward()
        rows = slice(rank * ROWS, (rank + 1) * ROWS)
        out[f"direct_{name}"] = {"image_grad": image.grad[rows], "text_grad": text.grad[rows]}
        image.grad, text.grad = None, None
        loss_of(rank, image, text, world).backward()  # this rank's loss alone (what a plain all-gather would give)
        out[f"own_only_{name}"] = {"image_grad": image.grad[rows], "text_grad": text.grad[rows]}
    # speed of the two on this backend (forward + backward of a 512 x 256 gather), timed in alternating
    # blocks of 10 calls so that load on the machine hits both alike
    big = torch.randn(512, 256)
    blocks = {"library": [], "previous": []}
    for _ in range(a.repeats // 10):
        for label, gather in (("library", gather_with_grad), ("previous", PreviousAllGather.apply)):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(10):
                x = big.clone().requires_grad_(True)
                (gather(x) * 2).sum().backward()
            blocks[label].append((time.perf_counter() - start) / 10)
    for label, seconds in blocks.items():
        if seconds:
            out[f"seconds_{label}"] = sorted(seconds)[len(seconds) // 2]  # median over blocks
    torch.save(out, os.path.join(a.out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
    exit_after_all_ranks(0)  # every rank done, then out without the teardown gloo can abort
