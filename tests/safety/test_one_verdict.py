"""One certificate, one verdict: the report JSON, the printed table, the card and ``report --check``
all say what the certificate says, and the training surrogate's values appear only as diagnostics.

Each test is one of the contradictions issue 31 found: ``all_satisfied: true`` beside a constraint
``satisfied: false``; "CERTIFIED ... all N constraints hold" above a row whose verdict is FAILS when
only a proxy statistic was certified; a CLT column saying "holds with confidence" next to NOT
CERTIFIED; the verdict printed several times; "not safe to publish" in a certified card.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
from test_certificate_gate import make, scaled_rate

from hf_constrained import finish_run
from hf_constrained.cli import main
from hf_constrained.constraint import CertifyStatistic
from hf_constrained.publishing.report import ConstraintResult, SafetyReport
from hf_constrained.publishing.tables import (
    CERTIFIED,
    EXACT_FAILS,
    EXACT_HOLDS,
    FAILS,
    HOLDS,
    NO_CERTIFICATION_SPLIT,
    NOT_CERTIFIED,
    NOT_TESTED,
)
from hf_constrained.publishing.verify import check_run_dir

VERDICT_WORDS = {CERTIFIED, NOT_CERTIFIED, NOT_TESTED, NO_CERTIFICATION_SPLIT, EXACT_HOLDS, EXACT_FAILS, HOLDS,
                 FAILS, "FAILS", "holds with confidence", "holds on the point estimate only"}


def assert_one_verdict(report: SafetyReport) -> None:
    """Every place a verdict shows agrees with :meth:`SafetyReport.verdicts`."""
    data = report.to_dict()
    entries = data["constraints"]
    assert all("satisfied" not in e for e in entries)  # no second, point-estimate verdict per constraint
    assert data["all_satisfied"] == (all(e["passes"] for e in entries) and bool(entries)
                                     and (report.safety_rule != "certified" or report.certified))
    assert data["failed"] == [e["name"] for e in entries if not e["passes"]]
    assert [e["verdict"] for e in entries] == [v.word for v in report.verdicts()]
    summary = report.summary()
    assert "\n" not in summary  # one line
    if report.safety_rule == "certified":
        assert summary.startswith("CERTIFIED") == data["all_satisfied"] == data["certified"]
    rows = report.table_rows()
    assert [r[-1] if report.safety_rule == "certified" else r[rows[0].index("verdict")] for r in rows[1:]] == [
        v.word for v in report.verdicts()]
    for row in report.diagnostic_rows()[1:]:  # diagnostics carry no verdict word
        assert not VERDICT_WORDS & set(row), row
    assert report.render().count(summary) == 1


@pytest.fixture
def proxy_certified(tmp_path, caplog):
    """The trained constraint fails on held-out data (value about 0.072 > 0.01) while its certified
    statistic (the same rows, tolerance 0.5) is certified: the issue's LLM/safe-release case."""
    stat = CertifyStatistic(scaled_rate, tolerance=0.5, value_range=(0.0, 1.0), bound="betting",
                            description="share of rows flagged")
    trainer = make(tmp_path, tolerance=0.01, statistic=stat)
    with caplog.at_level(logging.INFO, logger="hf_constrained"):
        report = finish_run(trainer, plots=False)
    return trainer, report, tmp_path / "run", caplog


def test_a_certified_proxy_says_which_statistic_and_never_that_the_constraints_hold(proxy_certified):
    trainer, report, out, _ = proxy_certified
    assert report.certified and report.all_satisfied
    assert report.constraints[0].value > report.constraints[0].tolerance  # the surrogate fails on held-out data
    assert_one_verdict(report)
    summary = report.summary()
    for needed in ("CERTIFIED at delta = 0.05", "share of rows flagged", "betting upper bounds", "n = 300",
                   "population", "not what is certified"):
        assert needed in summary, needed
    assert not re.search(r"all \d+ constraints hold", summary)
    on_disk = json.loads((out / "safety_report.json").read_text())
    assert on_disk["all_satisfied"] is True and on_disk["constraints"][0]["passes"] is True
    assert on_disk["statistics"]["rate"] == {"description": "share of rows flagged", "proxy": True, "old_value": None}
    # the surrogate's value is shown, labelled, without a verdict of its own
    diagnostics = report.format_diagnostics()
    assert diagnostics.startswith("Diagnostics (no verdict)") and "0.0730413" in diagnostics


def test_the_card_states_the_verdict_once_and_the_selection_as_a_diagnostic(proxy_certified):
    trainer, report, out, _ = proxy_certified
    card = (out / "README.md").read_text()
    assert card.count(report.summary()) == 1
    assert "NOT CERTIFIED" not in card and "not safe to publish" not in card and "FAILS" not in card
    diagnostics = card.split("## Diagnostics (no verdict)")[1].split("\n## ")[0]
    assert "0.0730413" in diagnostics and not re.search(r"\b(fails|holds|certified)\s*\|", diagnostics)
    table = card.split("## Safety verdict")[1].split("\n## ")[0]
    assert "| rate | share of rows flagged | n/a |" in table and table.rstrip().endswith("| certified |")


