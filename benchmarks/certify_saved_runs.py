"""Every saved run of the forgetting benchmark certified with ``hf-constrained certify``, the command a user runs.

``benchmarks/forgetting_frontier.py --save_models DIR`` keeps each run's fine-tuned model
(``DIR/runs/<method>-<value>-seed<seed>``) and writes the old tasks' certification rows once
(``DIR/certification_rows/<task>.jsonl``: independent draws of each task's generator, read by no run). This
script runs the command on every saved model against the old model, with the same claim for every method, so that
the replay, KL and A-GEM runs carry the certificate the library's default carries, computed by the code a user
calls on a model trained anywhere (docs/certify.md), not by the benchmark:

    hf-constrained certify --model DIR/runs/RUN --base_model OLD --protected_datasets TASK=FILE ... \\
        --claim "percent_forgotten <= 3" --delta 0.05 --output_dir DIR/certificates/RUN --device cpu

Each run is one release, certified once by the user who trained it: the command runs with a ledger of looks of its
own (``HF_CONSTRAINED_LEDGER=DIR/certificates/RUN/user_ledger.json``), so each certificate is that user's first
look at the rows, as in the benchmark. One user who certified every saved run on the same rows would spend a look
per model (the ledger's later looks test at a smaller level): ``--ledger shared`` certifies them so. With
``--frontier_json`` (the benchmark's result file of the same runs) each run's verdict and bounds are compared with
the certificate the benchmark computed inside the training run, and the disagreements are counted.

    python benchmarks/certify_saved_runs.py --runs outputs/ff_models --old_model outputs/old_llm_many_tasks \\
        --frontier_json outputs/ff.json --json benchmarks/results/certify_saved_runs.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any, Optional

from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hf_constrained.atomic_files import atomic_write_json  # noqa: E402
from hf_constrained.certification.ledger import LEDGER_ENV  # noqa: E402
from hf_constrained.publishable import publishable_command  # noqa: E402


def certify_command(run_dir: str, old_model: str, rows: dict[str, str], claim: str, delta: float,
                    output_dir: str) -> list[str]:
    """The ``hf-constrained certify`` command line of one saved run (as a module call of this interpreter)."""
    return [sys.executable, "-m", "hf_constrained.cli", "certify", "--model", run_dir, "--base_model", old_model,
            "--protected_datasets", *(f"{task}={path}" for task, path in sorted(rows.items())),
            "--claim", claim, "--delta", format(delta, "g"), "--output_dir", output_dir, "--device", "cpu",
            "--batch_size", "256"]


def certify_run(run_dir: str, old_model: str, rows: dict[str, str], claim: str, delta: float,
                output_dir: str, ledger: Optional[str]) -> dict[str, Any]:
    """Run the command on one saved model (with ``ledger`` as the user-level ledger of looks, if given); its verdict,
    every set's upper bound and the exit status."""
    env = dict(os.environ)
    if ledger is not None:
        env[LEDGER_ENV] = ledger
    done = subprocess.run(certify_command(run_dir, old_model, rows, claim, delta, output_dir),
                          capture_output=True, text=True, env=env)
    if done.returncode not in (0, 1):
        raise SystemExit(f"hf-constrained certify failed on {run_dir} (exit {done.returncode}):\n{done.stderr[-3000:]}")
    with open(os.path.join(output_dir, "safety_report.json")) as f:
        report = json.load(f)
    cert = report["certificate"]
    bounds = dict(cert["upper_bounds"][report.get("certificate_candidate", 0)])
    return {"exit_code": done.returncode, "certified": done.returncode == 0, "upper_bounds": bounds,
            "largest_bound": max(bounds.values()), "num_rows": cert.get("num_rows"), "looks": cert.get("looks"),
            "headline": next((line for line in done.stdout.splitlines() + done.stderr.splitlines()
                              if "ertified" in line), None)}


def frontier_certificates(path: Optional[str]) -> dict[str, dict[str, Any]]:
    """``{run name: the benchmark's own row}`` from a forgetting-frontier result file (empty without one)."""
    if path is None:
        return {}
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from forgetting_frontier import saved_run_name

    with open(path) as f:
        result = json.load(f)
    return {saved_run_name(r["method"], float("nan") if r["value"] is None else r["value"], r["seed"]): r
            for r in result["runs"]}


