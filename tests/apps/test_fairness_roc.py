"""ROC-fairness constraints, objective, methods (hinge / squared hinge / none / ICPPAC), recipe, FRVP."""

import json

import numpy as np
import pytest
import torch
from conftest import import_script
from fairness_tiny import biased_split
from recipe_outputs import assert_report_checks, run_card_snippet
from transformers import AutoModel

from hf_constrained import ConstrainedTrainingArguments
from hf_constrained.batches import collate_examples
from hf_constrained.fairness import (
    AUCConstrainedTrainer,
    MLPConfig,
    MLPForScoring,
    TabularSplit,
    collate_pairs,
    objective_pairs,
    pairwise_auc_loss,
    roc_fairness_constraints,
    roc_fairness_values,
)
from hf_constrained.fairness.frvp import constraint_jacobian, frvp_report, min_singular_value
from hf_constrained.fairness.icppac import ICPPACConfig, ICPPACTrainer

THRESHOLDS = (-1.0, 0.0, 1.0)


@pytest.fixture(scope="module")
def splits():
    return {"train": biased_split(600, 0), "validation": biased_split(300, 1), "test": biased_split(300, 2)}


def direct_gaps(model, split, thresholds):
    """Reference: |TPR/FPR-rate gap| computed straight from the model's logits with numpy."""
    with torch.no_grad():
        s = model(features=torch.from_numpy(split.features)).logits.double().numpy()
    out = {}
    for kind, y in (("tpr", 1), ("fpr", 0)):
        for tau in thresholds:
            p = 1 / (1 + np.exp(-(s - tau)))
            out[f"{kind}_gap@{tau:+g}"] = abs(p[(split.group == 1) & (split.label == y)].mean()
                                             - p[(split.group == 0) & (split.label == y)].mean())
    return out


def make_args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=32, constraint_batch_size=32,
                learning_rate=1e-2, num_train_epochs=1, logging_strategy="no", save_strategy="no", report_to="none",
                disable_tqdm=True, use_cpu=True, seed=0, remove_unused_columns=False)
    base.update(kw)
    return ConstrainedTrainingArguments(**base)


def mlp(seed=0):
    torch.manual_seed(seed)
    return MLPForScoring(MLPConfig(input_dim=4, hidden_sizes=[16, 8]))


def test_exact_constraint_values_match_numpy(splits, tmp_path):
    model = mlp()
    with torch.no_grad():  # make the gaps large, so a wrong sign/group/label would show
        model.mlp[-1].bias.fill_(0.3)
    cons = roc_fairness_constraints(splits["train"], splits["validation"], thresholds=THRESHOLDS, kappa=0.01)
    assert [c.name for c in cons] == [f"{k}_gap@{t:+g}" for k in ("tpr", "fpr") for t in THRESHOLDS]
    trainer = AUCConstrainedTrainer(model=model, args=make_args(tmp_path), constraints=cons,
                                    train_dataset=objective_pairs(splits["train"]), data_collator=collate_pairs)
    for split_name, trainer_split in (("train", "train"), ("validation", "eval")):
        ref = direct_gaps(model, splits[split_name], THRESHOLDS)
        got = trainer.evaluate_constraints(split=trainer_split)
        for name, value in ref.items():
            assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-7)
        s = model(features=torch.from_numpy(splits[split_name].features)).logits.detach().numpy()
        vec = roc_fairness_values(s, splits[split_name].label, splits[split_name].group, THRESHOLDS)
        for name, value in ref.items():
            assert vec[name] == pytest.approx(value, rel=1e-5, abs=1e-7)
    metrics = trainer.constraint_metrics(trainer.evaluate_constraints(split="train"), "eval")
    assert metrics["eval_constraint_max_violation"] == pytest.approx(
        max(direct_gaps(model, splits["train"], THRESHOLDS).values()) - 0.01, abs=1e-6)


