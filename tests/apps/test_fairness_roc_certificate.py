"""ROC fairness certificate: the smallest certified gap, the soft rates' temperature, and the
benchmark that compares the hinge's certificate with the unconstrained model's."""

import json
import os
import shlex

import numpy as np
import pytest
import torch
from conftest import import_script
from fairness_tiny import biased_split

from hf_constrained import ConstrainedTrainingArguments
from hf_constrained.certification.certify import certify
from hf_constrained.fairness import (
    AUCConstrainedTrainer,
    MLPConfig,
    MLPForScoring,
    SigmoidRate,
    collate_pairs,
    evaluate_roc,
    objective_pairs,
    roc_fairness_constraints,
    roc_fairness_values,
    smallest_certified_gap,
)
from hf_constrained.fairness.experiment import ROCFairnessArguments
from hf_constrained.safety.finish import certify_models

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
THRESHOLDS = (-1.0, 0.0, 1.0)


@pytest.fixture(scope="module")
def splits():
    return {"train": biased_split(600, 0), "validation": biased_split(300, 1), "certify": biased_split(400, 7)}


def _trainer(splits, tmp_path, temperature=1.0):
    torch.manual_seed(0)
    model = MLPForScoring(MLPConfig(input_dim=4, hidden_sizes=[16, 8]))
    cons = roc_fairness_constraints(splits["train"], splits["validation"], thresholds=THRESHOLDS, kappa=0.01,
                                    certify_data=splits["certify"], temperature=temperature)
    args = ConstrainedTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=32,
                                        constraint_batch_size=32, num_train_epochs=1, report_to="none",
                                        use_cpu=True, remove_unused_columns=False, disable_tqdm=True)
    return AUCConstrainedTrainer(model=model, args=args, constraints=cons,
                                 train_dataset=objective_pairs(splits["train"]), data_collator=collate_pairs)


def test_smallest_certified_gap_is_the_tolerance_where_the_same_bounds_start_to_certify(splits, tmp_path):
    """At the smallest certified gap every hard gap is certified, with the same bounds (same delta and
    certification split); at any smaller tolerance some constraint is not."""
    trainer = _trainer(splits, tmp_path)
    cert = certify_models(trainer, delta=0.05)
    gap = smallest_certified_gap(cert.upper_bounds[0])
    assert not cert.certified  # an untrained, unfair scorer: not at kappa = 0.01
    rows = trainer.constraint_row_values(split="certify")
    names = list(cert.upper_bounds[0])
    # the same level as the certificate: the delta its look at the split spent (the ledger's first look)
    assert set(cert.levels.values()) == {cert.level}
    kwargs = dict(value_range={n: (0.0, 1.0) for n in names}, delta=cert.level,
                  bound={n: "clopper_pearson" for n in names})
    at = certify([rows], {n: gap for n in names}, **kwargs)
    below = certify([rows], {n: gap - 1e-9 for n in names}, **kwargs)
    assert at.certified == [0] and below.certified == []
    assert at.upper_bounds[0] == cert.upper_bounds[0]  # the bounds do not move with the tolerance
    with pytest.raises(ValueError, match="bounds must be a non-empty set of finite numbers"):
        smallest_certified_gap({})
    with pytest.raises(ValueError, match="bounds must be a non-empty set of finite numbers"):
        smallest_certified_gap({"tpr_gap@+0": float("nan")})


def test_the_temperature_reaches_the_trained_rates_the_exact_values_and_the_history(splits, tmp_path):
    scores = torch.linspace(-3, 3, 13, dtype=torch.float64)
    assert torch.allclose(SigmoidRate(1.0, 0.25)(scores), torch.sigmoid((scores - 1.0) / 0.25))
    assert torch.allclose(SigmoidRate(1.0)(scores), torch.sigmoid(scores - 1.0))
    trainer = _trainer(splits, tmp_path, temperature=0.25)
    model, val = trainer.model, splits["validation"]
    with torch.no_grad():
        s = model(features=torch.from_numpy(val.features)).logits.double().numpy()
    sharp = roc_fairness_values(s, val.label, val.group, THRESHOLDS, temperature=0.25)
    for kind, y in (("tpr", 1), ("fpr", 0)):
        for tau in THRESHOLDS:
            rate = 1 / (1 + np.exp(-(s - tau) / 0.25))
            ref = abs(rate[(val.group == 1) & (val.label == y)].mean()
                      - rate[(val.group == 0) & (val.label == y)].mean())
            assert sharp[f"{kind}_gap@{tau:+g}"] == pytest.approx(ref, abs=1e-9)
    for c in trainer.constraints:  # each constraint's own exact value on its evaluation rows
        assert c.exact_fn(model, c.eval_dataset) == pytest.approx(sharp[c.name], abs=1e-6)
        assert c.metadata["temperature"] == 0.25
    assert sharp != roc_fairness_values(s, val.label, val.group, THRESHOLDS)
    h = evaluate_roc(model, val, thresholds=THRESHOLDS, kappa=0.01, temperature=0.25)["constraints"]
    assert h == pytest.approx({k: v - 0.01 for k, v in sharp.items()}, abs=1e-9)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
            SigmoidRate(0.0, bad)
        with pytest.raises(ValueError, match="--rate_temperature must be a finite number > 0"):
            ROCFairnessArguments(rate_temperature=bad)


def _benchmark():
    return import_script("benchmarks", "roc_certificate")


