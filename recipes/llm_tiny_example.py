"""A small causal LM that learns a new string task without forgetting its old ones (offline, CPU).

1. The old model: a tiny GPT-2 (built from a config, character-level tokenizer built
   locally) trained on three string tasks: reverse a word (``rev:abc=cba``), copy it
   (``cp:abc=abc``) and add two digits (``add:7+8=15``); words of 3-5 letters from a-j.
2. Fine-tuning on a new task, answering with the first letter only (``fst:abc=a``), twice per
   seed: unconstrained (plain SFT) and with one non-forgetting constraint per old task,
   h_k(w) = L_k(w) - L_k(w_old) <= tol (mean per-example token loss of the answers; hinge
   exact penalty with MSVR estimates, Algorithm 1), plus replay of old rows in its batches (``--replay_old``).
3. Held-out per-task loss and exact-match accuracy (greedy decoding; computed in one
   teacher-forced pass: the greedy answer is exact iff every answer token, EOS included,
   is the argmax given the correct prefix), old vs new.
4. A certificate per run: on 2000 certification rows per old task (``--certify_rows``; independent
   draws of the task's generator, fixed across seeds, read by nothing but the certificate), the
   share of rows the old model answered exactly and the new one no longer does (teacher-forced
   exact match, ``causal_lm_per_example_correct``), bounded by Clopper-Pearson. CERTIFIED: at most
   ``--forget_tolerance`` of each old task's examples forgotten, so at most that many points of its
   accuracy lost. Each run is one release, certified once: the first look at the rows (level 0.9 *
   ``--delta`` = 0.045 under the default spending, :func:`study_ledger`). The tasks are small (``add``
   has 100 problems), so certification rows can repeat a training row's text: they are named by their
   draw, and the claim is about each task's distribution, the one the training rows come from too, not
   about problems never trained on.

   The claim is the user's, stated before any data: ``--forget_tolerance 0.03`` ("at most 3% of each old
   task forgotten", at most 3 points lost), at delta 0.05; 2000 rows per task are what that claim needs
   (``benchmarks/certification_size.py``). The method's own settings (defaults chosen on seeds 0-4 by
   ``benchmarks/forgetting_frontier.py``, docs/benchmarks.md): 4096 constraint rows per old task
   (``--constraint_rows``), in two splits: a quarter drive the indicator (``--constraint_indicator_fraction
   0.25``), the rest the gradient; a proxy indicator (``--constraint_proxy_indicator``: it follows the
   certificate's statistic, the share of the indicator rows forgotten, against the claim minus
   ``--constraint_margin`` 0.02, while the gradient follows the loss change h_k, ``--constraint_surrogate``),
   an MSVR estimate that averages about five steps (``--msvr_gamma 0.2``) without the look-ahead forward
   (``--msvr_gamma_prime 0``: the twentieth round found it kept nothing more), beta 0.25, 11 constraint rows per
   task and step (``--constraint_batch_size``), and replay of those same rows as half of the loss
   (``--replay_old 0.5``: one draw of old rows per step, each row carrying replay's weight plus the hinge's);
   500 fine-tuning steps, shared by every method of the comparison. The results against replay, KL and plain
   fine-tuning, at each method's cost per step, are in docs/benchmarks.md.

Goals, over the seeds (median and worst reported): the unconstrained run forgets some old task
(its held-out h_k exceeds ``--tolerance``); the constrained run is certified, and learns the new
task (held-out exact match >= ``--learned_accuracy``), each in at least 80% of the seeds (4 of 5 with
``--seeds 0 1 2 3 4``). One seed by default, a few minutes; the wider evaluation is a flag away:

    python recipes/llm_tiny_example.py --seeds 100 101 102 103 104 --json benchmarks/results/llm_example.json
    python recipes/llm_tiny_example.py --penalty_beta 5 --replay_old 0 --seeds 0
    hf-constrained llm-example --config my_settings.yaml       # any flag below, as YAML

The fine-tuning flags carry the names of ``ConstrainedTrainingArguments``
(``--constraint_penalty``, ``--penalty_beta``, ``--max_steps``, ``--learning_rate``,
``--lr_scheduler_type``, ``--warmup_steps``, ``--per_device_train_batch_size``, ``--msvr_gamma``,
``--msvr_gamma_prime``, ``--constraint_batch_size``, ``--constraint_indicator_fraction``,
``--constraint_proxy_indicator``, ``--constraint_margin``);
``--constraint_surrogate loss_increase`` makes the gradient follow each row's loss rise only;
``--constraint_rows_kept old_correct`` keeps, of each old task's constraint rows, those the old model answers
exactly, for every method;
``--replay_old`` mixes old rows into the constrained run's batches (``hf_constrained.method.regularisers.Replay``),
``--kl_to_old`` adds a KL anchor instead (``KLToOld``; with ``--replay_old 0``);
a flag the example does not list is an error.

The old model is trained by every invocation, deterministically (seed 0, ``--threads`` torch
threads; its SHA-256 is in the results); the seeds vary the fine-tuning runs (data order,
constraint batches) and the new task's training rows. Results depend on the thread count: keep
``--threads 1`` (the default) to reproduce the published table.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import logging
import math
import multiprocessing
import os
import platform
import random
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import datasets
import torch
import transformers
from datasets import Dataset, concatenate_datasets
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.trainer_callback import PrinterCallback

from hf_constrained import ConstrainedTrainer, ConstrainedTrainingArguments
from hf_constrained.atomic_files import atomic_write_json
from hf_constrained.certification.ledger import user_ledger_at
from hf_constrained.method.projection import AGEM, GradientProjection, ReplayAGEM
from hf_constrained.method.regularisers import ConstraintRowReplay, KLToOld, L2ToOld, ObjectiveRegulariser, Replay
from hf_constrained.non_forgetting import (
    ROWS_KEPT,
    NonForgettingConfig,
    PaddingCollator,
    causal_lm_per_example_loss,
    non_forgetting_constraints,
    reference_losses,
    with_old_correctness,
)
from hf_constrained.per_sample_loss import IGNORE_INDEX, causal_lm_per_example_correct
from hf_constrained.progress import StepProgressBar
from hf_constrained.publishable import publishable_command, publishable_values
from hf_constrained.recipe_args import CertificateArguments, parse_recipe_args
from hf_constrained.recipes.tiny_lm import char_tokenizer, tiny_causal_lm
from hf_constrained.reference_pass import rows_answered
from hf_constrained.run_cost import rows_per_step
from hf_constrained.safety.finish import certify_models
from hf_constrained.text_data import tokenize_sft

logger = logging.getLogger("llm_tiny_example")

OLD_TASKS = ("reverse", "copy", "add")
NEW_TASK = "first"
LETTERS = "abcdefghij"
# generator seeds of the fixed rows (the same for every fine-tuning seed): constraint rows, held-out rows,
# certification rows (independent draws, read only by the certificate)
CONSTRAINT_DRAW, HELD_OUT_DRAW, CERTIFY_DRAW = 1, 999, 7


class IndependentDraws(torch.utils.data.Dataset):
    """Rows drawn independently from a task's generator, each named by its draw (``task/certify/i``).

    The certification split: a fresh sample of the task's distribution, drawn apart from every other
    row. The tasks are small (``add`` has 100 problems), so a draw can repeat a training row's text;
    the rows are named by their draw, not their text, and the certificate's claim is about the task's
    distribution (the one the training rows come from), not about problems never trained on.
    """

    def __init__(self, rows: Dataset, name: str) -> None:
        self.rows, self.name = rows, name

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]

    def __getitems__(self, rows: list[int]) -> list[dict[str, Any]]:
        return [self.rows[i] for i in rows]

    def row_identities(self) -> list[str]:
        return [f"{self.name}/{i}" for i in range(len(self.rows))]


def make_rows(task: str, n: int, rng: random.Random) -> list[dict[str, str]]:
    """``n`` prompt/completion rows of one task."""
    rows = []
    for _ in range(n):
        if task == "add":
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            rows.append({"prompt": f"add:{a}+{b}=", "completion": str(a + b)})
            continue
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 5)))
        answer = {"reverse": word[::-1], "copy": word, "first": word[0]}[task]
        prefix = {"reverse": "rev", "copy": "cp", "first": "fst"}[task]
        rows.append({"prompt": f"{prefix}:{word}=", "completion": answer})
    return rows


@dataclass(frozen=True)
class StringTasks:
    """The string tasks of an offline example: the old tasks the old model learns (one non-forgetting
    constraint each), the new task it is fine-tuned on, the generator of a task's prompt/completion rows
    (``make_rows(task, n, rng)``) and the GPT-2's context length that holds the longest row.

    Every function of this module reads its tasks from the settings (:meth:`ExampleArguments.string_tasks`),
    so an example with other tasks (``recipes/llm_many_tasks_example.py``) is a subclass of the settings."""

    old: tuple[str, ...]
    new: str
    make_rows: Callable[[str, int, random.Random], list[dict[str, str]]]
    max_positions: int = 32


TASKS = StringTasks(OLD_TASKS, NEW_TASK, make_rows)
"""This example's tasks: ``reverse``, ``copy`` and ``add`` old, ``first`` new."""


