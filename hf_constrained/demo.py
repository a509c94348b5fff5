"""The embedded demo (``make demo``): CLIP fine-tuning under non-forgetting constraints, offline.

REFERENCE section 4 (second application) in miniature, on scikit-learn's digits:

1. **Old model** (stage 1, cached under ``.cache/``): a small CLIP built from a config is
   pre-trained as a zero-shot classifier over the prompts "a photo of the digit {name}"
   on half of the digits, with the target digit held out almost entirely, so it is weak
   on the target.
2. **Target data**: image-caption pairs of the target digit (positives) and of other
   digits (negatives). Like web retrievals it is noisy: part of the "positives" are images
   of a similar protected digit captioned as the target, and that digit is absent from the
   negatives. Unconstrained contrastive fine-tuning therefore learns to call that digit
   the target: it forgets.
3. **Constrained fine-tuning** with :class:`~hf_constrained.clip.ContrastiveConstrainedTrainer`
   and one :class:`~hf_constrained.clip.NonForgettingConstraint` per protected digit, with
   the hinge penalty, the squared hinge at the same beta, and no penalty.

It prints, per class, the old and new held-out accuracy, which constraints hold (on their
training data, as the method enforces them, and on the held-out half), and the target
improvement. ``python -m hf_constrained.demo --help`` lists the knobs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np
import torch

logger = logging.getLogger(__name__)

DIGIT_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
TEMPLATE = "a photo of the digit {}"


@dataclass
class DemoConfig:
    target: int = 9
    pulled: int = 5  # the protected digit whose images pollute the target data
    seed: int = 0
    heldout_fraction: float = 0.4
    constraint_fraction: float = 0.25  # per class, unseen in stage 1 (like BDD100K for CLIP)
    stage1_target_keep: int = 3
    stage1_epochs: int = 40
    stage1_lr: float = 2e-3
    noisy_fraction: float = 0.5  # polluting images per clean target image
    negatives_per_class: int = 20
    steps: int = 150
    batch_size: int = 64
    lr: float = 1e-4
    schedule: str = "cosine"
    warmup_steps: int = 0
    beta: float = 10.0
    constraint_batch_size: int = 10
    temperature: float = 0.05


# ---------------------------------------------------------------------------------- data


def digits_split(cfg: DemoConfig) -> dict[str, Any]:
    """Digits as 1x8x8 images in [-1, 1], split per class into three disjoint parts.

    ``pretrain``: stage 1 and the target data; ``constraint``: the protected classes'
    constraint data D_k, never seen by the old model (as BDD100K was not CLIP's training
    data); ``test``: held-out, for the reported accuracies.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images.astype(np.float32) / 16.0 - 0.5) / 0.5
    labels = digits.target.astype(int)
    rng = np.random.default_rng(cfg.seed)
    parts: dict[str, list[int]] = {"pretrain": [], "constraint": [], "test": []}
    for c in range(10):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_test = int(round(len(idx) * cfg.heldout_fraction))
        n_con = int(round(len(idx) * cfg.constraint_fraction))
        parts["test"] += idx[:n_test].tolist()
        parts["constraint"] += idx[n_test : n_test + n_con].tolist()
        parts["pretrain"] += idx[n_test + n_con :].tolist()
    return {"images": images[:, None], "labels": labels, **{k: sorted(v) for k, v in parts.items()}}


def _row(data: dict[str, Any], i: int) -> dict[str, Any]:
    return {"pixel_values": data["images"][i], "label": int(data["labels"][i])}


def class_rows(data: dict[str, Any], split: str, c: int) -> list[dict[str, Any]]:
    return [_row(data, i) for i in data[split] if data["labels"][i] == c]


