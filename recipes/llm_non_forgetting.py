"""Supervised fine-tuning of a causal language model under non-forgetting constraints.

    min_w  SFT loss on the target data
    s.t.   L_k(w, D_k) - L_k(w_old, D_k) <= tol_k    for every protected dataset D_k
           (optionally) L_s(w, D_safe) - L_s(w_old, D_safe) <= tol_s   for a safety set

L is the mean next-token cross-entropy of each example's answer tokens; w_old is the
model before fine-tuning (with ``--lora_r`` the adapter-disabled base). The old model's
per-example losses are computed once before training. All constraints share one row
function (one model call for all sampled constraints when the trainer fuses them).

Data: each dataset is a Hub dataset id or a local JSON/JSONL/CSV/TSV/parquet file, with
rows in one of TRL's SFT formats: ``text``; ``prompt`` + ``completion`` (loss on the
completion); ``messages`` (a chat rendered with the tokenizer's chat template; loss on
the last message). A safety set such as "harmful prompts with refusals" in the
prompt/completion format gives the constraint "the loss of the refusals does not rise".

The certificate: ``--eval_fraction`` of every dataset is held out, and ``--certify_fraction``
(default 0.5) of each protected / safety set's held-out rows is set aside, seeded by
``--seed``, as its certification split, which nothing else reads (no gradient, no
evaluation during training, no checkpoint selection). ``finish_run`` then certifies, at
``--delta``, that at most ``--forget_tolerance`` of each protected task's examples are
forgotten: the share of rows the old model answered exactly (teacher-forced exact match of
the answer tokens) that the new one no longer does, a 0/1 rate with an exact
Clopper-Pearson bound. A rate over n rows has a bound of at least 1 - delta^(1/n) (about
3/n), so the tolerance must fit the split: 0.05 needs about 60 certification rows per
task with none forgotten. ``--certify_fraction 0`` leaves the run NOT CERTIFIED.

Run::

    accelerate launch recipes/llm_non_forgetting.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --lora_r 16 \\
        --target_dataset data/new_task.jsonl \\
        --protected_datasets math=data/math.jsonl code=data/code.jsonl \\
        --safety_dataset data/refusals.jsonl \\
        --output_dir out/llm --max_steps 500 --learning_rate 1e-4 \\
        --constraint_penalty hinge --penalty_beta 10 --relative_tolerance 0.02

or put the flags in a YAML file (keys = flag names) and pass ``--config x.yaml``; flags on
the command line override the file. ``--help`` lists every flag. At the end: held-out
evaluation, the model (or adapter) and tokenizer in ``--output_dir``, the safety report
and model card (with the certificate), ``llm_results.json`` (``certified``,
``certified_bounds``, the certification splits' sizes), and with ``--push_to_hub`` the gated
push (refused when the run is not certified, unless ``--allow_unsafe_push``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, Optional

import torch

from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

from hf_constrained import ConstrainedTrainer, ConstrainedTrainingArguments, UnsafeModelError, finish_run
from hf_constrained.errors import check_model_path
from hf_constrained.non_forgetting import (
    PaddingCollator,
    ReferenceGap,
    causal_lm_per_example_loss,
    non_forgetting_constraints,
)
from hf_constrained.per_sample_loss import causal_lm_per_example_correct
from hf_constrained.publishable import publishable_command, publishable_path, publishable_values
from hf_constrained.recipe_args import parse_recipe_args
from hf_constrained.text_data import load_text_dataset, tokenize_sft

logger = logging.getLogger("llm_non_forgetting")
RESULTS_FILE = "llm_results.json"


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "Causal LM: a Hub id (e.g. Qwen/Qwen2.5-0.5B-Instruct) or a "
                                              "local folder with the model and its tokenizer."})
    target_dataset: str = field(metadata={"help": "SFT data of the new task: Hub id or local JSON/CSV/parquet file."})
    protected_datasets: list[str] = field(default_factory=list, metadata={
        "help": "Protected datasets, one constraint each: NAME=SOURCE (or SOURCE; the name is the file's stem)."})
    safety_dataset: Optional[str] = field(default=None, metadata={
        "help": "Optional safety set (e.g. harmful prompts with refusals): its loss must not rise either."})
    dataset_config: Optional[str] = field(default=None, metadata={"help": "Hub dataset configuration name, if any."})
    target_split: str = field(default="train", metadata={"help": "Split of a Hub target dataset."})
    protected_split: str = field(default="train", metadata={"help": "Split of Hub protected / safety datasets."})
    eval_fraction: float = field(default=0.1, metadata={
        "help": "Fraction of every dataset held out: target rows for the objective's evaluation, protected rows "
                "for the exact constraint values of the safety report."})
    max_constraint_rows: Optional[int] = field(default=None, metadata={
        "help": "Cap on the rows taken from each protected / safety dataset (before the held-out split)."})
    max_target_rows: Optional[int] = field(default=None, metadata={"help": "Cap on the target rows."})
    max_length: int = field(default=512, metadata={"help": "Token limit per example (longer ones are cut)."})
    text_column: str = field(default="text", metadata={"help": "Column of plain-text rows."})
    prompt_column: str = field(default="prompt", metadata={"help": "Prompt column of prompt/completion rows."})
    completion_column: str = field(default="completion", metadata={"help": "Completion column."})
    messages_column: str = field(default="messages", metadata={"help": "Chat column (list of role/content)."})
    constraint_tolerance: float = field(default=0.0, metadata={
        "help": "Absolute tolerance of every protected constraint (nats per token)."})
    relative_tolerance: float = field(default=0.0, metadata={
        "help": "Added tolerance as a fraction of the old model's mean loss on each protected set."})
    safety_tolerance: float = field(default=0.0, metadata={"help": "Absolute tolerance of the safety constraint."})
    certify_fraction: float = field(default=0.5, metadata={
        "help": "Share of each protected (and safety) dataset's held-out rows set aside as its certification split, "
                "read only by the certificate (seeded by --seed; 0: no certificate, the run is NOT CERTIFIED)."})
    forget_tolerance: float = field(default=0.05, metadata={
        "help": "Certified: at most this share of each protected task's examples forgotten (answered exactly, "
                "teacher-forced, by the old model and not by the new one). A rate over n rows with none forgotten "
                "has a bound of 1 - delta^(1/n): the certification split needs enough rows."})
    delta: float = field(default=0.05, metadata={
        "help": "The certificate's error level: it holds with probability at least 1 - delta."})
    reference_batch_size: int = field(default=16, metadata={"help": "Batch size of the old model's reference pass."})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank (0: train all parameters)."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: str = field(default="all-linear", metadata={
        "help": "Comma-separated LoRA target modules, or 'all-linear'."})
    dtype: str = field(default="float32", metadata={"help": "Weights dtype.", "choices": ["float32", "bfloat16",
                                                                                           "float16", "auto"]})
    allow_unsafe_push: bool = field(default=False, metadata={
        "help": "With --push_to_hub: publish even when a constraint fails (the card then says UNSAFE)."})


# ---------------------------------------------------------------------------------- arguments
def parse_arguments(argv: Optional[list[str]] = None) -> tuple[ScriptArguments, ConstrainedTrainingArguments]:
    """Flags of both dataclasses; with ``--config x.yaml`` the file's values are the defaults
    and flags given on the command line override them (the convention of TRL's scripts)."""
    script, args = parse_recipe_args([ScriptArguments, ConstrainedTrainingArguments], argv)
    return script, args


def _named_sources(entries: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for entry in entries:
        name, sep, source = entry.partition("=")
        if not sep:
            source = entry
            name = os.path.splitext(os.path.basename(entry.rstrip("/")))[0] or entry
        if not name or not source:
            raise ValueError(f"--protected_datasets entry {entry!r}: expected NAME=SOURCE or SOURCE")
        if name in out:
            raise ValueError(f"--protected_datasets: two datasets named {name!r}; name them with NAME=SOURCE")
        out[name] = source
    return out


# ---------------------------------------------------------------------------------- data
class Splits(NamedTuple):
    """One dataset's disjoint parts: training rows, held-out rows (evaluation and the safety report's values),
    certification rows (read only by the certificate; ``None`` without them)."""

    train: Any
    held_out: Any
    certify: Any


def load_tokenized(source: str, split: str, tokenizer: Any, script: ScriptArguments, name: str,
                   max_rows: Optional[int], seed: int, certify: bool = False) -> Splits:
    """One dataset, tokenised, split in disjoint parts: ``eval_fraction`` of the rows held out and, with
    ``certify``, ``certify_fraction`` of those set aside as the certification split (both seeded by ``seed``)."""
    raw = load_text_dataset(source, split=split, config_name=script.dataset_config)
    if max_rows is not None and len(raw) > max_rows:
        raw = raw.shuffle(seed=seed).select(range(max_rows))
    rows = tokenize_sft(raw, tokenizer, max_length=script.max_length, text_column=script.text_column,
                        prompt_column=script.prompt_column, completion_column=script.completion_column,
                        messages_column=script.messages_column, name=name)
    if script.eval_fraction <= 0:
        return Splits(rows, None, None)
    if len(rows) < 2:
        raise ValueError(f"{name} ({source}): {len(rows)} usable row(s); need at least 2 to hold some out")
    split_rows = rows.train_test_split(test_size=script.eval_fraction, seed=seed)
    train, held_out = split_rows["train"], split_rows["test"]
    if not certify or script.certify_fraction <= 0:
        return Splits(train, held_out, None)
    if len(held_out) < 2:
        raise ValueError(f"{name} ({source}): {len(held_out)} held-out row(s); --certify_fraction "
                         f"{script.certify_fraction} needs at least 2 (one held out, one certifying): raise "
                         "--eval_fraction or pass --certify_fraction 0 (no certificate)")
    parts = held_out.train_test_split(test_size=script.certify_fraction, seed=seed)
    return Splits(train, parts["train"], parts["test"])


def check_arguments(script: ScriptArguments, args: ConstrainedTrainingArguments) -> None:
    if not script.protected_datasets and not script.safety_dataset and args.constraint_penalty != "none":
        raise ValueError("no constraint: pass --protected_datasets and/or --safety_dataset "
                         "(or --constraint_penalty none for plain SFT)")
    if not 0.0 <= script.eval_fraction < 1.0:
        raise ValueError(f"--eval_fraction must be in [0, 1), got {script.eval_fraction}")
    if script.lora_r < 0:
        raise ValueError(f"--lora_r must be >= 0, got {script.lora_r}")
    for flag in ("constraint_tolerance", "relative_tolerance", "safety_tolerance"):
        if getattr(script, flag) < 0:
            raise ValueError(f"--{flag} must be >= 0, got {getattr(script, flag)}")
    if script.max_length < 2:
        raise ValueError(f"--max_length must be >= 2, got {script.max_length}")
    if not 0.0 <= script.certify_fraction < 1.0:
        raise ValueError(f"--certify_fraction must be in [0, 1), got {script.certify_fraction}")
    if script.certify_fraction > 0 and script.eval_fraction <= 0:
        raise ValueError(f"--certify_fraction {script.certify_fraction} splits the held-out rows, but --eval_fraction "
                         "is 0: raise --eval_fraction or pass --certify_fraction 0 (no certificate)")
    if not 0.0 <= script.forget_tolerance <= 1.0:
        raise ValueError(f"--forget_tolerance is a share of examples, in [0, 1]; got {script.forget_tolerance}")
    if not 0.0 < script.delta < 1.0:
        raise ValueError(f"--delta must be in (0, 1), got {script.delta}")
    # a logger whose package is missing would fail when the Trainer is built, after the model loaded
    loggers = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "mlflow": ("mlflow",)}
    for name in args.report_to or []:
        if name in loggers and not any(importlib.util.find_spec(m) is not None for m in loggers[name]):
            raise ValueError(f"--report_to {name}: the {loggers[name][0]} package is not installed "
                             f"(pip install {loggers[name][0]}), or pass --report_to none")
    # a mistyped path is an error naming the flag, before the tokenizer or the model loads
    script.model_name_or_path = check_model_path(script.model_name_or_path)


# ---------------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    script, args = parse_arguments(argv)
    logging.basicConfig(level=logging.INFO if args.should_log else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_arguments(script, args)
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(script.model_name_or_path)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"{script.model_name_or_path}: the tokenizer has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out of every loss
    dtype = script.dtype if script.dtype == "auto" else getattr(torch, script.dtype)
    model = AutoModelForCausalLM.from_pretrained(script.model_name_or_path, dtype=dtype)
    if script.lora_r:
        from peft import LoraConfig, get_peft_model

        targets = script.lora_target_modules
        model = get_peft_model(model, LoraConfig(
            task_type="CAUSAL_LM", r=script.lora_r, lora_alpha=script.lora_alpha, lora_dropout=script.lora_dropout,
            target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]))

    with args.main_process_first(desc="tokenising"):
        train_rows, eval_rows, _ = load_tokenized(script.target_dataset, script.target_split, tokenizer, script,
                                                  "target", script.max_target_rows, args.seed)
        protected = {name: load_tokenized(src, script.protected_split, tokenizer, script, name,
                                          script.max_constraint_rows, args.seed, certify=True)
                     for name, src in _named_sources(script.protected_datasets).items()}
        safety = None
        if script.safety_dataset:
            safety = load_tokenized(script.safety_dataset, script.protected_split, tokenizer, script, "safety",
                                    script.max_constraint_rows, args.seed, certify=True)

    collate = PaddingCollator(tokenizer)
    model.to(args.device)
    gap = ReferenceGap(causal_lm_per_example_loss)  # one row function: every constraint in one group
    # the certificate: per protected task, the share of its certification rows the old model (with LoRA: the
    # adapter-disabled base) answers exactly and the new one does not (teacher-forced exact match of the answer)
    certifying = script.certify_fraction > 0
    constraints = []
    if protected:
        constraints += non_forgetting_constraints(
            model, causal_lm_per_example_loss, {k: v.train for k, v in protected.items()}, collate,
            eval_datasets=None if script.eval_fraction <= 0 else {k: v.held_out for k, v in protected.items()},
            tolerance=script.constraint_tolerance, relative_tolerance=script.relative_tolerance,
            batch_size=script.reference_batch_size, row_fn=gap,
            certify_datasets={k: v.certify for k, v in protected.items()} if certifying else None,
            correct=causal_lm_per_example_correct, forget_tolerance=script.forget_tolerance)
    if safety is not None:
        constraints += non_forgetting_constraints(
            model, causal_lm_per_example_loss, {"refusals": safety.train}, collate,
            eval_datasets=None if safety.held_out is None else {"refusals": safety.held_out},
            tolerance=script.safety_tolerance, batch_size=script.reference_batch_size, name="safety/{task}",
            row_fn=gap, certify_datasets={"refusals": safety.certify} if certifying else None,
            correct=causal_lm_per_example_correct, forget_tolerance=script.forget_tolerance)
    certification = {c.name: {"rows": len(c.certify_dataset), "fraction_of_held_out": script.certify_fraction,
                              "seed": args.seed} for c in constraints if c.certify_dataset is not None}
    for name, split in certification.items():
        floor = 1.0 - script.delta ** (1.0 / split["rows"])  # the bound with nothing forgotten
        if floor > script.forget_tolerance:
            logger.warning("%s: %d certification rows cannot certify --forget_tolerance %g (even with nothing "
                           "forgotten the bound is %.3f): more rows (--eval_fraction, --certify_fraction) or a "
                           "larger tolerance", name, split["rows"], script.forget_tolerance, floor)

    trainer = ConstrainedTrainer(model=model, args=args, train_dataset=train_rows, eval_dataset=eval_rows,
                                 data_collator=collate, processing_class=tokenizer, constraints=constraints)
    train_result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    # the upload comes last, after the results, report and card exist: this save does not push
    push, args.push_to_hub = args.push_to_hub, False
    try:
        trainer.save_model(args.output_dir)  # before the card: a PEFT save writes its own README.md
    finally:
        args.push_to_hub = push

    hub_ids = [s for s in [script.target_dataset, *_named_sources(script.protected_datasets).values(),
                           script.safety_dataset] if s and not os.path.exists(s)]
    report, metrics = None, {}
    if constraints:
        # held-out evaluation (objective and exact constraint values), safety report, card, figures;
        # a non-forgetting constraint is 0 at the old model by definition
        report = finish_run(
            trainer, old_model_values={c.name: 0.0 for c in constraints}, base_model_name=script.model_name_or_path,
            dataset_description=(f"SFT on {publishable_path(script.target_dataset)}; "
                                 f"protected: {sorted(protected) or 'none'}"
                                 f"{'; safety set ' + publishable_path(script.safety_dataset) if script.safety_dataset else ''}; "
                                 f"{script.eval_fraction:.0%} of every dataset held out"
                                 + (f", {script.certify_fraction:.0%} of each protected / safety set's held-out rows "
                                    "set aside as its certification split (read only by the certificate: the "
                                    "share of the set's examples forgotten, teacher-forced exact match, at most "
                                    f"{script.forget_tolerance:g})" if certifying else "; no certification split")),
            datasets=hub_ids or None,
            reproduce_command=publishable_command("accelerate launch recipes/llm_non_forgetting.py",
                                                  sys.argv[1:] if argv is None else argv, output_dir=args.output_dir),
            delta=script.delta,
        )
        metrics = dict(report.objective_metrics)
    elif eval_rows is not None:
        metrics = trainer.evaluate()
    results = {
        "model": publishable_path(script.model_name_or_path),  # results are shared: no local paths
        "penalty": args.constraint_penalty,
        "penalty_beta": args.penalty_beta,
        "num_processes": trainer.accelerator.num_processes,
        "train_metrics": train_result.metrics,
        "eval_metrics": metrics,
        "constraints": {c.name: {"tolerance": c.tolerance, **c.metadata} for c in constraints},
        "safety_report": None if report is None else report.to_dict(),
        "safe": None if report is None else report.all_satisfied,
        "certified": None if report is None else report.certified,
        "certified_bounds": {} if report is None else report.certified_bounds(),
        "forget_tolerance": script.forget_tolerance,
        "delta": script.delta,
        "certification_splits": certification,
        "script_args": publishable_values(asdict(script), args.output_dir),
    }
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(args.output_dir)
        path = os.path.join(args.output_dir, RESULTS_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump(results, f, indent=2, default=str)
        os.replace(path + ".tmp", path)
        logger.info("saved the model, tokenizer and %s to %s", RESULTS_FILE, args.output_dir)
        if report is not None:
            logger.info(report.summary())
    results["exit_status"] = 0
    if args.push_to_hub:
        try:  # every local file is complete by now: a refusal uploads nothing and loses nothing
            trainer.push_to_hub(allow_unsafe=script.allow_unsafe_push)
        except UnsafeModelError as err:
            logger.error("%s", str(err).splitlines()[0])
            results["exit_status"] = 1  # the gate refused: the command fails
    return results


if __name__ == "__main__":
    sys.exit(main()["exit_status"])
