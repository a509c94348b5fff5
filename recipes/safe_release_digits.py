"""From training to a checked release: safety report, model card, figures and the push gate.

A tiny non-forgetting problem (the paper's non-forgetting application, in miniature) on
scikit-learn's digits, offline, on a CPU:

1. the OLD model, an MLP, is trained on digits 0-7 only (its own 30% of the data);
2. the NEW task teaches it digits 8 and 9 (the objective: cross-entropy on 8/9 images);
3. one constraint per old digit k = 0..7 asks it not to forget:
   h_k(w) = CE_k(w) - CE_k(w_old) <= tolerance, on digit k's fine-tuning images (the training
   surrogate), checked during training on digit k's selection images;
4. training with the hinge penalty evaluates every ``--eval_steps``; ``load_best_model_at_end``
   keeps the best objective among the checkpoints whose constraints all hold on the selection
   images;
5. ``finish_run`` certifies the chosen model on digit k's certification images, which nothing
   else reads: the statistic is the share of digit k's images that the old model classified
   right and the new one gets wrong (``--forget_tolerance``, a 0/1 rate with an exact
   Clopper-Pearson bound at ``--delta``), so "certified" reads "with probability >= 1 - delta,
   at most forget_tolerance of each old digit's images are forgotten"; it writes the safety
   report, the model card, the figures and ``results.json``;
6. the push gate is checked offline (``trainer.safety.check_safe_to_push()``); ``--hub_model_id``
   pushes for real. The exit status is 1 when the gate refuses.

The images unseen by the old model are split, stratified by digit, into fine-tuning (30%),
selection (15%) and certification (55%) images; ``--audit_fraction f`` sets a share ``f`` of
the certification images aside as an audit split that neither training nor the certificate
reads (``results.json`` reports both statistics on it: what a certificate's claim looks like on
unseen images).

    python recipes/safe_release_digits.py                              # hinge: CERTIFIED
    python recipes/safe_release_digits.py --constraint_penalty none --load_best_model_at_end false
        # plain fine-tuning, its last weights: NOT CERTIFIED (every old digit forgotten), push refused
    python recipes/safe_release_digits.py --docs docs/safety           # also refresh the README figures
    python recipes/safe_release_digits.py --config my_settings.yaml    # any flag, as YAML

Every field of ``ConstrainedTrainingArguments`` is a flag (``--penalty_beta``, ``--max_steps``,
``--eval_steps``, ``--seed``, ``--hub_model_id``, ...); the recipe's own flags are
``--tolerance``, ``--forget_tolerance``, ``--delta``, ``--audit_fraction``, ``--docs`` and
``--allow_unsafe``. The seed also draws the data split.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from datasets import Dataset
from torch import nn

from hf_constrained import (
    Certification,
    CertifyStatistic,
    ConstrainedTrainer,
    ConstrainedTrainingArguments,
    SafetyReport,
    UnsafeModelError,
    constraints_per_value,
    finish_run,
)
from hf_constrained.atomic_files import atomic_write_json
from hf_constrained.certification.splits import check_certify_fraction
from hf_constrained.extras import require_extra
from hf_constrained.non_forgetting import CORRECT_KEY, ForgottenRows
from hf_constrained.publishable import publishable_command
from hf_constrained.recipe_args import CertificateArguments, parse_recipe_args

OLD_DIGITS = list(range(8))
NEW_DIGITS = [8, 9]


class DigitMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor | None = None, **_) -> dict:
        logits = self.net(pixels)
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


def per_sample_ce(model: nn.Module, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(pixels)["logits"], labels, reduction="none")


def train_old_model(x: np.ndarray, y: np.ndarray, seed: int, steps: int = 150) -> DigitMLP:
    """Stage 1: digits 0-7 only (full-batch AdamW)."""
    torch.manual_seed(seed)
    model = DigitMLP()
    keep = np.isin(y, OLD_DIGITS)
    xs, ys = torch.tensor(x[keep], dtype=torch.float32), torch.tensor(y[keep])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    for _ in range(steps):
        opt.zero_grad()
        model(xs, ys)["loss"].backward()
        opt.step()
    return model.eval()


def with_reference_loss(old: nn.Module, x: np.ndarray, y: np.ndarray, ids: np.ndarray) -> Dataset:
    """Rows with the old model's per-sample loss and correctness, computed once (as in the paper's
    non-forgetting application), and the image's index in the digits data (its identity)."""
    with torch.no_grad():
        pixels = torch.tensor(x, dtype=torch.float32)
        ref = per_sample_ce(old, pixels, torch.tensor(y))
        correct = old(pixels)["logits"].argmax(-1).numpy() == y
    return Dataset.from_dict({"pixels": x.tolist(), "labels": y.tolist(), "ref_loss": ref.tolist(),
                              CORRECT_KEY: correct.astype(np.int64).tolist(), "image_id": ids.tolist()})


