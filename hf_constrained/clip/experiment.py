"""The CLIP non-forgetting experiment on a small zero-shot image task: the pipeline of the embedded demo
(``make demo``, ``recipes/demo_clip_digits.py``), of its generated-shapes example and of
``benchmarks/forgetting_frontier_demo.py``. The second application of Yang et al. (TMLR 2026, section 5) in
miniature (docs/demo.md: what it does, and why its numbers hold on images training never saw):

1. **Old model** (:func:`pretrain_old_model`, cached): a small CLIP pre-trained as a zero-shot classifier over
   the prompts of the task's classes (scikit-learn's digits by default, ``data="shapes"``: generated shapes), with
   the target class held out almost entirely, so it is weak on the target
   (:func:`hf_constrained.clip.image_task.train_zero_shot_classifier`).
2. **Target data** (:func:`target_rows`): noisy image-caption pairs: part of the "positives" are images of a
   protected class (``pulled``) captioned as the target, absent from the negatives, so plain fine-tuning forgets
   that class.
3. **Constrained fine-tuning** (:func:`finetune`, :class:`~hf_constrained.clip.ContrastiveConstrainedTrainer`,
   Algorithm 2) with one non-forgetting constraint per protected class k over its constraint images D_k, in the
   row-wise form (one shared ``row_fn``, d_i = CE_i(w) - CE_i(w_old) per image): by default
   h_k(w) = mean_i [d_i]_+ <= tol. Each image of D_k enters as several augmented copies, each with the old model's
   loss on THAT copy as its reference (:mod:`hf_constrained.clip.protected`); with ``confidence`` the constraints
   are calibrated, their margin z_c * s_k / sqrt(n_k) counting the original images, not their copies.
4. **Checkpoint selection** on images nothing else reads: every ``select_every`` steps the library's in-memory
   selection (:mod:`hf_constrained.safety.in_memory_selection`) keeps the best target loss among the checkpoints
   feasible there (``select_on="forgotten"``: every protected class's share of selection images forgotten is at
   most ``select_forget_rate``; ``"loss"``: every h_k <= tolerance, evaluated exactly).
5. **The release certificate** on the held-out images (25% of each digit by default, drawn with the run's seed:
   :func:`hf_constrained.certification.splits.partition_by_class`), read once, after training: per protected class
   "at most ``forget_tolerance`` of its images forgotten" (right under the old model, wrong now), an exact
   Clopper-Pearson bound at ``delta``, certified when every class passes; the run ends with ``finish_run``
   (:func:`write_run`: safety report, model card, figures). The accuracies are reported on the same images,
   read after the model is fixed.

Opt-in: two-split estimation (``indicator_fraction``) and the proxy indicator (``proxy_indicator``).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch
from transformers import AutoTokenizer, CLIPModel, TrainerCallback
from transformers.trainer_callback import PrinterCallback

from ..certification.splits import certification_tail, partition_by_class
from ..config import ConstrainedTrainingArguments
from ..constraint import Certification, Constraint
from ..margin import CalibratedMargin
from ..non_forgetting import ROWS_KEPT, ReferenceGap, forgetting_statistic, reference_losses
from ..progress import StepProgressBar
from ..publishing.certificate_text import certificate_record
from ..run_cost import StepClock, step_cost
from ..safety.finish import certify_models, finish_run
from ..safety.in_memory_selection import InMemoryFeasibleSelection, forgetting_violation, largest_constraint_violation
from ..safety.settings import CertificateArguments
from .contrastive import ContrastiveConstrainedTrainer
from .data import CLIPCollator, RowDataset
from .image_task import ImageTask, augmented_copies, load_digit_images, save_pretrained_once, train_zero_shot_classifier
from .non_forgetting import ZeroShotCorrect, ZeroShotLoss, zero_shot_accuracy
from .protected import ProtectedPools, held_out_values, protected_pools, zero_shot_regulariser
from .tiny import tiny_clip, word_tokenizer

logger = logging.getLogger(__name__)

DIGIT_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
SPLITS = ("pretrain", "constraint", "selection", "test", "certify")
# the per-row value of a non-forgetting constraint from d_i = CE_i(w) - CE_i(w_old)
FORGETTING: dict[str, Optional[Callable[[torch.Tensor], torch.Tensor]]] = {"mean": None, "increase": torch.relu}
SELECT_ON = ("loss", "forgotten")  # a feasible checkpoint: every h_k <= tolerance, or every share forgotten
STAGE1_COPIES = 4  # stage 1 sees each image or one of 3 shifted / noised copies of it
# The requirement the certificate checks: no protected digit loses more than 15 points (at most 15% of its images
# forgotten), stated before any run read the certification images (docs/demo.md, "What the certificate claims")
FORGET_TOLERANCE = 0.15
# none of the tuning seeds (0-4) nor the reporting seeds (100-104): nothing chose a setting on its images
DEFAULT_SEED = 2027


def _opt(default: Any, help: str) -> Any:
    """A setting's default and its one line of ``--help``."""
    return field(default=default, metadata={"help": help})


