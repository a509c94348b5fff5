"""MSVR (gamma' > 0) against a plain moving average (gamma' = 0) on a noisy convex problem.

min ||x - a||^2 s.t. Ax <= b (24 rows, KKT point by scipy), noisy objective gradients and
noisy constraint values, 6 of 24 constraints sampled per step, hinge penalty at 4x the
exact-penalty threshold. Reports, over seeds, the final largest violation and the distance
to x* for each gamma'.

    python benchmarks/stochastic_convex.py --seeds 5 --out benchmarks/results/stochastic_convex.json
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_json  # noqa: E402
from toy_problems import make_projection_qp, train_projection  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--gamma-primes", default="0.1,0,theory")
    parser.add_argument("--beta-factor", type=float, default=4.0)
    parser.add_argument("--out", default="benchmarks/results/stochastic_convex.json")
    opts = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    qp = make_projection_qp()
    beta = opts.beta_factor * qp.exact_penalty_threshold
    rows = []
    for gp in opts.gamma_primes.split(","):
        gp_value = gp if gp == "theory" else float(gp)
        viol, dist = [], []
        for seed in range(opts.seeds):
            x = train_projection(qp, "hinge", beta, noisy=True, per_step=6, gamma_prime=gp_value,
                                 steps=opts.steps, seed=seed)
            viol.append(qp.max_violation(x))
            dist.append(float(np.linalg.norm(x - qp.x_star)))
        rows.append({"gamma_prime": gp, "max_violation_mean": float(np.mean(viol)),
                     "max_violation_worst": float(np.max(viol)), "feasible_runs": int(sum(v <= 0 for v in viol)),
                     "distance_mean": float(np.mean(dist)), "seeds": opts.seeds})
        print(f"gamma'={gp:>6}: max violation mean {np.mean(viol):+.4f} worst {np.max(viol):+.4f} "
              f"feasible {sum(v <= 0 for v in viol)}/{opts.seeds}; |x - x*| mean {np.mean(dist):.4f}", flush=True)
    result = {"beta": beta, "threshold": qp.exact_penalty_threshold, "steps": opts.steps, "rows": rows,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "date": time.strftime("%Y-%m-%d")}
    write_json(opts.out, result, echo=False)


if __name__ == "__main__":
    main()
