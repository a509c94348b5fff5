"""Fine-tune a CLIP model on a target class under one non-forgetting constraint per protected class.

    min_w F(w, D_target)  s.t.  L_k(w, D_k) - L_k(w_old, D_k) <= tol,  k = protected classes

F is the two-way global contrastive loss (Setting II, Algorithm 2) on target image-text
pairs; L_k the zero-shot cross-entropy over all class prompts (the paper's application "Continual learning with
non-forgetting constraints").
Run with ``accelerate launch recipes/clip_non_forgetting.py --help`` for every option;
the README (section "clip") has the paper's BDD100K command lines.

Data:
  * ``--data bdd100k --bdd100k_root DIR --task {foggy,overcast,tunnel}``: the official
    label JSONs and image folders; target pairs from the train split, constraints on the
    protected classes' train images, evaluation on val;
  * ``--data csv``: ``--target_csv`` (image path, caption, label: positives are rows whose
    label is the target class) plus ``--protected_csv`` / ``--protected_eval_csv``
    (image path, label) for the constraints; ``--target_csv`` can also add extra pairs
    (e.g. LAION retrievals) to the BDD100K data.

Certificate: ``--certify_fraction`` (default 0.5) of each protected class's held-out images
(of its constraint images when there are no held-out ones), drawn with ``--seed``, are set
aside as the class's certification split: neither training, nor evaluation, nor the reported
accuracies read them. ``finish_run`` certifies the final model on them at ``--delta``
(default 0.05): "at most ``--forget_tolerance`` of class k's images forgotten" (right under the
old model, wrong now; a 0/1 rate with an exact Clopper-Pearson bound). With n certification
images per class no tolerance below 1 - delta^(1/n) can be certified (a warning says so).

At the end: ``trainer.evaluate()``, the model and processor saved to ``--output_dir``, the
safety report and model card (certified or not), and ``non_forgetting_results.json`` with
per-class accuracies of the old and new model, the exact constraint values and the certificate.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, Optional

import numpy as np
import torch
from transformers import CLIPModel, CLIPProcessor, set_seed

from hf_constrained import ConstrainedTrainingArguments, finish_run
from hf_constrained.atomic_files import atomic_write_json
from hf_constrained.callbacks import PeriodicMetricsCallback
from hf_constrained.certification.bounds import clopper_pearson_upper_bound
from hf_constrained.certification.splits import carve_certification, check_certify_fraction
from hf_constrained.clip import (
    CLIPWithClassTextHeads,
    ContrastiveConstrainedTrainer,
    NonForgettingConfig,
    ZeroShotLoss,
    non_forgetting_constraints,
    zero_shot_accuracy,
)
from hf_constrained.clip.data import (
    BDD100K_TASKS,
    CLIPCollator,
    RowDataset,
    bdd100k_task_data,
    csv_target_rows,
    load_image_text_csv,
)
from hf_constrained.distributed import exit_after_all_ranks
from hf_constrained.errors import check_model_path
from hf_constrained.extras import require_extra
from hf_constrained.publishable import publishable_command, publishable_path, publishable_values
from hf_constrained.recipe_args import CertificateArguments, RecipeConfigError, given_flags, parse_recipe_args
from hf_constrained.safety.finish import push_last

logger = logging.getLogger("clip_non_forgetting")
RESULTS_FILE = "non_forgetting_results.json"


@dataclass
class ScriptArguments(CertificateArguments):
    model_name_or_path: str = field(metadata={"help": "Any CLIPModel checkpoint: a hub name "
                                              "(e.g. openai/clip-vit-base-patch16) or a local folder with its "
                                              "processor."})
    data: str = field(default="bdd100k", metadata={"help": "Where the data comes from.", "choices": ["bdd100k", "csv"]})
    bdd100k_root: Optional[str] = field(default=None, metadata={
        "help": "BDD100K folder with images/100k/{train,val} and labels/bdd100k_labels_images_{train,val}.json."})
    task: str = field(default="foggy",
                      metadata={"help": "BDD100K task of the paper.", "choices": sorted(BDD100K_TASKS)})
    target_class: Optional[str] = field(default=None, metadata={
        "help": "Target class (default: the task's; required with --data csv)."})
    protected_classes: Optional[str] = field(default=None, metadata={
        "help": "Comma-separated protected classes, one constraint each (default: the task's)."})
    prompt_template: Optional[str] = field(default=None, metadata={
        "help": "Class prompt with one {} (default: the task's, e.g. 'the weather is {}.')."})
    target_csv: Optional[str] = field(default=None, metadata={
        "help": "CSV/TSV of extra target image-text pairs (image path, caption, label), e.g. LAION retrievals."})
    protected_csv: Optional[str] = field(default=None, metadata={
        "help": "--data csv: images of the protected classes (image path, label)."})
    protected_eval_csv: Optional[str] = field(default=None, metadata={"help": "--data csv: held-out protected images."})
    image_column: str = field(default="filepath", metadata={"help": "CSV column of image paths."})
    caption_column: str = field(default="title", metadata={"help": "CSV column of captions."})
    label_column: str = field(default="label", metadata={"help": "CSV column of class names."})
    max_per_class: Optional[int] = field(default=None, metadata={
        "help": "Cap on images per class and split (BDD100K)."})
    negatives_per_class: Optional[int] = field(default=None, metadata={
        "help": "Cap on negative pairs per non-target class in the target data (BDD100K)."})
    temperature: float = field(default=0.05, metadata={"help": "tau of the zero-shot logits in the constraints."})
    contrastive_temperature: float = field(default=0.05, metadata={"help": "t of the contrastive objective."})
    constraint_tolerance: float = field(default=0.0, metadata={
        "help": "h_k <= tolerance (0: no worse than the old model)."})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank (0: train all parameters, as the paper)."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha."})
    lora_target_modules: str = field(default="q_proj,v_proj", metadata={"help": "Comma-separated LoRA target modules."})
    class_text_heads_rank: int = field(default=0, metadata={
        "help": "Rank of per-class low-rank text heads P + A_c B_c (0: off)."})
    reference_batch_size: int = field(default=64, metadata={"help": "Batch size of the old model's reference pass."})
    half_positive_batches: bool = field(default=False, metadata={
        "help": "Every batch half target pairs, half others (the reference code's batches); default: shuffled rows."})
    certify_fraction: float = field(default=0.5, metadata={
        "help": "Share of each protected class's held-out images (its constraint images when there are no held-out "
                "ones) set aside, with --seed, as its certification split; nothing else reads them "
                "(0: no certificate)."})
    forget_tolerance: float = field(default=0.05, metadata={
        "help": "Certified: at most this share of each protected class's certification images forgotten "
                "(right under the old model, wrong now)."})
    allow_unsafe_push: bool = field(default=False, metadata={
        "help": "With --push_to_hub: publish even when the run is not certified (the card then says so)."})
    accuracy_every_steps: int = field(default=0, metadata={
        "help": "Log per-class zero-shot accuracy (eval_accuracy/<class>) on the held-out images every N steps "
                "(400 = once per paper epoch); 0: only at the end."})


OUTPUT_DIR = "outputs/clip_non_forgetting"
"""``--output_dir`` unless given: ``outputs/<recipe module>``, as every recipe."""


def _split(value: Optional[str]) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()] if value else []


def dataset_id(script: ScriptArguments) -> str:
    """The data's identifier in the model card's model-index: ``bdd100k``, or the protected
    CSV's file name (``--data csv``)."""
    if script.data == "csv" and script.protected_csv:
        return os.path.splitext(os.path.basename(script.protected_csv))[0]
    return script.data