def target_rows(data: dict[str, Any], cfg: DemoConfig) -> list[dict[str, Any]]:
    """Noisy target pairs: target images + polluting images of ``pulled`` captioned as the target
    (positives), and other digits with their own captions (negatives, ``pulled`` excluded)."""
    rng = np.random.default_rng(cfg.seed + 1)
    target_name = DIGIT_NAMES[cfg.target]
    rows = []
    # every non-held-out target image (the target has no constraint data)
    clean = [i for i in data["pretrain"] + data["constraint"] if data["labels"][i] == cfg.target]
    for i in clean:
        rows.append({**_row(data, i), "caption": TEMPLATE.format(target_name), "is_positive": True})
    pulled = [i for i in data["pretrain"] if data["labels"][i] == cfg.pulled]
    n_noisy = min(len(pulled), int(round(cfg.noisy_fraction * len(clean))))
    for i in rng.choice(pulled, size=n_noisy, replace=False):
        rows.append({**_row(data, int(i)), "caption": TEMPLATE.format(target_name), "is_positive": True})
    for c in range(10):
        if c in (cfg.target, cfg.pulled):
            continue
        pool = [i for i in data["pretrain"] if data["labels"][i] == c]
        for i in rng.choice(pool, size=min(len(pool), cfg.negatives_per_class), replace=False):
            rows.append({**_row(data, int(i)), "caption": TEMPLATE.format(DIGIT_NAMES[c]), "is_positive": False})
    return rows


# ---------------------------------------------------------------------------------- stage 1


def _stage1_key(cfg: DemoConfig) -> str:
    keys = ("target", "seed", "heldout_fraction", "constraint_fraction", "stage1_target_keep", "stage1_epochs",
            "stage1_lr", "temperature")
    blob = json.dumps({k: getattr(cfg, k) for k in keys}, sort_keys=True) + "v1"
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def prompts(tokenizer: Any) -> dict[str, torch.Tensor]:
    return tokenizer([TEMPLATE.format(n) for n in DIGIT_NAMES], padding=True, return_tensors="pt")


