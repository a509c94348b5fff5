"""``Constraint.independent_rows``: the n of a calibrated constraint's margin z_c * s_k / sqrt(n_k).

When D_k holds several correlated copies of each original example (augmentation), the
margin must count the originals, not the copies. Checked against a direct numpy
recomputation from the per-row values the shared ``row_fn`` returned during training.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import Net64
from conftest import args64 as make_args
from conftest import per_row_ce64 as per_row_ce
from conftest import rows64 as make_data
from scipy.stats import norm
from test_constraint_noise_margin import recording

from hf_constrained import ConstrainedTrainer, Constraint, constraints_per_value
from hf_constrained.method.margins import SPREAD_DECAY


def test_margin_counts_independent_rows_not_copies(tmp_path):
    data = make_data(120, 0)
    outputs: list = []
    holder: dict = {}
    # class 0 declares 7 independent rows, class 1 12, class 2 none (defaults to |D_k|)
    cons = constraints_per_value(data, "cls", row_fn=recording(outputs, holder), tolerance=0.4)
    independent = {0: 7, 1: 12, 2: None}
    cons = [Constraint(c.name, row_fn=c.row_fn, dataset=c.dataset, tolerance=c.tolerance, collate_fn=c.collate_fn,
                       independent_rows=independent[k]) for k, c in enumerate(cons)]
    steps, b, conf = 10, 8, 0.9
    trainer = ConstrainedTrainer(model=Net64(), train_dataset=make_data(32, 1), constraints=cons,
                                 args=make_args(tmp_path, "m", max_steps=steps, constraints_per_step=None,
                                                constraint_batch_size=b, constraint_confidence=conf))
    holder["trainer"] = trainer
    trainer.train()
    assert len(outputs) == steps

    var = np.zeros(3)
    for t, out in enumerate(outputs):  # every constraint every step, in constraint order
        rho = max(1.0 / (t + 1), SPREAD_DECAY)
        var = (1 - rho) * var + rho * out.reshape(3, b).var(axis=1, ddof=1)
    n = np.array([7, 12, len(cons[2].dataset)], dtype=float)
    expected = norm.ppf(conf) * np.sqrt(var / n)
    got = trainer.constraint_margins()
    np.testing.assert_allclose([got[c.name] for c in cons], expected, rtol=1e-10)
    # not vacuous: counting every row would give a margin sqrt(|D_k| / n_k) times smaller
    wrong = norm.ppf(conf) * np.sqrt(var / np.array([len(c.dataset) for c in cons]))
    assert len(cons[0].dataset) > 2 * 7 and got[cons[0].name] > 1.4 * wrong[0]


def test_independent_rows_is_validated():
    data = make_data(30, 0)
    with pytest.raises(ValueError, match="independent_rows needs per-row values"):
        Constraint("c", fn=lambda m, b: m(b["x"])["loss"], dataset=data, independent_rows=5)
    with pytest.raises(ValueError, match="independent_rows must be an integer >= 1"):
        Constraint("c", row_fn=per_row_ce, dataset=data, independent_rows=0)
    with pytest.raises(ValueError, match="independent_rows must be an integer >= 1"):
        Constraint("c", row_fn=per_row_ce, dataset=data, independent_rows=2.5)
    with pytest.raises(ValueError, match="exceeds the dataset's 30 rows"):
        Constraint("c", row_fn=per_row_ce, dataset=data, independent_rows=31)
    assert Constraint("c", row_fn=per_row_ce, dataset=data, independent_rows=30).independent_rows == 30