def build_data(script: ScriptArguments) -> dict:
    """Target rows, protected train/eval rows and the class list, from BDD100K and/or CSVs."""
    if script.data == "bdd100k":
        if not script.bdd100k_root:
            raise RecipeConfigError("--data bdd100k needs --bdd100k_root")
        task = BDD100K_TASKS[script.task]
        if script.target_class or script.protected_classes or script.prompt_template:
            from hf_constrained.clip.data import BDD100KTask

            task = BDD100KTask(task.attribute, script.target_class or task.target,
                               tuple(_split(script.protected_classes)) or task.protected,
                               script.prompt_template or task.template)
        data = bdd100k_task_data(script.bdd100k_root, task, max_per_class=script.max_per_class,
                                 negatives_per_class=script.negatives_per_class)
        classes, target, template = list(task.classes), task.target, task.template
        target_rows = data["target_rows"]
        train, held_out = data["train"], data["val"]
    else:
        target, protected = script.target_class, _split(script.protected_classes)
        if not target or not protected or not script.prompt_template:
            raise RecipeConfigError("--data csv needs --target_class, --protected_classes and --prompt_template")
        if not script.target_csv or not script.protected_csv:
            raise RecipeConfigError("--data csv needs --target_csv (image-text pairs) and --protected_csv "
                                    "(protected images)")
        classes, template = protected + [target], script.prompt_template
        target_rows = []
        index = {c: i for i, c in enumerate(classes)}

        def protected_rows(path: str) -> dict:
            rows = load_image_text_csv(path, image_column=script.image_column, caption_column=None,
                                       label_column=script.label_column)
            out = {c: [] for c in classes}
            for r in rows:
                if r["label_name"] in out:
                    out[r["label_name"]].append({"image": r["image"], "label": index[r["label_name"]]})
            empty = [c for c in protected if not out[c]]
            if empty:
                raise ValueError(f"{path}: no images of protected classes {empty}")
            return out

        train = protected_rows(script.protected_csv)
        held_out = protected_rows(script.protected_eval_csv) if script.protected_eval_csv else None
    if "{}" not in template:
        raise RecipeConfigError(f"--prompt_template needs a '{{}}' for the class name, got {template!r}")
    if script.target_csv:
        extra = load_image_text_csv(script.target_csv, image_column=script.image_column,
                                    caption_column=script.caption_column, label_column=script.label_column)
        target_rows = target_rows + csv_target_rows(extra, target, classes)
    if not any(r["is_positive"] for r in target_rows):
        raise ValueError(f"the target data has no pair of the target class {target!r}")
    if all(r["is_positive"] for r in target_rows):
        raise ValueError("the target data has no negative pair (rows of other classes): nothing to contrast with")
    return {"classes": classes, "target": target, "protected": [c for c in classes if c != target],
            "template": template, "target_rows": target_rows, "train": train, "held_out": held_out}


