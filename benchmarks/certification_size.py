"""How many certification rows per old task a claim "at most ``eps`` of each old task's examples forgotten" needs.

The LLM example's certificate bounds, per old task, the share of certification rows the old model answered
exactly and the new one no longer does, with Clopper-Pearson at ``delta`` (each task at ``delta``: the claim
holds for every task at once, an intersection-union test, REFERENCE section 8). Forgotten rows are at least
the points of accuracy lost (a row can only add a point back if it was wrong before), so the claim "at most 3%
forgotten" also certifies "at most 3 points lost". For each ``n``: the most forgotten rows that still certify,
and the probability that all ``--tasks`` tasks certify when each truly forgets a share ``p`` (binomial).

    python benchmarks/certification_size.py --json benchmarks/results/certification_size_llm_example.json

The rule, stated before any data: the smallest ``n`` on the grid with which a model that truly forgets half
the tolerance on every task certifies with probability at least ``--power`` (0.99: a model that
forgets 1.5% should almost never read NOT CERTIFIED).

The other way round, for a split whose size is fixed (``--rows N``, the smallest task's certification rows):
the tightest claim on the grid 0.05, 0.10, ..., 0.50 that a model truly forgetting ``--rate`` of every task
certifies on all ``--tasks`` tasks with probability at least ``--power``:

    python benchmarks/certification_size.py --rows 60 --tasks 8 --rate 0.02
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

from scipy.stats import binom

from hf_constrained.atomic_files import atomic_write_json
from hf_constrained.certification.bounds import clopper_pearson_upper_bound, most_forgotten_that_certify
from hf_constrained.publishable import publishable_command


def all_certify(most: int, n: int, rate: float, tasks: int) -> float:
    """P(all ``tasks`` tasks certify) when each truly forgets ``rate`` of its ``n`` rows and certifies with at most
    ``most`` forgotten (binomial; 0 when no count certifies, ``most`` -1)."""
    return float(binom.cdf(most, n, rate) ** tasks) if most >= 0 else 0.0


def sizing(eps: float, delta: float, tasks: int, grid: list[int], rates: list[float]) -> list[dict[str, Any]]:
    rows = []
    for n in grid:
        x = most_forgotten_that_certify(n, eps, delta)
        rows.append({"n": n, "most_forgotten_rows": x,
                     "probability_all_tasks_certify": {f"{p:g}": all_certify(x, n, p, tasks) for p in rates}})
    return rows


def tightest_claim(rows: int, rate: float, delta: float, tasks: int, power: float,
                   grid: list[float]) -> tuple[Optional[float], list[dict[str, Any]]]:
    """The smallest claim ``eps`` on ``grid`` that ``rows`` certification rows per task support: all ``tasks``
    tasks certify with probability >= ``power`` when each truly forgets ``rate`` (binomial), and the table."""
    table = []
    for eps in sorted(grid):
        x = most_forgotten_that_certify(rows, eps, delta)
        table.append({"eps": eps, "most_forgotten_rows": x,
                      "probability_all_tasks_certify": all_certify(x, rows, rate, tasks)})
    return next((r["eps"] for r in table if r["probability_all_tasks_certify"] >= power), None), table


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--eps", type=float, default=0.03, help="the claim: at most this share forgotten per task")
    p.add_argument("--delta", type=float, default=0.05)
    p.add_argument("--tasks", type=int, default=3, help="old tasks certified at once")
    p.add_argument("--power", type=float, default=0.99,
                   help="required probability that a model forgetting half the tolerance certifies")
    p.add_argument("--rows", type=int, default=None,
                   help="a fixed split of this many rows per task: report the tightest claim it supports instead")
    p.add_argument("--rate", type=float, default=0.02,
                   help="with --rows: the true share forgotten per task at which the claim must certify")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    command = publishable_command("python benchmarks/certification_size.py", sys.argv[1:] if argv is None else argv)
    if args.rows is not None:
        return supported_claim(args, command)
    grid = [100, 200, 300, 500, 1000, 1500, 2000, 3000, 4000]
    rates = [0.0, 0.005, 0.01, args.eps / 2, 0.02, 0.025]
    table = sizing(args.eps, args.delta, args.tasks, grid, rates)
    half = f"{args.eps / 2:g}"
    chosen = next((r["n"] for r in table if r["probability_all_tasks_certify"][half] >= args.power), None)
    result = {"command": command,
              "bound": "Clopper-Pearson, one-sided, per task", "eps": args.eps, "delta": args.delta,
              "tasks": args.tasks, "power": args.power, "rule": f"smallest n with P(all tasks certify) >= "
              f"{args.power:g} at a true {half} forgotten per task", "chosen_n": chosen,
              "n_needed_with_nothing_forgotten": next(n for n in range(1, 100000)
                                                      if clopper_pearson_upper_bound(0, n, args.delta) <= args.eps),
              "table": table}
    for r in table:
        probs = "  ".join(f"p={k}: {v:.3f}" for k, v in r["probability_all_tasks_certify"].items())
        print(f"n={r['n']:5d}  certifies with <= {r['most_forgotten_rows']:4d} forgotten  {probs}")
    print(f"chosen n = {chosen}; with nothing forgotten n >= {result['n_needed_with_nothing_forgotten']}")
    if args.json:
        atomic_write_json(args.json, result)
    return result


def supported_claim(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """``--rows``: the tightest claim a fixed split supports (:func:`tightest_claim`), printed and written."""
    if args.rows < 1 or not 0.0 <= args.rate < 1.0:
        raise SystemExit(f"--rows must be at least 1 and --rate in [0, 1); got {args.rows} and {args.rate}")
    grid = [round(0.05 * k, 2) for k in range(1, 11)]
    claim, table = tightest_claim(args.rows, args.rate, args.delta, args.tasks, args.power, grid)
    result = {"command": command, "bound": "Clopper-Pearson, one-sided, per task", "rows": args.rows,
              "rate": args.rate, "delta": args.delta, "tasks": args.tasks, "power": args.power,
              "rule": f"smallest claim on the grid with P(all tasks certify) >= {args.power:g} at a true "
              f"{args.rate:g} forgotten per task", "tightest_claim": claim, "table": table}
    for r in table:
        print(f"claim {r['eps']:.2f}: certifies with <= {r['most_forgotten_rows']:3d} of {args.rows} forgotten, "
              f"P(all {args.tasks} certify at {args.rate:g}) = {r['probability_all_tasks_certify']:.3f}")
    print(f"tightest claim: {claim if claim is not None else 'none on the grid'}")
    if args.json:
        atomic_write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
