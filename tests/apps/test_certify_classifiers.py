"""``hf-constrained certify`` for classifiers and CLIP zero-shot heads (issue 43): per class (``--per_class``) or
per set, accuracy in points, paired row by row under the same certificate machinery as causal LMs. A model that
forgets a class is NOT certified for that class while the classes it kept are; a model identical to its base is
certified; label sets that differ and bad rows are one line before any model loads."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from certify_tiny import write_jsonl
from certify_tiny_labelled import build_clip, build_text

from hf_constrained import cli
from hf_constrained.publishing.report import SafetyReport


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return build_text(str(tmp_path_factory.mktemp("certify_text")))


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return build_clip(str(tmp_path_factory.mktemp("certify_images")))


def certify(base: str, model: str, out, sets: list[str], claim: str, *extra: str) -> int:
    return cli.main(["certify", "--model", model, "--base_model", base, "--protected_datasets", *sets,
                     "--claim", claim, "--output_dir", str(out), "--device", "cpu", "--batch_size", "16", *extra])


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hf-constrained certify: error:"), err
    return err[0]


def _no_model_loads(monkeypatch):
    from hf_constrained.safety import certify_labelled

    monkeypatch.setattr(certify_labelled, "load_pair", lambda plan, cls: pytest.fail("a model was loaded"))


# ---------------------------------------------------------------------------------- text classifiers
def test_a_text_classifier_that_kept_its_classes_is_certified_per_class(text, tmp_path, capsys):
    out = tmp_path / "cert"
    code = certify(text["base"], text["kept"], out, [text["cert"]], "points_lost <= 10", "--per_class",
                   "--train_files", text["train"], text["new"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "sequence classification" in printed and "classes: ['one', 'two', 'three']" in printed
    assert "one: 60 rows will be read (text/label)" in printed
    assert "Certified: each protected set loses at most 10 points of accuracy, delta 0.05, 60 rows each" in printed
    report = SafetyReport.load(str(out))
    assert [c.name for c in report.constraints] == ["one", "two", "three"]
    assert report.certificate["bound"] == dict.fromkeys(["one", "two", "three"], "paired_change")
    assert report.constraints[0].extra["base accuracy"] == pytest.approx(1.0)
    card = (out / "README.md").read_text()
    assert "pipeline_tag: text-classification" in card and "AutoModelForSequenceClassification" in card
    assert cli.main(["report", str(out), "--check"]) == 0


def test_a_text_classifier_that_forgot_a_class_fails_that_class_only(text, tmp_path):
    out = tmp_path / "cert"
    assert certify(text["base"], text["forgot"], out, [text["cert"]], "points_lost <= 10", "--per_class") == 1
    report = SafetyReport.load(str(out))
    bounds = report.certificate["upper_bounds"][0]
    assert bounds["one"] > 0.9 and bounds["two"] <= 0.1 and bounds["three"] <= 0.1  # only class one forgotten
    assert report.constraints[0].extra["new accuracy"] < 0.1
    assert cli.main(["report", str(out), "--check"]) == 1


def test_a_set_claim_in_shares_forgotten_uses_the_exact_rate_bound(text, tmp_path):
    out = tmp_path / "kept"
    assert certify(text["base"], text["kept"], out, [f"words={text['cert']}"], "percent_forgotten <= 5") == 0
    report = SafetyReport.load(str(out))
    assert report.certificate["bound"] == {"words": "clopper_pearson"}
    assert report.certificate["num_rows"]["words"] == 180
    # a third of the rows (class one) forgotten: far above 5%
    assert certify(text["base"], text["forgot"], tmp_path / "forgot", [f"words={text['cert']}"],
                   "percent_forgotten <= 5") == 1


def test_a_peft_adapter_of_a_text_classifier_is_certified_against_its_base(text, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    adapter = tmp_path / "adapter"
    model = get_peft_model(AutoModelForSequenceClassification.from_pretrained(text["base"]),
                           LoraConfig(task_type="SEQ_CLS", r=2, lora_alpha=4, target_modules=["c_attn"]))
    model.save_pretrained(adapter)  # an adapter as it starts: the same answers as its base
    out = tmp_path / "cert"
    assert certify(text["base"], str(adapter), out, [text["cert"]], "points_lost <= 10", "--per_class") == 0
    report = SafetyReport.load(str(out))
    assert report.method["model"] == "PEFT adapter" and report.settings["task"] == "sequence_classification"
    assert all(c.extra["base accuracy"] == c.extra["new accuracy"] for c in report.constraints)
    assert "PeftModel.from_pretrained" in (out / "README.md").read_text()


def test_label_sets_that_differ_are_refused_before_any_model_loads(text, tmp_path, capsys, monkeypatch):
    _no_model_loads(monkeypatch)
    assert certify(text["base"], text["renamed"], tmp_path / "cert", [text["cert"]], "points_lost <= 10") == 2
    line = _error(capsys)
    assert "different label sets" in line and "'uno'" in line and "'one'" in line


def test_bad_classifier_rows_are_one_line_before_any_model_loads(text, tmp_path, capsys, monkeypatch):
    _no_model_loads(monkeypatch)
    out = tmp_path / "cert"
    other = write_jsonl(str(tmp_path / "sentence.jsonl"), [{"sentence": "abcd1", "label": "one"}])
    assert certify(text["base"], text["kept"], out, [f"s={other}"], "points_lost <= 10") == 2
    assert "missing ['text']" in (line := _error(capsys)) and "--text_column" in line and "sentence.jsonl" in line
    unknown = write_jsonl(str(tmp_path / "unknown.jsonl"), [{"text": "abcd1", "label": "one"},
                                                           {"text": "abcd4", "label": "four"}])
    assert certify(text["base"], text["kept"], out, [f"u={unknown}"], "points_lost <= 10") == 2
    assert "row 2: label 'four' is none of the model's classes" in (line := _error(capsys)) and "unknown" in line
    with open(text["train"]) as f:
        leaked_rows = [json.loads(x) for x in f.readlines()[:4]]
    with open(text["cert"]) as f:
        leaked_rows += [json.loads(x) for x in f]
    leaked = write_jsonl(str(tmp_path / "leaked.jsonl"), leaked_rows)
    assert certify(text["base"], text["kept"], out, [f"l={leaked}"], "points_lost <= 10",
                   "--train_files", text["train"]) == 2
    assert "4 of its 184 rows also appear in the training files" in _error(capsys)
    assert certify(text["base"], text["kept"], out, [text["cert"]], "loss_rise <= 0.1") == 2
    assert "loss_rise is a claim about a causal LM" in _error(capsys)
    assert certify(text["base"], text["kept"], out, [text["cert"]], "zebra: points_lost <= 1", "--per_class") == 2
    assert "none of the protected sets ['one', 'two', 'three']" in _error(capsys)


# ---------------------------------------------------------------------------------- image classifiers
def test_an_image_classifier_from_a_folder_of_class_subfolders(images, tmp_path, capsys):
    out = tmp_path / "same"
    assert certify(images["vit_base"], images["vit_same"], out, [images["cert_folder"]], "points_lost <= 15",
                   "--per_class", "--train_files", images["train_folder"]) == 0
    assert "image classification" in capsys.readouterr().out
    card = (out / "README.md").read_text()
    assert "pipeline_tag: image-classification" in card and "AutoModelForImageClassification" in card
    assert cli.main(["report", str(out), "--check"]) == 0
    out = tmp_path / "forgot"
    assert certify(images["vit_base"], images["vit_forgot"], out, [images["cert_folder"]], "points_lost <= 15",
                   "--per_class") == 1
    bounds = SafetyReport.load(str(out)).certificate["upper_bounds"][0]
    assert bounds["circle"] > 0.5 and bounds["cross"] <= 0.15  # the circles are forgotten, the crosses are not


# ---------------------------------------------------------------------------------- CLIP zero-shot heads
def test_a_clip_model_identical_to_its_base_is_certified_per_class(images, tmp_path, capsys):
    out = tmp_path / "cert"
    assert certify(images["base"], images["same"], out, [images["cert_csv"]], "points_lost <= 15", "--per_class",
                   "--train_files", images["train_folder"]) == 0
    printed = capsys.readouterr().out
    assert "zero-shot head: 3 classes ['bar', 'circle', 'cross'], prompts 'a photo of a {}.'" in printed
    assert "Certified: each protected set loses at most 15 points of zero-shot accuracy" in printed
    report = SafetyReport.load(str(out))
    assert report.settings["prompt_template"] == "a photo of a {}." and report.settings["task"] == "clip"
    assert all(c.extra["base accuracy"] == c.extra["new accuracy"] > 0.8 for c in report.constraints)
    assert "pipeline_tag: zero-shot-image-classification" in (out / "README.md").read_text()
    assert cli.main(["report", str(out), "--check"]) == 0


def test_push_uploads_a_clip_models_weights_and_processor(images, tmp_path, monkeypatch):
    from test_push import StubHub

    from hf_constrained.publishing import push

    out = tmp_path / "cert"
    assert certify(images["base"], images["same"], out, [images["cert_csv"]], "points_lost <= 15") == 0
    hub = StubHub()
    monkeypatch.setattr(push, "hub_api", lambda: hub)
    assert cli.main(["push", str(out), "--repo_id", "me/clip"]) == 0
    uploads = [kw for name, kw in hub.calls if name == "upload_folder"]
    assert uploads[0]["folder_path"] == os.path.normpath(images["same"])
    assert {"model.safetensors", "preprocessor_config.json", "tokenizer*"} <= set(uploads[0]["allow_patterns"])


def test_a_clip_model_that_forgot_a_class_is_not_certified(images, tmp_path):
    out = tmp_path / "cert"
    assert certify(images["base"], images["forgot"], out, [images["cert_csv"]], "points_lost <= 15",
                   "--per_class", "--class_names", "circle", "cross", "bar") == 1
    report = SafetyReport.load(str(out))
    assert [c.name for c in report.constraints] == ["circle", "cross", "bar"]  # in --class_names order
    assert report.certificate["upper_bounds"][0]["circle"] > 0.5
    assert report.constraints[0].extra["new accuracy"] < 0.1


def test_clip_rows_errors_are_one_line_before_any_model_loads(images, tmp_path, capsys, monkeypatch):
    _no_model_loads(monkeypatch)
    out = tmp_path / "cert"
    assert certify(images["base"], images["same"], out, [images["cert_csv"]], "points_lost <= 15",
                   "--class_names", "circle", "cross") == 2
    assert "label 'bar' is none of the model's classes ['circle', 'cross']" in _error(capsys)
    leak = tmp_path / "train"
    shutil.copytree(images["train_folder"], leak)
    shutil.copy(os.path.join(images["cert_folder"], "circle", sorted(os.listdir(
        os.path.join(images["cert_folder"], "circle")))[0]), leak / "circle" / "copied.png")
    assert certify(images["base"], images["same"], out, [images["cert_csv"]], "points_lost <= 15",
                   "--train_files", str(leak)) == 2
    assert "1 of its 180 rows also appear in the training files" in _error(capsys)
    missing = tmp_path / "missing.csv"
    missing.write_text("filepath,label\nnope.png,circle\n")
    assert certify(images["base"], images["same"], out, [str(missing)], "points_lost <= 15") == 2
    assert "row 1: image not found" in _error(capsys)


def test_the_command_lines_tasks_are_the_certifiable_ones():
    from hf_constrained.safety.certify_claims import TASKS

    assert cli.CERTIFY_TASKS == TASKS