def test_paired_batches_hold_both_groups_and_labels(splits):
    train = splits["train"]
    cons = roc_fairness_constraints(train, thresholds=(0.0,), kappa=0.0)
    for c in cons:
        y = c.metadata["label"]
        data = c.dataset
        assert set(train.group[data.rows_a]) == {1} and set(train.group[data.rows_b]) == {0}
        assert set(train.label[data.rows_a]) == {y} and set(train.label[data.rows_b]) == {y}
        batch = (c.collate_fn or collate_examples)([data[j] for j in range(len(data) - 5, len(data))] + [data[0]])
        assert batch["inputs"].shape == (12, 4) and batch["roc_group"].tolist() == [0, 1] * 6
    obj = objective_pairs(train)
    rows = obj.batch(list(range(7)))
    assert rows["inputs_a"].shape[0] == rows["inputs_b"].shape[0] == 7
    assert set(train.label[obj.rows_a]) == {1} and set(train.label[obj.rows_b]) == {0}
    with pytest.raises(IndexError):
        obj[len(obj)]


def test_missing_group_or_label_is_a_clear_error(splits):
    tr = splits["train"]
    no_neg_female = ~((tr.group == 0) & (tr.label == 0))
    bad = TabularSplit(tr.features[no_neg_female], tr.label[no_neg_female], tr.group[no_neg_female])
    with pytest.raises(ValueError, match=r"group u \(0\) with label 0"):
        roc_fairness_constraints(bad)
    with pytest.raises(ValueError, match="both labels"):
        objective_pairs(TabularSplit(tr.features[:5], np.ones(5, dtype=np.int64), tr.group[:5]))
    with pytest.raises(ValueError, match="kappa"):
        roc_fairness_constraints(tr, kappa=-1.0)


def test_pairwise_auc_loss_is_one_minus_soft_auc():
    model = mlp()
    a, b = torch.randn(5, 4), torch.randn(3, 4)
    loss = pairwise_auc_loss(model, {"inputs_a": a, "inputs_b": b})
    with torch.no_grad():
        sa, sb = model(features=a).logits, model(features=b).logits
    assert loss.item() == pytest.approx(1 - torch.sigmoid(sa[:, None] - sb[None, :]).mean().item(), rel=1e-6)


def _train(splits, tmp_path, penalty, beta=20.0, epochs=6):
    model = mlp(1)
    cons = roc_fairness_constraints(splits["train"], splits["validation"], thresholds=THRESHOLDS, kappa=0.02)
    args = make_args(tmp_path / penalty, constraint_penalty=penalty, penalty_beta=beta, num_train_epochs=epochs)
    trainer = AUCConstrainedTrainer(model=model, args=args, constraints=cons,
                                    train_dataset=objective_pairs(splits["train"]), data_collator=collate_pairs)
    trainer.train()
    return trainer, model


def test_short_hinge_run_ends_feasible_where_unconstrained_does_not(splits, tmp_path):
    trainer_none, _ = _train(splits, tmp_path, "none")
    none_viol = trainer_none.constraint_metrics(trainer_none.evaluate_constraints(split="train"))
    assert none_viol["eval_constraint_max_violation"] > 0.05  # the data really is unfair
    trainer, model = _train(splits, tmp_path, "hinge")
    metrics = trainer.constraint_metrics(trainer.evaluate_constraints(split="train"))
    assert metrics["eval_constraints_satisfied"] == 1.0, metrics
    assert max(direct_gaps(model, splits["train"], THRESHOLDS).values()) <= 0.02
    # the objective still learnt something: AUC well above chance
    from hf_constrained.fairness import auc_score

    s = model(features=torch.from_numpy(splits["test"].features)).logits.detach().numpy()
    assert auc_score(s, splits["test"].label) > 0.6