def test_check_and_log_repeat_the_reports_verdict_once(proxy_certified, capsys):
    trainer, report, out, caplog = proxy_certified
    records = caplog.get_records("setup")  # finish_run ran in the fixture
    shown = [r.getMessage() for r in records if report.summary() in r.getMessage()]
    assert len(shown) == 1 and "Diagnostics (no verdict)" in shown[0]  # finish_run shows it once, whole
    check = check_run_dir(str(out))
    assert check.exit_code == 0 and check.message.startswith(report.summary())
    assert main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count(report.summary()) == 1


def test_a_failed_certificate_says_why_in_one_line_everywhere(tmp_path, capsys):
    trainer = make(tmp_path, tolerance=0.08)  # the value passes the point rule, the bound does not
    report = finish_run(trainer, plots=False)
    assert report.with_rule("point").all_satisfied and not report.certified
    assert_one_verdict(report)
    assert_one_verdict(report.with_rule("point"))
    summary = report.summary()
    assert re.fullmatch(r"NOT CERTIFIED at delta = 0\.05: certified bound above tolerance for rate "
                        r"\(0\.1\d+ > 0\.08\)", summary), summary  # Hoeffding-Bentkus at the first look (0.9 delta)
    on_disk = json.loads((tmp_path / "run" / "safety_report.json").read_text())
    assert on_disk["all_satisfied"] is False and on_disk["constraints"][0]["passes"] is False
    assert on_disk["constraints"][0]["verdict"] == NOT_CERTIFIED
    card = (tmp_path / "run" / "README.md").read_text()
    assert "**CERTIFIED" not in card and card.count(summary) == 1
    assert main(["report", str(tmp_path / "run"), "--check"]) == 1
    assert capsys.readouterr().out.count(summary) == 2  # the report, then --check's line, which is the same


def test_a_run_without_certification_rows_says_so_in_one_line(tmp_path):
    report = finish_run(make(tmp_path, certify=False), plots=False)
    assert report.summary() == ("NOT CERTIFIED: no constraint has a certification split (Constraint.certify), so "
                                "nothing was tested on data that training and selection never touched")
    assert_one_verdict(report)
    assert [v.word for v in report.verdicts()] == [NO_CERTIFICATION_SPLIT]


def _certificate(bound: float, tolerance: float = 0.2, tested: bool = True) -> dict:
    return {"certified": [0] if tested and bound <= tolerance else [], "upper_bounds": [{"a": bound}] if tested else [],
            "values": [{"a": bound / 2}] if tested else [], "tolerance": {"a": tolerance},
            "value_range": {"a": [0.0, 1.0]}, "bound": {"a": "clopper_pearson"}, "num_rows": {"a": 100},
            "delta": 0.05, "procedure": "fixed_sequence", "num_candidates": 2 if not tested else 1, "level": 0.05}


@pytest.mark.parametrize("bound, held_out, tested", [(0.1, 0.5, True), (0.3, 0.05, True), (0.1, 0.05, False)],
                         ids=["certified-surrogate-fails", "surrogate-holds-bound-fails", "not-tested"])
@pytest.mark.parametrize("rule", ["certified", "point", "upper_bound"])
def test_no_report_contradicts_itself(bound, held_out, tested, rule):
    """The contradictions of the issue cannot be built: whatever the certificate and the held-out
    values say, the report's JSON, table and summary agree (one verdict loop)."""
    report = SafetyReport([ConstraintResult("a", held_out, 0.2, 0.0, upper_bound=held_out + 0.1, confidence=0.95,
                                            bound_method="CLT"),
                           ConstraintResult("cap", 0.1, 0.2, 0.0, "data-free", upper_bound=0.1, bound_method="exact")],
                          certificate=_certificate(bound, tested=tested), safety_rule=rule,
                          statistics={"a": {"description": "share forgotten", "proxy": True, "old_value": 0.0}})
    assert_one_verdict(report)
    if rule == "certified":
        word = CERTIFIED if tested and bound <= 0.2 else (NOT_CERTIFIED if tested else NOT_TESTED)
        assert [v.word for v in report.verdicts()] == [word, EXACT_HOLDS]
    assert SafetyReport.from_dict(json.loads(json.dumps(report.to_dict()))).to_dict() == report.to_dict()


def test_an_evaluation_during_training_is_not_called_uncertifiable(tmp_path):
    """A checkpoint's report from an evaluation during training has no certificate yet: its line says
    that, not that the constraints lack certification rows (they have them)."""
    from hf_constrained.safety.finish import report_from_metrics

    trainer = make(tmp_path)
    report = report_from_metrics(trainer, trainer.evaluate())
    assert report.summary().startswith("NOT CERTIFIED: these weights were evaluated, not certified")
    assert_one_verdict(report)
    assert [v.word for v in report.verdicts()] == [NOT_TESTED]
    assert ("| rate | the constraint's own value (mean of its per-row values) "
            "| n/a | n/a | n/a | n/a | n/a | not tested |") in report.format_table(markdown=True)
