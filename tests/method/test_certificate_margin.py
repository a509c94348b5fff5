"""Margins sized to the certificate (``constraint_certificate_delta``): the hinge aims at the tolerance
minus the empirical-Bernstein width the certificate's bound will need, checked against numpy."""

import math

import numpy as np
import pytest
import torch
from scale_tiny import NUM_GROUPS, ListDataset, TinyClassifier, make_rows, per_row_ce, tiny_args

from hf_constrained import Certification, ConstrainedTrainer, Constraint


def make(tmp_path, n_certify=40, **overrides):
    torch.manual_seed(1234)
    train_rows, _ = make_rows(128, 0)
    rows, groups = make_rows(96, 1)
    cert, cert_groups = make_rows(4 * n_certify, 2)
    # every row carries the gap's group label: the constraints share one row_fn, so their rows collate together
    rows = [dict(r, g=torch.tensor(int(gk >= 2))) for r, gk in zip(rows, groups)]
    cert = [dict(r, g=torch.tensor(int(gk >= 2))) for r, gk in zip(cert, cert_groups)]
    constraints = [Constraint(name=f"group{k}", row_fn=per_row_ce, tolerance=0.25,
                              dataset=ListDataset([r for r, g in zip(rows, groups) if g == k]),
                              certify=Certification(
                                  dataset=ListDataset([r for r, g in zip(cert, cert_groups) if g == k]),
                                  value_range=(0.0, 20.0)))
               for k in range(NUM_GROUPS)]
    constraints.append(Constraint(name="gap", row_fn=per_row_ce, dataset=ListDataset(rows), tolerance=0.1,
                                  group_key="g", outer=torch.abs,
                                  certify=Certification(dataset=ListDataset(cert), value_range=(0.0, 20.0))))
    kw = dict(constraints_per_step=5, max_steps=4, constraint_certificate_delta=0.05)
    kw.update(overrides)
    return ConstrainedTrainer(model=TinyClassifier(), args=tiny_args(str(tmp_path), **kw),
                              train_dataset=ListDataset(train_rows), constraints=constraints)


def eb_width(var, n, delta, width):
    """Empirical Bernstein (Maurer & Pontil 2009), the documented rule, in numpy."""
    log_term = math.log(2.0 / delta)
    return math.sqrt(2.0 * var * log_term / n) + 7.0 * width * log_term / (3.0 * (n - 1.0))


def test_margins_are_the_certificates_bound_width(tmp_path):
    trainer = make(tmp_path)
    trainer.train()
    margins = trainer.constraint_margins()
    spread = trainer.engine.spread
    var = spread.var.detach().cpu().numpy().reshape(-1, 2)
    rows = spread.rows.detach().cpu().numpy().reshape(-1, 2)
    for k, c in enumerate(trainer.constraints):
        if c.group_key is None:
            expected = eb_width(var[k, 0], len(c.certify.dataset), 0.05, 20.0)
        else:  # each group over its share of the certification rows, at delta / 4 (|difference|)
            share = rows[k] / rows[k].sum()
            expected = sum(eb_width(var[k, g], len(c.certify.dataset) * share[g], 0.05 / 4, 20.0) for g in (0, 1))
        assert margins[c.name] == pytest.approx(expected, rel=1e-6), c.name
        assert margins[c.name] > 0


def test_more_certification_rows_need_a_smaller_margin(tmp_path):
    small, large = make(tmp_path / "s", n_certify=20), make(tmp_path / "l", n_certify=200)
    small.train()
    large.train()
    ratio = np.array([small.constraint_margins()[c.name] / large.constraint_margins()[c.name]
                      for c in small.constraints])
    assert (ratio > 2).all()  # same spread (same training), ten times the rows


def test_certificate_delta_is_checked(tmp_path):
    with pytest.raises(ValueError, match="constraint_certificate_delta must be in \\(0, 1\\)"):
        tiny_args(str(tmp_path), constraint_certificate_delta=1.5)
    with pytest.raises(ValueError, match="give at most one of constraint_margin, constraint_confidence"):
        tiny_args(str(tmp_path), constraint_certificate_delta=0.05, constraint_confidence=0.9)
