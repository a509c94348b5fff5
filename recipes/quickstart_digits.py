"""Quick start: the smallest real constrained training the core supports.

A classifier of scikit-learn's handwritten digits is trained on data where digits 7-9
are rare, so plain training neglects them. One constraint per digit asks that the
digit's cross-entropy stay below a bound (``h_k(w) = CE_k(w) <= bound``, the bound
being the constraint's tolerance).
The script trains with the hinge exact penalty, the squared hinge at the same beta
and no penalty, and prints each constraint's exact value on its training rows and on unseen
test data, and the test accuracy (the objective's measure).

Each run ends with a certificate. A per-image cross-entropy is unbounded, so no finite-sample
bound holds for the constrained quantity itself; the certificate bounds a proxy users check
instead: each digit's error rate (0/1 per image, exact Clopper-Pearson bound at ``--delta``).
Each digit's unseen images (its share of the 400 test images and, for the rare digits 7-9,
their training images left out) are split, seeded by the seed, into test images and
certification images (``--certify_fraction``, default 0.5), which only the certificate reads.
A run is CERTIFIED when every digit's bound is at most ``--error_tolerance``: with probability
at least 1 - delta, every digit's error rate is at most that. The default, 0.5, is what the
data supports: digits 0-6 get about 20 certification images each, over which a rate has a
bound of at least 1 - 0.05^(1/20) = 0.14 even with no error (3 errors of 20: 0.34).

The defaults (40 epochs, ``--constraint_margin 0.3``, ``--label_smoothing_factor 0.1``) were chosen on
seeds 0-4 so that the bounds hold on each digit's unseen test images, not only on its 50 training rows;
the README reports them on seeds 100-104 and docs/method.md lists every setting tried.

    python recipes/quickstart_digits.py                                   # all three methods
    python recipes/quickstart_digits.py --compare false --constraint_penalty hinge --penalty_beta 10
    python recipes/quickstart_digits.py --config my_settings.yaml         # any flag below, as YAML

Every field of ``ConstrainedTrainingArguments`` is a flag (``--penalty_beta``,
``--msvr_gamma``, ``--learning_rate``, ...); the recipe's own flags are ``--bound``,
``--compare``, ``--seeds``, ``--certify_fraction``, ``--error_tolerance``, ``--delta`` and ``--json``.
``--constraint_penalty`` needs ``--compare false`` and ``--seed`` no ``--seeds`` (otherwise they are errors, as they
would not be used).

Everything a run prints also goes to ``<output_dir>/results.json`` (default ``outputs/quickstart_digits``): the
command, every parsed setting, each digit's cross-entropy on its training and test rows, the test accuracy and the
certificate, per method and seed, with the summary over seeds; ``--json PATH`` writes a copy there too. Each method
(and seed) trains in its own folder under ``--output_dir``, where its certificate is written as ``certificate.json``.
After one seed's table, one line per method says in plain words what holds and, when constraints are violated on
their own training rows, why (e.g. too few epochs).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
from datasets import Dataset
from sklearn.datasets import load_digits
from torch import nn
from transformers import PretrainedConfig, PrinterCallback

from hf_constrained import (
    Certification,
    CertifyStatistic,
    ConstrainedTrainer,
    ConstrainedTrainingArguments,
    constraints_per_value,
)
from hf_constrained.atomic_files import atomic_write_json
from hf_constrained.certification.splits import carve_certification, check_certify_fraction
from hf_constrained.publishable import publishable_command, publishable_values
from hf_constrained.recipe_args import CertificateArguments, RecipeConfigError, given_flags, parse_recipe_args
from hf_constrained.safety.finish import certify_models

# the recipe's defaults for the training arguments (each can be overridden by a flag or --config)
TRAINING_DEFAULTS = dict(
    output_dir="outputs/quickstart_digits", num_train_epochs=40, per_device_train_batch_size=32, learning_rate=3e-3,
    penalty_beta=20.0, constraint_batch_size=16, constraints_per_step=5, logging_steps=50, save_strategy="no",
    report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
    max_grad_norm=0.0, lr_scheduler_type="constant",  # the exact penalty's gradient must not be clipped or decayed away
    # chosen on seeds 0-4 for the bounds to hold on unseen test images (docs/method.md): train each digit's
    # cross-entropy to 0.4 - 0.3 on its 50 rows, and smooth the objective's labels so no image is scored with
    # extreme confidence (one confidently wrong test image among a digit's ~20 costs the bound otherwise)
    constraint_margin=0.3, label_smoothing_factor=0.1,
)
OTHER_MARGINS = ("constraint_confidence", "constraint_certificate_delta")
"""Margin settings exclusive with ``constraint_margin``: a user who gives one replaces the recipe's default margin."""


