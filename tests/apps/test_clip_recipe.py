"""The recipe end to end on a saved-then-reloaded tiny CLIP (the hub-model path), and a short
constrained run of the demo's code path that must beat unconstrained fine-tuning on forgetting."""

import importlib.util
import json
import math
import os
import sys

import pytest
import torch
from clip_synthetic import make_bdd100k, make_csv, save_tiny_clip
from recipe_outputs import assert_report_checks, run_card_snippet
from transformers import CLIPModel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _recipe():
    spec = importlib.util.spec_from_file_location("clip_non_forgetting",
                                                  os.path.join(ROOT, "recipes", "clip_non_forgetting.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


COMMON = ["--max_steps", "3", "--per_device_train_batch_size", "8", "--constraint_batch_size", "2",
          "--learning_rate", "1e-4", "--report_to", "none", "--use_cpu", "--save_strategy", "no",
          "--disable_tqdm", "true", "--dataloader_drop_last", "true", "--per_device_eval_batch_size", "8",
          "--accuracy_every_steps", "2"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    base = tmp_path_factory.mktemp("recipe")
    bdd = make_bdd100k(str(base / "bdd100k"), per_class=3)
    texts = [f"the weather is {c}." for c in ("clear", "overcast", "snowy", "rainy", "partly cloudy", "foggy")]
    clip = save_tiny_clip(str(base / "tiny-clip"), texts + ["a foggy road at dawn"])
    return base, bdd, clip


def test_recipe_bdd100k_hinge_saves_model_and_results(assets, tmp_path):
    base, bdd, clip = assets
    extra = make_csv(str(base / "laion"), [("l0.jpg", "a foggy road at dawn", "foggy"),
                                           ("l1.jpg", "a foggy road", "foggy")])
    out = str(tmp_path / "out")
    results = _recipe().main(["--model_name_or_path", clip, "--bdd100k_root", bdd, "--task", "foggy",
                              "--target_csv", extra, "--output_dir", out, "--constraint_penalty", "hinge",
                              "--penalty_beta", "10", *COMMON])
    assert set(results["protected_classes"]) == {"clear", "overcast", "snowy", "rainy", "partly cloudy"}
    assert "eval_constraints_satisfied" in results["eval_metrics"]
    assert set(results["accuracy_new"]) == set(results["accuracy_old"]) and "foggy" in results["accuracy_new"]
    with open(os.path.join(out, "non_forgetting_results.json")) as f:
        saved = json.load(f)
    assert saved["penalty"] == "hinge" and len(saved["constraints_train"]) == 5
    assert saved["penalty_beta"] == 10.0  # given in main's argv: kept, not the paper's default (0.5)
    curve = [h for h in saved["log_history"] if "eval_accuracy/foggy" in h]
    assert [h["step"] for h in curve] == [2]  # --accuracy_every_steps 2 over 3 steps
    reloaded = CLIPModel.from_pretrained(out)  # the fine-tuned model loads like any checkpoint
    assert reloaded.config.projection_dim == 16
    # the run ends with a safety report and a model card whose verdict matches the exact evaluation
    with open(os.path.join(out, "safety_report.json")) as f:
        report = json.load(f)
    # the point values agree with the evaluation; the verdict (certified by default) is the recipe's "safe"
    assert all(c["value"] <= c["tolerance"] for c in report["constraints"]) == bool(
        results["eval_metrics"]["eval_constraints_satisfied"])
    assert report["all_satisfied"] == results["safe"]
    # 2 certification images per class (0.5 of 3 held-out) cannot certify the default 0.05: even with none
    # forgotten the Clopper-Pearson bound is 1 - 0.05 ** (1 / 2) = 0.78
    cert = results["certificate"]
    assert not cert["certified"] and not results["safe"]
    assert sorted(cert["failing"]) == sorted(saved["constraints_train"])
    assert all(b >= 1 - 0.05 ** 0.5 - 1e-9 for b in cert["certified_bounds"].values())
    assert sorted(c["name"] for c in report["constraints"]) == sorted(saved["constraints_train"])
    # each protected class's old and new zero-shot accuracy, in the report and the card's table
    assert report["extra_columns"] == ["old accuracy", "new accuracy"]
    for c in report["constraints"]:
        old, new = c["extra"]["old accuracy"], c["extra"]["new accuracy"]
        assert all(isinstance(v, float) and math.isfinite(v) and 0 <= v <= 1 for v in (old, new)), c
    by_class = {c["name"]: c["extra"] for c in report["constraints"]}
    assert sorted(v["old accuracy"] for v in by_class.values()) == sorted(
        v for k, v in results["accuracy_old"].items() if k != "foggy")
    with open(os.path.join(out, "README.md")) as f:
        card = f.read()
    table = card.split("old accuracy")[1].split("\n\n")[0]
    assert "nan" not in table.lower()
    head = card.split("\n---", 2)[-1][:400]
    assert ("UNSAFE" in head or "NOT CERTIFIED" in head) != report["all_satisfied"]
    assert "fine-tuned for the target class 'foggy'" in card
    assert "%" not in card.split("## Data")[1].split("\n## ")[0]  # fractions, the unit of every number here
    # the recipe's own output passes `report --check`, and the card's snippet loads model and processor
    assert_report_checks(out, certified=False)
    loaded = run_card_snippet(out)
    assert type(loaded["model"]).__name__ == "CLIPModel" and type(loaded["processor"]).__name__ == "CLIPProcessor"
    for key, value in CLIPModel.from_pretrained(out).state_dict().items():
        assert torch.equal(loaded["model"].state_dict()[key], value), key


def test_recipe_csv_lora_squared_hinge(assets, tmp_path):
    base, bdd, clip = assets
    folder = base / "csvdata"
    target = make_csv(str(folder), [(f"t{i}.jpg", f"the weather is {c}.", c)
                                    for i, c in enumerate(["foggy", "foggy", "foggy", "clear", "rainy", "clear",
                                                           "rainy", "foggy", "clear", "rainy"])], name="target.csv")
    protected = make_csv(str(folder), [(f"p{i}.jpg", "", c) for i, c in enumerate(["clear", "rainy"] * 3)],
                         name="protected.csv")
    out = str(tmp_path / "out")
    results = _recipe().main(["--model_name_or_path", clip, "--data", "csv", "--target_class", "foggy",
                              "--protected_classes", "clear,rainy", "--prompt_template", "the weather is {}.",
                              "--target_csv", target, "--protected_csv", protected, "--lora_r", "2",
                              "--output_dir", out, "--constraint_penalty", "squared_hinge", "--penalty_beta", "100",
                              *COMMON])
    assert results["accuracy_split"] == "constraint data"
    assert os.path.exists(os.path.join(out, "adapter_config.json"))  # a LoRA adapter was saved
    assert os.path.exists(os.path.join(out, "safety_report.json")) and os.path.exists(os.path.join(out, "README.md"))
    assert_report_checks(out)
    loaded = run_card_snippet(out)  # the base model, with the adapters, and the processor
    assert type(loaded["model"]).__name__ == "PeftModel" and type(loaded["processor"]).__name__ == "CLIPProcessor"
    with pytest.raises(ValueError, match="prompt_template"):
        _recipe().main(["--model_name_or_path", clip, "--data", "csv", "--target_class", "foggy",
                        "--protected_classes", "clear", "--output_dir", out, *COMMON])


@pytest.mark.slow
def test_short_constrained_run_forgets_less_than_unconstrained(tmp_path):
    """Scaled-down demo: on the pulled digit the hinge keeps the constraint far lower than no penalty."""
    from hf_constrained.clip import experiment as demo  # the demo's pipeline

    cfg = demo.DemoConfig(stage1_epochs=8, steps=30, lr=1e-4, beta=10.0, constraint_copies=2, eval_copies=1,
                          select_every=0)
    path = demo.pretrain_old_model(cfg, str(tmp_path), log=lambda *a: None)
    pulled = f"non_forgetting/{demo.DIGIT_NAMES[cfg.pulled]}"
    hinge = demo.finetune(cfg, path, "hinge", log=lambda *a: None)
    none = demo.finetune(cfg, path, "none", log=lambda *a: None)
    assert none["h_train"][pulled] > 0.5  # the polluted target data makes plain fine-tuning forget
    assert hinge["h_train"][pulled] < none["h_train"][pulled] / 5
    assert max(hinge["h_train"].values()) < 0.1  # and no other protected class pays for it


def test_the_default_beta_is_the_papers_for_the_penalty(tmp_path):
    """Without --penalty_beta the recipe takes the paper's beta of its penalty in this library's units (hinge 10 and
    squared hinge 800, times tau 0.05: 0.5 and 40), not the library's 10; a given beta is kept."""
    from hf_constrained import ConstrainedTrainingArguments

    recipe = _recipe()
    for penalty, beta in (("hinge", 0.5), ("squared_hinge", 40.0)):
        args = ConstrainedTrainingArguments(output_dir=str(tmp_path), constraint_penalty=penalty, use_cpu=True)
        recipe.default_penalty_beta(args, set())
        assert args.penalty_beta == beta
        given = ConstrainedTrainingArguments(output_dir=str(tmp_path), constraint_penalty=penalty, penalty_beta=3.0,
                                             use_cpu=True)
        recipe.default_penalty_beta(given, {"penalty_beta"})
        assert given.penalty_beta == 3.0


def test_recipe_certifies_on_held_out_images_nothing_else_reads(assets, tmp_path):
    """--certify_fraction sets part of each protected class's held-out images aside; the certified bound
    is the exact Clopper-Pearson bound of the share of them forgotten, recomputed here from the old and
    new models' zero-shot predictions."""
    from transformers import CLIPProcessor

    from hf_constrained.certification.bounds import clopper_pearson_upper_bound
    from hf_constrained.clip import ZeroShotLoss
    from hf_constrained.clip.data import CLIPCollator, RowDataset
    from hf_constrained.clip.non_forgetting import zero_shot_predictions

    base, bdd, clip = assets
    out = str(tmp_path / "out")
    recipe = _recipe()
    argv = ["--model_name_or_path", clip, "--bdd100k_root", bdd, "--task", "foggy", "--output_dir", out,
            "--constraint_penalty", "none", "--certify_fraction", "0.5", "--forget_tolerance", "0.9",
            "--delta", "0.1", *[("5e-2" if a == "1e-4" else a) for a in COMMON]]  # a large step: the model changes
    results = recipe.main(argv)
    cert = results["certificate"]
    assert cert["certify_split"] == "held-out" and cert["delta"] == 0.1 and cert["forget_tolerance"] == 0.9
    assert cert["certify_rows"] == {c: 2 for c in results["protected_classes"]}  # round(0.5 * 3) of 3 per class
    # the same split, recomputed: disjoint from the held-out rows left for evaluation and accuracies
    script = recipe.ScriptArguments(model_name_or_path=clip, bdd100k_root=bdd, task="foggy")
    data = recipe.build_data(script)
    left, certify = recipe.split_certification(data["held_out"], data["protected"], 0.5, 42, "held-out")
    for c in data["protected"]:
        assert not {r["image"] for r in left[c]} & {r["image"] for r in certify[c]} and len(left[c]) == 1
    processor = CLIPProcessor.from_pretrained(clip)
    prompts = processor.tokenizer([data["template"].format(c) for c in data["classes"]], padding=True,
                                  return_tensors="pt")
    zs = ZeroShotLoss(prompts["input_ids"], prompts["attention_mask"], temperature=0.05)
    collate = CLIPCollator(image_processor=processor.image_processor, tokenizer=processor.tokenizer)
    old, new = CLIPModel.from_pretrained(clip), CLIPModel.from_pretrained(out)
    expected = {}
    for c in data["protected"]:
        rows = RowDataset(certify[c])
        p_old, label = zero_shot_predictions(old, rows, zs, collate)
        p_new, _ = zero_shot_predictions(new, rows, zs, collate)
        forgotten = int(((p_old == label) & (p_new != label)).sum())
        # at the delta the split's first look spends: 0.9 of --delta 0.1 (the ledger of looks)
        expected[f"non_forgetting/{c}"] = clopper_pearson_upper_bound(forgotten, len(rows), 0.09)
    assert cert["certified_bounds"] == pytest.approx(expected)
    assert cert["certified"] == all(b <= 0.9 for b in expected.values()) == (cert["failing"] == [])
    assert sorted(cert["failing"]) == sorted(k for k, b in expected.items() if b > 0.9)
    with open(os.path.join(out, "safety_report.json")) as f:
        report = json.load(f)
    assert report["certificate"]["delta"] == 0.1
    with open(os.path.join(out, "non_forgetting_results.json")) as f:
        assert json.load(f)["certificate"] == cert
    with pytest.raises(ValueError, match="--certify_fraction"):
        recipe.main([*argv[:argv.index("--certify_fraction") + 1], "1.0", *argv[argv.index("--certify_fraction") + 2:]])


def test_push_to_hub_is_gated_and_comes_last(assets, tmp_path, monkeypatch):
    """--push_to_hub: a run that is not certified uploads nothing, keeps its files, and the command
    fails (status 1); --allow_unsafe_push publishes it."""
    import transformers.trainer as hf_trainer
    from conftest import UploadRecorder

    from hf_constrained.cli import main as cli_main

    hub = UploadRecorder()
    monkeypatch.setattr(hf_trainer, "hf_api", lambda: hub)
    base, bdd, clip = assets

    def run(name, *extra):
        out = str(tmp_path / name)
        return out, cli_main(["clip", "--model_name_or_path", clip, "--bdd100k_root", bdd, "--task", "foggy",
                              "--output_dir", out, "--push_to_hub", "true", "--hub_model_id", "user/clip", *COMMON,
                              *extra])

    out, status = run("refused")  # 2 certification images per class cannot certify 0.05
    assert status == 1 and hub.calls == []
    for name in ("non_forgetting_results.json", "safety_report.json", "README.md"):
        assert os.path.exists(os.path.join(out, name)), name
    from huggingface_hub import metadata_load  # no Hub task and dataset id named: no invented model-index

    assert "model-index" not in metadata_load(os.path.join(out, "README.md"))
    out, status = run("override", "--allow_unsafe_push", "true")
    assert status == 0 and ("upload_folder", "user/clip") in hub.calls