def split_certification(rows: dict, protected: list[str], fraction: float, seed: int, what: str
                        ) -> tuple[dict, dict]:
    """(rows left, certification rows) per protected class: ``round(fraction * n)`` of each class's n
    rows (at least one each side), carved by the library's ``carve_certification`` from one generator
    seeded by ``seed``, class after class; other classes' rows stay as they are."""
    check_certify_fraction(fraction)
    left, certify = dict(rows), {}
    if fraction == 0:
        return left, certify
    rng = np.random.default_rng(seed)  # one stream for all classes, seeded by the run's seed alone
    for c in protected:
        left[c], certify[c] = carve_certification(list(rows.get(c, [])), fraction, rng,
                                                  name=f"protected class {c!r}", unit=f"{what} image(s)")
    return left, certify


# The paper's beta for Setting I (section 5: 10 for the hinge, 800 for the squared hinge), in this library's units:
# the reference code multiplies the constraint term by tau (0.05, --temperature's default), this library does not
# (docs/clip.md, "Beta"). The library's own default, 10, would be the paper's 200, outside the grid it searched.
PAPER_BETA = {"hinge": 0.5, "squared_hinge": 40.0}


def default_penalty_beta(args: ConstrainedTrainingArguments, given: set[str]) -> None:
    """Without ``--penalty_beta``: the paper's beta for the run's penalty (:data:`PAPER_BETA`); a given one is kept."""
    if "penalty_beta" not in given and args.constraint_penalty in PAPER_BETA:
        args.penalty_beta = PAPER_BETA[args.constraint_penalty]


