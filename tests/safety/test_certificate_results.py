"""The README's certificate numbers are the committed results' numbers, and each result file names
the command that wrote it (shown beside the numbers)."""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def _load(name):
    return json.loads((RESULTS / name).read_text())


def _readme():
    return " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())  # every measurement, with its command


def test_validity_numbers_are_the_committed_monte_carlo():
    data = _load("certificate_validity.json")
    readme = _readme()
    assert data["command"] == ("python benchmarks/certificate_validity.py "
                               "--out benchmarks/results/certificate_validity.json")
    assert "python benchmarks/certificate_validity.py --out benchmarks/results/certificate_validity.json" in readme
    finite = [r for r in data["rows"] if r["bound"] != "clt"]
    assert data["finite_sample_valid_everywhere"] and max(r["false_certification_rate"] for r in finite) == 0.01
    assert "at most 1.0% of runs in every setting" in readme
    clt = {(r["n"], r["candidates"], r["procedure"], r["constraints"]): r["false_certification_rate"]
           for r in data["rows"] if r["bound"] == "clt"}
    assert clt[(20, 1, "fixed_sequence", 1)] == 0.155 and "15.5% (one candidate, n = 20)" in readme
    assert clt[(20, 20, "bonferroni", 1)] == 0.93 and "93% (Bonferroni over 20 candidates, n = 20)" in readme
    power = {(r["n"], r["bound"]): r["power"] for r in data["rows"]
             if r["constraints"] == 1 and r["candidates"] == 1}
    assert power[(200, "betting")] == 0.91 and power[(20, "betting")] == 0.0 and power[(20, "hoeffding_bentkus")] == 0.1
    assert "91% of runs at n = 200 and in none at n = 20 (Hoeffding-Bentkus: 10%)" in readme


def test_end_to_end_numbers_are_the_committed_runs():
    readme = _readme()
    safe = _load("certificate_end_to_end_safe_release.json")
    assert safe["command"].startswith(
        "python benchmarks/certificate_end_to_end.py --recipe safe_release --seeds 100-119")
    cert, point = safe["certificate"], safe["point_rule"]
    assert (cert["solution_rate"]["count"], cert["solution_rate"]["of"]) == (18, 20)
    assert (cert["failure_rate_on_audit"]["count"], cert["failure_rate_on_audit"]["of"]) == (1, 18)
    assert (point["solution_rate"]["count"], point["failure_rate_on_audit"]["count"]) == (12, 11)
    assert ("| 18 / 20 | 1 / 18 (5.6%; 95% CI 0.1-27%) | 12 / 20; 11 / 12 fail their own claim |" in readme)