@dataclass
class QuickstartArguments(CertificateArguments):
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
    json: str = field(default="", metadata={"help": "also write the results JSON here (it always goes to "
                                                    "<output_dir>/results.json)"})


class DigitClassifier(nn.Module):
    """A 64-64-10 MLP on the 8x8 images. Its ``config`` is an empty ``PretrainedConfig``: the Trainer reads
    it (e.g. with ``--label_smoothing_factor``, which smooths the objective's labels, never the constraints')."""

    def __init__(self) -> None:
        super().__init__()
        self.config = PretrainedConfig()
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
    certify_fraction = check_certify_fraction(certify_fraction)
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
    # its own stream ([seed, 1]): the other parts do not depend on the fraction
    kept, certify = carve_certification(unseen, certify_fraction, [seed, 1], labels=y[unseen], classes=range(10),
                                        name="digit", unit="unseen row(s)")
    return make(train), make(constraint), make(np.sort(kept)), make(np.sort(certify))


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
                                        certify=None if statistic is None else Certification(statistic=statistic))
    if certify_rows is not None:
        labels = np.asarray(certify_rows["labels"])
        for c in constraints:  # each digit's own certification rows
            c.certify = dataclasses.replace(
                c.certify, dataset=certify_rows.select(np.flatnonzero(labels == c.metadata["value"])))
    torch.manual_seed(args.seed)
    trainer = ConstrainedTrainer(model=DigitClassifier(), args=args, train_dataset=train, constraints=constraints)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    metrics: dict[str, Any] = dict(trainer.evaluate())
    metrics["test_accuracy"] = test_accuracy(trainer.model, test)
    on_constraint_data = trainer.evaluate_constraints(split="train")
    metrics.update({f"train_constraint/{name}": value for name, value in on_constraint_data.items()})
    certificate = certify_models(trainer, delta=opts.delta)
    if certificate is not None:  # the run's certificate, next to its results
        atomic_write_json(os.path.join(args.output_dir, "certificate.json"), publishable_values(certificate.to_dict()))
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
        raise RecipeConfigError(f"--constraint_penalty {args.constraint_penalty} is not used with --compare true (it "
                                "trains hinge, squared_hinge and none): pass --compare false to train one method")
    if opts.seeds and args.seed != TRAINING_DEFAULTS["seed"]:
        raise RecipeConfigError(f"--seed {args.seed} is not used with --seeds {opts.seeds}: put every seed in "
                                "--seeds")
    if opts.seeds and not all(s.strip().lstrip("-").isdigit() for s in opts.seeds.split(",")):
        raise RecipeConfigError(f"--seeds {opts.seeds!r}: expected comma-separated integers, e.g. 0,1,2")
    try:
        check_certify_fraction(opts.certify_fraction)
    except ValueError as err:
        raise RecipeConfigError(str(err)) from None
    if not 0.0 <= opts.error_tolerance <= 1.0:
        raise RecipeConfigError(f"--error_tolerance is an error rate, in [0, 1]; got {opts.error_tolerance}")


def parse_args(argv: Optional[list[str]] = None) -> tuple[QuickstartArguments, ConstrainedTrainingArguments]:
    """The recipe's settings from ``argv`` (default: the command line) and ``--config``, checked."""
    defaults = dict(TRAINING_DEFAULTS)
    given = given_flags(argv)
    if any(name in given for name in OTHER_MARGINS) and "constraint_margin" not in given:
        del defaults["constraint_margin"]  # the user's margin setting replaces the recipe's default margin
    opts, args = parse_recipe_args([QuickstartArguments, ConstrainedTrainingArguments], argv, description=__doc__,
                                   defaults=defaults)
    check_recipe_flags(opts, args)
    return opts, args


def settings(opts: QuickstartArguments, args: ConstrainedTrainingArguments) -> dict[str, Any]:
    """Every parsed setting, as stored in the results JSON under ``"config"`` (paths made publishable):
    what the stored ``"command"`` parses to."""
    return {"quickstart": publishable_values(dataclasses.asdict(opts), args.output_dir),
            "training": publishable_values(args.to_dict(), args.output_dir)}