INDICATOR_BATCH_SIZE = 8
"""Indicator images per protected class and step under two-split estimation: the twenty-second tuning round's
choice (docs/benchmarks.md): as many tuning seeds certified as with 32, at a quarter of the forward-only images."""


SETTINGS_ADDED_LATER: dict[str, Any] = {"constraint_rows_kept": "all"}
"""Settings added after results were stored, each with the value every run before it had (:func:`stored_config`)."""


def stored_config(config: dict[str, Any]) -> dict[str, Any]:
    """A stored result's settings, completed with :data:`SETTINGS_ADDED_LATER` where they predate one."""
    return {**SETTINGS_ADDED_LATER, **config}


@dataclass
class DemoConfig(CertificateArguments):
    """The settings of one run of the experiment: the demo's options (``recipes/demo_clip_digits.py``: one
    ``--option`` each, whose help is the field's), with the certificate's error level ``delta`` inherited from
    :class:`~hf_constrained.safety.settings.CertificateArguments` (declared and checked there for every recipe)."""

    target: int = _opt(9, "class index of the new class to learn (9: 'nine')")
    pulled: int = _opt(5, "the protected class whose images pollute the target data (captioned as the target)")
    seed: int = _opt(DEFAULT_SEED, "the seed of the split, the old model and the fine-tuning (--seeds: several)")
    test_fraction: float = _opt(0.25, "per class: share of the images held out for the reported numbers")
    selection_fraction: float = _opt(0.15, "per class: share of the images that decides which checkpoint is kept")
    constraint_fraction: float = _opt(0.25, "per class: share of the images in D_k, the constraint data (unseen in "
                                            "stage 1)")
    certify_fraction: float = _opt(1.0, "share of each class's held-out images the certificate reads (0: no "
                                        "certificate)")
    stage1_target_keep: int = _opt(3, "stage 1: images of the target class the old model sees (it knows it barely)")
    stage1_epochs: int = _opt(40, "stage 1: epochs of the old model's training")
    stage1_lr: float = _opt(2e-3, "stage 1: learning rate of the old model's training")
    noisy_fraction: float = _opt(0.5, "polluting images (of --pulled) per clean target image in the target data")
    negatives_per_class: int = _opt(20, "negative image-caption pairs per other class in the target data")
    steps: int = _opt(150, "fine-tuning steps")
    batch_size: int = _opt(64, "fine-tuning batch size (image-caption pairs)")
    lr: float = _opt(3e-4, "fine-tuning learning rate")
    schedule: str = _opt("cosine", "fine-tuning learning-rate schedule (a transformers scheduler type)")
    warmup_steps: int = _opt(0, "fine-tuning warm-up steps")
    beta: float = _opt(10.0, "the penalty parameter beta (the hinge's weight, the paper's eq. (3))")
    constraint_batch_size: int = _opt(32, "|B_k|: rows of each sampled constraint per step")
    constraints_per_step: int = _opt(0, "|B_c|: constraints sampled per step, the others' estimates kept (0: every "
                                        "one)")
    forgetting: str = _opt("increase", "per-row constraint value: CE(new) - CE(old) ('mean') or its positive part "
                                       "('increase')")
    tolerance: float = _opt(0.05, "training: h_k <= tolerance (nats), checked on the selection and test splits")
    margin: float = _opt(0.0, "training enforces h_k <= tolerance - margin on D_k")
    confidence: float = _opt(0.9, "> 0: calibrated constraints, margin z_c * s_k / sqrt(originals of D_k); 0: off")
    msvr_gamma: float = _opt(0.5, "the MSVR constraint estimator's weight (Algorithm 2, line 12)")
    msvr_gamma_prime: float = _opt(0.0, "MSVR gamma': the look-ahead term's weight (0: none, the 21st round's choice)")
    max_grad_norm: float = _opt(0.0, "gradient clipping of the fine-tuning (0: none, as the method expects)")
    temperature: float = _opt(0.05, "temperature of the zero-shot logits in the constraints")
    constraint_copies: int = _opt(8, "augmented copies of each constraint image (the first is the image itself)")
    eval_copies: int = _opt(5, "augmented copies of each selection / test image")
    shift: float = _opt(0.5, "largest translation (pixels) of a copy")
    rotate: float = _opt(10.0, "largest rotation (degrees) of a copy")
    noise: float = _opt(0.1, "std of the Gaussian noise of a copy (images are in [-1, 1])")
    select_every: int = _opt(10, "steps between checkpoint-selection evaluations; 0 keeps the last iterate")
    forget_tolerance: float = _opt(FORGET_TOLERANCE, "the claim, certified: each protected class loses at most 100x "
                                                     "this many points")
    indicator_fraction: float = _opt(0.3, "> 0: two-split estimation, this share of D_k decides the hinge's "
                                          "indicator; 0: off")
    indicator_batch_size: int = _opt(INDICATOR_BATCH_SIZE, "with two-split estimation: rows per indicator batch "
                                                           "(0: --constraint_batch_size)")
    proxy_indicator: bool = _opt(False, "with two-split estimation: the hinge's indicator follows the share of D_k "
                                        "forgotten")
    proxy_forget_rate: float = _opt(0.05, "with --proxy_indicator: the share forgotten above which the hinge acts")
    constraint_rows_kept: str = _opt("all", "which of D_k's rows every method reads: all, or old_correct (those "
                                            "the old model classifies right)")
    select_on: str = _opt("forgotten", "feasible checkpoint: every h_k <= tolerance ('loss') or share forgotten "
                                       "('forgotten')")
    select_forget_rate: float = _opt(0.05, "with --select_on forgotten: the largest share of a class's selection "
                                           "images forgotten")
    data: str = _opt("digits", "the images: scikit-learn's digits, generated shapes, or 32 generated classes "
                               "(many_shapes)")
    pretrain_images: int = _opt(500, "--data shapes: images per class for stage 1 and the target data")
    constraint_images: int = _opt(300, "--data shapes: images per class in D_k")
    selection_images: int = _opt(200, "--data shapes: images per class for the checkpoint selection")
    held_out_images: int = _opt(3000, "--data shapes: held-out images per class (--certify_fraction of them "
                                      "certify)")
    shape_noise: float = _opt(0.1, "--data shapes: std of the generated images' pixel noise")


