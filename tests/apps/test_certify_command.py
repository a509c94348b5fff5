"""``hf-constrained certify`` (issue 43): a model fine-tuned with PLAIN ``transformers.Trainer`` (or a PEFT
adapter) is certified against its base from the command line; ``report --check`` and ``push`` work on the output
as on a training run; the ledger counts a second look; a model that forgot is NOT certified; bad input is one
line before any model loads; a killed run resumes from its cache of per-row values."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from certify_tiny import build, write_jsonl

from hf_constrained import cli
from hf_constrained.publishing import push
from hf_constrained.publishing.report import SafetyReport
from hf_constrained.safety import certify_rows

CLAIM = "points_lost <= 20"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build(str(tmp_path_factory.mktemp("certify")))


def certify(tiny, model: str, out, *extra: str, sets=None, claim: str = CLAIM) -> int:
    argv = ["certify", "--model", tiny[model] if model in tiny else model, "--base_model", tiny["base"],
            "--protected_datasets", *(sets or [f"old={tiny['cert']}"]), "--claim", claim,
            "--output_dir", str(out), "--batch_size", "16", "--device", "cpu", *extra]
    return cli.main(argv)


def card_verdict_line(out) -> str:
    text = (out / "README.md").read_text()
    body = text.split("---", 2)[2].lstrip("\n")
    return body.splitlines()[0]


def test_a_plain_trainer_fine_tune_is_certified_and_checks_as_a_run(tiny, tmp_path, capsys):
    out = tmp_path / "cert"
    assert certify(tiny, "kept", out, "--train_files", tiny["old_train"], tiny["new_train"]) == 0
    printed = capsys.readouterr().out
    assert "old: 80 rows will be read" in printed and "first look at these rows" in printed
    assert "Certified: old loses at most 20 points of exact match, delta 0.05, 80 rows" in printed
    # the card opens with the verdict in one short line; the long sentence comes below it
    assert card_verdict_line(out) == "**Certified: old loses at most 20 points of exact match, delta 0.05, 80 rows**"
    assert "CERTIFIED at delta = 0.05: with probability" in (out / "README.md").read_text()
    report = SafetyReport.load(str(out))
    assert report.certified and report.weights_folder == os.path.relpath(tiny["kept"], out)
    assert report.certificate["bound"] == {"old": "paired_change"} and report.certificate["num_rows"] == {"old": 80}
    assert cli.main(["report", str(out), "--check"]) == 0
    assert "describes the weight files in" in capsys.readouterr().out


def test_a_model_that_forgot_is_not_certified(tiny, tmp_path, capsys):
    out = tmp_path / "cert"
    assert certify(tiny, "forgot", out) == 1
    assert card_verdict_line(out).startswith("**Not certified: not shown that old loses at most 20 points")
    report = SafetyReport.load(str(out))
    assert not report.certified and report.certified_values()["old"] > 0.5  # the old answer is gone
    assert cli.main(["report", str(out), "--check"]) == 1
    assert push.push_run(str(out), "me/forgot", api=object()).exit_code == 1  # refused before any Hub call


def test_a_peft_adapter_is_certified_against_its_base(tiny, tmp_path):
    out = tmp_path / "cert"
    assert certify(tiny, "adapter", out) == 0
    assert cli.main(["report", str(out), "--check"]) == 0
    text = (out / "README.md").read_text()
    assert "library_name: peft" in text and "PeftModel.from_pretrained" in text


def test_the_ledger_counts_a_second_look_and_the_same_model_is_one_look(tiny, tmp_path):
    out = tmp_path / "cert"
    assert certify(tiny, "kept", out) == 0
    first = SafetyReport.load(str(out)).certificate
    assert first["looks"] == {"old": 1} and first["delta_spent"]["old"] == pytest.approx(0.045)
    assert certify(tiny, "kept", out) == 0  # the same model again: the same look, nothing more spent
    assert SafetyReport.load(str(out)).certificate["looks"] == {"old": 1}
    assert certify(tiny, "adapter", out) == 0  # another model at the same rows: what is left of delta
    second = SafetyReport.load(str(out)).certificate
    assert second["looks"] == {"old": 2} and second["delta_spent"]["old"] == pytest.approx(0.0045)


def test_push_uploads_the_weights_the_report_names(tiny, tmp_path, monkeypatch, capsys):
    from test_push import StubHub

    out = tmp_path / "cert"
    assert certify(tiny, "kept", out) == 0
    hub = StubHub()
    monkeypatch.setattr(push, "hub_api", lambda: hub)
    assert cli.main(["push", str(out), "--repo_id", "me/kept"]) == 0
    uploads = [kw for name, kw in hub.calls if name == "upload_folder"]
    assert uploads[0]["folder_path"] == os.path.normpath(tiny["kept"])
    assert "model.safetensors" in uploads[0]["allow_patterns"] and "tokenizer*" in uploads[0]["allow_patterns"]
    assert uploads[1]["folder_path"] == str(out) and "certify_cache/**" in uploads[1]["ignore_patterns"]


def test_check_refuses_weights_changed_after_certification(tiny, tmp_path):
    model = tmp_path / "kept"
    shutil.copytree(tiny["kept"], model)
    out = tmp_path / "cert"
    assert certify(tiny, str(model), out) == 0
    with open(model / "model.safetensors", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert cli.main(["report", str(out), "--check"]) == 2


def test_a_killed_run_resumes_from_its_cache(tiny, tmp_path, monkeypatch):
    out = tmp_path / "cert"
    real, scored = certify_rows.score_batch, []

    def dies_after_two_batches(model, batch):
        if len(scored) == 2:
            raise KeyboardInterrupt("killed")
        scored.append(len(batch["input_ids"]))
        return real(model, batch)

    monkeypatch.setattr(certify_rows, "score_batch", dies_after_two_batches)
    with pytest.raises(KeyboardInterrupt):
        certify(tiny, "kept", out)
    cache = json.loads((out / "certify_cache" / "old.base.json").read_text())
    assert len(cache["values"]) == 32  # two batches of 16 saved before the kill
    scored.clear()
    monkeypatch.setattr(certify_rows, "score_batch", lambda model, batch: scored.append(len(batch["input_ids"]))
                        or real(model, batch))
    assert certify(tiny, "kept", out) == 0
    assert sum(scored) == 80 - 32 + 80  # the base's 48 rows left, then the model's 80


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hf-constrained certify: error:"), err
    return err[0]


def test_bad_input_is_one_line_before_any_model_loads(tiny, tmp_path, capsys, monkeypatch):
    from hf_constrained.safety import certify_model

    monkeypatch.setattr(certify_model, "load_models", lambda plan: pytest.fail("a model was loaded"))
    out = tmp_path / "cert"
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert certify(tiny, "kept", out, sets=[f"old={empty}"]) == 2
    assert "the file is empty" in _error(capsys)
    text_rows = write_jsonl(str(tmp_path / "text.jsonl"), [{"text": "abc"}, {"text": "abd"}])
    assert certify(tiny, "kept", out, sets=[f"old={text_rows}"]) == 2
    assert "'prompt' and 'completion' columns" in _error(capsys)
    assert certify(tiny, "kept", out, claim="points_lost < 3") == 2
    assert "STATISTIC <= AMOUNT" in _error(capsys)
    assert certify(tiny, "kept", out, claim="math: points_lost <= 3") == 2
    assert "none of the protected sets" in _error(capsys)
    leaked = write_jsonl(str(tmp_path / "leaked.jsonl"), [json.loads(line) for line in
                                                          open(tiny["old_train"]).readlines()[:5]]
                         + [json.loads(line) for line in open(tiny["cert"])])
    assert certify(tiny, "kept", out, "--train_files", tiny["old_train"], sets=[f"old={leaked}"]) == 2
    assert "5 of its 85 rows also appear in the training files" in _error(capsys)
    assert certify(tiny, "adapter", out, "--base_model", tiny["kept"]) == 2
    assert "is an adapter of" in _error(capsys)


def test_repeated_rows_are_dropped_and_a_small_set_warned(tiny, tmp_path, capsys, caplog):
    rows = [json.loads(line) for line in open(tiny["cert"])][:10]
    small = write_jsonl(str(tmp_path / "small.jsonl"), rows + rows[:3])
    assert certify(tiny, "kept", tmp_path / "cert", sets=[f"old={small}"], claim="points_lost <= 3") == 1
    printed = capsys.readouterr().out
    assert "10 rows will be read" in printed and "3 repeated row(s) dropped" in printed
    assert "warning: old: 10 rows can never certify points_lost <= 3" in printed and "needs at least" in printed


def test_tokenizers_that_differ_are_refused(tiny, tmp_path, capsys):
    from hf_constrained.recipes.tiny_lm import char_tokenizer

    model = tmp_path / "other_tok"
    shutil.copytree(tiny["kept"], model)
    char_tokenizer("zyxwvutsrqponmlkjihgfedcba0123456789 +-=:|>?.,").save_pretrained(model)
    assert certify(tiny, str(model), tmp_path / "cert") == 2
    assert "tokenizers of --model and --base_model differ" in _error(capsys)


def test_certify_model_is_a_library_call(tiny, tmp_path):
    from hf_constrained import CertifySettings, certify_model

    lines: list[str] = []
    result = certify_model(CertifySettings(model=tiny["kept"], base_model=tiny["base"],
                                           protected_datasets=(f"old={tiny['cert']}", f"more={tiny['cert2']}"),
                                           claims=("percent_forgotten <= 25", "more: points_lost <= 30"),
                                           output_dir=str(tmp_path / "cert"), device="cpu"), echo=lines.append)
    assert result.exit_code == 0 and result.report.certified
    assert result.report.certificate["bound"] == {"old": "clopper_pearson", "more": "paired_change"}
    assert lines[-1].startswith("Certified: old forgets at most 25% of its examples; more loses at most 30 points")