def test_icppac_reduces_violation_with_nonnegative_duals(splits):
    torch.manual_seed(0)
    plain = mlp(1)  # the same steps on the objective alone: the unfair reference
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    plain_loader = torch.utils.data.DataLoader(objective_pairs(splits["train"]), batch_size=32, shuffle=True,
                                               collate_fn=collate_pairs, generator=torch.Generator().manual_seed(0))
    for _ in range(6):
        for batch in plain_loader:
            opt.zero_grad()
            pairwise_auc_loss(plain, batch).backward()
            opt.step()
    before = max(direct_gaps(plain, splits["train"], THRESHOLDS).values())
    model = mlp(1)
    cons = roc_fairness_constraints(splits["train"], thresholds=THRESHOLDS, kappa=0.02)
    loader = torch.utils.data.DataLoader(objective_pairs(splits["train"]), batch_size=32, shuffle=True,
                                         collate_fn=collate_pairs, generator=torch.Generator().manual_seed(0))
    seen = []
    trainer = ICPPACTrainer(model, pairwise_auc_loss, loader, cons, ICPPACConfig(eta=0.1, tau=1.0, mu=1e-3),
                            constraint_batch_size=32, callbacks=[lambda ep, m, s: seen.append(ep)])
    summary = trainer.train(6)
    assert seen == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0] and summary["steps"] == 6 * len(loader)
    assert all(y >= 0 for y in summary["dual"]) and max(summary["dual"]) > 0
    after = max(direct_gaps(model, splits["train"], THRESHOLDS).values())
    assert after <= 0.035 and after < 0.5 * before
    with pytest.raises(ValueError, match="tau"):
        ICPPACConfig(tau=0.0)
    with pytest.raises(ValueError, match="inner_output"):
        ICPPACConfig(inner_output="median")


def _csv_recipe_flags(splits, tmp_path) -> list[str]:
    """The ROC recipe's flags for the training split written as a CSV with string labels and groups."""
    import pandas as pd

    tr = splits["train"]
    df = pd.DataFrame(tr.features, columns=["a", "b", "c", "d"])
    df["sex"] = np.where(tr.group == 1, "M", "F")
    df["y"] = np.where(tr.label == 1, "yes", "no")
    df["colour"] = np.where(tr.features[:, 3] > 0, "red", "blue")
    path = tmp_path / "mine.csv"
    df.to_csv(path, index=False)
    return ["--dataset", "csv", "--csv_path", str(path), "--label_column", "y", "--positive_label", "yes",
            "--group_column", "sex", "--group_value", "M", "--method", "hinge", "--penalty_beta", "10",
            "--thresholds", "0", "--use_cpu", "true", "--hidden_sizes", "8,8"]


def _roc_recipe():
    return import_script("recipes", "roc_fairness")


def test_recipe_on_a_csv_writes_results_and_a_loadable_model(splits, tmp_path):
    out = tmp_path / "run"
    res = _roc_recipe().main(_csv_recipe_flags(splits, tmp_path) + ["--num_train_epochs", "2",
                                                                     "--output_dir", str(out)])
    saved = json.loads((out / "results.json").read_text())
    assert saved["method"] == "hinge" and saved["beta"] == 10.0 and len(saved["history"]) == 3
    # the recipe's defaults (the paper's gamma 0.8, lr 1e-3, no margin and plain logits only when asked for)
    assert saved["msvr_gamma"] == 0.05 and saved["constraint_margin"] == 0.004 and saved["learning_rate"] == 1e-4
    assert saved["score_bound"] == 1.0  # 'auto' with the single threshold 0
    for split in ("train", "validation", "test"):  # the shift-proof measures and where the scores lie
        assert 0.0 <= saved["shift_proof"][split]["roc_gap"] <= 1.0
        assert saved["shift_proof"][split]["hard_gap_max"] == saved["final"][split]["shift_proof"]["hard_gap_max"]
        assert 0.0 <= saved["scores_outside_thresholds"][split] <= 1.0
    assert saved["scores_shifted_outside_thresholds"] == [
        s for s in ("train", "validation", "test") if saved["scores_outside_thresholds"][s] > 0.5]
    for split in ("train", "validation", "test"):
        assert set(saved["final"][split]["constraints"]) == {"tpr_gap@+0", "fpr_gap@+0"}
    assert saved["test_max_violation"] == pytest.approx(max(saved["final"]["test"]["constraints"].values()))
    assert res["train_seconds"] > 0 and 0.5 < saved["test_auc"] <= 1.0
    loaded = AutoModel.from_pretrained(str(out))
    assert isinstance(loaded, MLPForScoring) and loaded.config.hidden_sizes == [8, 8]
    loaded_state = loaded.state_dict()
    # the run ends with a safety report on the validation split and a model card
    report = json.loads((out / "safety_report.json").read_text())
    values = {c["name"]: c["value"] - c["tolerance"] for c in report["constraints"]}
    assert values == pytest.approx(saved["final"]["validation"]["constraints"], abs=1e-5)
    assert report["objective_metrics"]["test_auc"] == pytest.approx(saved["test_auc"])
    assert (out / "README.md").exists()
    # the recipe's own output passes `report --check`, and the card's snippet loads the saved model
    assert_report_checks(out)
    loaded = run_card_snippet(out)
    assert all(torch.equal(loaded["model"].state_dict()[k], v) for k, v in loaded_state.items())


