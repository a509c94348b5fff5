"""Gradient accumulation (issue 6, item 3): 4 micro-batches of 8 == one batch of 32.

The constraint part (B_c, B_k, the MSVR update and the penalty) belongs to the optimizer
step, so both runs draw the same constraint batches, update the estimators once per step
and add the penalty gradient once; the mean objective over 4 x 8 equals the mean over 32
up to float rounding.
"""

from __future__ import annotations

import torch
from scale_tiny import make_trainer, snapshot

STEPS = 4


def _run(tmp_path, name: str, **kw):
    trainer = make_trainer(str(tmp_path / name), max_steps=STEPS, **kw)
    trainer.train()
    return snapshot(trainer)


def test_accumulation_4x8_matches_batch_32(tmp_path):
    accumulated = _run(tmp_path, "ga", per_device_train_batch_size=8, gradient_accumulation_steps=4)
    big = _run(tmp_path, "big", per_device_train_batch_size=32, gradient_accumulation_steps=1)
    plain = _run(tmp_path, "plain", per_device_train_batch_size=32, constraint_penalty="none")

    # the constraint part ran once per optimizer step in both: same streams, same estimator visits
    assert accumulated["streams"] == big["streams"]
    assert torch.equal(accumulated["estimator_visited"], big["estimator_visited"])
    torch.testing.assert_close(accumulated["estimator_values"], big["estimator_values"], rtol=1e-5, atol=1e-6)
    for name, p in big["params"].items():
        torch.testing.assert_close(accumulated["params"][name], p, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
    # ... and the penalty is part of what was compared: without it the parameters differ by far more
    gap = max((plain["params"][n] - p).abs().max().item() for n, p in big["params"].items())
    assert gap > 1e-3, gap
