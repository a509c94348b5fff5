"""End to end: how often a certified run is wrong on data nothing saw, and how often runs certify.

Runs a recipe over many seeds with an **audit split** set aside that neither training, checkpoint
selection nor the certificate reads, and reports, for the certificate (the default rule) and
for the old point rule (every held-out selection value within tolerance):

- the **failure rate**: among runs the rule passed, the share where some constraint's statistic
  exceeds its tolerance on the audit split (the certificate's claim is about the population, so
  an audit split of finite size also fails now and then through its own noise: the JSON gives
  the Clopper-Pearson interval of the rate);
- the **solution rate**: the share of runs the rule passed;
- for the certificate, the smallest tolerance at which 70% of the runs certify (a run certifies
  at tolerance t when its largest certified bound is <= t: the bounds do not depend on t).

    python benchmarks/certificate_end_to_end.py --recipe safe_release --seeds 100-119 \\
        --out benchmarks/results/certificate_end_to_end_safe_release.json

The ROC-fairness recipe's certificate, next to the unconstrained model's on the same splits:
``benchmarks/roc_certificate.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import sys
import tempfile
import time
from typing import Any, Callable

from scipy.stats import binomtest

from hf_constrained.atomic_files import atomic_write_json
from hf_constrained.publishable import publishable_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "recipes"))


def seeds_of(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            out.extend(range(int(a), int(b) + 1))
        elif part.strip():
            out.append(int(part))
    return out


def run_safe_release(seed: int, out_dir: str, extra: list[str]) -> dict[str, Any]:
    import safe_release_digits

    argv = ["--seed", str(seed), "--output_dir", out_dir, "--audit_fraction", "0.4", *extra]
    with contextlib.redirect_stdout(io.StringIO()):
        safe_release_digits.main(argv)
    with open(os.path.join(out_dir, "results.json"), encoding="utf-8") as f:
        r = json.load(f)
    audit = r["audit"]
    return {
        "seed": seed,
        "certified": r["certified"], "certified_bounds": r["certified_bounds"],
        "certify_tolerance": r["forget_tolerance"],
        "audit_certified_statistic": audit["forgotten_share"],
        "point_rule_passes": r["point_rule_passes"], "point_tolerance": r["tolerance"],
        "audit_point_statistic": audit["loss_change"], "audit_rows": audit["rows_per_digit"],
        "objective": r["objective_metrics"],
    }


RECIPES: dict[str, Callable[[int, str, list[str]], dict[str, Any]]] = {
    "safe_release": run_safe_release,
}


def rate(hits: int, n: int) -> dict[str, Any]:
    if n == 0:
        return {"rate": None, "count": 0, "of": 0}
    ci = binomtest(hits, n).proportion_ci(0.95, method="exact")
    return {"rate": hits / n, "count": hits, "of": n, "ci95": [ci.low, ci.high]}


def summarize(runs: list[dict[str, Any]], delta: float) -> dict[str, Any]:
    def fails(run: dict[str, Any], statistic: str, tolerance: str) -> bool:
        return any(v > run[tolerance] for v in run[statistic].values())

    cert = [r for r in runs if r["certified"]]
    point = [r for r in runs if r["point_rule_passes"]]
    largest = sorted(max(r["certified_bounds"].values()) for r in runs if r["certified_bounds"])
    k = max(0, math.ceil(0.7 * len(largest)) - 1)
    t70 = largest[k] if largest else None
    at_t70 = [r for r in runs if r["certified_bounds"] and max(r["certified_bounds"].values()) <= t70]
    return {
        "runs": len(runs),
        "delta": delta,
        "certificate": {
            "solution_rate": rate(len(cert), len(runs)),
            "failure_rate_on_audit": rate(sum(fails(r, "audit_certified_statistic", "certify_tolerance") for r in cert),
                                          len(cert)),
            "tolerance_for_70_percent": t70,
            "failure_rate_on_audit_at_that_tolerance": rate(
                sum(any(v > t70 for v in r["audit_certified_statistic"].values()) for r in at_t70), len(at_t70)),
        },
        "point_rule": {
            "solution_rate": rate(len(point), len(runs)),
            "failure_rate_on_audit": rate(sum(fails(r, "audit_point_statistic", "point_tolerance") for r in point),
                                          len(point)),
            "failure_rate_on_audit_by_the_certified_statistic": rate(
                sum(fails(r, "audit_certified_statistic", "certify_tolerance") for r in point), len(point)),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", choices=sorted(RECIPES), required=True)
    parser.add_argument("--seeds", default="100-119")
    parser.add_argument("--delta", type=float, default=0.05)
    parser.add_argument("--out", default=None)
    parser.add_argument("extra", nargs="*", help="further recipe flags, after --")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    runs = []
    start = time.time()
    for seed in seeds_of(args.seeds):
        with tempfile.TemporaryDirectory() as tmp:
            run = RECIPES[args.recipe](seed, os.path.join(tmp, "run"), [*args.extra, "--delta", str(args.delta)])
        runs.append(run)
        logging.getLogger(__name__).info("seed %d done", seed)
        sys.stderr.write(f"seed {seed}: certified={run['certified']} point={run['point_rule_passes']}\n")
    summary = {"command": publishable_command("python benchmarks/certificate_end_to_end.py", sys.argv[1:]),
               "recipe": args.recipe, "seeds": args.seeds, "seconds": round(time.time() - start, 1),
               **summarize(runs, args.delta), "per_run": runs}
    if args.out:
        atomic_write_json(args.out, summary, indent=1, newline=True)
    sys.stdout.write(json.dumps({k: summary[k] for k in ("certificate", "point_rule")}, indent=1) + "\n")


if __name__ == "__main__":
    main()