def test_recipe_defaults_give_way_to_the_papers_setting_and_to_calibrated_margins(splits, tmp_path):
    recipe, flags = _roc_recipe(), _csv_recipe_flags(splits, tmp_path)
    out = tmp_path / "paper"
    recipe.main(flags + ["--num_train_epochs", "1", "--output_dir", str(out), "--save_model", "false",
                         "--learning_rate", "1e-3", "--msvr_gamma", "0.8", "--constraint_margin", "0",
                         "--score_bound", "none"])
    saved = json.loads((out / "results.json").read_text())
    assert (saved["learning_rate"], saved["msvr_gamma"], saved["constraint_margin"], saved["score_bound"]) == (
        1e-3, 0.8, 0.0, None)
    # a calibrated margin (--constraint_confidence) excludes an explicit one: the default margin steps aside
    out = tmp_path / "calibrated"
    recipe.main(flags + ["--num_train_epochs", "1", "--output_dir", str(out), "--save_model", "false",
                         "--constraint_confidence", "0.9"])
    assert json.loads((out / "results.json").read_text())["constraint_margin"] is None
    with pytest.raises(ValueError, match="--score_bound 0.5 is below the largest"):
        recipe.main(flags + ["--thresholds=-1,1", "--score_bound", "0.5", "--output_dir", str(tmp_path / "x")])


def test_model_save_load_roundtrip(tmp_path):
    model = mlp(3)
    model.save_pretrained(tmp_path)
    again = AutoModel.from_pretrained(tmp_path)
    x = torch.randn(4, 4)
    assert torch.allclose(model(features=x).logits, again(features=x).logits)
    with pytest.raises(ValueError, match="features of shape"):
        model(features=torch.randn(4, 5))


def test_score_bound_is_b_tanh_of_the_logit_and_survives_save_load(tmp_path):
    torch.manual_seed(0)
    plain = MLPForScoring(MLPConfig(input_dim=4, hidden_sizes=[16, 8]))
    bounded = MLPForScoring(MLPConfig(input_dim=4, hidden_sizes=[16, 8], score_bound=3.0))
    bounded.load_state_dict(plain.state_dict())  # same weights: only the output map differs
    with torch.no_grad():
        plain.mlp[-1].weight.mul_(50.0)
        bounded.mlp[-1].weight.mul_(50.0)
    x = torch.randn(64, 4)
    z = plain(features=x).logits
    s = bounded(features=x).logits
    assert z.abs().max() > 6.0  # the plain logit leaves [-3, 3] ...
    assert s.abs().max() < 3.0  # ... the bounded score cannot
    assert torch.allclose(s, 3.0 * torch.tanh(z / 3.0), atol=1e-6)
    # monotone: the ranking (hence the AUC) of the bounded score is the logit's
    assert torch.all(torch.diff(s[torch.argsort(z)]) >= 0)
    bounded.save_pretrained(tmp_path)
    again = AutoModel.from_pretrained(tmp_path)
    assert again.config.score_bound == 3.0
    assert torch.allclose(again(features=x).logits, s)
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="score_bound"):
            MLPConfig(input_dim=4, score_bound=bad)