def setup(argv: Optional[list[str]]) -> tuple[ScriptArguments, ConstrainedTrainingArguments]:
    """The flags, checked before any data is read or model loaded (optional packages: an error naming the
    extra); then logging and the seed."""
    script, args = parse_recipe_args([ScriptArguments, ConstrainedTrainingArguments], argv, description=__doc__,
                                     # --help-all shows the hinge's default beta (the squared hinge's follows below)
                                     defaults={"remove_unused_columns": False, "output_dir": OUTPUT_DIR,
                                               "penalty_beta": PAPER_BETA["hinge"]})
    default_penalty_beta(args, given_flags(argv))
    if args.remove_unused_columns:  # a flag this recipe cannot honour: an error, not silently replaced
        raise ValueError("--remove_unused_columns true is not supported by this recipe: its collator reads the "
                         "raw columns (image, caption) that the Trainer would remove")
    check_model_path(script.model_name_or_path)  # before any data is read
    # optional packages, before any data is read or model loaded: an error naming the extra
    require_extra("PIL", "clip", "the CLIP recipe's images")
    if script.lora_r:
        require_extra("peft", "peft", "--lora_r (LoRA adapters)")
    logging.basicConfig(level=logging.INFO if args.should_log else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    set_seed(args.seed)
    if script.lora_r and script.class_text_heads_rank:
        raise ValueError("--lora_r and --class_text_heads_rank cannot be combined in this recipe")
    return script, args


def set_aside_certification(script: ScriptArguments, seed: int, data: dict) -> tuple[dict, str]:
    """Each protected class's certification images, carved before anything reads the rows (reference pass,
    evaluation, accuracies): from the held-out images, or the constraint images when there are none (``data`` keeps
    the rest). Returns them and where they came from; warns where a class has too few to certify
    ``--forget_tolerance`` even with none forgotten."""
    certify_from = "held-out" if data["held_out"] is not None else "constraint data"
    if data["held_out"] is not None:
        data["held_out"], certify_rows = split_certification(data["held_out"], data["protected"],
                                                             script.certify_fraction, seed, "held-out")
    else:
        data["train"], certify_rows = split_certification(data["train"], data["protected"], script.certify_fraction,
                                                          seed, "constraint")
    for c, rows in certify_rows.items():
        floor = clopper_pearson_upper_bound(0, len(rows), script.delta)
        if script.forget_tolerance < floor:
            logger.warning("protected class %r: %d certification images cannot certify --forget_tolerance %g at "
                           "--delta %g (even with none forgotten the bound is %.3f)", c, len(rows),
                           script.forget_tolerance, script.delta, floor)
    return certify_rows, certify_from


def load_model(script: ScriptArguments, args: ConstrainedTrainingArguments, data: dict) -> tuple[Any, Any, bool]:
    """The processor and the model (fixed temperatures; with ``--lora_r`` a LoRA adapter, with
    ``--class_text_heads_rank`` per-class text heads), on the run's device; and whether it has the heads."""
    processor = CLIPProcessor.from_pretrained(script.model_name_or_path)
    model = CLIPModel.from_pretrained(script.model_name_or_path, dtype=torch.float32)
    model.logit_scale.requires_grad_(False)  # fixed temperatures (t, tau), as the paper
    if script.lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=script.lora_r, lora_alpha=script.lora_alpha,
                                                 target_modules=_split(script.lora_target_modules)))
    heads = script.class_text_heads_rank > 0
    if heads:
        model = CLIPWithClassTextHeads(model, len(data["classes"]), script.class_text_heads_rank)
        for r in data["target_rows"]:
            r["text_class_id"] = int(r.get("label", -1))
    model.to(args.device)
    return processor, model, heads


class Problem(NamedTuple):
    """The constrained problem: the zero-shot loss, the collator, one constraint per protected class, the rows the
    accuracies are reported on, and whether there are held-out and certification images."""

    loss: ZeroShotLoss
    collate: CLIPCollator
    constraints: list[Any]
    report_rows: RowDataset
    held_out: bool
    certified: bool


