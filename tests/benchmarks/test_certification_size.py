"""benchmarks/certification_size.py's fixed-split mode (``--rows``): the tightest claim a split supports,
checked against an independent Clopper-Pearson bound (scipy's beta quantile) and binomial probabilities."""

from __future__ import annotations

import json

from conftest import import_script
from scipy.stats import beta, binom

cs = import_script("benchmarks", "certification_size")


def _independent_probability(rows: int, eps: float, rate: float, delta: float, tasks: int) -> float:
    """P(all tasks certify): a task certifies when the one-sided Clopper-Pearson upper bound of its forgotten
    count is at most eps; the bound at x forgotten is the (1 - delta) quantile of Beta(x + 1, rows - x)."""
    certifying = [x for x in range(rows) if beta.ppf(1 - delta, x + 1, rows - x) <= eps]
    most = max(certifying) if certifying else -1
    return float(binom.cdf(most, rows, rate) ** tasks) if most >= 0 else 0.0


def test_tightest_claim_matches_an_independent_computation(tmp_path):
    out = tmp_path / "size.json"
    result = cs.main(["--rows", "60", "--tasks", "8", "--rate", "0.02", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    for row in result["table"]:
        assert abs(row["probability_all_tasks_certify"]
                   - _independent_probability(60, row["eps"], 0.02, 0.05, 8)) < 1e-9
    expected = next(r["eps"] for r in result["table"]
                    if _independent_probability(60, r["eps"], 0.02, 0.05, 8) >= 0.99)
    assert result["tightest_claim"] == expected == 0.2  # the safe-release recipe's default claim
    assert result["command"].startswith("python benchmarks/certification_size.py --rows 60")


def test_a_split_too_small_for_every_claim_says_none():
    claim, table = cs.tightest_claim(3, 0.4, 0.05, 8, 0.99, [0.05, 0.1])
    assert claim is None and all(r["probability_all_tasks_certify"] < 0.99 for r in table)