def task_data(task: str, n: int, seed: int, tokenizer: Any,
              make: Callable[[str, int, random.Random], list[dict[str, str]]] = make_rows) -> Dataset:
    """``n`` tokenised rows of ``task`` from generator seed ``seed`` (``make``: the tasks' row generator).

    Kept for the process's later runs (a worker of :func:`finetune_runs` runs several): the rows are a function
    of the arguments and the tokenizer's vocabulary, and tokenising them is a good part of a run's setup."""
    key = (task, n, seed, make, type(tokenizer).__name__, tuple(sorted(tokenizer.get_vocab().items())))
    if key not in _TOKENIZED:
        if len(_TOKENIZED) >= 512:
            _TOKENIZED.clear()
        rng = random.Random(f"{task}-{seed}")
        _TOKENIZED[key] = tokenize_sft(Dataset.from_list(make(task, n, rng)), tokenizer, name=task)
    return _TOKENIZED[key]


_TOKENIZED: dict[tuple, Dataset] = {}


@torch.no_grad()
def exact_match(model: torch.nn.Module, rows: Dataset, collate: PaddingCollator, batch_size: int = 256) -> float:
    """Fraction of rows whose greedy answer (EOS included) is exactly the target."""
    model.eval()
    hits = 0
    for start in range(0, len(rows), batch_size):
        batch = collate([rows[i] for i in range(start, min(start + batch_size, len(rows)))])
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        pred, target = logits[:, :-1].argmax(-1), batch["labels"][:, 1:]
        scored = target != IGNORE_INDEX
        hits += int(((pred == target) | ~scored).all(dim=1).sum())
    return hits / len(rows)


def evaluate(model: torch.nn.Module, held_out: dict[str, Dataset], collate: PaddingCollator) -> dict[str, dict]:
    out = {}
    for task, rows in held_out.items():
        losses = reference_losses(model, rows, causal_lm_per_example_loss, collate, batch_size=256)
        out[task] = {"loss": float(losses.mean()), "accuracy": exact_match(model, rows, collate)}
    return out


def _args(out: str, seed: int, **kw: Any) -> ConstrainedTrainingArguments:
    base = dict(output_dir=out, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, seed=seed,
                logging_steps=50, weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant",
                dataloader_drop_last=True)
    base.update(kw)
    return ConstrainedTrainingArguments(**base)


def model_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 of a model's parameters and buffers (names, shapes, dtypes and bytes, in name order).

    The old model is trained by every invocation (it is never downloaded or shipped); its
    fingerprint in the results shows whether two runs started from the same weights, which is what
    a reproduction needs first."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        digest.update(t.numpy().tobytes())
    return digest.hexdigest()