def run_summary(m: dict[str, Any], bound: float) -> dict[str, Any]:
    """One run's record for the results JSON: each digit's cross-entropy on its constraint (training)
    rows and on its test rows, whether all hold on each, the largest test violation, the test
    accuracy and the certificate."""
    train = {f"digit{d}": m[f"train_constraint/digit{d}"] for d in range(10)}
    test = {f"digit{d}": m[f"eval_constraint/digit{d}"] for d in range(10)}
    cert = m["certificate"]
    return {"hold_train": all(v <= bound for v in train.values()), "hold_test": all(v <= bound for v in test.values()),
            "test_max_violation": m["eval_constraint_max_violation"], "test_accuracy": m["test_accuracy"],
            "train_constraint": train, "test_constraint": test, "certificate": cert,
            "largest_certified_bound": max(cert["upper_bound"].values()) if cert else None}


def verdict(penalty: str, r: dict[str, Any], bound: float, epochs: float) -> str:
    """One plain sentence per method saying what its table column shows and why: a user who ran too
    few epochs is told so, and the unconstrained run is marked as the baseline it is."""
    over_train = sorted(k for k, v in r["train_constraint"].items() if v > bound)
    over_test = sorted(k for k, v in r["test_constraint"].items() if v > bound)
    if penalty == "none":
        return (f"{penalty}: no penalty, so nothing enforces the bounds ({len(over_test)} of 10 violated on test "
                "images): the baseline the penalties are compared with")
    default_epochs = TRAINING_DEFAULTS["num_train_epochs"]
    if over_train:
        why = (f"too few epochs ({epochs:g}; the recipe's default is {default_epochs}) for the penalty to bring them "
               "down: run longer (--num_train_epochs)" if epochs < default_epochs else
               "the penalty has not brought them down: try a larger --penalty_beta or more --num_train_epochs")
        return f"{penalty}: {len(over_train)} of 10 constraints violated on their own training rows: {why}"
    if over_test:
        verb = "exceeds" if len(over_test) == 1 else "exceed"
        return (f"{penalty}: every constraint holds on its training rows; on unseen test images "
                f"{', '.join(over_test)} {verb} {bound:g} (50 training rows per digit do not pin the test value "
                "down: docs/method.md)")
    return f"{penalty}: every constraint holds on its training rows and on unseen test images"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the recipe; returns the results JSON it writes to ``<output_dir>/results.json`` (and to ``--json``)."""
    opts, args = parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)  # a tiny model: threads only add overhead
    penalties = ["hinge", "squared_hinge", "none"] if opts.compare else [args.constraint_penalty]
    seeds = [int(s) for s in opts.seeds.split(",")] if opts.seeds else [args.seed]
    runs = []
    for seed in seeds:
        for p in penalties:  # one run per method and seed, each in its own folder under --output_dir
            folder = os.path.join(args.output_dir, p if not opts.seeds else f"{p}_seed{seed}")
            m = run(dataclasses.replace(args, constraint_penalty=p, seed=seed, output_dir=folder), opts.bound, opts)
            runs.append({"seed": seed, "method": p, **run_summary(m, opts.bound)})
            if opts.seeds:
                r = runs[-1]
                print(f"seed {seed} {p:>14}: hold on constraint data {r['hold_train']}, on test {r['hold_test']}, "
                      f"test max violation {r['test_max_violation']:+.3f}, test accuracy {r['test_accuracy']:.3f}; "
                      f"{certificate_line(r['certificate'], opts)}", flush=True)
    summary = summarize(runs, penalties)
    result = {"command": publishable_command("python recipes/quickstart_digits.py",
                                             sys.argv[1:] if argv is None else argv),
              "config": settings(opts, args), "seeds": seeds, "summary": summary, "runs": runs}
    if opts.seeds:
        print_summary(summary, seeds, opts, args)
    else:
        print_table({r["method"]: r for r in runs}, penalties, opts, args)
    for path in [os.path.join(args.output_dir, "results.json")] + ([opts.json] if opts.json else []):
        atomic_write_json(path, result)
    print(f"\nresults: {os.path.join(args.output_dir, 'results.json')}"
          + (f" and {opts.json}" if opts.json else "") + "; each run's certificate: certificate.json in its folder")
    return result


def print_table(results: dict[str, dict[str, Any]], penalties: list[str], opts: QuickstartArguments,
                args: ConstrainedTrainingArguments) -> None:
    """One seed: each digit's cross-entropy per method (constraint rows / test rows), then a verdict per method."""
    print(f"\nCross-entropy per digit, constraint: <= {opts.bound}, beta = {args.penalty_beta}; "
          "each cell: constraint data (what training sees) / unseen test data; * = violated")
    print(f"{'digit':>6} " + " ".join(f"{p:>18}" for p in penalties))
    for d in range(10):
        cells = []
        for p in penalties:
            tr, te = results[p]["train_constraint"][f"digit{d}"], results[p]["test_constraint"][f"digit{d}"]
            cells.append(f"{tr:6.3f}{'*' if tr > opts.bound else ' '} / {te:6.3f}{'*' if te > opts.bound else ' '}")
        print(f"{d:>6} " + " ".join(f"{c:>18}" for c in cells))
    print(f"{'test max violation':>18} " + " ".join(f"{results[p]['test_max_violation']:>+10.3f}" for p in penalties))
    print(f"{'test accuracy':>18} " + " ".join(f"{results[p]['test_accuracy']:>10.3f}" for p in penalties))
    print(f"{'all hold (train)':>18} " + " ".join(f"{str(results[p]['hold_train']):>10}" for p in penalties))
    print(f"{'all hold (test)':>18} " + " ".join(f"{str(results[p]['hold_test']):>10}" for p in penalties))
    print("\nCertificate (each digit's error rate on its certification images, Clopper-Pearson upper bound):")
    for p in penalties:
        print(f"{p:>14}: {certificate_line(results[p]['certificate'], opts)}")
    print()
    for p in penalties:
        print(verdict(p, results[p], opts.bound, args.num_train_epochs))