# ---------------------------------------------------------------------------------- data


def digits_split(cfg: DemoConfig) -> dict[str, Any]:
    """Digits as 1x8x8 images in [-1, 1], split per class with ``cfg.seed`` (:func:`partition_by_class`) into
    ``test`` (the held-out images), ``selection`` (which checkpoint is kept), ``constraint`` (D_k, never seen by
    the old model, as BDD100K was not CLIP's training data) and ``pretrain`` (stage 1 and the target data);
    ``certify``: the last ``certify_fraction`` of each class's held-out images (all by default), read once by the
    certificate, after training. ``held_out`` (``test`` and ``certify``) is what the accuracies are reported on,
    after the model is fixed. Only ``test`` and ``certify`` depend on ``certify_fraction``."""
    if cfg.test_fraction + cfg.selection_fraction + cfg.constraint_fraction >= 1:
        raise ValueError("test_fraction + selection_fraction + constraint_fraction must leave images for stage 1")
    images, labels = load_digit_images()
    shares = [("test", cfg.test_fraction), ("selection", cfg.selection_fraction),
              ("constraint", cfg.constraint_fraction)]
    parts = partition_by_class(labels, shares, cfg.seed, rest="pretrain", certify_from="test",
                               certify_fraction=cfg.certify_fraction, unit="images")
    return {"images": images, "labels": labels, **parts, "held_out": sorted(parts["test"] + parts["certify"])}


def shapes_split(cfg: DemoConfig) -> dict[str, Any]:
    """Generated shapes (:mod:`hf_constrained.clip.shapes`, 1x16x16; ``--data many_shapes``: the 32 classes of
    :mod:`hf_constrained.clip.many_shapes`) in the layout of :func:`digits_split`: per class ``pretrain_images``,
    ``constraint_images``, ``selection_images`` and ``held_out_images`` images, each split from its own generator
    stream of ``cfg.seed`` (its index in :data:`SPLITS`): independent samples that never share an image. The
    held-out images split into ``test`` and ``certify`` as the digits' do."""
    classes, draw = _generator(cfg.data)
    counts = {"pretrain": cfg.pretrain_images, "constraint": cfg.constraint_images,
              "selection": cfg.selection_images, "held_out": cfg.held_out_images}
    bad = [f"--{k}_images" for k, v in counts.items() if v < 0 or (k == "pretrain" and v < 1)]
    if bad:
        raise ValueError(f"{', '.join(bad)}: a number of generated images per class (>= 0; stage 1 needs >= 1)")
    certification_tail([], cfg.certify_fraction, unit="images")  # checked before any image is drawn
    images, labels, parts = [], [], {k: [] for k in SPLITS}
    for split, n in counts.items():
        stream = SPLITS.index("test" if split == "held_out" else split)
        x, y = draw(cfg.seed, stream, [n] * len(classes), image_size=SHAPE_SIZE, noise=cfg.shape_noise)
        idx = np.arange(len(y)) + sum(map(len, labels))
        images.append(x)
        labels.append(y)
        if split != "held_out":
            parts[split] = idx.tolist()
            continue
        for c in range(len(classes)):  # per class, as the digits: the last certify_fraction certify
            test, certify = certification_tail(idx[y == c], cfg.certify_fraction, unit="images")
            parts["test"] += test.tolist()
            parts["certify"] += certify.tolist()
    return {"images": np.concatenate(images), "labels": np.concatenate(labels),
            **{k: sorted(v) for k, v in parts.items()}, "held_out": sorted(parts["test"] + parts["certify"])}