def loss_change(model: nn.Module, batch: dict) -> torch.Tensor:
    """Per image of digit k: CE now minus the stored old CE (the training surrogate; h_k is its mean)."""
    return per_sample_ce(model, batch["pixels"].float(), batch["labels"]) - batch["ref_loss"].float()


def digit_correct(model: nn.Module, batch: dict) -> torch.Tensor:
    """Per image: 1 when the model classifies it right."""
    return model(batch["pixels"].float())["logits"].argmax(-1) == batch["labels"]


# per image: 1 when the old model classified it right and the new one gets it wrong (the certified statistic)
forgotten = ForgottenRows(digit_correct)


# the recipe's settings; each is a flag of ConstrainedTrainingArguments that the command line or --config can change
TRAINING_DEFAULTS = dict(
    output_dir="outputs/safe_release_digits", max_steps=200, per_device_train_batch_size=32, learning_rate=1e-3,
    optim="adamw_torch", weight_decay=0.0, lr_scheduler_type="constant", constraint_penalty="hinge",
    penalty_beta=50.0, constraint_batch_size=16, eval_strategy="steps", eval_steps=20, save_strategy="steps",
    save_steps=20, save_total_limit=3, load_best_model_at_end=True, metric_for_best_model="loss", logging_steps=5,
    report_to="none", use_cpu=True, seed=0, disable_tqdm=True, save_only_model=True,
    # no clipping: at max_grad_norm 1 every step was clipped, shrinking the exact penalty's beta (the library warned)
    max_grad_norm=0.0,
)


@dataclass
class ReleaseArguments(CertificateArguments):
    tolerance: float = field(default=0.1, metadata={"help": "h_k <= tolerance for every old digit k (nats): training "
                                                             "and checkpoint selection"})
    # 0.2: the tightest claim on the grid 0.05, 0.10, ... that this split supports: with 52-70 certification images
    # per digit, a model truly forgetting 2% of each digit's images certifies all 8 digits with probability >= 0.99
    # at 0.2 but not at 0.15 (`python benchmarks/certification_size.py --rows 60 --tasks 8 --rate 0.02`; the same at
    # 52 and 69 rows). A claim of at most 5 points per digit needs about 1,500 images per digit (`--eps 0.05 --tasks 8`)
    forget_tolerance: float = field(default=0.2, metadata={
        "help": "certified: at most this share of each old digit's images forgotten (right before, wrong now); 0.2 is "
                "the tightest claim the 52-70 certification images per digit support (docs/safety.md)"})
    audit_fraction: float = field(default=0.0, metadata={
        "help": "share of the certification images set aside, read by neither training nor the certificate, and "
                "reported in results.json"})
    docs: Optional[str] = field(default=None, metadata={"help": "copy the figures and the card here (README material)"})
    allow_unsafe: bool = field(default=False, metadata={"help": "with --hub_model_id: push even if a constraint fails"})

    def __post_init__(self) -> None:
        super().__post_init__()  # --delta
        # the certificate reads these only after training: a value it cannot use stops the run here, naming the flag
        if not 0 < self.forget_tolerance <= 1:  # NaN fails too
            raise ValueError(f"--forget_tolerance is a share of each old digit's images forgotten, in (0, 1] "
                             f"(0.2: at most 20%), got {self.forget_tolerance}")
        check_certify_fraction(self.audit_fraction, "--audit_fraction")


