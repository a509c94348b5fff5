"""The one reduction of per-row values (``hf_constrained.method.rows``): the scalar form, the fused
step and the exact evaluation give the same h(w; B) and the same gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_constrained.row_sums import inner_values, local_contribution, reduce_rows, segment_sums
from hf_constrained.statistics import inner_statistics


@pytest.mark.parametrize("grouped", [False, True])
def test_one_reduction_everywhere(grouped):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(9, dtype=torch.float64, generator=g, requires_grad=True)
    groups = torch.tensor([0, 1, 1, 0, 0, 1, 0, 1, 1]) if grouped else None
    values = torch.sin(w) * 3

    direct = values[groups == 0].mean() - values[groups == 1].mean() if grouped else values.mean()
    scalar = reduce_rows(values, groups)
    owners = torch.zeros(9, dtype=torch.long) if groups is None else groups
    sums, stats = segment_sums(values, owners, 1, need_grad=True)
    fused = local_contribution(sums, stats[2], 1)[0]
    exact, _, _ = inner_statistics(values.detach().numpy(), None if groups is None else groups.numpy())

    for h in (scalar.detach(), fused.detach(), inner_values(stats)[0], torch.tensor(exact, dtype=torch.float64)):
        assert abs(h.item() - direct.detach().item()) < 1e-14
    (expected,) = torch.autograd.grad(direct, w, retain_graph=True)
    for h in (scalar, fused):
        (grad,) = torch.autograd.grad(h, w, retain_graph=True)
        np.testing.assert_allclose(grad.numpy(), expected.numpy(), rtol=0, atol=1e-14)
