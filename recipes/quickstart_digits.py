"""Quick start: the smallest real constrained training the core supports.

A classifier of scikit-learn's handwritten digits is trained on data where digits 7-9
are rare, so plain training neglects them. One constraint per digit asks that the
digit's cross-entropy stay below a bound (``h_k(w) = CE_k(w) <= bound``, the bound
being the constraint's tolerance).
The script trains with the hinge exact penalty, the squared hinge at the same beta
and no penalty, and prints each constraint's exact value on unseen test data.

Each run ends with a certificate. A per-image cross-entropy is unbounded, so no finite-sample
bound holds for the constrained quantity itself; the certificate bounds a proxy users check
instead: each digit's error rate (0/1 per image, exact Clopper-Pearson bound at ``--delta``).
Each digit's unseen images (its share of the 400 test images and, for the rare digits 7-9,
their training images left out) are split, seeded by the seed, into test images and
certification images (``--certify_fraction``, default 0.5), which only the certificate reads.
A run is CERTIFIED when every digit's bound is at most ``--error_tolerance``: with probability
at least 1 - delta, every digit's error rate is at most that. The default, 0.5, is what the
data supports: digits 0-6 get about 20 certification images each, over which a rate has a
bound of at least 1 - 0.05^(1/20) = 0.14 even with no error (3 errors of 20: 0.34); on seeds
0-4 the hinge's largest bound was 0.33-0.44 and the unconstrained run's 0.52-1.00.

    python recipes/quickstart_digits.py                                   # all three methods
    python recipes/quickstart_digits.py --compare false --constraint_penalty hinge --penalty_beta 10
    python recipes/quickstart_digits.py --config my_settings.yaml         # any flag below, as YAML

Every field of ``ConstrainedTrainingArguments`` is a flag (``--penalty_beta``,
``--msvr_gamma``, ``--learning_rate``, ...); the recipe's own flags are ``--bound``,
``--compare``, ``--seeds``, ``--certify_fraction``, ``--error_tolerance`` and ``--delta``.
``--constraint_penalty`` needs ``--compare false`` and ``--seed`` no ``--seeds`` (otherwise they are errors, as they would not be used). Each run
writes to its own folder under ``--output_dir``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
from datasets import Dataset
from sklearn.datasets import load_digits
from torch import nn
from transformers import PrinterCallback

from hf_constrained import CertifyStatistic, ConstrainedTrainer, ConstrainedTrainingArguments, constraints_per_value
from hf_constrained.recipe_args import parse_recipe_args
from hf_constrained.safety.evaluation import certify_models

# the recipe's defaults for the training arguments (each can be overridden by a flag or --config)
TRAINING_DEFAULTS = dict(
    output_dir="runs/quickstart_digits", num_train_epochs=20, per_device_train_batch_size=32, learning_rate=3e-3,
    penalty_beta=20.0, constraint_batch_size=16, constraints_per_step=5, logging_steps=50, save_strategy="no",
    report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
    max_grad_norm=0.0, lr_scheduler_type="constant",  # the exact penalty's gradient must not be clipped or decayed away
)


@dataclass
class QuickstartArguments:
    bound: float = field(default=0.4, metadata={"help": "per-digit cross-entropy bound (each constraint's tolerance)"})
    compare: bool = field(default=True, metadata={"help": "train with hinge, squared_hinge and none; false: only "
                                                          "--constraint_penalty"})
    seeds: str = field(default="", metadata={"help": "comma-separated seeds (e.g. 0,1,2,3,4): a summary over seeds "
                                                     "instead of one run's table (default: --seed only)"})
    certify_fraction: float = field(default=0.5, metadata={
        "help": "share of each digit's unseen images set aside (seeded) as its certification split, read only by "
                "the certificate (0: none, the runs are NOT CERTIFIED)"})
    error_tolerance: float = field(default=0.5, metadata={
        "help": "certified: every digit's error rate (share of its images misclassified) is at most this"})
    delta: float = field(default=0.05, metadata={"help": "the certificate's error level"})


class DigitClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor | None = None, **_) -> dict:
        logits = self.net(pixels)
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


def per_image_cross_entropy(model: nn.Module, batch: dict) -> torch.Tensor:
    """Per-row values of h_k: each image's cross-entropy (h_k(w; B_k) is their mean over a batch
    of one digit). One function for all ten constraints: each step scores all sampled digits'
    rows in one forward."""
    logits = model(batch["pixels"])["logits"]
    return nn.functional.cross_entropy(logits, batch["labels"], reduction="none")


def make_parts(seed: int = 0, certify_fraction: float = 0.0) -> tuple[Dataset, Dataset, Dataset, Optional[Dataset]]:
    """(training rows, constraint rows, test rows, certification rows or ``None``), disjoint, drawn by ``seed``.

    The unseen rows are the 400 test images and, with ``certify_fraction`` > 0, also the training images of
    digits 7-9 left out to make them rare; ``certify_fraction`` of each digit's unseen rows (seeded) become its
    certification rows, read only by the certificate, and the rest its test rows."""
    if not 0.0 <= certify_fraction < 1.0:
        raise ValueError(f"--certify_fraction must be in [0, 1), got {certify_fraction}")
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    test, constraint, train = order[:400], order[400:900], order[900:]
    rare = np.isin(y[train], [7, 8, 9])
    keep = ~rare | (rng.random(len(train)) < 0.08)  # digits 7-9: 8% of their training rows
    train, left_out = train[keep], train[~keep]
    make = lambda idx: Dataset.from_dict({"pixels": x[idx].tolist(), "labels": y[idx].tolist()})  # noqa: E731
    if certify_fraction <= 0:
        return make(train), make(constraint), make(test), None
    unseen = np.concatenate([test, left_out])
    split_rng = np.random.default_rng([seed, 1])  # its own stream: the other parts do not depend on the fraction
    certify, kept = [], []
    for digit in range(10):
        rows = split_rng.permutation(unseen[y[unseen] == digit])
        n = int(round(certify_fraction * len(rows)))
        if n < 1 or n >= len(rows):
            raise ValueError(f"--certify_fraction {certify_fraction}: digit {digit} has {len(rows)} unseen rows, "
                             f"{n} would certify; each digit needs both test and certification rows")
        certify.append(rows[:n])
        kept.append(rows[n:])
    return make(train), make(constraint), make(np.sort(np.concatenate(kept))), make(np.sort(np.concatenate(certify)))


def make_splits(seed: int = 0) -> tuple[Dataset, Dataset, Dataset]:
    """(training rows, constraint rows, test rows), without a certification split."""
    train, constraint, test, _ = make_parts(seed)
    return train, constraint, test


def digit_error(model: nn.Module, batch: dict) -> torch.Tensor:
    """Per image: 1 when the classifier gets it wrong, else 0 (the certified statistic: a digit's error rate)."""
    return (model(batch["pixels"])["logits"].argmax(-1) != batch["labels"]).double()


@torch.no_grad()
def test_accuracy(model: nn.Module, rows: Dataset) -> float:
    """The share of ``rows`` the classifier gets right: the objective's measure on unseen images
    (the constraints bound each digit's cross-entropy; this is what a user of the classifier sees)."""
    model.eval()
    pixels = torch.tensor(rows["pixels"], dtype=torch.float32, device=next(model.parameters()).device)
    predicted = model(pixels)["logits"].argmax(-1).cpu()
    return float((predicted == torch.tensor(rows["labels"])).double().mean())


def run(args: ConstrainedTrainingArguments, bound: float, opts: Optional[QuickstartArguments] = None
        ) -> dict[str, Any]:
    """Train one method; the held-out metrics, the constraints' values on their training rows and, with a
    certification split (``opts.certify_fraction`` > 0), the certificate of each digit's error rate."""
    opts = opts or QuickstartArguments(certify_fraction=0.0)
    train, constraint_data, test, certify_rows = make_parts(args.seed, opts.certify_fraction)
    statistic = None if certify_rows is None else CertifyStatistic(
        digit_error, tolerance=opts.error_tolerance, value_range=(0.0, 1.0), bound="clopper_pearson",
        description="the digit's error rate")
    constraints = constraints_per_value(constraint_data, "labels", row_fn=per_image_cross_entropy,
                                        name="digit{value}", tolerance=bound, eval_dataset=test,
                                        certify_statistic=statistic)
    if certify_rows is not None:
        labels = np.asarray(certify_rows["labels"])
        for c in constraints:
            c.certify_dataset = certify_rows.select(np.flatnonzero(labels == c.metadata["value"]))
    torch.manual_seed(args.seed)
    trainer = ConstrainedTrainer(model=DigitClassifier(), args=args, train_dataset=train, constraints=constraints)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    metrics: dict[str, Any] = dict(trainer.evaluate())
    metrics["test_accuracy"] = test_accuracy(trainer.model, test)
    on_constraint_data = trainer.evaluate_constraints(split="train")
    metrics.update({f"train_constraint/{name}": value for name, value in on_constraint_data.items()})
    certificate = certify_models(trainer, delta=opts.delta)
    metrics["certificate"] = None if certificate is None else {
        "certified": certificate.is_certified(0), "error_rate": certificate.values[0],
        "upper_bound": certificate.upper_bounds[0], "rows": certificate.num_rows}
    return metrics


def certificate_line(cert: Optional[dict[str, Any]], opts: QuickstartArguments) -> str:
    """CERTIFIED / NOT CERTIFIED, with the largest bound and the digit it belongs to."""
    if cert is None:
        return "NOT CERTIFIED (no certification split: --certify_fraction 0)"
    worst = max(cert["upper_bound"], key=cert["upper_bound"].get)
    return (f"{'CERTIFIED' if cert['certified'] else 'NOT CERTIFIED'}: largest bound {cert['upper_bound'][worst]:.3f} "
            f"({worst}) vs error tolerance {opts.error_tolerance:g} at delta {opts.delta:g}")


def check_recipe_flags(opts: QuickstartArguments, args: ConstrainedTrainingArguments) -> None:
    """Flags this recipe cannot honour are errors, never silently replaced: ``--compare true``
    trains all three methods (so ``--constraint_penalty`` must stay at its default), and
    ``--seeds`` gives the seeds (so ``--seed`` must stay at its default)."""
    if opts.compare and args.constraint_penalty != "hinge":
        raise ValueError(f"--constraint_penalty {args.constraint_penalty} is not used with --compare true (it trains "
                         "hinge, squared_hinge and none): pass --compare false to train one method")
    if opts.seeds and args.seed != TRAINING_DEFAULTS["seed"]:
        raise ValueError(f"--seed {args.seed} is not used with --seeds {opts.seeds}: put every seed in --seeds")
    if opts.seeds and not all(s.strip().lstrip("-").isdigit() for s in opts.seeds.split(",")):
        raise ValueError(f"--seeds {opts.seeds!r}: expected comma-separated integers, e.g. 0,1,2")
    if not 0.0 <= opts.certify_fraction < 1.0:
        raise ValueError(f"--certify_fraction must be in [0, 1), got {opts.certify_fraction}")
    if not 0.0 <= opts.error_tolerance <= 1.0:
        raise ValueError(f"--error_tolerance is an error rate, in [0, 1]; got {opts.error_tolerance}")
    if not 0.0 < opts.delta < 1.0:
        raise ValueError(f"--delta must be in (0, 1), got {opts.delta}")


def main(argv: list[str] | None = None) -> None:
    opts, args = parse_recipe_args([QuickstartArguments, ConstrainedTrainingArguments], argv, description=__doc__,
                                   defaults=TRAINING_DEFAULTS)
    check_recipe_flags(opts, args)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)  # a tiny model: threads only add overhead
    penalties = ["hinge", "squared_hinge", "none"] if opts.compare else [args.constraint_penalty]
    if opts.seeds:
        summarize_seeds(args, opts, penalties, [int(s) for s in opts.seeds.split(",")])
        return
    results = {}
    for p in penalties:  # one run per method, each in its own folder under --output_dir
        results[p] = run(dataclasses.replace(args, constraint_penalty=p, output_dir=os.path.join(args.output_dir, p)),
                         opts.bound, opts)
    beta = args.penalty_beta
    print(f"\nCross-entropy per digit, constraint: <= {opts.bound}, beta = {beta}; "
          "each cell: constraint data (what training sees) / unseen test data; * = violated")
    print(f"{'digit':>6} " + " ".join(f"{p:>18}" for p in penalties))
    for d in range(10):
        cells = []
        for p in penalties:
            tr, te = results[p][f"train_constraint/digit{d}"], results[p][f"eval_constraint/digit{d}"]
            cells.append(f"{tr:6.3f}{'*' if tr > opts.bound else ' '} / {te:6.3f}{'*' if te > opts.bound else ' '}")
        print(f"{d:>6} " + " ".join(f"{c:>18}" for c in cells))
    for label, key in (("test max violation", "eval_constraint_max_violation"),):
        print(f"{label:>18} " + " ".join(f"{results[p][key]:>+10.3f}" for p in penalties))
    train_ok = [all(results[p][f"train_constraint/digit{d}"] <= opts.bound for d in range(10)) for p in penalties]
    print(f"{'all hold (train)':>18} " + " ".join(f"{str(ok):>10}" for ok in train_ok))
    print(f"{'all hold (test)':>18} " + " ".join(f"{str(bool(results[p]['eval_constraints_satisfied'])):>10}"
                                                for p in penalties))
    print("\nCertificate (each digit's error rate on its certification images, Clopper-Pearson upper bound):")
    for p in penalties:
        print(f"{p:>14}: {certificate_line(results[p]['certificate'], opts)}")