def test_frvp_sigma_matches_svd_and_jacobian_matches_autograd(splits):
    rng = np.random.default_rng(0)
    jac = rng.normal(size=(5, 40))
    assert min_singular_value(jac) == pytest.approx(np.linalg.svd(jac, compute_uv=False).min(), rel=1e-8)
    model = mlp(2)
    with torch.no_grad():
        model.mlp[-1].bias.fill_(0.5)
    cons = roc_fairness_constraints(splits["train"], thresholds=(0.0,), kappa=0.001)
    values, jac = constraint_jacobian(model, cons)
    gaps = direct_gaps(model, splits["train"], (0.0,))
    assert values[0] == pytest.approx(gaps["tpr_gap@+0"] - 0.001, abs=1e-6)  # float32 means
    # row 0 by hand: d/dw |mean_p sigmoid(s) - mean_u sigmoid(s)|
    tr = splits["train"]
    s = model(features=torch.from_numpy(tr.features)).logits
    p = torch.sigmoid(s)
    pos = torch.from_numpy(tr.label == 1)
    gap = p[pos & torch.from_numpy(tr.group == 1)].mean() - p[pos & torch.from_numpy(tr.group == 0)].mean()
    grads = torch.autograd.grad(gap.abs(), list(model.parameters()))
    assert np.allclose(jac[0], torch.cat([g.reshape(-1) for g in grads]).double().numpy(), rtol=1e-4, atol=1e-7)
    rep = frvp_report(model, cons)
    assert rep["violated"] and rep["sigma_violated"] > 0 and rep["delta"] == pytest.approx(rep["sigma_violated"] / 2)


