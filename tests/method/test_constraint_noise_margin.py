"""Noise you can see and calibrated constraints (row-wise constraints).

* the running per-row spread behind ``constraint_std/<name>`` and the margin
  ``z_c * s_k / sqrt(|D_k|)`` of ``constraint_confidence``, recomputed with numpy from the
  per-row values the shared ``row_fn`` returned during training;
* a margin acts as a lowered tolerance in the hinge's indicator;
* one clear warning when the noise an estimate keeps dwarfs the constraint's scale, and none
  when the batch is the whole of D_k (no sampling noise: the finite-population correction,
  checked against the sampler itself);
* log size bounded: per-constraint keys only up to ``log_constraint_estimates_max``.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from conftest import Net64
from conftest import args64 as make_args
from conftest import per_row_ce64 as per_row_ce
from conftest import rows64 as make_data
from scipy.stats import norm

from hf_constrained import ConstrainedTrainer, Constraint, constraints_per_value
from hf_constrained.margin import CalibratedMargin
from hf_constrained.method.margins import SPREAD_DECAY, without_replacement_factor
from hf_constrained.method.sampling import ConstraintBatchStream


def recording(outputs: list, holder: dict):
    def row_fn(model, batch):
        out = per_row_ce(model, batch)
        if holder["trainer"].in_training_step and torch.is_grad_enabled():
            outputs.append(out.detach().numpy().copy())
        return out
    return row_fn


def pieces_factor(n: int, big_n: int) -> float:
    """``Var(batch mean) / (s^2 / n)`` by enumerating the batch start offsets 0, g, ... of
    consecutive passes over ``big_n`` rows and the piece of each pass a batch covers."""
    total, offsets = 0.0, range(0, big_n, math.gcd(n, big_n))
    for start in offsets:
        pos, left = start, n
        while left:
            piece = min(left, big_n - pos % big_n)
            total += piece * (big_n - piece) / big_n
            pos, left = pos + piece, left - piece
    return total / len(offsets) / n


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
    # B_k cut from shuffled passes over |D_k| rows: the finite-population factor, by enumeration
    factors = np.array([pieces_factor(b, int(size)) for size in sizes])
    np.testing.assert_allclose([noise[c.name] for c in cons], np.sqrt(var / b * factors), rtol=1e-10)
    assert factors.max() < 0.9  # the correction is in play
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
        Constraint("c", fn=lambda m, b: m(b["x"])["loss"], dataset=data, margin=CalibratedMargin(0.9))
    with pytest.raises(ValueError, match="confidence must be in"):
        Constraint("c", row_fn=per_row_ce, dataset=data, margin=CalibratedMargin(1.2))
    with pytest.raises(ValueError, match="give at most one of constraint_margin, constraint_confidence"):
        ConstrainedTrainer(model=Net64(), train_dataset=data,
                           constraints=[Constraint("c", row_fn=per_row_ce, dataset=data)],
                           args=make_args(tmp_path, "v", constraint_confidence=0.9, constraint_margin=0.1))


# a tolerance at about the initial per-row cross-entropy (ln 2): the estimates stay near their threshold, where
# noise decides the indicator; with metadata noise_scale 0.01 the noise dwarfs the scale
NEAR = dict(tolerance=0.69, metadata={"noise_scale": 0.01})


def test_noise_warning_once_and_bounded_logs(tmp_path, caplog):
    data = make_data(90, 0)
    noisy = constraints_per_value(data, "cls", row_fn=per_row_ce, **NEAR)
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


@pytest.mark.parametrize("n", [10, 20, 30, 40, 56])
def test_without_replacement_factor_matches_the_sampler(n):
    """The variance of a batch mean under the constraint sampler's shuffled passes over N = 40
    rows, measured over 20 000 batches, against ``s^2 / n * without_replacement_factor``
    (1 - n/N below N, 0 at N, r (1 - r/N) / n above it; independent draws would give factor 1)."""
    big_n, draws = 40, 20_000
    y = np.random.default_rng(0).standard_normal(big_n)
    s2 = y.var(ddof=1)
    stream = ConstraintBatchStream(big_n, seed=3, key=1)
    means = np.array([y[stream.next_indices(n)].mean() for _ in range(draws)])
    factor = float(without_replacement_factor(torch.tensor(float(n), dtype=torch.float64),
                                              torch.tensor(float(big_n), dtype=torch.float64)))
    assert factor == pytest.approx(pieces_factor(n, big_n), abs=1e-12)
    expected = s2 / n * factor
    if factor == 0:
        assert means.var() < 1e-20
    else:
        assert means.var() == pytest.approx(expected, rel=0.08)
        assert abs(means.var() - s2 / n) > 0.2 * s2 / n  # far from the with-replacement value


def test_without_replacement_factor_closed_form():
    """The closed form equals the enumeration of batch offsets and pieces for every n, N <= 60."""
    grid = [(n, big) for n in range(1, 61) for big in range(1, 61)]
    got = without_replacement_factor(torch.tensor([float(n) for n, _ in grid], dtype=torch.float64),
                                     torch.tensor([float(b) for _, b in grid], dtype=torch.float64))
    np.testing.assert_allclose(got.numpy(), [pieces_factor(n, b) for n, b in grid], atol=1e-12)
    assert float(without_replacement_factor(torch.tensor(8.0), torch.tensor(0.0))) == 1.0  # N unknown


def test_no_noise_warning_when_the_batch_is_the_whole_constraint_set(tmp_path, caplog):
    """Same tiny tolerance, same constraints of 30 rows each: batches of 8 warn; batches of 30
    hold all of D_k every step, so the estimate has no sampling noise to warn about."""
    data = make_data(90, 0)
    cons = [Constraint(f"part{j}", row_fn=per_row_ce, dataset=data.select(range(30 * j, 30 * j + 30)), **NEAR)
            for j in range(3)]

    def run(b: int) -> tuple[list, ConstrainedTrainer]:
        caplog.clear()
        args = make_args(tmp_path, f"b{b}", max_steps=6, logging_steps=1, constraints_per_step=None,
                         constraint_batch_size=b)
        trainer = ConstrainedTrainer(model=Net64(), train_dataset=make_data(32, 1), constraints=cons, args=args)
        with caplog.at_level(logging.WARNING, logger="hf_constrained.trainer"):
            trainer.train()
        return [r.getMessage() for r in caplog.records if "constraint noise" in r.getMessage()], trainer

    noisy, trainer = run(8)
    assert len(noisy) == 1 and min(trainer.constraint_noise().values()) > 0.01
    quiet, trainer = run(30)
    assert quiet == [] and max(trainer.constraint_noise().values()) < 1e-9


def test_noise_warning_under_two_split_names_the_indicator_batch(tmp_path, caplog):
    data = make_data(90, 0)
    cons = constraints_per_value(data, "cls", row_fn=per_row_ce, **NEAR)
    args = make_args(tmp_path, "two", max_steps=6, logging_steps=1, constraints_per_step=None,
                     constraint_indicator_fraction=0.5)
    trainer = ConstrainedTrainer(model=Net64(), train_dataset=make_data(32, 1), constraints=cons, args=args)
    with caplog.at_level(logging.WARNING, logger="hf_constrained.trainer"):
        trainer.train()
    (warning,) = [r.getMessage() for r in caplog.records if "constraint noise" in r.getMessage()]
    assert "Raise constraint_indicator_batch_size" in warning


def test_under_two_split_the_noise_is_counted_over_the_indicator_part(tmp_path):
    """Constraints of 30 rows split in half: indicator batches of 15 rows hold all of the indicator
    part every step, so its estimate has no sampling noise; the same 15-row batches over all 30
    rows (one split) do."""
    data = make_data(90, 0)
    cons = [Constraint(f"part{j}", row_fn=per_row_ce, dataset=data.select(range(30 * j, 30 * j + 30)), **NEAR)
            for j in range(3)]

    def noise(**kw) -> dict:
        args = make_args(tmp_path, f"s{len(kw)}", max_steps=4, constraints_per_step=None, constraint_batch_size=15,
                         **kw)
        trainer = ConstrainedTrainer(model=Net64(), train_dataset=make_data(32, 1), constraints=cons, args=args)
        trainer.train()
        return trainer.constraint_noise()

    assert max(noise(constraint_indicator_fraction=0.5).values()) < 1e-9
    assert min(noise().values()) > 0.01


def test_no_noise_warning_for_estimates_far_from_their_threshold(tmp_path, caplog):
    """The same noise against the same scale (0.01): constraints whose estimates stay far from the
    threshold (tolerance 0.01 against a cross-entropy near 0.7: violated whatever the noise) get no
    warning; with the tolerance at the estimates the noise decides the indicator, and it warns."""
    data = make_data(90, 0)

    def run(tolerance: float) -> tuple[list, ConstrainedTrainer]:
        caplog.clear()
        cons = constraints_per_value(data, "cls", row_fn=per_row_ce, tolerance=tolerance,
                                     metadata={"noise_scale": 0.01})
        args = make_args(tmp_path, f"t{tolerance}", max_steps=6, logging_steps=1, constraints_per_step=None)
        trainer = ConstrainedTrainer(model=Net64(), train_dataset=make_data(32, 1), constraints=cons, args=args)
        with caplog.at_level(logging.WARNING, logger="hf_constrained.trainer"):
            trainer.train()
        return [r.getMessage() for r in caplog.records if "constraint noise" in r.getMessage()], trainer

    far, trainer = run(0.01)
    kept = math.sqrt(0.5 / 1.5)  # msvr_gamma 0.5
    assert far == [] and min(trainer.constraint_noise().values()) * kept > 0.01  # the noise is there
    assert min(trainer.engine.threshold_distances().values()) > max(trainer.constraint_noise().values()) * kept
    near, _ = run(0.69)
    assert len(near) == 1 and "within that noise of its threshold" in near[0]
