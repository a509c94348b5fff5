"""From training to a checked release: safety report, model card, figures and the push gate.

A tiny non-forgetting problem (the paper's non-forgetting application, in miniature) on
scikit-learn's digits, offline, on a CPU:

1. the OLD model, an MLP, is trained on digits 0-7 only (its own 40% of the data);
2. the NEW task teaches it digits 8 and 9 (the objective: cross-entropy on 8/9 images);
3. one constraint per old digit k = 0..7 asks it not to forget:
   h_k(w) = CE_k(w) - CE_k(w_old) <= tolerance, on digit k's fine-tuning images, and is
   checked exactly on digit k's held-out images (both unseen by the old model);
4. training with the hinge penalty evaluates every ``--eval_steps``; ``load_best_model_at_end``
   keeps the best objective among the checkpoints whose constraints all hold on held-out
   data; ``finish_run`` writes the safety report, the model card and the figures;
5. the push gate is checked offline (``trainer.check_safe_to_push()``); ``--hub_model_id``
   pushes for real.

    python recipes/safe_release_digits.py                              # hinge: SAFE
    python recipes/safe_release_digits.py --constraint_penalty none --load_best_model_at_end false
        # plain fine-tuning, its last weights: UNSAFE (every old digit forgotten), push refused
    python recipes/safe_release_digits.py --docs docs/safety           # also refresh the README figures
    python recipes/safe_release_digits.py --config my_settings.yaml    # any flag, as YAML

(Plain fine-tuning WITH feasible-checkpoint selection keeps its one feasible evaluation, step
20, before it has learned digits 8 and 9: SAFE, at a held-out objective loss of 11.1 against
the hinge's 1.34, seed 0.)

Every field of ``ConstrainedTrainingArguments`` is a flag (``--penalty_beta``, ``--max_steps``,
``--eval_steps``, ``--seed``, ``--hub_model_id``, ...); the recipe's own flags are
``--tolerance``, ``--docs`` and ``--allow_unsafe``. The seed also draws the data split.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from datasets import Dataset
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from hf_constrained import ConstrainedTrainer, ConstrainedTrainingArguments, constraints_per_value
from hf_constrained import UnsafeModelError, finish_run
from hf_constrained.publishable import publishable_command
from hf_constrained.recipe_args import parse_recipe_args

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


def with_reference_loss(old: nn.Module, x: np.ndarray, y: np.ndarray) -> Dataset:
    """Rows with the old model's per-sample loss, computed once (as in the paper's non-forgetting application)."""
    with torch.no_grad():
        ref = per_sample_ce(old, torch.tensor(x, dtype=torch.float32), torch.tensor(y))
    return Dataset.from_dict({"pixels": x.tolist(), "labels": y.tolist(), "ref_loss": ref.tolist()})


def forgetting(model: nn.Module, batch: dict) -> torch.Tensor:
    """h_k on a batch of digit k: mean CE now minus the stored old CE on the same images."""
    return (per_sample_ce(model, batch["pixels"].float(), batch["labels"]) - batch["ref_loss"].float()).mean()


# the recipe's settings; each is a flag of ConstrainedTrainingArguments that the command line or --config can change
TRAINING_DEFAULTS = dict(
    output_dir="outputs/safe_release_digits", max_steps=200, per_device_train_batch_size=32, learning_rate=1e-3,
    optim="adamw_torch", weight_decay=0.0, lr_scheduler_type="constant", constraint_penalty="hinge",
    penalty_beta=50.0, constraint_batch_size=16, eval_strategy="steps", eval_steps=20, save_strategy="steps",
    save_steps=20, save_total_limit=3, load_best_model_at_end=True, metric_for_best_model="loss", logging_steps=5,
    report_to="none", use_cpu=True, seed=0, disable_tqdm=True, save_only_model=True,
)


@dataclass
class ReleaseArguments:
    tolerance: float = field(default=0.1, metadata={"help": "h_k <= tolerance for every old digit k (nats)"})
    docs: Optional[str] = field(default=None, metadata={"help": "copy the figures and the card here (README material)"})
    allow_unsafe: bool = field(default=False, metadata={"help": "with --hub_model_id: push even if a constraint fails"})


def main(argv: list[str] | None = None) -> int:
    opts, training_args = parse_recipe_args([ReleaseArguments, ConstrainedTrainingArguments], argv,
                                            description=__doc__, defaults=TRAINING_DEFAULTS)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    seed = training_args.seed

    digits = load_digits()
    x, y = (digits.data / 16.0).astype(np.float32), digits.target
    # three disjoint parts: the old model's training data, the fine-tuning / constraint data and the
    # held-out data; constraint and held-out rows are equally unseen by the old model
    x_old, x_rest, y_old, y_rest = train_test_split(x, y, test_size=0.6, stratify=y, random_state=seed)
    x_tr, x_te, y_tr, y_te = train_test_split(x_rest, y_rest, test_size=0.5, stratify=y_rest, random_state=seed)
    old = train_old_model(x_old, y_old, seed)

    train_all, heldout_all = with_reference_loss(old, x_tr, y_tr), with_reference_loss(old, x_te, y_te)
    new_train = train_all.filter(lambda r: r["labels"] in NEW_DIGITS)
    new_heldout = heldout_all.filter(lambda r: r["labels"] in NEW_DIGITS)
    constraints = constraints_per_value(train_all, "labels", forgetting, values=OLD_DIGITS, name="forget_digit_{value}",
                                        tolerance=opts.tolerance, eval_dataset=heldout_all)

    model = DigitMLP()
    model.load_state_dict(old.state_dict())
    trainer = ConstrainedTrainer(model=model, args=training_args, constraints=constraints,
                                 train_dataset=new_train, eval_dataset=new_heldout)
    trainer.train()
    # no secrets (--hub_token) and no local paths: the command is published in the card
    command = publishable_command("python recipes/safe_release_digits.py", argv if argv is not None else sys.argv[1:],
                                  output_dir=training_args.output_dir)
    report = finish_run(
        trainer, old_model=old, base_model_name="digits MLP trained on digits 0-7 (stage 1 of this recipe)",
        dataset_description="scikit-learn digits (8x8), split stratified into three disjoint parts: 40% trains the "
        "old model (digits 0-7), 30% is the fine-tuning data (objective: cross-entropy on digits 8-9; constraint "
        "batches), 30% is held out (objective metric and exact constraint check). One non-forgetting constraint per "
        f"old digit 0-7: CE_k(w) - CE_k(w_old) <= {opts.tolerance}.",
        reproduce_command=command,
    )
    print(report.format_table())
    print(report.summary())
    try:
        trainer.check_safe_to_push(allow_unsafe=opts.allow_unsafe)
        print("push gate: open" + (" (override)" if not report.all_satisfied else ""))
        if training_args.hub_model_id:
            trainer.push_to_hub(allow_unsafe=opts.allow_unsafe)
    except UnsafeModelError as err:
        print(f"push gate: closed\n{str(err).splitlines()[0]}")
    if opts.docs:
        os.makedirs(opts.docs, exist_ok=True)
        for name in ("constraints.png", "objective.png"):
            shutil.copy(os.path.join(training_args.output_dir, "figures", name), os.path.join(opts.docs, name))
        shutil.copy(os.path.join(training_args.output_dir, "README.md"), os.path.join(opts.docs, "model_card.md"))
        print(f"figures and card copied to {opts.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
