"""``hf-constrained certify`` on causal LMs (issue 43): chat rows (the LLM recipe's ``messages`` format) from the
command line, and the ``loss_rise`` claim in nats per token (each row's loss clipped at ``--loss_clip``, the
betting bound). A model that forgot is NOT certified under either; a model that kept its answers is."""

from __future__ import annotations

import json

import numpy as np
import pytest
from certify_tiny import build, build_chat, chat, write_jsonl

from hf_constrained import cli
from hf_constrained.certification.bounds import upper_bound
from hf_constrained.publishing.report import SafetyReport


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("certify_lm"))
    return {"chat": build_chat(root), "pc": build(root)}


def certify(paths, model: str, out, claim: str, *extra: str, sets=None) -> int:
    return cli.main(["certify", "--model", paths[model], "--base_model", paths["base"], "--protected_datasets",
                     *(sets or [f"old={paths['cert']}"]), "--claim", claim, "--output_dir", str(out),
                     "--device", "cpu", "--batch_size", "16", *extra])


def test_chat_rows_certify_a_fine_tune_that_kept_its_answers(tiny, tmp_path, capsys):
    paths = tiny["chat"]
    out = tmp_path / "kept"
    assert certify(paths, "kept", out, "points_lost <= 20", "--train_files", paths["old_train"],
                   paths["new_train"]) == 0
    printed = capsys.readouterr().out
    assert "old: 80 rows will be read (messages)" in printed
    assert "Certified: old loses at most 20 points of exact match, delta 0.05, 80 rows" in printed
    report = SafetyReport.load(str(out))
    assert report.constraints[0].extra == {"base exact match": 1.0, "new exact match": 1.0}
    assert cli.main(["report", str(out), "--check"]) == 0


def test_chat_rows_refuse_a_fine_tune_that_forgot(tiny, tmp_path):
    paths = tiny["chat"]
    out = tmp_path / "forgot"
    assert certify(paths, "forgot", out, "points_lost <= 20") == 1
    report = SafetyReport.load(str(out))
    assert report.constraints[0].extra["new exact match"] < 0.2 and report.certified_values()["old"] > 0.8


def test_chat_rows_in_the_training_files_are_refused(tiny, tmp_path, capsys):
    paths = tiny["chat"]
    with open(paths["cert"]) as f:
        rows = [json.loads(line) for line in f]
    leaked = write_jsonl(str(tmp_path / "train.jsonl"), rows[:3] + [chat("zzzzz=", "ok")])
    assert certify(paths, "kept", tmp_path / "out", "points_lost <= 20", "--train_files", leaked) == 2
    assert "3 of its 80 rows also appear in the training files" in capsys.readouterr().err


def test_loss_rise_certifies_a_model_that_kept_its_loss_and_refuses_one_that_forgot(tiny, tmp_path, capsys):
    paths = tiny["pc"]
    out = tmp_path / "kept"
    assert certify(paths, "kept", out, "loss_rise <= 0.5", "--loss_clip", "5") == 0
    printed = capsys.readouterr().out
    assert "with no row's loss changed the bound would be 0.373 nats (the claim allows 0.5)" in printed
    assert "Certified: old has a per-token loss at most 0.5 nats above the base's, delta 0.05, 80 rows" in printed
    report = SafetyReport.load(str(out))
    cert = report.certificate
    assert cert["bound"] == {"old": "betting"} and cert["value_range"] == {"old": [-5.0, 5.0]}
    assert cert["row_order_seed"] is not None and report.settings["loss_clip"] == 5.0
    extra = report.constraints[0].extra
    assert extra["new loss"] - extra["base loss"] == pytest.approx(report.constraints[0].value, abs=1e-9)
    # the bound is the library's betting bound of the clipped per-row rises, at the first look's delta
    base_cache = json.loads((out / "certify_cache" / "old.base.json").read_text())["values"]
    model_cache = json.loads((out / "certify_cache" / "old.model.json").read_text())["values"]
    rises = np.array([min(model_cache[k], 5.0) - min(base_cache[k], 5.0) for k in sorted(base_cache, key=int)])
    assert cert["upper_bounds"][0]["old"] == pytest.approx(
        upper_bound(rises, (-5.0, 5.0), cert["levels"]["old"], "betting", order_seed=cert["row_order_seed"]))
    assert cli.main(["report", str(out), "--check"]) == 0
    out = tmp_path / "forgot"
    assert certify(paths, "forgot", out, "loss_rise <= 0.5", "--loss_clip", "5") == 1
    report = SafetyReport.load(str(out))
    assert report.constraints[0].extra["new loss"] > 2.0 and report.certificate["upper_bounds"][0]["old"] > 0.5


def test_loss_rise_claims_are_checked_before_any_row_is_read(tiny, tmp_path, capsys):
    paths = tiny["pc"]
    assert certify(paths, "kept", tmp_path / "out", "loss_rise <= 0.5%") == 2
    assert "loss_rise is in nats per token" in capsys.readouterr().err
    assert certify(paths, "kept", tmp_path / "out", "loss_rise <= 0.5", "--loss_clip", "0") == 2
    assert "--loss_clip must be a positive number" in capsys.readouterr().err
    # a set too small for the claim at this clip: warned before any model loads, and not certified
    assert certify(paths, "kept", tmp_path / "small", "loss_rise <= 0.05", "--loss_clip", "10") == 1
    assert "warning: old: 80 rows can never certify loss_rise <= 0.05" in capsys.readouterr().out
