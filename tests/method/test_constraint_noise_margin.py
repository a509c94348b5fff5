"""Noise you can see and calibrated constraints (row-wise constraints).

* the running per-row spread behind ``constraint_std/<name>`` and the margin
  ``z_c * s_k / sqrt(|D_k|)`` of ``constraint_confidence``, recomputed with numpy from the
  per-row values the shared ``row_fn`` returned during training;
* a margin acts as a lowered tolerance in the hinge's indicator;
* one clear warning when the noise an estimate keeps dwarfs the constraint's scale;
* log size bounded: per-constraint keys only up to ``log_constraint_estimates_max``.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from scipy.stats import norm

from hf_constrained import ConstrainedTrainer, Constraint, constraints_per_value
from hf_constrained.method.margins import SPREAD_DECAY

from conftest import Net64, args64 as make_args, per_row_ce64 as per_row_ce, rows64 as make_data


def recording(outputs: list, holder: dict):
    def row_fn(model, batch):
        out = per_row_ce(model, batch)
        if holder["trainer"].in_training_step and torch.is_grad_enabled():
            outputs.append(out.detach().numpy().copy())
        return out
    return row_fn


def test_margin_and_noise_match_numpy(tmp_path):
    data = make_data(120, 0)
    outputs: list = []
    holder: dict = {}
    cons = constraints_per_value(data, "cls", row_fn=recording(outputs, holder), tolerance=0.4)
    steps, b, conf = 14, 8, 0.9
    trainer = ConstrainedTrainer(model=Net64(), train_dataset=make_data(32, 1), constraints=cons,
                                 args=make_args(tmp_path, "m", max_steps=steps, constraints_per_step=None,
                                                constraint_batch_size=b, constraint_confidence=conf))
    holder["trainer"] = trainer
    trainer.train()
    assert len(outputs) == steps and all(o.shape == (3 * b,) for o in outputs)

    z = norm.ppf(conf)
    var = np.zeros(3)
    for t, out in enumerate(outputs):  # every constraint every step: segments in constraint order
        s2 = out.reshape(3, b).var(axis=1, ddof=1)
        rho = max(1.0 / (t + 1), SPREAD_DECAY)
        var = (1 - rho) * var + rho * s2
    sizes = np.array([len(c.dataset) for c in cons])
    expected_margin = z * np.sqrt(var / sizes)
    got = trainer.constraint_margins()
    np.testing.assert_allclose([got[c.name] for c in cons], expected_margin, rtol=1e-10)
    noise = trainer.constraint_noise()
    np.testing.assert_allclose([noise[c.name] for c in cons], np.sqrt(var / b), rtol=1e-10)
    assert expected_margin.min() > 1e-3  # not vacuous: the spread is real
    logged = [e for e in trainer.state.log_history if "constraint_margin/cls=0" in e]
    assert logged and "constraint_std/cls=0" in logged[-1] and "constraint_margin/max" in logged[-1]


def test_margin_acts_as_a_lowered_tolerance(tmp_path):
    """A constraint with margin 0.15 and tolerance t trains exactly as one with tolerance t - 0.15."""
    data = make_data(90, 0)

    def train(margin: float, tol: float):
        cons = constraints_per_value(data, "cls", row_fn=per_row_ce, tolerance=tol,
                                     margin=margin if margin else None)
        tr = ConstrainedTrainer(model=Net64(), train_dataset=make_data(32, 1), constraints=cons,
                                args=make_args(tmp_path, f"t{margin}", max_steps=6))
        tr.train()
        return tr

    with_margin, lowered, plain = train(0.15, 0.7), train(0.0, 0.55), train(0.0, 0.7)
    assert with_margin.constraint_margins() == {f"cls={v}": 0.15 for v in range(3)}
    for name, p in lowered.model.named_parameters():
        torch.testing.assert_close(dict(with_margin.model.named_parameters())[name], p, rtol=1e-12, atol=1e-14)
    gap = max((dict(plain.model.named_parameters())[n] - p).abs().max().item()
              for n, p in lowered.model.named_parameters())
    assert gap > 1e-4  # the margin changed training


def test_margin_settings_are_validated(tmp_path):
    data = make_data(30, 0)
    with pytest.raises(ValueError, match="confidence needs per-row values"):
        Constraint("c", fn=lambda m, b: m(b["x"])["loss"], dataset=data, confidence=0.9)
    with pytest.raises(ValueError, match="confidence must be in"):
        Constraint("c", row_fn=per_row_ce, dataset=data, confidence=1.2)
    with pytest.raises(ValueError, match="not both"):
        ConstrainedTrainer(model=Net64(), train_dataset=data,
                           constraints=[Constraint("c", row_fn=per_row_ce, dataset=data)],
                           args=make_args(tmp_path, "v", constraint_confidence=0.9, constraint_margin=0.1))


def test_noise_warning_once_and_bounded_logs(tmp_path, caplog):
    data = make_data(90, 0)
    noisy = constraints_per_value(data, "cls", row_fn=per_row_ce, tolerance=0.01)  # scale 0.01: noise dwarfs it
    quiet = Constraint("quiet", row_fn=per_row_ce, dataset=data, tolerance=0.5, metadata={"noise_scale": 100.0})
    args = make_args(tmp_path, "n", max_steps=6, logging_steps=1, constraints_per_step=None,
                     log_constraint_estimates_max=2)
    trainer = ConstrainedTrainer(model=Net64(), train_dataset=make_data(32, 1), constraints=noisy + [quiet], args=args)
    with caplog.at_level(logging.WARNING, logger="hf_constrained.trainer"):
        trainer.train()
    warnings = [r.getMessage() for r in caplog.records if "constraint noise" in r.getMessage()]
    assert len(warnings) == 1
    assert "msvr_gamma" in warnings[0] and "constraint_batch_size" in warnings[0] and "quiet" not in warnings[0]
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert all("constraint_std/max" in e for e in logs)
    assert not any(k.startswith("constraint_std/cls") for e in logs for k in e)  # m = 4 > 2: summary only