def _run(seed, method, gap, test_gap=0.1):
    return {"seed": seed, "method": method, "certified_at_kappa": False, "smallest_certified_gap": gap,
            "test_hard_gap_max": test_gap, "test_auc": 0.7, "test_roc_gap": 0.1, "test_quantile_hard_gap_max": 0.2}


def test_benchmark_summary_median_worst_and_goal():
    bench = _benchmark()
    runs = [_run(0, "hinge", 0.1), _run(0, "none", 0.4), _run(1, "hinge", 0.3), _run(1, "none", 0.5),
            _run(2, "hinge", 0.2), _run(2, "none", 0.3)]
    s = bench.summarize(runs, 0.5)
    assert s["hinge"]["smallest_certified_gap"] == {"median": 0.2, "worst": 0.3}
    assert s["none"]["smallest_certified_gap"] == {"median": 0.4, "worst": 0.5}
    assert s["ratio_per_seed"] == pytest.approx({0: 0.25, 1: 0.6, 2: 2 / 3})
    assert s["ratio"]["of_medians"] == pytest.approx(0.5) and s["ratio"]["worst"] == pytest.approx(2 / 3)
    assert s["goal"]["met_at_median"] and not s["goal"]["met_on_every_seed"]
    with pytest.raises(ValueError, match="--seeds"):
        bench.parse_seeds("100,x")


def test_benchmark_recipe_command_and_stored_config_round_trip(tmp_path, monkeypatch):
    bench = _benchmark()
    assert bench.recipe_argv("compas", "none", 3, "out", ["--penalty_beta", "5"]) == [
        "--dataset", "compas", "--method", "none", "--seed", "3", "--output_dir", "out", "--save_model", "false",
        "--penalty_beta", "5"]
    calls = []
    monkeypatch.setattr(bench, "run_one", lambda d, m, s, f: calls.append((d, m, s, f)) or _run(s, m, 0.2))
    out = tmp_path / "r.json"
    argv = ["--dataset", "adult", "--seeds", "7,8", "--json", str(out), "--", "--num_train_epochs", "3"]
    bench.main(argv)
    saved = json.loads(out.read_text())
    assert calls == [("adult", m, s, ["--num_train_epochs", "3"]) for s in (7, 8) for m in ("hinge", "none")]
    parsed = bench.build_parser().parse_args(shlex.split(saved["command"])[2:])
    assert vars(parsed) == saved["config"]


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(os.path.join(ROOT, "benchmarks", "results"))
                                        if f.startswith("roc_certificate_")))
def test_stored_roc_certificate_results_name_their_real_command(name):
    """Each committed result's command, parsed by the benchmark's own parser, is its stored config; the
    README quotes the command and the numbers."""
    bench = _benchmark()
    saved = json.loads(open(os.path.join(ROOT, "benchmarks", "results", name)).read())
    argv = shlex.split(saved["command"])
    assert argv[:2] == ["python", "benchmarks/roc_certificate.py"]
    assert vars(bench.build_parser().parse_args(argv[2:])) == saved["config"]
    assert saved["config"]["json"] == f"benchmarks/results/{name}"
    readme = " ".join(open(os.path.join(ROOT, "docs", "benchmarks.md")).read().split())  # every measurement
    assert saved["command"] in readme
    s = saved["summary"]
    for method in ("hinge", "none"):
        g = s[method]["smallest_certified_gap"]
        assert f"{g['median']:.3f}" in readme and f"{g['worst']:.3f}" in readme


def _recipe():
    return import_script("recipes", "roc_fairness")


@pytest.mark.parametrize("flags, beta, temperature", [
    (["--dataset", "compas"], 20.0, 0.1),
    (["--dataset", "adult"], 4.0, 1.0),
    (["--dataset", "compas", "--penalty_beta", "7", "--rate_temperature", "1"], 7.0, 1.0),
    (["--dataset", "adult", "--penalty_beta=40", "--rate_temperature=0.5"], 40.0, 0.5),
])
def test_recipe_defaults_per_data_set_give_way_to_the_flags(flags, beta, temperature, tmp_path, monkeypatch):
    recipe = _recipe()
    runs = []
    monkeypatch.setattr(recipe, "run_roc_fairness",
                        lambda script, training, argv=None: runs.append((script, training)) or {})
    monkeypatch.setattr(ConstrainedTrainingArguments, "should_save", property(lambda self: False))
    recipe.main([*flags, "--output_dir", str(tmp_path)])
    script, training = runs[-1]
    assert training.penalty_beta == beta and script.rate_temperature == temperature


@pytest.mark.parametrize("flags, margin", [
    ([], 0.004),
    (["--constraint_margin", "0.001"], 0.001),
    (["--constraint_confidence", "0.9"], None),
    (["--constraint_certificate_delta", "0.05"], None),
])
def test_recipe_default_margin_steps_aside_for_calibrated_and_certificate_margins(flags, margin, tmp_path,
                                                                                   monkeypatch):
    recipe = _recipe()
    runs = []
    monkeypatch.setattr(recipe, "run_roc_fairness", lambda script, training, argv=None: runs.append(training) or {})
    monkeypatch.setattr(ConstrainedTrainingArguments, "should_save", property(lambda self: False))
    recipe.main(["--dataset", "compas", *flags, "--output_dir", str(tmp_path)])
    assert runs[-1].constraint_margin == margin