def summarize(runs: list[dict[str, Any]], penalties: list[str]) -> dict[str, dict[str, Any]]:
    """Per method over its runs: seeds holding every constraint (constraint rows / test rows), the
    largest test violation, test accuracy and largest certified bound (median and worst), seeds certified."""
    out = {}
    for p in penalties:
        rs = [r for r in runs if r["method"] == p]
        viol, acc = [r["test_max_violation"] for r in rs], [r["test_accuracy"] for r in rs]
        bounds = [r["largest_certified_bound"] for r in rs if r["largest_certified_bound"] is not None]
        out[p] = {"runs": len(rs), "hold_train": sum(r["hold_train"] for r in rs),
                  "hold_test": sum(r["hold_test"] for r in rs),
                  "test_max_violation_median": float(np.median(viol)), "test_max_violation_worst": max(viol),
                  "test_accuracy_median": float(np.median(acc)), "test_accuracy_worst": min(acc),
                  "certified": sum(bool(r["certificate"] and r["certificate"]["certified"]) for r in rs),
                  "largest_bound_median": float(np.median(bounds)) if bounds else None,
                  "largest_bound_worst": max(bounds) if bounds else None}
    return out


def print_summary(summary: dict[str, dict[str, Any]], seeds: list[int], opts: QuickstartArguments,
                  args: ConstrainedTrainingArguments) -> None:
    """The summary over seeds, one line per method."""
    n = len(seeds)
    print(f"\nseeds {seeds}, bound {opts.bound}, beta {args.penalty_beta}, certified error tolerance "
          f"{opts.error_tolerance:g} (delta {opts.delta:g})")
    print(f"{'method':>14} {'hold (constraint data)':>23} {'hold (test)':>12} {'test max viol. median':>22} "
          f"{'worst':>7} {'test acc. median':>17} {'worst':>6} {'certified':>10} {'largest bound median':>21} "
          f"{'worst':>7}")
    for p, s in summary.items():
        cert_cells = (f"{s['certified']:>8}/{n} {s['largest_bound_median']:>21.3f} {s['largest_bound_worst']:>7.3f}"
                      if s["largest_bound_median"] is not None else f"{'-':>10} {'-':>21} {'-':>7}")
        print(f"{p:>14} {s['hold_train']:>21}/{n} {s['hold_test']:>10}/{n} {s['test_max_violation_median']:>+22.3f} "
              f"{s['test_max_violation_worst']:>+7.3f} {s['test_accuracy_median']:>17.3f} "
              f"{s['test_accuracy_worst']:>6.3f} {cert_cells}")


if __name__ == "__main__":
    main()