def pretrain_old_model(cfg: DemoConfig, cache_dir: str, log: Callable[[str], None] = logger.info) -> str:
    """Stage 1 (cached): a small CLIP trained as a zero-shot digit classifier, weak on the target."""
    from .clip.tiny import tiny_clip, word_tokenizer

    path = os.path.join(cache_dir, f"digits-clip-{_stage1_key(cfg)}")
    if os.path.exists(os.path.join(path, "config.json")):
        log(f"stage 1: cached old model at {path}")
        return path
    t0 = time.time()
    data = digits_split(cfg)
    tokenizer = word_tokenizer([TEMPLATE.format(n) for n in DIGIT_NAMES])
    model = tiny_clip(len(tokenizer), image_size=8, patch_size=2, num_channels=1, seed=cfg.seed)
    rng = np.random.default_rng(cfg.seed + 2)
    train = [i for i in data["pretrain"] if data["labels"][i] != cfg.target]
    keep = [i for i in data["pretrain"] if data["labels"][i] == cfg.target][: cfg.stage1_target_keep]
    idx = np.array(train + keep)
    x = torch.as_tensor(data["images"][idx])
    y = torch.as_tensor(data["labels"][idx])
    p = prompts(tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.stage1_lr, weight_decay=0.01)
    torch.manual_seed(cfg.seed)
    model.train()
    for epoch in range(cfg.stage1_epochs):
        perm = torch.as_tensor(rng.permutation(len(idx)))
        for start in range(0, len(idx), 128):
            b = perm[start : start + 128]
            out = model(pixel_values=x[b], input_ids=p["input_ids"], attention_mask=p["attention_mask"])
            logits = out.image_embeds @ out.text_embeds.T / cfg.temperature
            loss = torch.nn.functional.cross_entropy(logits, y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
    tmp = tempfile.mkdtemp(dir=cache_dir, prefix=".stage1-")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if os.path.exists(path):  # another run finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, path)
    log(f"stage 1: pre-trained the old model in {time.time() - t0:.0f}s -> {path}")
    return path


# ---------------------------------------------------------------------------------- stage 2


def finetune(cfg: DemoConfig, old_path: str, penalty: str,
             log: Callable[[str], None] = logger.info) -> dict[str, Any]:
    """Contrastive fine-tuning toward the target digit with one non-forgetting constraint per other digit."""
    from transformers import AutoTokenizer, CLIPModel

    from .clip import ContrastiveConstrainedTrainer, ZeroShotLoss, non_forgetting_constraints, zero_shot_accuracy
    from .clip.data import CLIPCollator, RowDataset
    from .config import ConstrainedTrainingArguments

    t0 = time.time()
    data = digits_split(cfg)
    tokenizer = AutoTokenizer.from_pretrained(old_path)
    model = CLIPModel.from_pretrained(old_path)
    model.logit_scale.requires_grad_(False)  # fixed temperature
    collate = CLIPCollator(tokenizer=tokenizer)
    p = prompts(tokenizer)
    zs = ZeroShotLoss(p["input_ids"], p["attention_mask"], temperature=cfg.temperature)
    protected = [c for c in range(10) if c != cfg.target]
    train_sets = {DIGIT_NAMES[c]: RowDataset(class_rows(data, "constraint", c)) for c in protected}
    test_sets = {DIGIT_NAMES[c]: RowDataset(class_rows(data, "test", c)) for c in protected}
    constraints = non_forgetting_constraints(model, zs, train_sets, collate, eval_datasets=test_sets)
    heldout = RowDataset([_row(data, i) for i in data["test"]])
    with tempfile.TemporaryDirectory() as out_dir:
        args = ConstrainedTrainingArguments(
            output_dir=out_dir, max_steps=cfg.steps, per_device_train_batch_size=cfg.batch_size,
            learning_rate=cfg.lr, lr_scheduler_type=cfg.schedule, warmup_steps=cfg.warmup_steps, weight_decay=0.0, max_grad_norm=1.0,
            constraint_penalty=penalty, penalty_beta=cfg.beta, constraint_batch_size=cfg.constraint_batch_size,
            constraint_eval_batch_size=256, logging_steps=max(cfg.steps // 5, 1), save_strategy="no",
            report_to=[], seed=cfg.seed, use_cpu=True, dataloader_drop_last=True, disable_tqdm=True,
            remove_unused_columns=False,
        )
        trainer = ContrastiveConstrainedTrainer(
            model=model, args=args, train_dataset=RowDataset(target_rows(data, cfg)), data_collator=collate,
            constraints=constraints, contrastive_temperature=cfg.temperature,
        )
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)  # the report below says what matters
        trainer.train()
        train_h = trainer.evaluate_constraints(split="train")
        test_h = trainer.evaluate_constraints(split="eval")
    acc = zero_shot_accuracy(model, heldout, zs, collate, DIGIT_NAMES)
    log(f"  {penalty:>13}: {time.time() - t0:.0f}s")
    return {"penalty": penalty, "accuracy": acc, "h_train": train_h, "h_heldout": test_h}


def old_accuracy(cfg: DemoConfig, old_path: str) -> dict[str, float]:
    from transformers import AutoTokenizer, CLIPModel

    from .clip import ZeroShotLoss, zero_shot_accuracy
    from .clip.data import CLIPCollator, RowDataset

    data = digits_split(cfg)
    tokenizer = AutoTokenizer.from_pretrained(old_path)
    model = CLIPModel.from_pretrained(old_path)
    p = prompts(tokenizer)
    zs = ZeroShotLoss(p["input_ids"], p["attention_mask"], temperature=cfg.temperature)
    heldout = RowDataset([_row(data, i) for i in data["test"]])
    return zero_shot_accuracy(model, heldout, zs, CLIPCollator(tokenizer=tokenizer), DIGIT_NAMES)


# ---------------------------------------------------------------------------------- report


def report(cfg: DemoConfig, old: dict[str, float], runs: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    target = DIGIT_NAMES[cfg.target]
    names = [r["penalty"] for r in runs]
    lines = [f"Held-out zero-shot accuracy (%), target digit: {target}; beta = {cfg.beta} for both penalties",
             "| class | old | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for name in DIGIT_NAMES:
        cells = [f"{100 * r['accuracy'][name]:.1f}" for r in runs]
        tag = " (target)" if name == target else (" (pulled)" if name == DIGIT_NAMES[cfg.pulled] else "")
        lines.append(f"| {name}{tag} | {100 * old[name]:.1f} | " + " | ".join(cells) + " |")
    summary: dict[str, Any] = {}
    rows = {"target gain (points)": [], "worst protected drop (points)": [],
            "constraints holding on D_k (h_k <= 0)": [], "constraints holding, held-out": [],
            "max h_k on D_k": []}
    protected = [n for n in DIGIT_NAMES if n != target]
    for r in runs:
        gain = 100 * (r["accuracy"][target] - old[target])
        drop = max(100 * (old[n] - r["accuracy"][n]) for n in protected)
        held_train = sum(v <= 0 for v in r["h_train"].values())
        held_test = sum(v <= 0 for v in r["h_heldout"].values())
        rows["target gain (points)"].append(f"{gain:+.1f}")
        rows["worst protected drop (points)"].append(f"{drop:.1f}")
        rows["constraints holding on D_k (h_k <= 0)"].append(f"{held_train}/{len(protected)}")
        rows["constraints holding, held-out"].append(f"{held_test}/{len(protected)}")
        rows["max h_k on D_k"].append(f"{max(r['h_train'].values()):+.4f}")
        summary[r["penalty"]] = {"target_gain": gain, "worst_protected_drop": drop,
                                 "constraints_holding_train": held_train, "constraints_holding_heldout": held_test,
                                 "max_h_train": max(r["h_train"].values())}
    lines.append("")
    lines.append("| | " + " | ".join(names) + " |")
    lines.append("|---|" + "---|" * len(names))
    for k, v in rows.items():
        lines.append(f"| {k} | " + " | ".join(v) + " |")
    goals = []
    if "hinge" in summary:
        s = summary["hinge"]
        ok = s["worst_protected_drop"] <= 2.0 and s["target_gain"] >= 10.0
        goals.append(f"hinge keeps every protected class within 2 points held-out and gains >= 10 on the target: "
                     f"{'MET' if ok else 'NOT MET'}")
    if "squared_hinge" in summary:
        ok = summary["squared_hinge"]["constraints_holding_train"] < len(protected)
        goals.append(f"squared hinge at the same beta violates some constraint: {'MET' if ok else 'NOT MET'}")
    if "none" in summary:
        ok = summary["none"]["worst_protected_drop"] >= 5.0
        goals.append(f"unconstrained fine-tuning forgets (some protected class loses >= 5 points): "
                     f"{'MET' if ok else 'NOT MET'}")
    lines.append("")
    lines += [f"- {g}" for g in goals]
    return "\n".join(lines), summary


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (every :class:`DemoConfig` field, the penalties, cache and output)."""
    for name, value in asdict(DemoConfig()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--penalties", default="hinge,squared_hinge,none")
    parser.add_argument("--cache-dir", default=os.path.join(os.getcwd(), ".cache", "hf_constrained_demo"))
    parser.add_argument("--output", default=None, help="write the results JSON here")


def run_demo(ns: argparse.Namespace, echo: Callable[[str], None]) -> dict[str, Any]:
    """Run both stages with the options in ``ns``; ``echo`` receives the progress lines and the report.

    Writes the results JSON (tmp + rename) and returns it.
    """
    cfg = DemoConfig(**{k: getattr(ns, k) for k in asdict(DemoConfig())})
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)  # tiny models: one thread is fastest and immune to a busy machine
    os.makedirs(ns.cache_dir, exist_ok=True)
    t0 = time.time()
    echo(f"hf_constrained demo: CLIP non-forgetting fine-tuning on digits (target: {DIGIT_NAMES[cfg.target]})")
    old_path = pretrain_old_model(cfg, ns.cache_dir, log=echo)
    old = old_accuracy(cfg, old_path)
    runs = []
    echo("stage 2: constrained fine-tuning")
    for penalty in ns.penalties.split(","):
        runs.append(finetune(cfg, old_path, penalty.strip(), log=echo))
    text, summary = report(cfg, old, runs)
    echo("")
    echo(text)
    echo(f"\ntotal {time.time() - t0:.0f}s on {os.cpu_count()} CPU core(s), torch {torch.__version__}")
    out = ns.output or os.path.join(ns.cache_dir, "demo_results.json")
    results = {"config": asdict(cfg), "old_accuracy": old, "runs": runs, "summary": summary}
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2)
    os.replace(tmp, out)
    echo(f"results: {out}")
    return results


if __name__ == "__main__":  # `python -m hf_constrained.demo` is `hf-constrained demo`
    from .cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
