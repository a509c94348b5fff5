"""Time per training step of each ROC-fairness method, on one machine, in one process.

    python benchmarks/roc_fairness_step_time.py                 # Adult, MLP 64-32 and 1024-1024
    python benchmarks/roc_fairness_step_time.py --widths 64,32 --steps 60

Methods: the AUC objective alone; a plain PyTorch step over the SAME rows as a hinge step
(the objective batch plus every constraint's batch scored in one forward, one backward of
the AUC loss plus the constraint rows' mean soft rates: the floor a fused constrained step
can approach); the hinge method with all m = 14 constraints per step
(gamma' = 0.1, the paper's setting, which evaluates each sampled constraint batch a second
time at the previous iterate), the same with gamma' = 0 (no second evaluation), the hinge
with |B_c| = 4 sampled constraints per step; the squared hinge; ICPPAC (one backward pass
per constraint per step); when the trainer offers ``share_constraint_batches``, the hinge
with the TPR constraints sharing one batch of positives and the FPR ones one of
negatives. Each is timed over ``--steps`` optimizer steps after ``--warmup``
untimed ones (median of the per-step times; the fastest of ``--repeats`` interleaved
rounds, since a shared machine is noisy). Writes
benchmarks/results/roc_fairness_step_time.json and prints a Markdown table.
"""

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
from transformers import TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times, self._t = [], None

    def on_step_begin(self, args, state, control, **kw):
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self._t)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dataset", default="adult")
    p.add_argument("--widths", default="64,32;1024,1024", help="';'-separated hidden sizes")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2,
                   help="rounds over all methods; the fastest round's median is kept (a shared machine is noisy)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "roc_fairness_step_time.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from hf_constrained import ConstrainedTrainingArguments
    from hf_constrained.batches import collate_examples
    from hf_constrained.fairness import (
        AUCConstrainedTrainer,
        MLPConfig,
        MLPForScoring,
        collate_pairs,
        objective_pairs,
        pairwise_auc_loss,
        roc_fairness_constraints,
    )
    from hf_constrained.fairness.experiment import ROCFairnessArguments, load_splits
    from hf_constrained.fairness.icppac import ICPPACConfig, ICPPACTrainer
    from hf_constrained.fairness.model import model_scores
    from hf_constrained.method.sampling import ConstraintBatchStream

    splits = load_splits(ROCFairnessArguments(dataset=args.dataset))
    train = splits["train"]
    cons = roc_fairness_constraints(train)
    objective = objective_pairs(train)
    n_steps = args.steps + args.warmup
    methods = [("none", dict(constraint_penalty="none")),
               ("hinge, |B_c|=m=14, gamma'=0.1", dict(constraint_penalty="hinge", penalty_beta=20.0)),
               ("hinge, |B_c|=m=14, gamma'=0", dict(constraint_penalty="hinge", penalty_beta=20.0,
                                                    msvr_gamma_prime=0.0)),
               ("hinge, |B_c|=4, gamma'=0.1", dict(constraint_penalty="hinge", penalty_beta=20.0,
                                                   constraints_per_step=4)),
               ("squared hinge, |B_c|=m", dict(constraint_penalty="squared_hinge", penalty_beta=800.0)),
               ("icppac", None), ("plain step, same rows as hinge |B_c|=m", "plain")]
    if "share_constraint_batches" in getattr(ConstrainedTrainingArguments, "__dataclass_fields__", {}):
        methods.append(("hinge, |B_c|=m=14, gamma'=0.1, shared batches",
                        dict(constraint_penalty="hinge", penalty_beta=20.0, share_constraint_batches=True)))
    best: dict = {}
    for rnd, widths in [(r, w) for r in range(args.repeats) for w in args.widths.split(";")]:
        hidden = [int(w) for w in widths.split(",")]
        for name, kw in methods:
            torch.manual_seed(0)
            model = MLPForScoring(MLPConfig(input_dim=train.features.shape[1], hidden_sizes=hidden))
            if kw == "plain":  # the objective batch + 14 constraint batches, one forward, one backward
                loader = torch.utils.data.DataLoader(objective, batch_size=64, shuffle=True, collate_fn=collate_pairs)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
                streams = [ConstraintBatchStream(len(c.dataset), 0, k) for k, c in enumerate(cons)]
                times = []
                for i, batch in enumerate(loader):
                    if i == n_steps:
                        break
                    t = time.perf_counter()
                    rows = [(c.collate_fn or collate_examples)([c.dataset[j] for j in streams[k].next_indices(64)])
                            for k, c in enumerate(cons)]
                    n_obj = 2 * batch["inputs_a"].shape[0]
                    scores = model_scores(model, torch.cat([batch["inputs_a"], batch["inputs_b"]]
                                                           + [r["inputs"] for r in rows]))
                    s_pos, s_neg = scores[:n_obj // 2], scores[n_obj // 2:n_obj]
                    loss = 1.0 - torch.sigmoid(s_pos[:, None] - s_neg[None, :]).mean() \
                        + torch.sigmoid(scores[n_obj:]).mean()
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    times.append(time.perf_counter() - t)
            elif kw is None:
                loader = torch.utils.data.DataLoader(objective, batch_size=64, shuffle=True, collate_fn=collate_pairs)
                tr = ICPPACTrainer(model, pairwise_auc_loss, loader, cons, ICPPACConfig(eta=0.1, tau=10, mu=1e-3),
                                   constraint_batch_size=64)
                times = []
                for i, batch in enumerate(loader):
                    if i == n_steps:
                        break
                    t = time.perf_counter()
                    tr._iteration(batch, torch.cat([q.detach().reshape(-1) for q in tr.params]))
                    times.append(time.perf_counter() - t)
            else:
                with tempfile.TemporaryDirectory() as tmp:
                    targs = ConstrainedTrainingArguments(
                        output_dir=tmp, max_steps=n_steps, per_device_train_batch_size=64, constraint_batch_size=64,
                        learning_rate=1e-3, logging_strategy="no", save_strategy="no", report_to="none",
                        disable_tqdm=True, use_cpu=True, remove_unused_columns=False, msvr_gamma=0.1, **kw)
                    timer = StepTimer()
                    AUCConstrainedTrainer(model=model, args=targs, constraints=cons, train_dataset=objective,
                                          data_collator=collate_pairs, callbacks=[timer]).train()
                    times = timer.times
            ms = 1000 * statistics.median(times[args.warmup:])
            key = (widths, name)
            if key not in best or ms < best[key]["ms_per_step"]:
                best[key] = {"hidden_sizes": hidden, "method": name, "ms_per_step": ms,
                             "num_parameters": sum(q.numel() for q in model.parameters())}
            print(f"round {rnd} {widths:>10} {name:32s} {ms:8.1f} ms/step", flush=True)
    rows = list(best.values())
    payload = {"dataset": args.dataset, "batch_rows": 128, "constraint_batch_rows": 128, "rows": rows,
               "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
               "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), {args.threads} torch thread(s)",
               "command": "python benchmarks/roc_fairness_step_time.py "
                          + " ".join(sys.argv[1:] if argv is None else argv)}
    write_json(args.out, payload, echo=False)
    print("| MLP | method | ms / step |\n|---|---|---|")
    for r in rows:
        method = r["method"].replace("|", "\\|")  # a literal pipe would split the Markdown cell
        print(f"| {'-'.join(map(str, r['hidden_sizes']))} ({r['num_parameters']:,} params) | {method} | "
              f"{r['ms_per_step']:.1f} |")


if __name__ == "__main__":
    main()