def _generator(data: str) -> tuple[tuple[str, ...], Callable[..., tuple[np.ndarray, np.ndarray]]]:
    """The class names and the draw function of a generated image task (``--data shapes`` or ``many_shapes``)."""
    if data == "many_shapes":
        from .many_shapes import MANY_SHAPES, draw_many_shapes

        return MANY_SHAPES, draw_many_shapes
    from .shapes import SHAPES, draw_shapes

    return SHAPES, draw_shapes


DATA_NAMES = ("digits", "shapes", "many_shapes")  # the choices of --data (:func:`demo_data`)
# the settings only the generated images read (the digits split by fractions)
SHAPE_FIELDS = ("data", "pretrain_images", "constraint_images", "selection_images", "held_out_images", "shape_noise")
# settings added after results were committed: a results file records them only where they differ from the default
# (0: every constraint each step, as every earlier run)
LATER_FIELDS = ("constraints_per_step",)
SHAPE_SIZE = 16  # the generated images' side (4x4 patches: 16 patches, as the digits' 8x8 with 2x2 patches)


def demo_data(cfg: DemoConfig) -> ImageTask:
    """The image task ``cfg.data`` names; an unknown one, or a target / pulled class outside it, is an error
    naming the flag."""
    from .many_shapes import MANY_SHAPES
    from .shapes import SHAPES

    sources = {
        "digits": ImageTask(tuple(DIGIT_NAMES), "a photo of the digit {}", "digit", 8, 2, digits_split,
                            "scikit-learn digits (8x8)", supply="the digits have about 180 per digit in all "
                            "(docs/demo.md); hf-constrained shapes-example certifies 3 points on generated images"),
        "shapes": ImageTask(SHAPES, "a photo of a {}", "shape", SHAPE_SIZE, 4, shapes_split,
                            "generated shapes (16x16, hf_constrained.clip.shapes)", supply_flag="--held_out_images"),
        "many_shapes": ImageTask(MANY_SHAPES, "a photo of a {}", "class", SHAPE_SIZE, 4, shapes_split,
                                 "32 generated classes: 8 shapes x 2 sizes x 2 tones (16x16, "
                                 "hf_constrained.clip.many_shapes)", supply_flag="--held_out_images"),
    }
    if cfg.data not in sources:
        raise ValueError(f"--data must be one of {list(sources)}, got {cfg.data!r}")
    source = sources[cfg.data]
    for flag in ("target", "pulled"):
        if not 0 <= getattr(cfg, flag) < len(source.names):
            raise ValueError(f"--{flag} must be a class index of --data {cfg.data} (0-{len(source.names) - 1}), "
                             f"got {getattr(cfg, flag)}")
    if cfg.target == cfg.pulled:
        raise ValueError(f"--pulled must differ from --target, got {cfg.pulled} for both")
    return source


def _row(data: dict[str, Any], i: int) -> dict[str, Any]:
    return {"pixel_values": data["images"][i], "label": int(data["labels"][i])}


def class_rows(data: dict[str, Any], split: str, c: int, copies: int = 1, cfg: Optional[DemoConfig] = None
               ) -> list[dict[str, Any]]:
    """Rows of class ``c`` in ``split``; with ``copies > 1`` each image as :func:`augmented_copies`."""
    idx = [i for i in data[split] if data["labels"][i] == c]
    if copies == 1:
        return [_row(data, i) for i in idx]
    cfg = cfg or DemoConfig()
    # one stream per (seed, split, class); the held-out images keep the test split's stream
    seed = cfg.seed * 1000 + SPLITS.index("test" if split == "held_out" else split) * 10 + c
    images = augmented_copies(data["images"][idx], copies, seed, cfg.shift, cfg.rotate, cfg.noise)
    return [{"pixel_values": x, "label": c} for x in images]


def target_rows(data: dict[str, Any], cfg: DemoConfig) -> list[dict[str, Any]]:
    """Noisy target pairs: target images + polluting images of ``pulled`` captioned as the target
    (positives), and other classes with their own captions (negatives, ``pulled`` excluded)."""
    rng = np.random.default_rng(cfg.seed + 1)
    source = demo_data(cfg)
    caption = source.template.format(source.names[cfg.target])
    # every target image outside the selection, test and certification splits (the target has no constraint data)
    clean = [i for i in data["pretrain"] + data["constraint"] if data["labels"][i] == cfg.target]
    rows = [{**_row(data, i), "caption": caption, "is_positive": True} for i in clean]
    pulled = [i for i in data["pretrain"] if data["labels"][i] == cfg.pulled]
    n_noisy = min(len(pulled), int(round(cfg.noisy_fraction * len(clean))))
    rows += [{**_row(data, int(i)), "caption": caption, "is_positive": True}
             for i in rng.choice(pulled, size=n_noisy, replace=False)]
    for c in range(len(source.names)):
        if c in (cfg.target, cfg.pulled):
            continue
        pool = [i for i in data["pretrain"] if data["labels"][i] == c]
        rows += [{**_row(data, int(i)), "caption": source.template.format(source.names[c]), "is_positive": False}
                 for i in rng.choice(pool, size=min(len(pool), cfg.negatives_per_class), replace=False)]
    return rows


# ---------------------------------------------------------------------------------- stage 1