@pytest.mark.parametrize("inner_output", ["average", "last"])
def test_icppac_outer_step_returns_the_mean_of_its_inner_iterates(splits, inner_output):
    model = mlp(3)
    cons = roc_fairness_constraints(splits["train"], thresholds=(0.0,), kappa=0.0)
    loader = torch.utils.data.DataLoader(objective_pairs(splits["train"]), batch_size=64, shuffle=True,
                                         collate_fn=collate_pairs, generator=torch.Generator().manual_seed(0))
    trainer = ICPPACTrainer(model, pairwise_auc_loss, loader, cons,
                            ICPPACConfig(eta=0.1, tau=1.0, mu=1e-3, inner_steps=4, inner_output=inner_output),
                            constraint_batch_size=16)
    iterates, anchors = [], []
    step = trainer._iteration

    def recording(batch, anchor):
        anchors.append(anchor.clone())
        out = step(batch, anchor)
        iterates.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
        return out

    trainer._iteration = recording
    trainer.train(1)
    n = len(iterates)
    assert n == len(loader) and n > 4 and n % 4 != 0
    final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    last_loop = iterates[(n - 1) // 4 * 4:]  # the last (possibly shorter) outer step
    if inner_output == "average":
        assert torch.allclose(anchors[4], torch.stack(iterates[:4]).mean(0), atol=1e-6)  # next proximal centre
        assert torch.allclose(final, torch.stack(last_loop).mean(0), atol=1e-6)
    else:
        assert torch.allclose(anchors[4], iterates[3]) and torch.allclose(final, iterates[-1])


def test_score_bound_reaches_the_trained_model_and_keeps_the_scores_within_the_thresholds(splits, tmp_path):
    """The AUC objective alone spreads the scores past the thresholds (it gains from any larger
    score difference); with ``score_bound`` = max |Gamma| none can leave [-1, 1]."""
    from hf_constrained.fairness.experiment import ROCFairnessArguments, run_roc_fairness

    outside = {}
    for bound in (None, 1.0):
        args = ROCFairnessArguments(dataset="adult", method="none", thresholds="-1,0,1", hidden_sizes="8",
                                    score_bound=bound, save_model=False)
        results = run_roc_fairness(args, make_args(tmp_path, num_train_epochs=2, learning_rate=5e-2), splits=splits)
        assert results["score_bound"] == bound
        outside[bound] = {split: results["final"][split]["shift_proof"]["fraction_outside_thresholds"]
                          for split in ("train", "validation", "test")}
        assert results["test_auc"] > 0.75  # both learn the ranking
    assert min(outside[None].values()) > 0.5, outside
    assert max(outside[1.0].values()) == 0.0, outside


def test_score_bound_flag_takes_a_number_auto_or_none_and_rejects_a_bound_below_the_thresholds():
    from hf_constrained.fairness.experiment import ROCFairnessArguments

    def bound(value, thresholds="-3,-2,-1,0,1,2,3"):
        return ROCFairnessArguments(thresholds=thresholds, score_bound=value).score_bound_value

    assert bound("none") is None and bound(None) is None  # the paper's plain logit
    assert bound("auto") == 3.0 and bound("auto", "-1,0,2") == 2.0 and bound("auto", "0") == 1.0
    assert bound("4.5") == 4.5 and bound(3.0) == 3.0
    with pytest.raises(ValueError, match="below the largest .threshold. 3"):
        bound("2")
    for bad in ("0", "-1", "inf", "wide"):
        with pytest.raises(ValueError, match="--score_bound"):
            bound(bad)


def test_penalty_methods_follow_the_step_decay_through_multisteplr(splits, tmp_path):
    """x0.1 at 50% and 75% of training: torch's MultiStepLR, read from the optimizer at every step."""
    from transformers import TrainerCallback

    from hf_constrained.fairness.experiment import ROCFairnessArguments, decay_milestones, run_roc_fairness, step_decay

    class LRs(TrainerCallback):
        def __init__(self):
            self.lrs, self.schedulers = [], set()

        def on_step_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kw):
            self.lrs.append(optimizer.param_groups[0]["lr"])
            self.schedulers.add(type(lr_scheduler).__name__)

    seen = LRs()
    args = ROCFairnessArguments(dataset="adult", method="hinge", thresholds="-1,0,1", hidden_sizes="8",
                                save_model=False)
    # 600 rows, ~360 negatives -> 12 batches of 32 pairs per epoch, 2 epochs = 24 steps
    targs = make_args(tmp_path, num_train_epochs=2, learning_rate=1e-2)
    run_roc_fairness(args, targs, splits=splits, callbacks=[seen])
    total = len(seen.lrs)
    assert total == 2 * -(-int((splits["train"].label == 0).sum()) // 32)
    assert seen.schedulers == {"MultiStepLR"}
    half, three_quarters = decay_milestones(total, [0.5, 0.75])
    expected = [1e-2] * half + [1e-3] * (three_quarters - half) + [1e-4] * (total - three_quarters)
    np.testing.assert_allclose(seen.lrs, expected, rtol=1e-9)
    # ICPPAC's loop (no torch optimizer) gets the same multipliers
    np.testing.assert_allclose([1e-2 * step_decay(total, [0.5, 0.75], 0.1)(t) for t in range(total)], expected,
                               rtol=1e-9)


def test_the_certificate_bounds_the_hard_gaps_on_its_own_split(splits, tmp_path):
    """The ROC certificate measures what users check, the hard |TPR/FPR gap| of 1[s > tau], on a
    certification split: each group's rate gets exact Clopper-Pearson bounds at delta/4 (both ends
    of both groups), checked here against scipy's beta quantiles."""
    from scipy.stats import beta as beta_dist

    from hf_constrained.safety.finish import certify_models

    model = mlp()
    with torch.no_grad():
        model.mlp[-1].bias.fill_(0.3)
    certify = biased_split(400, 7)
    cons = roc_fairness_constraints(splits["train"], splits["validation"], thresholds=THRESHOLDS, kappa=0.01,
                                    certify_data=certify)
    trainer = AUCConstrainedTrainer(model=model, args=make_args(tmp_path), constraints=cons,
                                    train_dataset=objective_pairs(splits["train"]), data_collator=collate_pairs)
    cert = certify_models(trainer, delta=0.05)
    with torch.no_grad():
        s = model(features=torch.from_numpy(certify.features)).logits.double().numpy()

    def ends(hits):
        k, n = int(hits.sum()), hits.size
        # each group's end at a quarter of the delta the split's first look spends (0.9 of 0.05, the ledger of looks)
        up = 1.0 if k == n else beta_dist.ppf(1 - 0.045 / 4, k + 1, n - k)
        lo = 0.0 if k == 0 else beta_dist.ppf(0.045 / 4, k, n - k + 1)
        return lo, up

    for kind, y in (("tpr", 1), ("fpr", 0)):
        for tau in THRESHOLDS:
            name = f"{kind}_gap@{tau:+g}"
            lo_p, up_p = ends(s[(certify.group == 1) & (certify.label == y)] > tau)
            lo_u, up_u = ends(s[(certify.group == 0) & (certify.label == y)] > tau)
            assert cert.upper_bounds[0][name] == pytest.approx(max(up_p - lo_u, up_u - lo_p), abs=1e-9)
            hard = abs((s[(certify.group == 1) & (certify.label == y)] > tau).mean()
                       - (s[(certify.group == 0) & (certify.label == y)] > tau).mean())
            assert cert.values[0][name] == pytest.approx(hard)
    assert cert.bound == {c.name: "clopper_pearson" for c in cons}


def test_push_to_hub_is_gated_and_comes_last(splits, tmp_path, monkeypatch):
    """--push_to_hub: results, report and card are written first; a run that is not certified uploads
    nothing, keeps its files and the command fails (status 1); --allow_unsafe_push publishes it."""
    import transformers.trainer as hf_trainer
    from conftest import UploadRecorder
    from huggingface_hub import metadata_load

    from hf_constrained.cli import main as cli_main

    hub = UploadRecorder()
    monkeypatch.setattr(hf_trainer, "hf_api", lambda: hub)
    flags = _csv_recipe_flags(splits, tmp_path) + ["--num_train_epochs", "1", "--push_to_hub", "true",
                                                   "--hub_model_id", "user/roc"]

    out = tmp_path / "refused"  # the tight default kappa on a tiny certification split: not certified
    assert cli_main(["fairness", *flags, "--output_dir", str(out)]) == 1 and hub.calls == []
    for name in ("results.json", "safety_report.json", "README.md", "model.safetensors"):
        assert (out / name).exists(), name
    assert json.loads((out / "safety_report.json").read_text())["certified"] is False
    # a local CSV is no Hub dataset: no model-index with an invented dataset type
    assert "model-index" not in metadata_load(out / "README.md")
    out = tmp_path / "override"
    assert cli_main(["fairness", *flags, "--output_dir", str(out), "--allow_unsafe_push", "true"]) == 0
    assert ("upload_folder", "user/roc") in hub.calls and (out / "results.json").exists()
    # a push the recipe cannot gate is refused before any data loads
    with pytest.raises(ValueError, match="--push_to_hub is not available with --method icppac"):
        _roc_recipe().main(flags[:flags.index("--method")] + ["--method", "icppac", "--output_dir", str(tmp_path / "x")]
                           + flags[flags.index("--method") + 2:])
    with pytest.raises(ValueError, match="--allow_unsafe_push only applies with --push_to_hub"):
        _roc_recipe().main(_csv_recipe_flags(splits, tmp_path) + ["--allow_unsafe_push", "true"])