def train_old_model(path: str, cfg: ExampleArguments) -> None:
    """Train the old model on the three old tasks and save it (with its tokenizer) in ``path``.

    Deterministic: the weights are initialised from seed 0, the rows are drawn from seed 0 and
    shuffled with seed 0, the Trainer runs with seed 0 on the CPU, with ``--threads`` torch threads
    (the caller sets them). The same code, thread count and platform give the same weights
    (the results' ``old_model_sha256``); the fine-tuning seeds do not touch it."""
    tasks = cfg.string_tasks()
    tokenizer = char_tokenizer()
    model = tiny_causal_lm(len(tokenizer), "gpt2", hidden_size=cfg.hidden, layers=cfg.layers, heads=4,
                           max_positions=tasks.max_positions, seed=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    train = concatenate_datasets([task_data(t, cfg.old_rows, 0, tokenizer, tasks.make_rows)
                                  for t in tasks.old]).shuffle(seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = ConstrainedTrainer(model=model, args=_args(tmp, 0, constraint_penalty="none", max_steps=cfg.old_steps,
                                                             learning_rate=cfg.old_lr, per_device_train_batch_size=64,
                                                             lr_scheduler_type="cosine", warmup_steps=50),
                                     train_dataset=train, data_collator=PaddingCollator(tokenizer),
                                     callbacks=[StepProgressBar("training the old model (once; --old_model keeps it)",
                                                                leave=True)])
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def data_splits(tokenizer: Any, cfg: ExampleArguments) -> tuple[dict[str, Dataset], dict[str, Dataset]]:
    """(held-out rows of every task, constraint rows of every old task): fixed across seeds."""
    tasks = cfg.string_tasks()
    held_out = {t: task_data(t, cfg.held_out_rows, HELD_OUT_DRAW, tokenizer, tasks.make_rows)
                for t in (*tasks.old, tasks.new)}
    constraint_rows = {t: task_data(t, cfg.constraint_rows, CONSTRAINT_DRAW, tokenizer, tasks.make_rows)
                       for t in tasks.old}
    return held_out, constraint_rows


def write_certification_rows(cfg: ExampleArguments, folder: str) -> dict[str, str]:
    """The certification rows of every old task (:func:`certification_rows`, before tokenising) as JSONL files
    ``folder/<task>.jsonl`` of ``id`` / ``prompt`` / ``completion`` rows, for ``hf-constrained certify``; returns
    ``{task: path}``. Each row carries its draw's name (``task/certify/i``): two draws of the same text are two
    independent samples of the task, and the command keeps both (it drops only rows equal in every column)."""
    tasks = cfg.string_tasks()
    os.makedirs(folder, exist_ok=True)
    paths = {}
    for t in tasks.old:
        rows = tasks.make_rows(t, cfg.certify_rows, random.Random(f"{t}-{CERTIFY_DRAW}"))  # task_data's draw
        paths[t] = os.path.join(folder, f"{t}.jsonl")
        with open(paths[t] + ".tmp", "w") as f:
            for i, row in enumerate(rows):
                f.write(json.dumps({"id": f"{t}/certify/{i}", **row}) + "\n")
        os.replace(paths[t] + ".tmp", paths[t])
    return paths


def certification_rows(tokenizer: Any, cfg: ExampleArguments) -> dict[str, IndependentDraws]:
    """The certification split of every old task: ``certify_rows`` independent draws (generator seed
    ``CERTIFY_DRAW``, fixed across seeds), read only by the certificate."""
    tasks = cfg.string_tasks()
    return {t: IndependentDraws(task_data(t, cfg.certify_rows, CERTIFY_DRAW, tokenizer, tasks.make_rows),
                                f"{t}/certify") for t in tasks.old}


def old_correct_rows(old_model: torch.nn.Module, rows: dict[str, Dataset],
                     collate: PaddingCollator) -> dict[str, Dataset]:
    """Each task's rows that ``old_model`` answers exactly (teacher-forced exact match of the answer tokens, the
    certificate's statistic), in their order (``--constraint_rows_kept old_correct``; the library's
    ``rows_answered``). A task the old model answers on no row is an error naming it: its constraint would have
    no rows."""
    return {task: data.select(rows_answered(old_model, data, causal_lm_per_example_correct, collate, batch_size=256,
                                            name=f"--constraint_rows_kept old_correct: task {task!r}",
                                            desc=f"old model's exact match {task}"))
            for task, data in rows.items()}


def baseline_regulariser(spec: Optional[tuple[str, float]], model: torch.nn.Module, constraint_rows: dict[str, Dataset],
                     collate: PaddingCollator, seed: int) -> Optional[ObjectiveRegulariser]:
    """The baseline ``(name, value)`` of a run (``benchmarks/forgetting_frontier.py``): ``("replay", r)`` mixes the
    old tasks' constraint rows into the batches at share r, drawn on their own; ``("replay_rows", r)`` replays the
    constraints' own rows of each step at share r of the loss (``ConstraintRowReplay``: one draw of old rows per
    step, |B_k| per task; with the hinge each row carries both weights); ``("kl", lam)`` adds lam * KL(old || new)
    on 32 of them per step; ``("l2", lam)`` adds lam / 2 * ||w - w_old||^2. Every baseline reads the same old rows
    as the constraints (the constraint rows, never the held-out or certification rows)."""
    if spec is None:
        return None
    name, value = spec
    if name == "replay_rows":
        return ConstraintRowReplay(value)
    old_rows = concatenate_datasets(list(constraint_rows.values()))  # every old task's, in the tasks' order
    if name == "replay":
        return Replay(old_rows, value, collate, seed=seed)
    if name == "kl":
        return KLToOld(model, old_rows, value, collate, rows_per_step=32, seed=seed)
    if name == "l2":
        return L2ToOld(value)
    if name == "replay_agem":  # replay at share value; its rows are A-GEM's reference batch (baseline_projection)
        return Replay(old_rows, value, collate, seed=seed)
    if name == "agem":
        return None  # a projection of the step's gradient, the objective unchanged (baseline_projection)
    raise ValueError(f"unknown baseline {name!r}: one of replay, replay_rows, kl, l2, agem, replay_agem")


def baseline_projection(spec: Optional[tuple[str, float]], regulariser: Optional[ObjectiveRegulariser],
                        constraint_rows: dict[str, Dataset], collate: PaddingCollator,
                        seed: int) -> Optional[GradientProjection]:
    """The gradient projection of a baseline ``(name, value)`` (``benchmarks/forgetting_frontier.py``):
    ``("agem", rows)`` is A-GEM with ``rows`` reference rows per step, equal rows of every old task's constraint
    rows (``rows`` a multiple of the number of old tasks); ``("replay_agem", ratio)`` is replay + A-GEM, the replay
    batch of ``regulariser`` (:func:`baseline_regulariser`) as A-GEM's reference batch. None for other baselines."""
    if spec is None or spec[0] not in ("agem", "replay_agem"):
        return None
    name, value = spec
    if name == "replay_agem":
        return ReplayAGEM(regulariser)
    tasks = len(constraint_rows)  # the old tasks
    if not (float(value).is_integer() and value >= tasks and int(value) % tasks == 0):
        raise ValueError(f"agem: the reference rows per step must be a multiple of the {tasks} old tasks (equal rows "
                         f"of every task), got {value:g}")
    return AGEM(dict(constraint_rows), int(value) // tasks, collate, seed=seed)


def build_trainer(old_path: str, penalty: str, seed: int, cfg: ExampleArguments, output_dir: str,
                  regulariser: Optional[tuple[str, float]] = None) -> tuple[ConstrainedTrainer, dict[str, Dataset]]:
    """The fine-tuning run of :func:`finetune` before it trains: the old model's copy under ``penalty`` ("none" or
    the constrained run's) with the baseline ``regulariser`` (``(name, value)``, :func:`baseline_regulariser`;
    default the constrained run's own anchor), and the held-out rows."""
    _quiet()
    tokenizer = AutoTokenizer.from_pretrained(old_path)
    model = AutoModelForCausalLM.from_pretrained(old_path)
    collate = PaddingCollator(tokenizer)
    held_out, constraint_rows = data_splits(tokenizer, cfg)
    if cfg.constraint_rows_kept == "old_correct":
        constraint_rows = old_correct_rows(model, constraint_rows, collate)
    certify = certification_rows(tokenizer, cfg) if cfg.certify_rows else None
    constraints = non_forgetting_constraints(model, causal_lm_per_example_loss, constraint_rows, collate,
                                             eval_datasets={t: held_out[t] for t in constraint_rows},
                                             certify_datasets=certify, correct=causal_lm_per_example_correct,
                                             config=NonForgettingConfig(tolerance=cfg.tolerance, batch_size=256,
                                                                        forget_tolerance=cfg.forget_tolerance))
    if cfg.constraint_surrogate == "loss_increase":
        for c in constraints:  # each row's loss rise only (the gradient's rows, and the held-out h_k)
            c.row_transform = torch.relu
    if cfg.constraint_proxy_indicator and penalty != "none":
        add_old_correctness(model, constraints, collate)
    if regulariser is None and penalty != "none":
        regulariser = constrained_anchor(cfg)  # the constrained run's own anchor (--replay_old / --kl_to_old)
    baseline = baseline_regulariser(regulariser, model, constraint_rows, collate, seed)
    projection = baseline_projection(regulariser, baseline, constraint_rows, collate, seed)
    trainer = ConstrainedTrainer(
        model=model, args=_args(output_dir, seed, constraint_penalty=penalty, penalty_beta=cfg.penalty_beta,
                                max_steps=cfg.max_steps, learning_rate=cfg.learning_rate,
                                per_device_train_batch_size=cfg.per_device_train_batch_size,
                                lr_scheduler_type=cfg.lr_scheduler_type,
                                warmup_steps=cfg.warmup_steps,
                                constraint_batch_size=cfg.constraint_batch_size,
                                constraints_per_step=cfg.constraints_per_step,
                                msvr_gamma=cfg.msvr_gamma, msvr_gamma_prime=cfg.msvr_gamma_prime,
                                **_estimation_args(cfg, penalty)),
        train_dataset=task_data(cfg.string_tasks().new, cfg.new_rows, 100 + seed, tokenizer,
                                cfg.string_tasks().make_rows), data_collator=collate,
        constraints=constraints, regulariser=baseline, gradient_projection=projection)
    trainer.remove_callback(PrinterCallback)
    return trainer, held_out


def finetune(old_path: str, penalty: str, seed: int, cfg: ExampleArguments,
             regulariser: Optional[tuple[str, float]] = None, save_to: Optional[str] = None) -> dict[str, Any]:
    """Fine-tune the old model on the new task (``penalty`` "none" or the constrained run's) and evaluate it held-out.

    ``regulariser``: a baseline ``(name, value)`` (:func:`baseline_regulariser`) added to the objective
    (``benchmarks/forgetting_frontier.py``). ``save_to``: a folder that receives the fine-tuned model and the
    tokenizer (``save_pretrained``), for ``hf-constrained certify`` to certify it apart from this run."""
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        trainer, held_out = build_trainer(old_path, penalty, seed, cfg, tmp, regulariser)
        train_seconds = trainer.train().metrics["train_runtime"]
        h_eval = trainer.evaluate_constraints(split="eval")
        with study_ledger(tmp):  # the final weights, on the certification rows: this run's first look
            certificate = certify_models(trainer, delta=cfg.delta)
    model, collate = trainer.model, trainer.data_collator
    if save_to is not None:
        model.save_pretrained(save_to)
        AutoTokenizer.from_pretrained(old_path).save_pretrained(save_to)
    metrics = evaluate(model, held_out, collate)
    cert = None if certificate is None else {
        "certified": certificate.is_certified(0), "forgotten": certificate.values[0],
        "upper_bounds": certificate.upper_bounds[0], "largest_bound": max(certificate.upper_bounds[0].values()),
        "num_rows": certificate.num_rows, "forget_tolerance": cfg.forget_tolerance, "delta": cfg.delta,
        "looks": dict(certificate.looks), "level": certificate.level}
    baseline = trainer.regularised
    return {"penalty": penalty, "seed": seed, "held_out": metrics, "h_held_out": h_eval,
            "tolerance": cfg.tolerance, "certificate": cert, "seconds": round(time.time() - t0, 1),
            "regulariser": None if baseline is None else baseline.regulariser.settings(),
            "gradient_projection": None if trainer.projected is None else {
                **trainer.projected.projection.settings(), "projected_steps": trainer.projected.projected_steps},
            "new_rows_per_step": trainer.args.per_device_train_batch_size,
            "rows_per_step": rows_per_step(trainer),
            "seconds_per_step": train_seconds / max(cfg.max_steps, 1)}


@contextlib.contextmanager
def study_ledger(folder: str) -> Iterator[None]:
    """Count this run's certificate looks in a ledger of its own (``folder``), not the user-level one.

    Every run of this example (and of ``benchmarks/forgetting_frontier.py``) is one simulated release: one
    method, one seed, certified once on the task's certification rows, as the one user who ran it would
    certify it (the first look of :mod:`hf_constrained.certification.ledger`, at ``delta_1`` = 0.9 delta under the
    default spending). The runs of a study share those rows, and counting them as looks of one user would
    test the tenth run at delta * 1e-9 and refuse the seventh; a user who certifies several models of
    their own on one split keeps the user-level ledger (the library's default)."""
    with user_ledger_at(os.path.join(folder, "study_ledger.json")):
        yield


def add_old_correctness(old_model: torch.nn.Module, constraints: list[Any], collate: PaddingCollator) -> None:
    """Give every constraint row the old model's 0/1 exact match (``reference_correct``), so that a proxy
    indicator can evaluate the certificate's statistic, the share of rows forgotten, on the constraint's
    own indicator rows (the rows of ``constraint_indicator_fraction`` that no gradient uses) or, with one split,
    on the gradient's rows."""
    for c in constraints:
        c.dataset = with_old_correctness(old_model, c.dataset, causal_lm_per_example_correct, collate, batch_size=256,
                                         desc=f"old model's exact match {c.name}")


def _estimation_args(cfg: ExampleArguments, penalty: str) -> dict[str, Any]:
    """The constrained run's estimation settings (two-split, proxy indicator, margin); none for the
    unconstrained run, which has no estimates."""
    if penalty == "none":
        return {}
    return dict(constraint_indicator_fraction=cfg.constraint_indicator_fraction or None,  # 0: one split
                constraint_indicator_batch_size=cfg.constraint_indicator_batch_size,
                constraint_proxy_indicator=cfg.constraint_proxy_indicator, constraint_margin=cfg.constraint_margin)


def _job(job: tuple[str, str, int, ExampleArguments]) -> dict[str, Any]:
    torch.set_num_threads(job[3].threads)  # results depend on the thread count: pinned by --threads
    return finetune(*job)


def _quiet() -> None:
    logging.getLogger("hf_constrained").setLevel(logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    datasets.disable_progress_bars()


def _summary(values: list[float], worst: str) -> dict[str, float]:
    return {"median": statistics.median(values), "worst": (max if worst == "max" else min)(values)}


def forgetting_summary(changes: dict[str, float], tolerance: float) -> dict[str, Any]:
    """What many protected tasks need of one run: the worst and the mean change of the old tasks' held-out exact
    match (``changes``: task -> change, negative a loss) and the share (and names) of the tasks that lost more than
    ``tolerance`` (a share of examples: 0.03 is 3 points)."""
    over = [t for t, c in changes.items() if c < -tolerance - 1e-12]
    return {"worst_old_change": min(changes.values()), "mean_old_change": statistics.fmean(changes.values()),
            "share_over_tolerance": len(over) / len(changes), "tasks_over_tolerance": over}


GOAL_SHARE = 0.8
"""A goal over seeds is met in at least this share of them (4 of 5)."""


def seeds_needed(n: int) -> int:
    """Seeds that must meet a goal out of ``n``: ``ceil(GOAL_SHARE * n)`` (4 of 5, 3 of 3)."""
    return math.ceil(GOAL_SHARE * n - 1e-9)


def per_seed_row(run: dict[str, Any], old: dict[str, dict]) -> dict[str, Any]:
    """One run's line of the per-seed table: its certificate, the new task's exact match, each old task's
    exact match and forgotten share, and the worst change of an old task's held-out exact match."""
    cert = run.get("certificate")
    changes = {t: run["held_out"][t]["accuracy"] - old[t]["accuracy"] for t in OLD_TASKS}
    return {"certified": None if cert is None else cert["certified"],
            "largest_bound": None if cert is None else cert["largest_bound"],
            "new_task_accuracy": run["held_out"][NEW_TASK]["accuracy"],
            "old_task_accuracy": {t: run["held_out"][t]["accuracy"] for t in OLD_TASKS},
            "forgotten": None if cert is None else {t: cert["forgotten"][f"non_forgetting/{t}"] for t in OLD_TASKS},
            "worst_old_accuracy_change": min(changes.values())}


def summarize(old: dict[str, dict], runs: list[dict[str, Any]], cfg: ExampleArguments) -> dict[str, Any]:
    """Median and worst over the seeds per method and task, the per-seed table, and the goals: the
    unconstrained run forgets some old task in every seed; the constrained run is certified, and learns
    the new task (held-out exact match >= ``--learned_accuracy``), each in at least 80% of the seeds."""
    constrained = cfg.constraint_penalty
    by = {p: [r for r in runs if r["penalty"] == p] for p in ("none", constrained)}
    table = {}
    for p, rs in by.items():
        table[p] = {}
        for t in (*OLD_TASKS, NEW_TASK):
            table[p][t] = {"accuracy": _summary([r["held_out"][t]["accuracy"] for r in rs], "min"),
                           "loss": _summary([r["held_out"][t]["loss"] for r in rs], "max")}
            if t in OLD_TASKS:
                table[p][t]["h"] = _summary([r["h_held_out"][f"non_forgetting/{t}"] for r in rs], "max")
    violated = {p: [any(r["h_held_out"][f"non_forgetting/{t}"] > cfg.tolerance for t in OLD_TASKS) for r in rs]
                for p, rs in by.items()}
    learned = {p: [r["held_out"][NEW_TASK]["accuracy"] >= cfg.learned_accuracy for r in rs] for p, rs in by.items()}
    n = len(by[constrained])
    goals = {
        "unconstrained_forgets_some_old_task": all(violated["none"]),
        f"{constrained}_learns_the_new_task_in_{seeds_needed(n)}_of_{n}_seeds":
            sum(learned[constrained]) >= seeds_needed(n),
    }
    certificates = {p: [r["certificate"] for r in rs if r.get("certificate")] for p, rs in by.items()}
    certified = {}
    if all(len(certificates[p]) == len(by[p]) and by[p] for p in by):
        goals[f"{constrained}_certified_in_{seeds_needed(n)}_of_{n}_seeds"] = \
            sum(c["certified"] for c in certificates[constrained]) >= seeds_needed(n)
        certified = {p: {"seeds_certified": sum(c["certified"] for c in cs),
                         "per_seed": {str(r["seed"]): c["certified"] for r, c in zip(by[p], cs)},
                         "largest_bound": _summary([c["largest_bound"] for c in cs], "max"),
                         "largest_bound_per_seed": {str(r["seed"]): c["largest_bound"] for r, c in zip(by[p], cs)},
                         "forgotten": {t: _summary([c["forgotten"][f"non_forgetting/{t}"] for c in cs], "max")
                                       for t in OLD_TASKS}}
                     for p, cs in certificates.items()}
    per_seed = {p: {str(r["seed"]): per_seed_row(r, old) for r in rs} for p, rs in by.items()}
    worst_change = {p: _summary([row["worst_old_accuracy_change"] for row in rows.values()], "min")
                    for p, rows in per_seed.items()}
    return {"old_model": old, "table": table, "goals": goals,
            "seeds_violating": {p: sum(v) for p, v in violated.items()},
            "seeds_learning": {p: sum(v) for p, v in learned.items()},
            "certificate": certified, "per_seed": per_seed, "worst_old_accuracy_change": worst_change}


def format_per_seed(summary: dict[str, Any], cfg: ExampleArguments) -> str:
    """The per-seed table (markdown): certificate, new-task exact match, each old task's exact match and
    forgotten share (certification rows), the worst change of an old task's held-out exact match."""
    tasks = " / ".join(OLD_TASKS)
    lines = [f"| method | seed | certificate (largest bound) | new-task exact match | {tasks} exact match | "
             f"{tasks} forgotten | worst old-task change |", "|---|---|---|---|---|---|---|"]
    for p in ("none", cfg.constraint_penalty):
        for seed, row in summary["per_seed"][p].items():
            cert = "-" if row["certified"] is None else \
                f"{'CERTIFIED' if row['certified'] else 'not certified'} ({row['largest_bound']:.3f})"
            acc = " / ".join(f"{100 * row['old_task_accuracy'][t]:.1f}%" for t in OLD_TASKS)
            forgot = "-" if row["forgotten"] is None else \
                " / ".join(f"{100 * row['forgotten'][t]:.1f}%" for t in OLD_TASKS)
            lines.append(f"| {p} | {seed} | {cert} | {100 * row['new_task_accuracy']:.1f}% | {acc} | {forgot} | "
                         f"{100 * row['worst_old_accuracy_change']:+.1f} pts |")
    return "\n".join(lines)


def constrained_anchor(cfg: ExampleArguments) -> Optional[tuple[str, float]]:
    """The constrained run's own baseline ``(name, value)``: replay of the constraints' rows (``--replay_old``: one
    draw of old rows per step) or KL (``--kl_to_old``)."""
    if cfg.replay_old:
        return ("replay_rows", cfg.replay_old)
    return ("kl", cfg.kl_to_old) if cfg.kl_to_old else None


def constrained_name(cfg: ExampleArguments) -> str:
    """The constrained run in words: its penalty, beta and anchor."""
    anchor = constrained_anchor(cfg)
    words = "" if anchor is None else f", {'KL' if anchor[0] == 'kl' else 'replay'} {anchor[1]:g}"
    return f"{cfg.constraint_penalty} (beta {cfg.penalty_beta:g}{words})"


def format_table(summary: dict[str, Any], cfg: ExampleArguments) -> str:
    old, table = summary["old_model"], summary["table"]
    lines = [f"| task | old model: accuracy / loss | unconstrained: accuracy / loss / h | "
             f"{constrained_name(cfg)}: accuracy / loss / h |", "|---|---|---|---|"]
    for t in (*OLD_TASKS, NEW_TASK):
        cells = [f"{100 * old[t]['accuracy']:.1f}% / {old[t]['loss']:.3f}"]
        for p in ("none", cfg.constraint_penalty):
            e = table[p][t]
            cell = (f"{100 * e['accuracy']['median']:.1f}% ({100 * e['accuracy']['worst']:.1f}%) / "
                    f"{e['loss']['median']:.3f} ({e['loss']['worst']:.3f})")
            if "h" in e:
                cell += f" / {e['h']['median']:+.3f} ({e['h']['worst']:+.3f})"
            cells.append(cell)
        name = f"{t} (new)" if t == NEW_TASK else t
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    cert = summary.get("certificate")
    if cert:
        n = len(next(iter(cert.values()))["per_seed"])
        cells = [f"{c['seeds_certified']}/{n} seeds; largest bound {c['largest_bound']['median']:.3f} "
                 f"({c['largest_bound']['worst']:.3f})" for c in (cert["none"], cert[cfg.constraint_penalty])]
        lines.append(f"| certified: at most {cfg.forget_tolerance:g} of each old task forgotten (delta "
                     f"{cfg.delta:g}) | | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@dataclass
class ExampleArguments(CertificateArguments):
    """The example's flags; the fine-tuning ones carry the names of
    :class:`~hf_constrained.ConstrainedTrainingArguments` (``--penalty_beta``, ``--max_steps``, ...)."""

    seeds: list[int] = field(default_factory=lambda: [0], metadata={
        "help": "fine-tuning seeds (default: seed 0, a few minutes; seeds 0-4 chose the defaults (with "
                "benchmarks/forgetting_frontier.py), --seeds 100 101 102 103 104 is the evaluation docs/llm.md "
                "reports, about 5-10 minutes on 2 cores)"})
    old_steps: int = field(default=1000, metadata={"help": "training steps of the old model"})
    old_rows: int = field(default=4000, metadata={"help": "training rows per old task"})
    old_lr: float = field(default=3e-3, metadata={"help": "learning rate of the old model"})
    hidden: int = field(default=128, metadata={"help": "width of the GPT-2"})
    layers: int = field(default=2, metadata={"help": "layers of the GPT-2"})
    max_steps: int = field(default=500, metadata={
        "help": "fine-tuning steps on the new task (every method of the comparison shares them)"})
    learning_rate: float = field(default=2e-3, metadata={"help": "fine-tuning learning rate"})
    per_device_train_batch_size: int = field(default=32, metadata={
        "help": "new-task rows per fine-tuning step (every method of the comparison shares it; old rows come on "
                "top: the constrained run's --constraint_batch_size per old task, which its replay reads too)"})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "fine-tuning learning-rate schedule"})
    warmup_steps: int = field(default=0, metadata={
        "help": "fine-tuning steps of linear learning-rate warmup (every method of the comparison shares it)"})
    constraint_penalty: str = field(default="hinge", metadata={
        "help": "penalty of the constrained run (each seed also runs unconstrained, penalty none)",
        "choices": ["hinge", "squared_hinge"]})
    penalty_beta: float = field(default=0.25, metadata={"help": "penalty parameter beta of the constrained run"})
    msvr_gamma: float = field(default=0.2, metadata={
        "help": "MSVR gamma of the constraint estimates (0.2: an average over about the last five steps)"})
    msvr_gamma_prime: str = field(default="0", metadata={
        "help": "MSVR gamma' of the constraint estimates (0: no look-ahead forward, the twentieth tuning round's "
                "choice; 'theory': Algorithm 1's value)"})
    constraint_indicator_fraction: Optional[float] = field(default=0.25, metadata={
        "help": "two-split estimation of the constrained run: this share of each old task's constraint rows drives "
                "the estimate and the hinge's indicator, the rest the gradient (in (0, 1); 0: one split, as in the "
                "paper, with --constraint_proxy_indicator its statistic scored on the gradient's own rows)"})
    constraint_indicator_batch_size: Optional[int] = field(default=None, metadata={
        "help": "with --constraint_indicator_fraction: indicator rows per sampled constraint and step, forwarded "
                "without grad (default: --constraint_batch_size; fewer cost less and leave the estimate noisier)"})
    constraint_proxy_indicator: bool = field(default=True, metadata={
        "help": "the indicator follows the certificate's statistic (the share of rows forgotten) against "
                "--forget_tolerance, on the indicator rows (--constraint_indicator_fraction) or, with one split, on "
                "the gradient's own rows in their forward; the gradient follows the constraint's row values "
                "(--constraint_surrogate)"})
    constraint_surrogate: str = field(default="loss_change", metadata={
        "help": "the constraint's row values, which give its gradient (and its held-out h_k): loss_change, the "
                "per-row loss change l(w, x) - l(w_old, x); loss_increase, its positive part, so rows whose loss "
                "fell do not offset rows at risk of being forgotten",
        "choices": ["loss_change", "loss_increase"]})
    constraint_rows_kept: str = field(default="all", metadata={
        "help": "which of each old task's constraint rows every method reads (the constraints, replay, KL, A-GEM): "
                "all; or old_correct, the rows the old model answers exactly (teacher-forced), the rows the "
                "certificate can count as forgotten: on a task the old model answers only in part, the other rows' "
                "gradient pulls toward answers it never gave",
        "choices": list(ROWS_KEPT)})
    constraint_margin: Optional[float] = field(default=0.02, metadata={
        "help": "the constrained run's margin: the hinge acts when the estimate exceeds its tolerance minus this "
                "(with --constraint_proxy_indicator a share of rows, else nats per answer token)"})
    new_rows: int = field(default=2000, metadata={"help": "training rows of the new task"})
    constraint_rows: int = field(default=4096, metadata={
        "help": "constraint rows per old task (drawn from the task's generator; every baseline of "
                "benchmarks/forgetting_frontier.py reads the same rows)"})
    held_out_rows: int = field(default=512, metadata={"help": "held-out rows per task"})
    certify_rows: int = field(default=2000, metadata={
        "help": "certification rows per old task (independent draws, read only by the certificate; 0: none). A "
                "claim of at most 3%% of each old task forgotten (so at most 3 points lost) at delta 0.05 needs "
                "2000 (benchmarks/certification_size.py, docs/benchmarks.md)"})
    forget_tolerance: float = field(default=0.03, metadata={
        "help": "the claim, stated before the data: certified at most this share of each old task's examples "
                "forgotten (exact before, not now), so at most this many points of its accuracy lost"})
    constraint_batch_size: int = field(default=11, metadata={
        "help": "constraint rows per task and step, which the constrained run's replay reads too (11: the "
                "seventeenth tuning round's choice, 33 old rows per step in one draw)"})
    constraints_per_step: Optional[int] = field(default=None, metadata={
        "help": "old-task constraints sampled per step (Algorithm 1's |I_t|; default: all three; the estimates of "
                "the others are kept)"})
    replay_old: float = field(default=0.5, metadata={
        "help": "the constrained run replays the constraints' own rows of each step (--constraint_batch_size per old "
                "task, drawn once: each row carries replay's weight plus the hinge's) as this share of its loss (0.5: "
                "old rows weigh as much as new ones; 0: none; the unconstrained run never has it)"})
    kl_to_old: float = field(default=0.0, metadata={
        "help": "instead of --replay_old: the constrained run's objective adds this weight times KL(old || new) on 32 "
                "of the old tasks' constraint rows per step (0: none)"})
    tolerance: float = field(default=0.2, metadata={"help": "h_k <= tolerance (nats per answer token)"})
    learned_accuracy: float = field(default=0.9, metadata={"help": "held-out new-task accuracy that counts as learned"})
    old_model: Optional[str] = field(default=None, metadata={"help": "reuse (or create) the old model in this folder"})
    json: Optional[str] = field(default="outputs/llm_tiny_example/results.json",
                                metadata={"help": "write the results here (the recipes' folder convention: "
                                                  "outputs/<module>)"})
    workers: int = field(default=2, metadata={"help": "fine-tuning runs in parallel (processes)"})
    threads: int = field(default=1, metadata={
        "help": "torch threads of the old model's training and of each fine-tuning run (results depend on it)"})

    def string_tasks(self) -> StringTasks:
        """The example's tasks (:data:`TASKS`); an example with other tasks subclasses these settings and
        overrides this."""
        return TASKS

    def __post_init__(self) -> None:
        super().__post_init__()  # --delta
        if not self.seeds:
            raise ValueError("--seeds: give at least one seed")
        if not (math.isfinite(self.penalty_beta) and self.penalty_beta > 0):
            raise ValueError(f"--penalty_beta must be a positive number, got {self.penalty_beta}")
        if self.certify_rows < 0:
            raise ValueError(f"--certify_rows must be >= 0, got {self.certify_rows}")
        if not 0.0 <= self.forget_tolerance <= 1.0:
            raise ValueError(f"--forget_tolerance is a share of examples, in [0, 1]; got {self.forget_tolerance}")
        if self.constraint_indicator_fraction is not None and not 0.0 <= self.constraint_indicator_fraction < 1.0:
            raise ValueError("--constraint_indicator_fraction must be in (0, 1), or 0 for one split; got "
                             f"{self.constraint_indicator_fraction}")
        if self.constraint_indicator_batch_size is not None and (
                not self.constraint_indicator_fraction or self.constraint_indicator_batch_size < 1):
            raise ValueError("--constraint_indicator_batch_size needs --constraint_indicator_fraction (two splits) and "
                             f"is at least 1; got {self.constraint_indicator_batch_size}")
        if self.constraint_proxy_indicator and not self.certify_rows:
            raise ValueError("--constraint_proxy_indicator needs --certify_rows > 0 (its statistic is the "
                             "certificate's share of rows forgotten, against --forget_tolerance)")
        if self.constraint_margin is not None and not (math.isfinite(self.constraint_margin)
                                                       and self.constraint_margin >= 0):
            raise ValueError(f"--constraint_margin must be a finite number >= 0, got {self.constraint_margin}")
        if not (math.isfinite(self.kl_to_old) and self.kl_to_old >= 0):
            raise ValueError(f"--kl_to_old must be a finite number >= 0, got {self.kl_to_old}")
        if not 0.0 <= self.replay_old < 1.0:
            raise ValueError(f"--replay_old is the old rows' share of the loss, in [0, 1); got {self.replay_old}")
        if self.replay_old and self.kl_to_old:
            raise ValueError(f"--replay_old {self.replay_old:g} and --kl_to_old {self.kl_to_old:g}: the constrained "
                             "run takes one anchor; set the other to 0")
        if not 0 <= self.warmup_steps < self.max_steps:
            raise ValueError(f"--warmup_steps must be in [0, --max_steps), got {self.warmup_steps}")
        tasks = len(self.string_tasks().old)
        if self.constraints_per_step is not None and not 1 <= self.constraints_per_step <= tasks:
            raise ValueError(f"--constraints_per_step must be in [1, {tasks}], got {self.constraints_per_step} "
                             "(one constraint per old task)")
        if self.constraint_surrogate not in ("loss_change", "loss_increase"):
            raise ValueError(f"--constraint_surrogate must be loss_change or loss_increase, got "
                             f"{self.constraint_surrogate!r}")
        if self.constraint_rows_kept not in ROWS_KEPT:
            raise ValueError(f"--constraint_rows_kept must be all or old_correct, got {self.constraint_rows_kept!r}")
        if self.per_device_train_batch_size < 1:
            raise ValueError(f"--per_device_train_batch_size must be >= 1, got {self.per_device_train_batch_size}")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")


# settings added after results were stored, with the value that reproduces what ran before they existed: a stored
# configuration without one of them ran with that value (no warmup: the Trainer's default)
SETTINGS_ADDED_LATER: dict[str, Any] = {"warmup_steps": 0, "constraint_surrogate": "loss_change", "replay_old": 0.0,
                                        "per_device_train_batch_size": 32, "constraint_indicator_batch_size": None,
                                        "constraint_rows_kept": "all"}


def stored_settings(config: dict[str, Any]) -> dict[str, Any]:
    """A stored result's example settings, completed with :data:`SETTINGS_ADDED_LATER` where they predate one."""
    return {**SETTINGS_ADDED_LATER, **config}


def parse(argv: Optional[list[str]] = None) -> ExampleArguments:
    """The flags (``--config x.yaml`` included); an unknown flag is an error."""
    (cfg,) = parse_recipe_args([ExampleArguments], argv, description=__doc__.split("\n\n")[0])
    return cfg


def environment(cfg: ExampleArguments) -> dict[str, Any]:
    """What the numbers depend on besides the flags: library versions, platform, threads."""
    return {"torch": torch.__version__, "transformers": transformers.__version__, "datasets": datasets.__version__,
            "python": platform.python_version(), "machine": platform.machine(), "system": platform.system(),
            "torch_threads": cfg.threads, "dtype": str(torch.get_default_dtype())}


def old_model_ready(cfg: ExampleArguments, folder: str) -> tuple[str, str, dict[str, dict]]:
    """The old model's folder (``--old_model``, else ``folder``; trained there by :func:`train_old_model` unless
    it holds one), its SHA-256 (:func:`model_fingerprint`) and its held-out loss and exact match per task."""
    t0 = time.time()
    old_path = cfg.old_model or folder
    if not os.path.exists(os.path.join(old_path, "config.json")):
        train_old_model(old_path, cfg)
    logger.info("old model ready (%.0fs)", time.time() - t0)
    tokenizer = AutoTokenizer.from_pretrained(old_path)
    held_out, _ = data_splits(tokenizer, cfg)
    old_model = AutoModelForCausalLM.from_pretrained(old_path)
    old_sha256 = model_fingerprint(old_model)
    old = evaluate(old_model, held_out, PaddingCollator(tokenizer))
    logger.info("old model sha256 %s: %s", old_sha256[:12], {t: round(m["accuracy"], 3) for t, m in old.items()})
    return old_path, old_sha256, old


def finetune_runs(jobs: list[tuple[str, str, int, ExampleArguments]], workers: int, desc: str) -> list[dict[str, Any]]:
    """:func:`finetune` on every job ``(old_path, penalty, seed, settings)``, in ``workers`` spawned processes when
    more than one, with a progress bar over the runs (``desc``); the run records in the jobs' order."""
    bar = tqdm(total=len(jobs), desc=desc, unit="run", dynamic_ncols=True)
    if workers > 1:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            futures = [pool.submit(_job, j) for j in jobs]
            for done in concurrent.futures.as_completed(futures):  # progress as runs end; results in job order
                r = done.result()
                bar.update()
                logger.info("finished seed %d %s: new task %.3f", r["seed"], r["penalty"],
                            r["held_out"][jobs[0][3].string_tasks().new]["accuracy"])
            runs = [f.result() for f in futures]
    else:
        runs = []
        for j in jobs:
            runs.append(_job(j))
            bar.update()
    bar.close()
    return runs


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    cfg = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    _quiet()
    torch.set_num_threads(cfg.threads)
    t0 = time.time()
    tmp = tempfile.TemporaryDirectory()
    old_path, old_sha256, old = old_model_ready(cfg, tmp.name)
    jobs = [(old_path, penalty, seed, cfg) for seed in cfg.seeds for penalty in ("none", cfg.constraint_penalty)]
    runs = finetune_runs(jobs, cfg.workers, f"fine-tuning runs ({len(cfg.seeds)} seed(s) x unconstrained and "
                                            f"{cfg.constraint_penalty})")
    for r in runs:
        logger.info("seed %d %-5s: %s (%.0fs)", r["seed"], r["penalty"],
                    {t: round(m["accuracy"], 3) for t, m in r["held_out"].items()}, r["seconds"])
        if r["certificate"]:
            c = r["certificate"]
            print(f"seed {r['seed']} {r['penalty']:>13}: {'CERTIFIED' if c['certified'] else 'NOT CERTIFIED'} "
                  f"(largest bound {c['largest_bound']:.3f}, tolerance {c['forget_tolerance']:g}, "
                  f"delta {c['delta']:g})")
    summary = summarize(old, runs, cfg)
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    result = {"command": publishable_command("python recipes/llm_tiny_example.py",
                                             sys.argv[1:] if argv is None else argv),
              "config": publishable_values(asdict(cfg)), "old_model_sha256": old_sha256,
              "environment": environment(cfg),
              "summary": summary, "runs": runs, "seconds": round(time.time() - t0, 1),
              "cpu_seconds": round(sum(u.ru_utime + u.ru_stime for u in usage), 1),
              "os_cpu_count": os.cpu_count()}
    print(format_table(summary, cfg))
    print(format_per_seed(summary, cfg))
    print("goals:", json.dumps(summary["goals"]))
    print(f"total {result['seconds']:.0f}s wall, {result['cpu_seconds']:.0f}s CPU")
    if cfg.json:
        atomic_write_json(cfg.json, result)
    tmp.cleanup()
    return result


if __name__ == "__main__":
    main()