def build_problem(script: ScriptArguments, args: ConstrainedTrainingArguments, data: dict, model: Any,
                  processor: Any, certify_rows: dict, heads: bool) -> Problem:
    """The zero-shot loss over every class prompt and a non-forgetting constraint per protected class, its old
    model's values computed here (with LoRA the adapter-disabled base: no second copy)."""
    classes = data["classes"]
    prompts = processor.tokenizer([data["template"].format(c) for c in classes], padding=True, return_tensors="pt")
    loss = ZeroShotLoss(prompts["input_ids"], prompts.get("attention_mask"), temperature=script.temperature,
                        class_heads=heads)
    collate = CLIPCollator(image_processor=processor.image_processor, tokenizer=processor.tokenizer)
    train_sets = {c: RowDataset(data["train"][c]) for c in data["protected"]}
    eval_sets = None if data["held_out"] is None else {c: RowDataset(data["held_out"][c]) for c in data["protected"]}
    certify_sets = {c: RowDataset(rows) for c, rows in certify_rows.items()} or None
    # the old model: the model before training; with LoRA the adapter-disabled base (no second copy)
    with model.disable_adapter() if script.lora_r else contextlib.nullcontext():
        constraints = non_forgetting_constraints(model, loss, train_sets, collate, eval_datasets=eval_sets,
                                                 certify_datasets=certify_sets, config=NonForgettingConfig(
                                                     tolerance=script.constraint_tolerance,
                                                     batch_size=script.reference_batch_size,
                                                     forget_tolerance=script.forget_tolerance if certify_sets else None,
                                                     old_correct_on_rows=bool(certify_sets)
                                                     and args.constraint_proxy_indicator))
    report_split = data["held_out"] if data["held_out"] is not None else data["train"]
    report_rows = RowDataset([row for c in classes for row in report_split.get(c, [])])
    return Problem(loss, collate, constraints, report_rows, bool(eval_sets), bool(certify_sets))


def build_trainer(script: ScriptArguments, args: ConstrainedTrainingArguments, model: Any, data: dict,
                  problem: Problem) -> ContrastiveConstrainedTrainer:
    """The contrastive objective on the target pairs under the constraints; with ``--accuracy_every_steps`` the
    per-class zero-shot accuracy logged with the Trainer's entries."""
    trainer = ContrastiveConstrainedTrainer(
        model=model, args=args, train_dataset=RowDataset(data["target_rows"]), data_collator=problem.collate,
        constraints=problem.constraints, contrastive_temperature=script.contrastive_temperature,
        half_positive_batches=script.half_positive_batches,
    )
    if script.accuracy_every_steps:  # logged WITH the Trainer's entry of that step, never instead of it
        trainer.add_callback(PeriodicMetricsCallback(
            trainer, script.accuracy_every_steps,
            lambda t: {f"eval_accuracy/{c}": v for c, v in zero_shot_accuracy(
                t.model, problem.report_rows, problem.loss, problem.collate, data["classes"]).items()}))
    return trainer


