"""Mini-batch noise and bias of the ROC-fairness constraint estimates at a trained model.

    python benchmarks/roc_fairness_noise.py                      # COMPAS, hinge beta 40, 10 epochs
    python benchmarks/roc_fairness_noise.py --dataset adult --epochs 3 --beta 4

Trains one model with the recipe's defaults (seed 0), then, for every constraint, draws
``--batches`` constraint batches of ``--pairs`` pairs (rows per group) exactly as training
does and reports: the exact signed gap (all rows), the mean of the batch gaps and its
standard error (the sampling is unbiased when they agree), the batch gaps' standard
deviation and its ratio to kappa, and the standard deviation of an MSVR-style moving
average with weight gamma (sd * sqrt(gamma / (2 - gamma)), for gamma = 0.8 and 0.1).
Writes benchmarks/results/roc_fairness_noise_<dataset>_beta<beta>.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="compas")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--beta", type=float, default=40.0)
    p.add_argument("--pairs", type=int, default=64, help="pairs per constraint batch = rows per group")
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from hf_constrained import ConstrainedTrainingArguments
    from hf_constrained.fairness.experiment import ROCFairnessArguments, load_splits, run_roc_fairness
    from hf_constrained.fairness.roc import roc_fairness_constraints, score_rows
    from hf_constrained.method.sampling import ConstraintBatchStream

    script = ROCFairnessArguments(dataset=args.dataset, method="hinge", save_model=True)
    splits = load_splits(script)
    with tempfile.TemporaryDirectory() as tmp:
        targs = ConstrainedTrainingArguments(
            output_dir=tmp, seed=args.seed, num_train_epochs=args.epochs, per_device_train_batch_size=64,
            constraint_batch_size=args.pairs, learning_rate=1e-3, weight_decay=0.0, penalty_beta=args.beta,
            msvr_gamma=0.1, logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True,
            use_cpu=True)
        result = run_roc_fairness(script, targs, splits=splits)
        from hf_constrained.fairness.model import MLPForScoring

        model = MLPForScoring.from_pretrained(tmp)
    train = splits["train"]
    scores = score_rows(model, train).astype(np.float64)
    rows = []
    for k, c in enumerate(roc_fairness_constraints(train, thresholds=script.threshold_list, kappa=script.kappa,
                                                   seed=args.seed)):
        rate = 1.0 / (1.0 + np.exp(-(scores - c.metadata["threshold"])))
        data = c.dataset
        exact = rate[data.rows_a].mean() - rate[data.rows_b].mean()
        stream = ConstraintBatchStream(len(data), args.seed, k)
        gaps = np.empty(args.batches)
        for b in range(args.batches):  # the rows a training batch would hold, scored without the model call
            r, g = data.rows(stream.next_indices(args.pairs))
            gaps[b] = rate[r][g == 0].mean() - rate[r][g == 1].mean()
        sd = float(gaps.std(ddof=1))
        rows.append({"constraint": c.name, "exact_gap": float(exact), "mean_batch_gap": float(gaps.mean()),
                     "standard_error": sd / math.sqrt(args.batches), "batch_gap_sd": sd,
                     "sd_over_kappa": sd / script.kappa,
                     "ema_sd_gamma_0.8": sd * math.sqrt(0.8 / 1.2), "ema_sd_gamma_0.1": sd * math.sqrt(0.1 / 1.9)})
    payload = {"dataset": args.dataset, "epochs": args.epochs, "beta": args.beta, "seed": args.seed,
               "pairs_per_batch": args.pairs, "batches": args.batches, "kappa": script.kappa,
               "model_test_auc": result["test_auc"], "model_train_max_violation": result["train_max_violation"],
               "rows": rows,
               "command": "python benchmarks/roc_fairness_noise.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    out = args.out or os.path.join(HERE, "results", f"roc_fairness_noise_{args.dataset}_beta{args.beta:g}.json")
    write_json(out, payload, echo=False)
    print(f"{args.dataset}, hinge beta {args.beta:g}, {args.epochs} epochs, seed {args.seed}; {args.batches} batches "
          f"of {args.pairs} pairs; kappa {script.kappa}")
    print("| constraint | exact gap | mean batch gap (s.e.) | batch sd | sd / kappa | sd of average, gamma 0.8 | "
          "gamma 0.1 |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['constraint']} | {r['exact_gap']:+.4f} | {r['mean_batch_gap']:+.4f} ({r['standard_error']:.4f}) | "
              f"{r['batch_gap_sd']:.4f} | {r['sd_over_kappa']:.1f} | {r['ema_sd_gamma_0.8']:.4f} | "
              f"{r['ema_sd_gamma_0.1']:.4f} |")
    return payload


if __name__ == "__main__":
    main()