def compare(mine: dict[str, Any], theirs: Optional[dict[str, Any]], claim: float) -> Optional[dict[str, Any]]:
    """Whether the command's certificate agrees with the benchmark's (verdict, and the largest bound gap)."""
    if theirs is None or theirs.get("upper_bounds") is None:
        return None
    bench = {k.split("/", 1)[-1]: v for k, v in theirs["upper_bounds"].items()}
    gap = max(abs(mine["upper_bounds"][t] - bench[t]) for t in bench if t in mine["upper_bounds"])
    return {"same_verdict": mine["certified"] == all(b <= claim for b in bench.values()),
            "largest_bound_difference": gap}


def summarize(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per method and knob value: seeds certified, and the largest bound's median and worst."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for name, r in runs.items():
        groups.setdefault(name.rsplit("-seed", 1)[0], []).append(r)
    return {g: {"seeds": len(rs), "seeds_certified": sum(r["certified"] for r in rs),
                "largest_bound": {"median": statistics.median(r["largest_bound"] for r in rs),
                                  "worst": max(r["largest_bound"] for r in rs)}}
            for g, rs in sorted(groups.items())}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", required=True, help="the --save_models folder of benchmarks/forgetting_frontier.py")
    p.add_argument("--old_model", required=True, help="the old model's folder (the base of every claim)")
    p.add_argument("--claim", default="percent_forgotten <= 3",
                   help="the claim, as hf-constrained certify takes it (the same for every run)")
    p.add_argument("--delta", type=float, default=0.05)
    p.add_argument("--frontier_json", default=None,
                   help="the benchmark's result file of the same runs: compare each verdict and bound with it")
    p.add_argument("--ledger", choices=["per_run", "shared"], default="per_run",
                   help="per_run: each run certified as the one release of the user who trained it (a ledger of its "
                        "own, the first look); shared: one user certifies every run on the same rows (the user-level "
                        "ledger, a look per model)")
    p.add_argument("--json", default=None, help="write the per-run certificates and the summary here")
    args = p.parse_args(argv)
    rows_dir = os.path.join(args.runs, "certification_rows")
    if not os.path.isdir(rows_dir):
        raise SystemExit(f"--runs {args.runs}: no certification_rows/ folder (run forgetting_frontier.py with "
                         "--save_models first)")
    rows = {name[:-len(".jsonl")]: os.path.join(rows_dir, name) for name in sorted(os.listdir(rows_dir))
            if name.endswith(".jsonl")}
    names = sorted(os.listdir(os.path.join(args.runs, "runs")))
    if not names:
        raise SystemExit(f"--runs {args.runs}: no saved run under runs/")
    theirs = frontier_certificates(args.frontier_json)
    tolerance = float(args.claim.split("<=")[1]) / 100
    runs = {}
    for name in tqdm(names, desc="hf-constrained certify, one saved run at a time", unit="run"):
        out = os.path.join(args.runs, "certificates", name)
        mine = certify_run(os.path.join(args.runs, "runs", name), args.old_model, rows, args.claim, args.delta, out,
                           os.path.join(out, "user_ledger.json") if args.ledger == "per_run" else None)
        mine["agrees_with_benchmark"] = compare(mine, theirs.get(name), tolerance)
        runs[name] = mine
    checked = [r["agrees_with_benchmark"] for r in runs.values() if r["agrees_with_benchmark"] is not None]
    result = {"command": publishable_command("python benchmarks/certify_saved_runs.py", argv or sys.argv[1:]),
              "certify_command": " ".join(certify_command("RUN", "OLD", {t: "FILE" for t in rows}, args.claim,
                                                          args.delta, "OUT")[3:]),
              "claim": args.claim, "delta": args.delta, "ledger": args.ledger, "sets": sorted(rows),
              "summary": summarize(runs),
              "compared_with_benchmark": None if not checked else {
                  "runs": len(checked), "same_verdict": sum(c["same_verdict"] for c in checked),
                  "largest_bound_difference": max(c["largest_bound_difference"] for c in checked)},
              "runs": runs}
    for group, s in result["summary"].items():
        print(f"{group}: certified {s['seeds_certified']}/{s['seeds']}, largest bound "
              f"{s['largest_bound']['median']:.3f} ({s['largest_bound']['worst']:.3f})")
    if result["compared_with_benchmark"]:
        print("against the benchmark's own certificates:", json.dumps(result["compared_with_benchmark"]))
    if args.json:
        atomic_write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
