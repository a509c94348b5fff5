"""The ROC comparison's run order and its two feasibility readings (benchmarks/roc_fairness_comparison.py)."""

import importlib.util
import os

import pytest

import hf_constrained.fairness.experiment as experiment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def comparison():
    spec = importlib.util.spec_from_file_location("roc_fairness_comparison",
                                                  os.path.join(ROOT, "benchmarks", "roc_fairness_comparison.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_extended_preset_runs_tiers_in_order_with_whole_settings(comparison, monkeypatch, tmp_path):
    captured, run_specs = {}, comparison.run_specs

    def stop(args):  # the planned runs, then stop before any training
        captured["specs"] = run_specs(args)
        raise SystemExit

    monkeypatch.setattr(comparison, "run_specs", stop)
    with pytest.raises(SystemExit):
        comparison.main(["--preset", "extended", "--out", str(tmp_path)])
    specs = captured["specs"]
    tiers = [(s["dataset"], "penalties" if s["method"] in ("hinge", "squared_hinge", "none") else s["method"])
             for s in specs]
    order = [("compas", "penalties"), ("compas", "hinge_shared"), ("compas", "icppac"), ("adult", "penalties"),
             ("adult", "icppac")]
    assert [t for n, t in enumerate(tiers) if n == 0 or tiers[n - 1] != t] == order  # each tier once, in order
    keys = [comparison.spec_key({**s, "seed": 0}) for s in specs]
    for n in range(0, len(specs), 5):  # every seed of one setting together, seeds 0..4
        assert len(set(keys[n:n + 5])) == 1 and [s["seed"] for s in specs[n:n + 5]] == [0, 1, 2, 3, 4]
    shared = [s for s in specs if s["method"] == "hinge_shared"]
    assert shared and all(s["share_constraint_batches"] for s in shared)
    assert {s["beta"] for s in specs if s["method"] == "squared_hinge"} >= {1000.0, 20000.0}
    assert {s["epochs"] for s in specs if s["dataset"] == "compas"} == {60}


def _setting(beta, feasible, outside, seeds_ok, seeds_in_range):
    return {"dataset": "d", "method": "hinge", "setting": f"beta={beta}", "beta": beta, "feasible": feasible,
            "shifted": outside > 0.5, "seeds": [0, 1], "seeds_feasible_on_train": seeds_ok,
            "seeds_feasible_in_range": seeds_in_range, "train_max_violation_of_mean": -0.001 if feasible else 0.01,
            "val_auc": 0.7, "lr": 1e-3, "test_auc": 0.7, "test_auc_std": 0.0, "test_max_violation": 0.0,
            "test_max_violation_worst_seed": 0.0, "seconds_per_epoch": 1.0, "train_hard_gap_max": 0.1,
            "train_roc_gap": 0.1, "test_hard_gap_max": 0.1, "test_roc_gap": 0.1,
            "test_fraction_outside_thresholds": outside, "test_fraction_outside_thresholds_worst_seed": outside,
            "train_fraction_outside_thresholds": outside}


def test_in_range_selection_skips_settings_feasible_by_saturated_scores(comparison):
    settings = {f"d|hinge|beta={b}": _setting(b, *rest) for b, *rest in (
        (1, True, 0.99, 2, 0), (10, False, 0.2, 0, 0), (20, True, 0.1, 1, 1), (40, True, 0.0, 2, 2))}
    paper = comparison._select(settings, ["d"], in_range=False)["d|hinge"]
    in_range = comparison._select(settings, ["d"], in_range=True)["d|hinge"]
    assert paper["beta"] == 1 and paper["smallest_beta_every_seed_feasible"] == 1
    assert in_range["beta"] == 20 and in_range["smallest_beta_every_seed_feasible"] == 40


def test_each_reading_chooses_the_learning_rate_among_its_own_feasible_settings(comparison):
    # beta 1: lr 1e-3 feasible only by saturated scores (best validation AUC), lr 1e-4 feasible in range
    # beta 4: feasible at neither lr under the in-range reading -> the better validation AUC
    every = {}
    for beta, lr, feasible, outside, val_auc in ((1, 1e-3, True, 0.99, 0.73), (1, 1e-4, True, 0.1, 0.70),
                                                 (4, 1e-3, True, 0.9, 0.72), (4, 1e-4, False, 0.1, 0.71)):
        v = _setting(beta, feasible, outside, 2, 2 if feasible and outside <= 0.5 else 0)
        v.update(setting=f"beta={beta},lr={lr:g}", base_setting=f"beta={beta}", lr=lr, val_auc=val_auc)
        every[f"d|hinge|{v['setting']}"] = v
    paper = comparison.choose_lr(every, in_range=False)
    in_range = comparison.choose_lr(every, in_range=True)
    assert paper["d|hinge|beta=1"]["lr"] == 1e-3 and paper["d|hinge|beta=4"]["lr"] == 1e-3
    assert in_range["d|hinge|beta=1"]["lr"] == 1e-4 and in_range["d|hinge|beta=4"]["lr"] == 1e-3
    assert in_range["d|hinge|beta=1"]["lr_candidates"] == [1e-4, 1e-3]
    assert comparison._select(in_range, ["d"], in_range=True)["d|hinge"]["setting"] == "beta=1,lr=0.0001"
    assert comparison._select(paper, ["d"], in_range=True)["d|hinge"]["setting"] is None  # one lr for both: lost


def test_incomplete_settings_names_the_settings_a_time_budget_cut_short(comparison):
    specs = [{"dataset": "d", "method": "icppac", "beta": None, "seed": seed, "lr": 1e-3, "epochs": 6,
              "icppac": {"eta": eta, "tau": 10.0, "mu": 1e-3}} for eta in (0.1, 0.01) for seed in (0, 1)]
    done = {comparison.spec_key(s): {} for s in specs[:3]}
    assert comparison.incomplete_settings(specs, done) == {"d|icppac|eta=0.01,tau=10,mu=0.001": "1/2"}


def test_constraint_batch_pairs_reach_the_trainer_and_default_to_the_batch_pairs(comparison, monkeypatch):
    seen = []
    monkeypatch.setattr(experiment, "run_roc_fairness",
                        lambda script, targs, splits: seen.append((script, targs)) or {"test_auc": 0.5})
    monkeypatch.setitem(comparison._SPLITS, "compas", object())  # no data loading: the run is captured above
    spec = {"dataset": "compas", "method": "hinge", "beta": 20.0, "seed": 0, "lr": 1e-3, "epochs": 1}
    common = {"batch_pairs": 64, "constraint_batch_pairs": 256, "msvr_gamma": 0.05, "constraint_margin": 0.004,
              "hidden_sizes": "8", "score_bound": 3.0, "icppac_inner_steps": 1, "icppac_inner_output": "average"}
    comparison._run_one(spec, common)
    script, targs = seen[-1]
    assert script.score_bound == 3.0
    assert targs.per_device_train_batch_size == 64 and targs.constraint_batch_size == 256
    assert targs.msvr_gamma == 0.05 and targs.constraint_margin == 0.004 and targs.penalty_beta == 20.0
    assert comparison.common_settings(comparison.parse_args(["--batch-pairs", "32"]))["constraint_batch_pairs"] == 32
    assert comparison.common_settings(comparison.parse_args(["--score-bound", "3"]))["score_bound"] == 3.0
    assert comparison.common_settings(comparison.parse_args([]))["score_bound"] is None  # the paper's model
    with pytest.raises(SystemExit):
        comparison.parse_args(["--score-bound", "2"])  # below the thresholds' range
    args = comparison.parse_args(["--batch-pairs", "32", "--constraint-batch-pairs", "128"])
    assert comparison.common_settings(args)["constraint_batch_pairs"] == 128
    with pytest.raises(SystemExit):
        comparison.parse_args(["--constraint-batch-pairs", "0"])


def test_every_seed_goal_in_range_counts_only_seeds_feasible_in_range(comparison):
    # beta 20 is the smallest feasible in range (seed mean); both seeds hold on train but one saturated
    settings = {f"d|hinge|beta={b}": _setting(b, *rest) for b, *rest in (
        (10, False, 0.2, 0, 0), (20, True, 0.3, 2, 1), (40, True, 0.0, 2, 2))}
    paper = comparison._goals(comparison._select(settings, ["d"], in_range=False), ["d"], in_range=False)
    in_range = comparison._goals(comparison._select(settings, ["d"], in_range=True), ["d"], in_range=True)
    goal = "hinge_every_seed_feasible_at_its_smallest_feasible_beta"
    assert paper["d"][goal]["met"] is True and paper["d"][goal]["beta"] == 20
    assert in_range["d"][goal]["met"] is False and in_range["d"][goal]["seeds_feasible_in_range"] == "1/2"


def test_recipe_preset_reports_committed_runs_made_with_the_recipes_defaults(comparison):
    """docs/roc_fairness.md and the README quote ``--preset recipe`` as the recipe's defaults: its
    settings, and every committed run it reads, must be the recipe's."""
    import gzip
    import json

    spec = importlib.util.spec_from_file_location("roc_recipe", os.path.join(ROOT, "recipes", "roc_fairness.py"))
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    defaults = recipe.DEFAULTS
    bound = experiment.ROCFairnessArguments(score_bound=defaults["score_bound"]).score_bound_value
    args = comparison.parse_args(["--preset", "recipe"])
    assert (args.msvr_gamma, args.constraint_margin, args.score_bound, args.epochs) == (
        defaults["msvr_gamma"], recipe.DEFAULT_MARGIN, bound, defaults["num_train_epochs"])
    assert comparison._floats(args.lrs) == [defaults["learning_rate"]]
    assert (args.batch_pairs, args.constraint_batch_pairs) == (
        defaults["per_device_train_batch_size"], defaults["constraint_batch_size"])
    wanted = {comparison.spec_key(s) for s in comparison.run_specs(args)}
    found = set()
    for path in args.runs_from.split(","):
        with open(os.path.join(os.path.dirname(path), "roc_fairness_summary.json")) as f:
            assert json.load(f)["meta"]["constraint_margin"] == recipe.DEFAULT_MARGIN, path
        with gzip.open(path, "rt") as f:
            for run in (json.loads(line) for line in f if line.strip()):
                if comparison.spec_key(run["spec"]) in wanted:
                    found.add(comparison.spec_key(run["spec"]))
                    assert (run["msvr_gamma"], run["score_bound"], run["learning_rate"]) == (
                        defaults["msvr_gamma"], bound, defaults["learning_rate"]), path
    assert found == wanted  # every planned run is there: the report leaves nothing out


def test_report_refuses_runs_made_with_other_settings_than_the_command(comparison):
    common = {"msvr_gamma": 0.05, "score_bound": 3.0, "constraint_margin": 0.004}

    def run(method="hinge", **recorded):
        spec = {"dataset": "d", "method": method, "beta": 4.0, "seed": 0, "lr": 1e-4, "epochs": 60}
        return {"spec": spec, "method": method, **recorded}

    same = run(msvr_gamma=0.05, score_bound=3.0, constraint_margin=0.004)
    older = run(msvr_gamma=0.05, score_bound=3.0)  # made before the margin was recorded: not checked on it
    icppac = run("icppac", msvr_gamma=None, score_bound=3.0, constraint_margin=None)
    assert comparison.runs_made_otherwise([same, older, icppac], common) == []
    unbounded = run(msvr_gamma=0.05, score_bound=None, constraint_margin=0.004)
    other_gamma = run(msvr_gamma=0.1, score_bound=3.0)
    found = comparison.runs_made_otherwise([unbounded, other_gamma], common)
    assert len(found) == 2 and "score_bound None (not 3.0)" in found[0] and "msvr_gamma 0.1 (not 0.05)" in found[1]
