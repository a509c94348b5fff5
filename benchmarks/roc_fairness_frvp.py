"""FRVP diagnostic on Adult (paper Appendix, Table tab:min_singular_values).

    python benchmarks/roc_fairness_frvp.py            # hinge, beta 20, 30 epochs, seed 0

Trains the hinge method on Adult and, at the initial model, two intermediate epochs and
the final model, computes sigma: the smallest singular value of the Jacobian of the
violated ROC constraints on the full training data (and of all 14 constraints), via the
m x m Gram matrix. Writes benchmarks/results/roc_fairness_frvp.json and prints a
Markdown table.
"""

import argparse
import copy
import os
import platform
import sys
import tempfile
import time

import torch
from transformers import TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


class Snapshots(TrainerCallback):
    def __init__(self, epochs):
        self.epochs = set(epochs)
        self.states = {}

    def on_train_begin(self, args, state, control, model=None, **kw):
        if 0 in self.epochs:
            self.states[0] = copy.deepcopy(model.state_dict())

    def on_epoch_end(self, args, state, control, model=None, **kw):
        ep = int(round(state.epoch))
        if ep in self.epochs:
            self.states[ep] = copy.deepcopy(model.state_dict())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dataset", default="adult")
    p.add_argument("--beta", type=float, default=20.0)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--at", default=None, help="epochs to inspect (default: 0, 1, E/3, 2E/3, E)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "roc_fairness_frvp.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from hf_constrained import ConstrainedTrainingArguments
    from hf_constrained.fairness.experiment import ROCFairnessArguments, load_splits, run_roc_fairness
    from hf_constrained.fairness.frvp import frvp_report
    from hf_constrained.fairness.model import MLPConfig, MLPForScoring
    from hf_constrained.fairness.roc import roc_fairness_constraints

    at = [int(x) for x in args.at.split(",")] if args.at else sorted({0, 1, args.epochs // 3, 2 * args.epochs // 3,
                                                                       args.epochs})
    script = ROCFairnessArguments(dataset=args.dataset, method="hinge", save_model=False)
    splits = load_splits(script)
    snaps = Snapshots(at)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        targs = ConstrainedTrainingArguments(
            output_dir=tmp, seed=args.seed, num_train_epochs=args.epochs, per_device_train_batch_size=64,
            constraint_batch_size=64, learning_rate=1e-3, weight_decay=0.0, penalty_beta=args.beta,
            logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True)
        result = run_roc_fairness(script, targs, splits=splits, callbacks=[snaps])
    constraints = roc_fairness_constraints(splits["train"], thresholds=script.threshold_list, kappa=script.kappa)
    model = MLPForScoring(MLPConfig(input_dim=splits["train"].features.shape[1], hidden_sizes=script.hidden_list))
    rows = []
    for ep in sorted(snaps.states):
        model.load_state_dict(snaps.states[ep])
        rep = frvp_report(model, constraints)
        rows.append({"epoch": ep, **rep})
    payload = {"dataset": args.dataset, "method": "hinge", "beta": args.beta, "epochs": args.epochs,
               "seed": args.seed, "final_test_auc": result["test_auc"], "rows": rows,
               "machine": f"{platform.machine()}, {os.cpu_count()} cores, 1 torch thread",
               "seconds": time.time() - t0,
               "command": "python benchmarks/roc_fairness_frvp.py " + " ".join(argv or [])}
    write_json(args.out, payload, echo=False)
    print("| epoch | violated constraints | max violation | sigma (violated) | delta = sigma/m | sigma (all 14) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        sv = "n/a (none violated)" if r["sigma_violated"] is None else f"{r['sigma_violated']:.3g}"
        dl = "n/a" if r["delta"] is None else f"{r['delta']:.3g}"
        print(f"| {r['epoch']} | {len(r['violated'])} | {r['max_violation']:+.4f} | {sv} | {dl} | "
              f"{r['sigma_all']:.3g} |")


if __name__ == "__main__":
    main()