def report_run(script: ScriptArguments, trainer: Any, problem: Problem, results: dict, certify_from: str,
               argv: Optional[list[str]]) -> Any:
    """The safety report and model card (a non-forgetting constraint is 0 at the old model by definition), with
    each protected class's old and new zero-shot accuracy beside its constraint."""
    accuracy_old, accuracy_new = results["accuracy_old"], results["accuracy_new"]
    constraints = problem.constraints
    return finish_run(
        trainer, old_model_values={c.name: 0.0 for c in constraints}, base_model_name=script.model_name_or_path,
        dataset_description=f"fine-tuned for the target class {results['target_class']!r}; protected classes "
                            f"{results['protected_classes']}; "
                            f"accuracies on {results['accuracy_split']} data; "
                            + (f"certified on {script.certify_fraction:g} of each protected class's {certify_from} "
                               f"images (read by nothing else) as 'at most {script.forget_tolerance:g} of the "
                               "class's images forgotten'" if problem.certified else "no certification split"),
        delta=script.delta, eval_dataset=dataset_id(script),
        population=f"the {certify_from} images of each protected class, each constraint its own class"
        if problem.certified else None,
        reproduce_command=publishable_command("accelerate launch recipes/clip_non_forgetting.py",
                                              sys.argv[1:] if argv is None else argv,
                                              output_dir=trainer.args.output_dir),
        objective_metrics={f"accuracy/{c}": v for c, v in accuracy_new.items()},
        # what users look at beside the loss-based value: zero-one accuracy per protected class
        # (each constraint's metadata names its class under "task", as the non-forgetting builder stores it)
        extra_columns={"old accuracy": {c.name: accuracy_old[c.metadata["task"]] for c in constraints},
                       "new accuracy": {c.name: accuracy_new[c.metadata["task"]] for c in constraints}},
    )


def main(argv: Optional[list[str]] = None) -> dict:
    script, args = setup(argv)
    data = build_data(script)
    classes, target = data["classes"], data["target"]
    certify_rows, certify_from = set_aside_certification(script, args.seed, data)
    processor, model, heads = load_model(script, args, data)
    problem = build_problem(script, args, data, model, processor, certify_rows, heads)
    accuracy_old = zero_shot_accuracy(model, problem.report_rows, problem.loss, problem.collate, classes)
    trainer = build_trainer(script, args, model, data, problem)
    train_result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = trainer.evaluate()
    accuracy_new = zero_shot_accuracy(model, problem.report_rows, problem.loss, problem.collate, classes)
    results = {
        "model": publishable_path(script.model_name_or_path),  # results are shared: no local paths
        "target_class": target,
        "protected_classes": [c for c in classes if c != target],
        "penalty": args.constraint_penalty,
        "penalty_beta": args.penalty_beta,
        "train_metrics": train_result.metrics,
        "eval_metrics": metrics,
        "constraints_train": trainer.evaluate_constraints(split="train"),
        "accuracy_old": accuracy_old,
        "accuracy_new": accuracy_new,
        "accuracy_split": "held-out" if problem.held_out else "constraint data",
        "log_history": trainer.state.log_history,
        "script_args": publishable_values(asdict(script), args.output_dir),
    }
    # through the trainer, which records the weight files it writes: the report written next to them
    # names them, so `hf-constrained report --check` can vouch for this folder (the push comes last)
    trainer.save_model(args.output_dir, push=False)
    if trainer.is_world_process_zero():
        processor.save_pretrained(args.output_dir)
    # safety report + model card (after save_pretrained: a PEFT save writes its own README.md)
    report = report_run(script, trainer, problem, results, certify_from, argv)
    results["safe"] = report.all_satisfied
    results["certificate"] = {
        "certified": report.certified, "delta": script.delta, "forget_tolerance": script.forget_tolerance,
        "certify_fraction": script.certify_fraction, "certify_split": certify_from if problem.certified else None,
        "certify_rows": {c: len(rows) for c, rows in certify_rows.items()},
        "certified_bounds": report.certified_bounds(), "failing": report.with_rule("certified").failed,
    }
    if trainer.is_world_process_zero():
        path = os.path.join(args.output_dir, RESULTS_FILE)
        atomic_write_json(path, results, default=str)
        logger.info("saved model and %s to %s", RESULTS_FILE, args.output_dir)
        # accuracies as fractions, the unit of the report and the card; the verdict is finish_run's, shown once
        for c in classes:
            if c in accuracy_old:
                print(f"{c:>20}: accuracy {accuracy_old[c]:.3f} -> {accuracy_new.get(c, float('nan')):.3f}")
    # last, after every local file is written: a refusal uploads nothing, loses nothing and fails the command
    results["exit_status"] = push_last(trainer, script.allow_unsafe_push) if args.push_to_hub else 0
    return results


if __name__ == "__main__":
    exit_after_all_ranks(main(sys.argv[1:] or None)["exit_status"])