def _stage1_key(cfg: DemoConfig) -> str:
    keys = ("target", "seed", "test_fraction", "selection_fraction", "constraint_fraction", "stage1_target_keep",
            "stage1_epochs", "stage1_lr", "temperature", "shift", "rotate", "noise")
    if cfg.data != "digits":  # the digits' key is unchanged, so their cached old models stay valid
        keys += ("data", "pretrain_images", "shape_noise")
    blob = json.dumps({k: getattr(cfg, k) for k in keys}, sort_keys=True) + "v3"
    if cfg.data == "many_shapes":  # its generator's size bands too (the other tasks' keys are as they were)
        from .many_shapes import SIZES

        blob += json.dumps(SIZES, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def pretrain_old_model(cfg: DemoConfig, cache_dir: str, log: Callable[[str], None] = logger.info) -> str:
    """Stage 1 (cached): a small CLIP trained as a zero-shot classifier of the task's classes, weak on the target
    (:func:`train_zero_shot_classifier`; one of ``STAGE1_COPIES`` augmented copies of each image per epoch, so the
    old model knows the shifted and noised images of the pools)."""
    source = demo_data(cfg)
    path = os.path.join(cache_dir, f"{cfg.data}-clip-{_stage1_key(cfg)}")
    if os.path.exists(os.path.join(path, "config.json")):
        log(f"stage 1: cached old model at {path}")
        return path
    t0 = time.time()
    data = source.split(cfg)
    tokenizer = word_tokenizer(source.prompt_texts)
    model = tiny_clip(len(tokenizer), image_size=source.image_size, patch_size=source.patch_size, num_channels=1,
                      seed=cfg.seed)
    rng = np.random.default_rng(cfg.seed + 2)
    train = [i for i in data["pretrain"] if data["labels"][i] != cfg.target]
    idx = np.array(train + [i for i in data["pretrain"] if data["labels"][i] == cfg.target][: cfg.stage1_target_keep])
    bank = augmented_copies(data["images"][idx], STAGE1_COPIES, cfg.seed + 3, cfg.shift, cfg.rotate, cfg.noise)
    train_zero_shot_classifier(model, bank, data["labels"][idx], source.prompts(tokenizer), copies=STAGE1_COPIES,
                               epochs=cfg.stage1_epochs, lr=cfg.stage1_lr, temperature=cfg.temperature, rng=rng,
                               seed=cfg.seed)
    save_pretrained_once(model, tokenizer, path)
    log(f"stage 1: pre-trained the old model in {time.time() - t0:.0f}s -> {path}")
    return path


def load_old_model(old_path: str) -> CLIPModel:
    """The old (stage-1) model from its folder: load it once per seed and pass it to :func:`old_pools`,
    :func:`old_accuracy` and :func:`finetune` (which trains a copy)."""
    return CLIPModel.from_pretrained(old_path)


def _zero_shot(old_path: str, cfg: DemoConfig) -> tuple[Any, ZeroShotLoss, CLIPCollator]:
    """The old model's tokenizer, the zero-shot loss over the task's prompts and the collator."""
    tokenizer = AutoTokenizer.from_pretrained(old_path)
    p = demo_data(cfg).prompts(tokenizer)
    return tokenizer, ZeroShotLoss(p["input_ids"], p["attention_mask"], temperature=cfg.temperature), \
        CLIPCollator(tokenizer=tokenizer)


def old_pools(cfg: DemoConfig, old_path: str, model: Optional[CLIPModel] = None) -> ProtectedPools:
    """The protected classes' pools with the old model's reference values (:func:`protected_pools`, computed once per
    seed; ``model``: the old model already loaded, else loaded from ``old_path``)."""
    _, zs, collate = _zero_shot(old_path, cfg)
    model = load_old_model(old_path) if model is None else model
    data = demo_data(cfg).split(cfg)
    return protected_pools(lambda split, c, copies: class_rows(data, split, c, copies, cfg), demo_data(cfg).names,
                           cfg.target, model, zs, collate, constraint_copies=cfg.constraint_copies,
                           eval_copies=cfg.eval_copies, constraint_correctness=cfg.proxy_indicator,
                           constraint_rows_kept=cfg.constraint_rows_kept)


def old_accuracy(cfg: DemoConfig, old_path: str, pools: ProtectedPools, model: Optional[CLIPModel] = None
                 ) -> dict[str, float]:
    """The old model's held-out accuracy per class (``model``: the old model already loaded; else from ``old_path``)."""
    _, zs, collate = _zero_shot(old_path, cfg)
    model = load_old_model(old_path) if model is None else model
    return zero_shot_accuracy(model, pools.test_all, zs, collate, list(demo_data(cfg).names), batch_size=512)


# ---------------------------------------------------------------------------------- stage 2


def check_settings(cfg: DemoConfig, certify: bool = True) -> None:
    """Reject settings that would be ignored or contradictory, naming the flag, before any model is trained (the
    certificate's claim is read only at the end; its level, ``--delta``, is checked when :class:`DemoConfig` is
    built)."""
    problems = [
        (cfg.select_on not in SELECT_ON, f"--select_on must be one of {list(SELECT_ON)}, got {cfg.select_on!r}"),
        (not 0 <= cfg.select_forget_rate < 1, f"--select_forget_rate must be in [0, 1), got {cfg.select_forget_rate}"),
        (not 0 <= cfg.indicator_fraction < 1,
         f"--indicator_fraction must be in [0, 1) (0: one split), got {cfg.indicator_fraction}"),
        (cfg.indicator_batch_size < 0,
         f"--indicator_batch_size must be >= 0 (0: --constraint_batch_size), got {cfg.indicator_batch_size}"),
        (cfg.proxy_indicator and cfg.indicator_fraction == 0,
         "--proxy_indicator needs two-split estimation: give --indicator_fraction > 0"),
        (cfg.proxy_indicator and (not certify or cfg.certify_fraction == 0),
         "--proxy_indicator follows the certificate's statistic: it needs --certify_fraction > 0"),
        (cfg.proxy_indicator and not 0 <= cfg.proxy_forget_rate <= cfg.forget_tolerance,
         f"--proxy_forget_rate must be in [0, --forget_tolerance={cfg.forget_tolerance:g}], "
         f"got {cfg.proxy_forget_rate}"),
        (cfg.constraint_rows_kept not in ROWS_KEPT,
         f"--constraint_rows_kept must be all or old_correct, got {cfg.constraint_rows_kept!r}"),
        (cfg.constraints_per_step < 0, f"--constraints_per_step must be >= 0 (0: every constraint each step), "
                                       f"got {cfg.constraints_per_step}"),
        (cfg.proxy_indicator and cfg.confidence > 0,
         "--confidence sizes a margin from the loss's spread, but with --proxy_indicator the hinge acts on the "
         "share forgotten (--proxy_forget_rate): give --confidence 0 with it"),
        (cfg.indicator_batch_size not in (0, INDICATOR_BATCH_SIZE) and cfg.indicator_fraction == 0,
         f"--indicator_batch_size {cfg.indicator_batch_size} sizes the batches of two-split estimation, which "
         "--indicator_fraction 0 turns off: give --indicator_batch_size 0 with it")]
    for wrong, message in problems:
        if wrong:
            raise ValueError(message)
    if not 0 < cfg.forget_tolerance <= 1:
        raise ValueError(f"--forget_tolerance is a share of each protected class's images forgotten, in (0, 1] "
                         f"(0.15: at most 15 points lost), got {cfg.forget_tolerance}")


def demo_constraints(cfg: DemoConfig, pools: ProtectedPools, rows_fn: ReferenceGap, collate: CLIPCollator
                     ) -> list[Constraint]:
    """One non-forgetting constraint per protected class: D_k = the class's constraint pool, checked on its
    selection pool, all with the one row function ``rows_fn`` (per image, CE now minus the old model's CE on
    the same input, so the mean over D_k is h_k = L_k(w) - L_k(w_old)); with ``cfg.confidence > 0`` a
    calibrated constraint whose margin counts the n_k original images of D_k, not their copies
    (``Constraint.independent_rows``); certified on the class's certification images, if any."""
    if cfg.forgetting not in FORGETTING:
        raise ValueError(f"--forgetting must be one of {list(FORGETTING)}, got {cfg.forgetting!r}")
    if not (cfg.confidence == 0 or 0.5 <= cfg.confidence < 1):
        raise ValueError(f"--confidence must be in [0.5, 1) (or 0: no calibrated margin), got {cfg.confidence}")
    check_settings(cfg, certify=bool(pools.certify))
    # with a proxy indicator the estimate is a share forgotten (0/1 per row), compared with forget_tolerance: the
    # fixed margin forget_tolerance - proxy_forget_rate makes the hinge act above proxy_forget_rate (no calibrated
    # margin from the surrogate's spread: two scales)
    calibrated = cfg.confidence > 0
    proxy_margin = cfg.forget_tolerance - cfg.proxy_forget_rate if cfg.proxy_indicator else None
    statistic = forgetting_statistic(ZeroShotCorrect(rows_fn.loss), cfg.forget_tolerance) if pools.certify else None
    return [Constraint(name=f"non_forgetting/{name}", row_fn=rows_fn, dataset=pools.constraint[name],
                       eval_dataset=pools.selection[name], tolerance=cfg.tolerance - cfg.margin,
                       row_transform=FORGETTING[cfg.forgetting], collate_fn=collate,
                       margin=CalibratedMargin(cfg.confidence) if calibrated else proxy_margin,
                       independent_rows=len(pools.constraint[name]) // cfg.constraint_copies if calibrated else None,
                       certify=Certification(dataset=pools.certify[name], statistic=statistic)
                       if name in pools.certify else None,
                       metadata={"class": name, "requirement": cfg.tolerance}) for name in pools.constraint]


@dataclass(frozen=True)
class RunOutput:
    """Where :func:`finetune` saves the kept model with its safety report, card and figures (``folder``), and what
    the card shows: the old model's held-out accuracies and the command that made the run."""

    folder: str
    old_accuracy: Optional[dict[str, float]] = None
    command: Optional[str] = None


RUN_FILES = {"report": "safety_report.json", "card": "README.md", "figures": "figures"}
"""What :func:`finetune` writes into a run folder besides the model (``finish_run``'s files)."""


def run_folder(seed: int | str, penalty: str) -> str:
    """The folder name (under ``--cache_dir``) of one fine-tuning run's model, report, card and figures."""
    return f"seed-{seed}-{penalty}"


def _trainer(cfg: DemoConfig, model: CLIPModel, penalty: str, out_dir: str, **parts: Any
             ) -> ContrastiveConstrainedTrainer:
    args = ConstrainedTrainingArguments(
        output_dir=out_dir, max_steps=cfg.steps, per_device_train_batch_size=cfg.batch_size,
        learning_rate=cfg.lr, lr_scheduler_type=cfg.schedule, warmup_steps=cfg.warmup_steps, weight_decay=0.0,
        max_grad_norm=cfg.max_grad_norm, constraint_penalty=penalty, penalty_beta=cfg.beta, msvr_gamma=cfg.msvr_gamma,
        msvr_gamma_prime=cfg.msvr_gamma_prime,
        constraint_batch_size=cfg.constraint_batch_size, constraint_eval_batch_size=512,
        constraints_per_step=cfg.constraints_per_step or None,
        logging_steps=max(cfg.steps // 5, 1), save_strategy="no", report_to=[], seed=cfg.seed, use_cpu=True,
        dataloader_drop_last=True, disable_tqdm=True, remove_unused_columns=False,
        constraint_indicator_fraction=cfg.indicator_fraction or None, constraint_proxy_indicator=cfg.proxy_indicator,
        constraint_indicator_batch_size=(cfg.indicator_batch_size or None) if cfg.indicator_fraction else None)
    trainer = ContrastiveConstrainedTrainer(model=model, args=args, contrastive_temperature=cfg.temperature, **parts)
    trainer.remove_callback(PrinterCallback)  # the summary says what matters
    return trainer


def finetune(cfg: DemoConfig, old_path: str, penalty: str, pools: Optional[ProtectedPools] = None,
             log: Callable[[str], None] = logger.info, output: Optional[RunOutput] = None,
             regulariser: Optional[tuple[str, float]] = None, callbacks: Sequence[TrainerCallback] = (),
             old_model: Optional[CLIPModel] = None) -> dict[str, Any]:
    """Contrastive fine-tuning toward the target class with one non-forgetting constraint per other class.

    Returns the kept model's per-class held-out accuracy, the exact constraint values on D_k (``h_train``), on the
    selection split (``h_selection``) and on the held-out images (``h_test``, CLT upper bounds in
    ``h_test_bound``), the calibrated margins, the certificate (:func:`certificate_record`) and the selection's
    record. The kept checkpoint: the library's in-memory selection, on the selection split (feasible first,
    then the target loss), whenever constraints or a baseline are trained; the target loss alone otherwise.

    ``output``: save the kept model there and end the run with ``finish_run`` (:func:`write_run`); the record's
    ``files`` names what it wrote. ``regulariser``: a baseline ``(name, value)`` (replay or KL to the old model,
    :func:`zero_shot_regulariser`) added to the objective, recorded as ``regulariser``. ``callbacks``: more
    trainer callbacks, called before the demo's own. ``old_model``: the old model already loaded from
    ``old_path`` (:func:`load_old_model`); a copy of it is trained, and it is left as it was.
    """
    t0 = time.time()
    source = demo_data(cfg)
    tokenizer, zs, collate = _zero_shot(old_path, cfg)
    model = load_old_model(old_path) if old_model is None else copy.deepcopy(old_model)
    model.logit_scale.requires_grad_(False)  # fixed temperature
    pools = old_pools(cfg, old_path, model) if pools is None else pools
    constraints = demo_constraints(cfg, pools, ReferenceGap(zs), collate)  # one row_fn: one row-wise group
    # replay and KL keep a checkpoint by the constrained runs' rule; plain fine-tuning by the target loss alone
    use_constraints = penalty != "none" or regulariser is not None
    violation = None
    if cfg.select_every > 0 and use_constraints and cfg.select_on == "forgotten":  # the old model's, taken now
        violation = forgetting_violation(model, pools.selection, ZeroShotCorrect(zs), cfg.select_forget_rate, collate)
    baseline = zero_shot_regulariser(regulariser, model, pools.constraint, zs, collate, rows_per_step=cfg.batch_size,
                                     seed=cfg.seed)  # before training: the old model
    files: dict[str, str] = {}
    clock = StepClock()  # before the selection's callback: its evaluations are left out of the step's time
    with contextlib.ExitStack() as stack:
        out_dir = output.folder if output is not None else stack.enter_context(tempfile.TemporaryDirectory())
        trainer = _trainer(cfg, model, penalty, out_dir, train_dataset=RowDataset(target_rows(source.split(cfg), cfg)),
                           data_collator=collate, constraints=constraints, regulariser=baseline,
                           callbacks=[*callbacks, clock])
        selection = None
        if cfg.select_every > 0:  # "loss": every h_k <= the requirement itself, not tolerance - margin
            if use_constraints and violation is None:
                violation = largest_constraint_violation(trainer, requirement=cfg.tolerance)
            selection = InMemoryFeasibleSelection(
                cfg.select_every, lambda m: float(reference_losses(m, pools.target_selection, zs, collate).mean()),
                violation, metric="target loss (selection images)")
            trainer.add_callback(selection)
        trainer.add_callback(StepProgressBar(f"stage 2: fine-tuning ({penalty})"))
        trainer.train()
        cost = step_cost(trainer, clock)
        best = selection.restore(model) if selection is not None else None
        kept = best.step if best is not None else cfg.steps
        margins = trainer.constraint_margins()  # the calibrated margins in force at the end of training
        h_train = trainer.evaluate_constraints(split="train")
        h_selection = trainer.evaluate_constraints(split="eval")
        # the kept model, certified once on the certification images (fixed before they are read)
        certificate = certify_models(trainer, delta=cfg.delta)
        h_test, h_bound = held_out_values(model, pools.test, zs, collate, FORGETTING[cfg.forgetting])
        acc = zero_shot_accuracy(model, pools.test_all, zs, collate, list(source.names), batch_size=512)
        if output is not None:
            trainer.safety.declare_weights_origin(kept)  # the step the demo's own selection kept (weights in memory)
            files = write_run(cfg, trainer, tokenizer, penalty, acc, output)
    log(f"  {penalty if baseline is None else f'{penalty}+{baseline.name}':>13}: kept step {kept}, "
        f"{time.time() - t0:.0f}s")
    record = {"penalty": penalty, "accuracy": acc, "h_train": h_train, "h_selection": h_selection, "h_test": h_test,
              "h_test_bound": h_bound, "kept_step": kept, "margins": margins,
              "certificate": certificate_record(certificate, [c.name for c in constraints]),
              "selection": selection.record_dicts() if selection is not None else [], "files": files, **cost}
    if baseline is not None:  # a run without one records what it always did
        record["regulariser"] = baseline.settings()
    return record


def write_run(cfg: DemoConfig, trainer: ContrastiveConstrainedTrainer, tokenizer: Any, penalty: str,
              acc: dict[str, float], output: RunOutput) -> dict[str, str]:
    """Save the kept model and tokenizer into the trainer's output folder (through the trainer, so the report can
    name the weight files and ``hf-constrained report FOLDER --check`` tell they are the weights it describes) and
    end the run with ``finish_run``: safety report (the same certificate: the same model, statistic and images),
    model card and training-curve figures. Returns the files written, relative to the folder."""
    out = trainer.args.output_dir
    os.makedirs(out, exist_ok=True)
    tokenizer.save_pretrained(out)
    trainer.save_model(out)
    source = demo_data(cfg)
    target, noun = source.names[cfg.target], source.noun
    names = {c.name: c.metadata["class"] for c in trainer.constraints}
    extra = {"new accuracy": {c: acc[k] for c, k in names.items()}}
    if output.old_accuracy is not None:
        extra = {"old accuracy": {c: output.old_accuracy[k] for c, k in names.items()}, **extra}
    n = sorted(len(c.certify.dataset) for c in trainer.constraints if c.certify is not None)
    certified_on = (f"{n[0]}-{n[-1]} held-out images per protected {noun} (read by nothing else) as 'each protected "
                    f"{noun} loses at most {100 * cfg.forget_tolerance:g} points of accuracy' (share of its images "
                    "forgotten)" if n else "no certification split")
    finish_run(trainer, old_model_values={c: 0.0 for c in names},
               base_model_name=f"{cfg.data} CLIP (stage 1 of the demo, seed {cfg.seed})",
               dataset_description=f"{source.description}. Fine-tuned toward the {noun} {target!r} on noisy "
               f"image-caption pairs ({source.names[cfg.pulled]!r} images captioned {target!r} among them), penalty "
               f"{penalty}, one non-forgetting constraint per other {noun}. Accuracies on held-out images; certified "
               f"on {certified_on}", eval_dataset=cfg.data, task="zero-shot-image-classification",
               license="apache-2.0", reproduce_command=output.command, delta=cfg.delta,
               objective_metrics={f"accuracy/{k}": v for k, v in acc.items()}, extra_columns=extra,
               show=False)  # the demo prints the verdict itself, in words: not a second time as a logged table
    return {key: name for key, name in RUN_FILES.items() if os.path.exists(os.path.join(out, name))}


__all__ = ["DemoConfig", "FORGETTING", "ImageTask", "LATER_FIELDS", "RunOutput", "check_settings", "class_rows",
           "demo_constraints", "demo_data", "digits_split", "finetune", "load_old_model", "old_accuracy", "old_pools",
           "pretrain_old_model", "run_folder", "shapes_split", "target_rows", "write_run"]