def split_digits(opts: ReleaseArguments, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """The digits (x in [0, 1], labels y) and their disjoint parts, stratified by digit and seeded by ``seed``: the
    old model's rows, and of the rest ``train``, ``select``, ``certify`` and, with ``--audit_fraction``, ``audit``."""
    load_digits = require_extra("sklearn.datasets", "recipes", "the safe-release recipe's digits").load_digits
    train_test_split = require_extra("sklearn.model_selection", "recipes", "the safe-release recipe's splits"
                                     ).train_test_split
    digits = load_digits()
    x, y = (digits.data / 16.0).astype(np.float32), digits.target
    ids = np.arange(len(y))
    # disjoint parts: the old model's data (30%); of the rest, fine-tuning / constraint batches (30%), selection
    # (15%) and certification (55%): all three equally unseen by the old model. The certification share is the
    # largest: a bound on a per-digit rate needs rows (0 of 60 images forgotten bounds the rate by 0.049 at 95%)
    part = {}
    idx_old, rest = train_test_split(ids, test_size=0.7, stratify=y, random_state=seed)
    part["train"], rest = train_test_split(rest, train_size=0.3, stratify=y[rest], random_state=seed)
    part["select"], part["certify"] = train_test_split(rest, train_size=0.15 / 0.7, stratify=y[rest],
                                                       random_state=seed)
    if opts.audit_fraction:
        part["certify"], part["audit"] = train_test_split(part["certify"], test_size=opts.audit_fraction,
                                                          stratify=y[part["certify"]], random_state=seed)
    return x, y, idx_old, part


def release_gate(trainer: ConstrainedTrainer, report: SafetyReport, opts: ReleaseArguments) -> bool:
    """The push gate's verdict, printed (and the push, with ``--hub_model_id``); whether it is closed."""
    output_dir, hub_model_id = trainer.args.output_dir, trainer.args.hub_model_id
    try:
        trainer.safety.check_safe_to_push(allow_unsafe=opts.allow_unsafe)
        # without a push asked for, say what an open gate allows and how (a bare "open" leaves a newcomer guessing)
        print("push gate: open" + (" (override)" if not report.all_satisfied else "")
              + ("" if hub_model_id else f" (no push was asked for; to publish: hf-constrained push "
                 f"{output_dir} --repo_id owner/name)"))
        if hub_model_id:
            trainer.push_to_hub(allow_unsafe=opts.allow_unsafe)
    except UnsafeModelError as err:
        # the refusal's own words only when a push was asked for; else the verdict, and what a push would do
        why = str(err).splitlines()[0] if hub_model_id else \
            f"{report.summary()} (no push was asked for; --hub_model_id would upload nothing)"
        print(f"push gate: closed: {why}")
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    opts, training_args = parse_recipe_args([ReleaseArguments, ConstrainedTrainingArguments], argv,
                                            description=__doc__, defaults=TRAINING_DEFAULTS)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    seed = training_args.seed
    x, y, idx_old, part = split_digits(opts, seed)
    old = train_old_model(x[idx_old], y[idx_old], seed)
    rows = {name: with_reference_loss(old, x[i], y[i], i) for name, i in part.items()}

    def where(name: str, digits: list[int]) -> Dataset:
        return rows[name].select(np.flatnonzero(np.isin(y[part[name]], digits)))

    new_train, new_heldout = where("train", NEW_DIGITS), where("select", NEW_DIGITS)
    certify_of = {k: where("certify", [k]) for k in OLD_DIGITS}
    constraints = constraints_per_value(
        rows["train"], "labels", values=OLD_DIGITS, name="forget_digit_{value}", tolerance=opts.tolerance,
        eval_dataset=rows["select"], row_fn=loss_change,
        certify=Certification(statistic=CertifyStatistic(
            forgotten, tolerance=opts.forget_tolerance, value_range=(0.0, 1.0), bound="clopper_pearson",
            description="share of the digit's images forgotten")))
    for c in constraints:  # each digit's own certification images
        c.certify = dataclasses.replace(c.certify, dataset=certify_of[c.metadata["value"]])

    model = DigitMLP()
    model.load_state_dict(old.state_dict())
    trainer = ConstrainedTrainer(model=model, args=training_args, constraints=constraints,
                                 train_dataset=new_train, eval_dataset=new_heldout)
    trainer.train()
    # the released weights next to their report and card (recorded, so `hf-constrained report --check`
    # vouches for the folder); the push, if any, comes after the gate below
    trainer.save_model(training_args.output_dir, push=False)
    # no secrets (--hub_token) and no local paths: the command is published in the card
    command = publishable_command("python recipes/safe_release_digits.py", argv if argv is not None else sys.argv[1:],
                                  output_dir=training_args.output_dir)
    report = finish_run(
        trainer, old_model=old, base_model_name="digits MLP trained on digits 0-7 (stage 1 of this recipe)",
        dataset_description="scikit-learn digits (8x8), split stratified into disjoint parts: 30% trains the old model "
        "(digits 0-7); of the rest, 30% is the fine-tuning data (objective: cross-entropy on digits 8-9; constraint "
        "batches), 15% selects the checkpoint (objective metric and constraint check during training), 55% certifies "
        f"(read only by the certificate). One non-forgetting constraint per old digit 0-7, trained as "
        f"CE_k(w) - CE_k(w_old) <= {opts.tolerance} and certified as 'at most {opts.forget_tolerance} of digit k's "
        "images forgotten'.",
        eval_dataset="digits", reproduce_command=command, delta=opts.delta, show=False,  # printed below, once
        population="scikit-learn 8x8 digits images of digits 0-7, each constraint the images of its own digit",
    )
    results = release_results(trainer, report, rows.get("audit"), opts)
    if trainer.is_world_process_zero():
        atomic_write_json(os.path.join(training_args.output_dir, "results.json"), results, indent=1)
    print(report.render())
    gate_closed = release_gate(trainer, report, opts)
    if trainer.is_world_process_zero():  # where the run's evidence is, as the demo prints it
        print(f"written to {training_args.output_dir}: the model, safety_report.json (hf-constrained report "
              f"{training_args.output_dir}), the model card README.md, figures/ and results.json")
    if opts.docs:
        os.makedirs(opts.docs, exist_ok=True)
        for name in ("constraints.png", "objective.png"):
            shutil.copy(os.path.join(training_args.output_dir, "figures", name), os.path.join(opts.docs, name))
        shutil.copy(os.path.join(training_args.output_dir, "README.md"), os.path.join(opts.docs, "model_card.md"))
        print(f"figures and card copied to {opts.docs}")
    return 1 if gate_closed else 0


@torch.no_grad()
def release_results(trainer: ConstrainedTrainer, report, audit: Optional[Dataset], opts: ReleaseArguments) -> dict:
    """The verdicts and, on the audit images (when set aside), what each verdict claimed: the share of
    each old digit's images forgotten (the certificate's statistic) and the loss change (the point rule's)."""
    out = {"certified": report.certified, "point_rule_passes": report.with_rule("point").all_satisfied,
           "forget_tolerance": opts.forget_tolerance, "tolerance": opts.tolerance, "delta": opts.delta,
           "certified_bounds": report.certified_bounds(),
           "selection_values": {c.name: c.value for c in report.constraints},
           "objective_metrics": report.objective_metrics}
    if audit is not None:
        model = trainer.model.eval()
        batch = audit.with_format("torch")[:]
        lost, change = forgotten(model, batch).numpy(), loss_change(model, batch).numpy()
        labels = batch["labels"].numpy()
        out["audit"] = {
            "rows_per_digit": {f"forget_digit_{k}": int((labels == k).sum()) for k in OLD_DIGITS},
            "forgotten_share": {f"forget_digit_{k}": float(lost[labels == k].mean()) for k in OLD_DIGITS},
            "loss_change": {f"forget_digit_{k}": float(change[labels == k].mean()) for k in OLD_DIGITS},
        }
    return out


if __name__ == "__main__":
    sys.exit(main())