def summarize_seeds(args: ConstrainedTrainingArguments, opts: QuickstartArguments, penalties: list[str],
                    seeds: list[int]) -> None:
    """Per method over seeds: how many runs hold every constraint (constraint data / test data), and the
    median and worst largest test violation."""
    rows = {p: [] for p in penalties}
    for seed in seeds:
        for p in penalties:
            m = run(dataclasses.replace(args, constraint_penalty=p, seed=seed,
                                        output_dir=os.path.join(args.output_dir, f"{p}_seed{seed}")), opts.bound, opts)
            train_ok = all(m[f"train_constraint/digit{d}"] <= opts.bound for d in range(10))
            cert = m["certificate"]
            rows[p].append((train_ok, bool(m["eval_constraints_satisfied"]), m["eval_constraint_max_violation"],
                            bool(cert and cert["certified"]), max(cert["upper_bound"].values()) if cert else None))
            print(f"seed {seed} {p:>14}: hold on constraint data {train_ok}, on test {rows[p][-1][1]}, "
                  f"test max violation {m['eval_constraint_max_violation']:+.3f}, test accuracy "
                  f"{m['test_accuracy']:.3f}; {certificate_line(cert, opts)}", flush=True)
    print(f"\nseeds {seeds}, bound {opts.bound}, beta {args.penalty_beta}, certified error tolerance "
          f"{opts.error_tolerance:g} (delta {opts.delta:g})")
    print(f"{'method':>14} {'hold (constraint data)':>23} {'hold (test)':>12} {'test max viol. median':>22} "
          f"{'worst':>7} {'certified':>10} {'largest bound median':>21} {'worst':>7}")
    for p in penalties:
        viol = sorted(r[2] for r in rows[p])
        bounds = sorted(r[4] for r in rows[p] if r[4] is not None)
        cert_cells = (f"{sum(r[3] for r in rows[p]):>8}/{len(seeds)} {float(np.median(bounds)):>21.3f} "
                      f"{bounds[-1]:>7.3f}" if bounds else f"{'-':>10} {'-':>21} {'-':>7}")
        print(f"{p:>14} {sum(r[0] for r in rows[p]):>19}/{len(seeds)} {sum(r[1] for r in rows[p]):>9}/{len(seeds)} "
              f"{float(np.median(viol)):>+22.3f} {viol[-1]:>+7.3f} {cert_cells}")


if __name__ == "__main__":
    main()
