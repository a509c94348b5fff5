"""ROC fairness: the certificate of the hinge model next to the unconstrained model's, per seed.

For each seed, trains the recipe (``recipes/roc_fairness.py``, its defaults plus any recipe flags
given after ``--``) twice on the same data and certification split: with the hinge (``--method
hinge``) and without constraints (``--method none``). For each model it records

- whether the certificate holds at the recipe's kappa (every hard |TPR/FPR gap| of 1[s > tau]);
- the **smallest certified gap**: the smallest tolerance at which the same bounds (same delta, same
  certification split) certify every hard gap. The bounds do not depend on the tolerance and a
  constraint is certified when its bound is <= its tolerance, so this is exactly the largest upper
  bound over the constraints (:func:`hf_constrained.fairness.roc.smallest_certified_gap`);
- the worst hard gap on the test split, which neither training nor the certificate read;
- the test AUC (the objective) and the shift-proof ROC-curve gap on the test split.

Then the median and the worst over the seeds, and the goal: the hinge's smallest certified gap at
most ``--goal_ratio`` (0.5) times the unconstrained model's, at the median and on every seed.

    python benchmarks/roc_certificate.py --dataset compas --seeds 100,101,102,103,104 \\
        --json benchmarks/results/roc_certificate_compas.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Optional, Sequence

from hf_constrained.atomic_files import atomic_write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ("hinge", "none")


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags (the stored ``config`` is this parser's result for the stored ``command``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--dataset", choices=("adult", "compas"), required=True)
    parser.add_argument("--seeds", default="0,1,2,3,4", help="Comma-separated training seeds.")
    parser.add_argument("--workers", type=int, default=1,
                        help="Runs at a time, each single-threaded (the results do not depend on it).")
    parser.add_argument("--goal_ratio", type=float, default=0.5,
                        help="Goal: hinge's smallest certified gap <= this times the unconstrained model's.")
    parser.add_argument("--json", default=None, help="Write the results here (with the command and config).")
    parser.add_argument("recipe_flags", nargs="*", help="Further recipe flags, after --.")
    return parser


def parse_seeds(text: str) -> list[int]:
    """``"100,101"`` -> [100, 101]; anything else is an error naming ``--seeds``."""
    try:
        seeds = [int(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds must list distinct integers, got {text!r}")
    return seeds


def recipe_argv(dataset: str, method: str, seed: int, output_dir: str, flags: Sequence[str]) -> list[str]:
    """The recipe's command line for one run (the recipe's defaults unless ``flags`` say otherwise)."""
    return ["--dataset", dataset, "--method", method, "--seed", str(seed), "--output_dir", output_dir,
            "--save_model", "false", *flags]


def run_one(dataset: str, method: str, seed: int, flags: Sequence[str]) -> dict[str, Any]:
    """Train one model with the recipe, single-threaded, and return what the certificate says of it."""
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    import roc_fairness  # noqa: E402  (the recipe file, as users run it)

    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        r = roc_fairness.main(recipe_argv(dataset, method, seed, os.path.join(tmp, "run"), flags))
    cert = r["certificate"]
    if cert is None:
        raise ValueError("the recipe wrote no certificate: keep --certify_fraction above 0")
    return {
        "seed": seed, "method": method, "beta": r["beta"], "epochs": r["epochs"],
        "certified_at_kappa": cert["certified"],
        "smallest_certified_gap": cert["smallest_certified_gap"],
        "worst_bound_constraint": max(cert["bounds"], key=cert["bounds"].get),
        "bounds": cert["bounds"],
        "certify_rows": cert["certify_rows"], "test_rows": cert["audit_rows"],
        "test_hard_gap_max": max(cert["test_values"].values()),
        "test_hard_gaps": cert["test_values"],
        "test_auc": r["test_auc"],
        "test_roc_gap": r["shift_proof"]["test"]["roc_gap"],
        # hard gaps at the test scores' own quantiles (thresholds that move with the scores) and where the test
        # scores lie: scores squeezed between two fixed thresholds make every decision 1[s > tau] the same for all
        "test_quantile_hard_gap_max": r["shift_proof"]["test"]["hard_gap_max"],
        "test_score_quantiles": r["final"]["test"]["shift_proof"]["score_quantiles"],
        "train_max_violation": r["train_max_violation"],
        "test_soft_max_violation": r["test_max_violation"],
        "scores_outside_thresholds_test": r["scores_outside_thresholds"]["test"],
        "train_seconds": r["train_seconds"],
    }


def _stats(values: Sequence[float], worst: str) -> dict[str, float]:
    return {"median": statistics.median(values), "worst": (max if worst == "max" else min)(values)}


def summarize(runs: Sequence[dict[str, Any]], goal_ratio: float) -> dict[str, Any]:
    """Median and worst over the seeds per method, and the hinge / unconstrained ratio per seed."""
    by = {m: sorted((r for r in runs if r["method"] == m), key=lambda r: r["seed"]) for m in METHODS}
    out: dict[str, Any] = {}
    for m, rs in by.items():
        out[m] = {
            "certified_at_kappa": sum(r["certified_at_kappa"] for r in rs), "of": len(rs),
            "smallest_certified_gap": _stats([r["smallest_certified_gap"] for r in rs], "max"),
            "test_hard_gap_max": _stats([r["test_hard_gap_max"] for r in rs], "max"),
            "test_auc": _stats([r["test_auc"] for r in rs], "min"),
            "test_roc_gap": _stats([r["test_roc_gap"] for r in rs], "max"),
            "test_quantile_hard_gap_max": _stats([r["test_quantile_hard_gap_max"] for r in rs], "max"),
        }
    ratios = [h["smallest_certified_gap"] / n["smallest_certified_gap"] for h, n in zip(by["hinge"], by["none"])]
    hinge_med = out["hinge"]["smallest_certified_gap"]["median"]
    none_med = out["none"]["smallest_certified_gap"]["median"]
    out["ratio_per_seed"] = dict(zip([r["seed"] for r in by["hinge"]], ratios))
    out["ratio"] = {"of_medians": hinge_med / none_med, **_stats(ratios, "max")}
    out["goal"] = {"ratio": goal_ratio, "met_at_median": hinge_med <= goal_ratio * none_med,
                   "met_on_every_seed": all(x <= goal_ratio for x in ratios)}
    return out


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    seeds = parse_seeds(args.seeds)
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    jobs = [(args.dataset, m, s, list(args.recipe_flags)) for s in seeds for m in METHODS]
    start = time.time()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.workers == 1:
        runs = [run_one(*job) for job in jobs]
    else:
        with ProcessPoolExecutor(args.workers) as pool:
            runs = list(pool.map(run_one, *zip(*jobs)))
    result = {"command": " ".join(["python benchmarks/roc_certificate.py", *argv]), "config": vars(args),
              "seconds": round(time.time() - start, 1), "summary": summarize(runs, args.goal_ratio), "per_run": runs}
    if args.json:
        atomic_write_json(args.json, result, indent=1, newline=True)
    sys.stdout.write(json.dumps(result["summary"], indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
