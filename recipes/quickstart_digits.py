"""Quick start: the smallest real constrained training the core supports.

A classifier of scikit-learn's handwritten digits is trained on data where digits 7-9
are rare, so plain training neglects them. One constraint per digit asks that the
digit's cross-entropy stay below a bound (``h_k(w) = CE_k(w) <= bound``, the bound
being the constraint's tolerance).
The script trains with the hinge exact penalty, the squared hinge at the same beta
and no penalty, and prints each constraint's exact value on unseen test data.

    python recipes/quickstart_digits.py            # all three methods
    python recipes/quickstart_digits.py --penalty hinge --beta 10
"""

from __future__ import annotations

import argparse
import logging
import tempfile

import numpy as np
import torch
from datasets import Dataset
from sklearn.datasets import load_digits
from torch import nn
from transformers import PrinterCallback

from hf_constrained import ConstrainedTrainer, ConstrainedTrainingArguments, constraints_per_value


class DigitClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor | None = None, **_) -> dict:
        logits = self.net(pixels)
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


def class_cross_entropy(model: nn.Module, batch: dict) -> torch.Tensor:
    """h_k(w; B_k): mean cross-entropy of the batch (all of one digit)."""
    return model(batch["pixels"], labels=batch["labels"])["loss"]


def make_splits(seed: int = 0) -> tuple[Dataset, Dataset, Dataset]:
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    test, constraint, train = order[:400], order[400:900], order[900:]
    rare = np.isin(y[train], [7, 8, 9])
    keep = ~rare | (rng.random(len(train)) < 0.08)  # digits 7-9: 8% of their training rows
    train = train[keep]
    make = lambda idx: Dataset.from_dict({"pixels": x[idx].tolist(), "labels": y[idx].tolist()})  # noqa: E731
    return make(train), make(constraint), make(test)


def run(penalty: str, beta: float, bound: float, epochs: int, output_dir: str, seed: int = 0) -> dict[str, float]:
    train, constraint_data, test = make_splits(seed)
    constraints = constraints_per_value(constraint_data, "labels", class_cross_entropy, name="digit{value}",
                                        tolerance=bound, eval_dataset=test)
    args = ConstrainedTrainingArguments(
        output_dir=output_dir, num_train_epochs=epochs, per_device_train_batch_size=32, learning_rate=3e-3,
        constraint_penalty=penalty, penalty_beta=beta, constraint_batch_size=16, constraints_per_step=5,
        logging_steps=50, save_strategy="no", report_to=[], use_cpu=True, seed=seed, disable_tqdm=True,
    )
    torch.manual_seed(seed)
    trainer = ConstrainedTrainer(model=DigitClassifier(), args=args, train_dataset=train, constraints=constraints)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    metrics = trainer.evaluate()
    on_constraint_data = trainer.evaluate_constraints(split="train")
    metrics.update({f"train_constraint/{name}": value for name, value in on_constraint_data.items()})
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--penalty", choices=["hinge", "squared_hinge", "none", "all"], default="all")
    parser.add_argument("--beta", type=float, default=20.0)
    parser.add_argument("--bound", type=float, default=0.4, help="per-digit cross-entropy bound")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)  # a tiny model: threads only add overhead
    penalties = ["hinge", "squared_hinge", "none"] if opts.penalty == "all" else [opts.penalty]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for p in penalties:
            results[p] = run(p, opts.beta, opts.bound, opts.epochs, f"{tmp}/{p}", opts.seed)
    print(f"\nCross-entropy per digit, constraint: <= {opts.bound}, beta = {opts.beta}; "
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


if __name__ == "__main__":
    main()
