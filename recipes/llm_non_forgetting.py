"""Supervised fine-tuning of a causal language model under non-forgetting constraints.

    min_w  SFT loss on the target data
    s.t.   L_k(w, D_k) - L_k(w_old, D_k) <= tol_k    for every protected dataset D_k
           (optionally) L_s(w, D_safe) - L_s(w_old, D_safe) <= tol_s   for a safety set

L is the mean next-token cross-entropy of each example's answer tokens; w_old is the
model before fine-tuning (with ``--lora_r`` the adapter-disabled base). The old model's
per-example losses are computed once before training. All constraints share one row
function (one model call for all sampled constraints when the trainer fuses them).

The defaults (``BENCHMARK_DEFAULTS``, ``--replay_old 0.5``) are the setting the forgetting benchmark chose on the
offline LLM example (docs/benchmarks.md): the hinge at beta 0.25 on top of replay of the protected rows,
two-split estimation whose indicator follows the share of rows forgotten (docs/llm.md).

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

The command line follows TRL's scripts (``trl/scripts/sft.py``): with TRL installed
(``pip install 'hf_constrained[trl]'``) it is parsed by ``TrlParser`` over TRL's
``ScriptArguments`` (``--dataset_name``: the target data, ``--dataset_config``,
``--dataset_train_split``), ``ModelConfig`` (``--model_name_or_path``, ``--dtype``,
``--use_peft``, ``--lora_r``, ``--lora_target_modules q_proj v_proj``, ...), the package's
``ConstrainedSFTConfig`` (TRL's ``SFTConfig``: ``--max_length``, ``--packing``,
``--chat_template_path``, ... plus the constraint settings) and this recipe's
``ConstraintDataArguments`` (the protected and safety data, tolerances, the certificate), and
the objective is trained by ``ConstrainedSFTTrainer`` (TRL prepares the target data and logs
its metrics, e.g. ``mean_token_accuracy``). Without TRL the same flag names are parsed by
``HfArgumentParser`` and the objective is trained by ``ConstrainedTrainer`` on rows tokenised
by :func:`hf_constrained.text_data.tokenize_sft`; a flag only TRL implements (``--packing``,
``--load_in_4bit``, ...) is then an error naming the extra to install.

Run::

    accelerate launch recipes/llm_non_forgetting.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --use_peft --lora_r 16 \\
        --dataset_name data/new_task.jsonl \\
        --protected_datasets math=data/math.jsonl code=data/code.jsonl \\
        --safety_dataset data/refusals.jsonl \\
        --output_dir outputs/llm --max_steps 500 --learning_rate 1e-4 \\
        --relative_tolerance 0.02

or put the flags in a YAML file (keys = flag names) and pass ``--config x.yaml``; flags on
the command line override the file. ``--help`` lists the main flags, ``--help-all`` every flag. At the end: held-out
evaluation, the model (or adapter) and tokenizer in ``--output_dir``, the safety report
and model card (with the certificate), ``llm_results.json`` (``certified``,
``certified_bounds``, the certification splits' sizes), with ``--config`` a copy of the file
(``recipe_config.yaml``, cited by the card's reproduce command), and with ``--push_to_hub``
the gated push (refused when the run is not certified, unless ``--allow_unsafe_push``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, Optional

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, set_seed

from hf_constrained import ConstrainedTrainer, ConstrainedTrainingArguments, finish_run
from hf_constrained.atomic_files import atomic_write_json
from hf_constrained.certification.splits import carve_certification, check_certify_fraction
from hf_constrained.distributed import exit_after_all_ranks
from hf_constrained.errors import check_model_path
from hf_constrained.extras import MissingExtraError, has_module, install_hint
from hf_constrained.method.regularisers import ConstraintRowReplay
from hf_constrained.non_forgetting import (
    ROWS_KEPT,
    NonForgettingConfig,
    ReferenceGap,
    causal_lm_per_example_loss,
    non_forgetting_constraints,
)
from hf_constrained.per_sample_loss import causal_lm_per_example_correct
from hf_constrained.publishable import publishable_command, publishable_path, publishable_values
from hf_constrained.recipe_args import CertificateArguments, RecipeConfigError, parse_recipe_args
from hf_constrained.safety.finish import push_last
from hf_constrained.text_data import SFTPaddingCollator, load_text_dataset, named_sources, tokenize_sft

logger = logging.getLogger("llm_non_forgetting")
RESULTS_FILE = "llm_results.json"
TRL_EXTRA = install_hint("trl")


# The constrained run the forgetting benchmark chose on the offline LLM example (docs/benchmarks.md, thirteenth to
# twentieth rounds): the hinge at beta 0.25 on top of replay 0.5, MSVR gamma 0.2 without the look-ahead (gamma' 0:
# the twentieth round found it kept nothing more on the example), two-split estimation
# (a quarter of each protected set's constraint rows drive the indicator) whose indicator follows the certificate's
# statistic (the share of rows forgotten) against --forget_tolerance minus a margin of 0.02, 8 rows per constraint and
# step. Two rows without the look-ahead, cheaper, lost to replay alone on the seeds that reported them.
# The defaults that depend on other flags (the margin, the proxy indicator, replay) are decided in one place,
# resolve_defaults, after parsing; until then the parser holds the library's value (UNTIL_RESOLVED).
BENCHMARK_DEFAULTS: dict[str, Any] = {
    "penalty_beta": 0.25, "msvr_gamma": 0.2, "msvr_gamma_prime": "0", "constraint_batch_size": 8,
    "constraint_indicator_fraction": 0.25, "constraint_proxy_indicator": True, "constraint_margin": 0.02}
BENCHMARK_REPLAY = 0.5
UNTIL_RESOLVED: dict[str, Any] = {"constraint_margin": None, "constraint_proxy_indicator": False}
MARGIN_FLAGS = ("constraint_margin", "constraint_confidence", "constraint_certificate_delta")
"""The margin rules, at most one per run: a user who gives one replaces the default margin."""


@dataclass
class ConstraintDataArguments(CertificateArguments):
    """The recipe's own flags: the protected and safety data, the tolerances and the certificate."""

    protected_datasets: list[str] = field(default_factory=list, metadata={
        "help": "Protected datasets, one constraint each: NAME=SOURCE (or SOURCE; the name is the file's stem). "
                "SOURCE: a Hub dataset id or a local JSON/JSONL/CSV/TSV/parquet file."})
    safety_dataset: Optional[str] = field(default=None, metadata={
        "help": "Optional safety set (e.g. harmful prompts with refusals): its loss must not rise either."})
    protected_split: str = field(default="train", metadata={"help": "Split of Hub protected / safety datasets."})
    eval_fraction: float = field(default=0.1, metadata={
        "help": "Fraction of every dataset held out: target rows for the objective's evaluation, protected rows "
                "for the exact constraint values of the safety report."})
    max_constraint_rows: Optional[int] = field(default=None, metadata={
        "help": "Cap on the rows taken from each protected / safety dataset (before the held-out split)."})
    max_target_rows: Optional[int] = field(default=None, metadata={"help": "Cap on the target rows."})
    replay_old: Optional[float] = field(default=None, metadata={
        "help": "Replay: the constraints' rows of each step (|B_k| per protected set and safety set) trained on "
                "as this share of the loss (0.5: old rows weigh as much as new ones; 0: none). The rows are drawn "
                "once and their loss computed once: with the hinge each row carries replay's weight plus the "
                "penalty's, so replay adds no rows to the step. Default: 0.5 (with the hinge at beta 0.25, the "
                "setting the forgetting benchmark chose, docs/benchmarks.md), 0 for --constraint_penalty none, "
                "without --protected_datasets, or with --packing / --padding_free. With --constraint_penalty none "
                "it is plain replay of the same rows."})
    protected_rows_kept: str = field(default="all", metadata={
        "help": "Which training rows of each protected set its constraint (and replay) reads: all, or old_correct, "
                "the rows the old model answers exactly (teacher-forced), the rows the certificate can count as "
                "forgotten (an error names a set with none). For short answers: on 24 string tasks replay of those "
                "rows kept 4-7 points more of the worst task (docs/many_tasks.md).",
        "choices": list(ROWS_KEPT)})
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
    reference_batch_size: int = field(default=16, metadata={"help": "Batch size of the old model's reference pass."})
    allow_unsafe_push: bool = field(default=False, metadata={
        "help": "With --push_to_hub: publish even when a constraint fails (the card then says UNSAFE)."})


# ----------------------------------------------------------- the same flag names without TRL
@dataclass
class DatasetArguments:
    """TRL's ``ScriptArguments`` (the flags this recipe reads), for a machine without TRL."""

    dataset_name: Optional[str] = field(default=None, metadata={
        "help": "The target data (the new task): a Hub dataset id or a local JSON/JSONL/CSV/TSV/parquet file."})
    dataset_config: Optional[str] = field(default=None, metadata={"help": "Hub dataset configuration name, if any."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split of a Hub target dataset."})
    dataset_test_split: str = field(default="test", metadata={
        "help": "Not used: the target's held-out rows are --eval_fraction of --dataset_train_split."})


@dataclass
class ModelArguments:
    """TRL's ``ModelConfig`` (model and LoRA flags, TRL's defaults), for a machine without TRL."""

    model_name_or_path: Optional[str] = field(default=None, metadata={
        "help": "Causal LM: a Hub id (e.g. Qwen/Qwen2.5-0.5B-Instruct) or a local folder with model and tokenizer."})
    model_revision: str = field(default="main", metadata={"help": "Model revision (branch, tag or commit)."})
    dtype: Optional[str] = field(default="float32", metadata={
        "help": "Weights dtype.", "choices": ["auto", "bfloat16", "float16", "float32"]})
    attn_implementation: Optional[str] = field(default=None, metadata={"help": "Attention implementation."})
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of every parameter."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={
        "help": "LoRA dropout (above 0 the constraint rows cannot share the objective's forward: docs/scale.md)"})
    lora_target_modules: Optional[list[str]] = field(default=None, metadata={
        "help": "LoRA target modules (e.g. q_proj v_proj, or all-linear); default: PEFT's for the model type."})
    lora_modules_to_save: Optional[list[str]] = field(default=None, metadata={
        "help": "Modules trained and saved in full beside the adapter."})
    use_rslora: bool = field(default=False, metadata={"help": "Rank-stabilised LoRA scaling."})
    use_dora: bool = field(default=False, metadata={"help": "Weight-decomposed LoRA (DoRA)."})


@dataclass
class SFTArguments(ConstrainedTrainingArguments):
    """The flags of TRL's ``SFTConfig`` this recipe implements without TRL, on top of the constraint settings."""

    max_length: Optional[int] = field(default=1024, metadata={
        "help": "Token limit per example (longer ones are cut); as TRL's SFTConfig."})
    dataset_text_field: str = field(default="text", metadata={"help": "Column of plain-text rows."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Run the model repository's own code."})


TRL_ONLY_FLAGS = frozenset({
    # SFTConfig
    "model_init_kwargs", "chat_template_path", "dataset_kwargs", "dataset_num_proc", "eos_token", "pad_token",
    "truncation_mode", "shuffle_dataset", "packing", "packing_strategy", "padding_free", "pad_to_multiple_of",
    "eval_packing", "completion_only_loss", "assistant_only_loss", "loss_type", "activation_offloading",
    "router_aux_loss_coef",
    # ScriptArguments
    "dataset_streaming", "ignore_bias_buffers",
    # ModelConfig
    "lora_target_parameters", "lora_task_type", "load_in_8bit", "load_in_4bit", "bnb_4bit_quant_type",
    "use_bnb_nested_quant", "bnb_4bit_quant_storage",
})
"""Flags of TRL's dataclasses that only TRL implements: without TRL, an error naming the extra."""

NOT_USED_FLAGS = {
    "dataset_test_split": "the target's held-out rows are --eval_fraction of --dataset_train_split",
    "dataset_streaming": "the recipe splits every dataset into training, held-out and certification rows",
    "ignore_bias_buffers": "not needed by this recipe",
    "lora_task_type": "the recipe trains a causal LM (CAUSAL_LM)",
}
"""Flags of TRL's dataclasses this recipe cannot honour: an error when given, not ignored."""

REPLACED_FLAGS = {
    "target_dataset": "the target data is --dataset_name (TRL's ScriptArguments)",
    "target_split": "the target's split is --dataset_train_split",
    "text_column": "the text column is --dataset_text_field (TRL's SFTConfig)",
    "prompt_column": "rows use TRL's column names: prompt + completion, text, or messages (rename the columns)",
    "completion_column": "rows use TRL's column names: prompt + completion, text, or messages (rename the columns)",
    "messages_column": "rows use TRL's column names: prompt + completion, text, or messages (rename the columns)",
}
"""Flags of earlier versions of this recipe and their replacements (an error naming the new flag)."""


def trl_available() -> bool:
    """Whether TRL (and so ``hf_constrained.integrations.trl``) can be imported."""
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


class RecipeArguments(NamedTuple):
    """The parsed flags: TRL's three groups and the recipe's own, and whether TRL parsed them."""

    dataset: Any
    training: Any
    model: Any
    data: ConstraintDataArguments
    trl: bool


def _dataclass_types(use_trl: bool) -> tuple[type, ...]:
    if use_trl:
        from trl import ModelConfig, ScriptArguments

        from hf_constrained.integrations.trl import ConstrainedSFTConfig

        return ScriptArguments, ConstrainedSFTConfig, ModelConfig, ConstraintDataArguments
    return DatasetArguments, SFTArguments, ModelArguments, ConstraintDataArguments


def parse_arguments(argv: Optional[list[str]] = None, use_trl: Optional[bool] = None) -> RecipeArguments:
    """TRL's flags (``TrlParser`` over ``ScriptArguments``, ``ConstrainedSFTConfig``, ``ModelConfig``) and the
    recipe's; without TRL (``use_trl=False`` or not installed) the same names through ``HfArgumentParser``.
    With ``--config x.yaml`` the file's values are the defaults and flags on the command line override them."""
    from hf_constrained.recipe_args import given_flags

    use_trl = trl_available() if use_trl is None else use_trl
    argv = list(sys.argv[1:] if argv is None else argv)
    given = given_flags(argv)
    for flag in sorted(given & set(NOT_USED_FLAGS)):
        raise RecipeConfigError(f"--{flag} is not used by this recipe: {NOT_USED_FLAGS[flag]}")
    if not use_trl:
        trl_only = sorted(given & TRL_ONLY_FLAGS)
        if trl_only:
            raise RecipeConfigError(f"{', '.join('--' + f for f in trl_only)}: implemented by TRL, "
                                    "which is not installed; "
                                    f"{TRL_EXTRA}")
    parser_class = HfArgumentParser
    if use_trl:
        from trl import TrlParser

        parser_class = TrlParser
    dataset, training, model, data = parse_recipe_args(
        _dataclass_types(use_trl), argv, description=__doc__.split("\n\n")[0], parser_class=parser_class,
        replaced_flags=REPLACED_FLAGS,
        defaults={"output_dir": "outputs/llm_non_forgetting", **BENCHMARK_DEFAULTS, **UNTIL_RESOLVED})
    lora_flags = sorted(given & {"lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",
                                 "lora_target_parameters", "lora_modules_to_save", "use_rslora", "use_dora"})
    if lora_flags and not model.use_peft:
        if "lora_r" in lora_flags and model.lora_r == 0:
            raise RecipeConfigError("--lora_r 0: full fine-tuning is the default; drop --lora_r 0 (LoRA is turned on "
                             "by --use_peft)")
        raise RecipeConfigError(f"{', '.join('--' + f for f in lora_flags)} without --use_peft: LoRA is turned on by "
                         "--use_peft (TRL's ModelConfig); add --use_peft true")
    resolve_defaults(data, training, given)
    return RecipeArguments(dataset, training, model, data, use_trl)


def packed_flags(args: Any) -> list[str]:
    """TRL's flags that make a batch one packed row (``--packing``, ``--padding_free``) this run sets: replay, which
    counts a batch's rows, cannot apply to such a batch."""
    return [f"--{flag}" for flag in ("packing", "padding_free") if getattr(args, flag, False)]


def resolve_defaults(data: ConstraintDataArguments, args: Any, given: set[str]) -> None:
    """The defaults that depend on other flags, all decided here, after parsing (the others are
    :data:`BENCHMARK_DEFAULTS`, the parser's): the margin (:data:`BENCHMARK_DEFAULTS`' 0.02 unless the user chose
    a margin rule: the arguments accept one), replay (``--replay_old``, :data:`BENCHMARK_REPLAY` where it applies)
    and the proxy indicator (on with two-split estimation where there is a certificate, whose statistic it
    follows). A value the user gave is kept (and checked by :func:`check_arguments`); a default that cannot apply
    is turned off, with a warning naming why. The default beta, the hinge's, is kept for the squared hinge with a
    warning (no benchmark chose one for it)."""
    if not given & set(MARGIN_FLAGS):
        args.constraint_margin = BENCHMARK_DEFAULTS["constraint_margin"]
    if data.replay_old is None:
        packed = packed_flags(args)
        off = ("--constraint_penalty none" if args.constraint_penalty == "none" else
               "no --protected_datasets" if not data.protected_datasets else
               " and ".join(packed) if packed else None)
        data.replay_old = BENCHMARK_REPLAY if off is None else 0.0
        if off is not None and args.constraint_penalty != "none":  # plain SFT never replays: nothing to say
            logger.warning("replay off (the default --replay_old %g needs a batch of rows from protected sets): %s",
                           BENCHMARK_REPLAY, off)
    if args.constraint_penalty == "squared_hinge" and "penalty_beta" not in given:
        # the benchmark chose beta for the hinge; the squared hinge's penalty is of another scale and was never run
        logger.warning("--penalty_beta %g is the forgetting benchmark's choice for the hinge, never run with "
                       "--constraint_penalty squared_hinge, which needs a much larger beta: give --penalty_beta",
                       args.penalty_beta)
    no_certificate = data.certify_fraction <= 0 or data.eval_fraction <= 0
    if "constraint_proxy_indicator" not in given:
        # on where it applies: two-split estimation (its indicator rows) and a certificate (whose statistic it follows),
        # in a constrained run (plain SFT has no indicator: its old model's correctness on the rows would be wasted)
        two_split = bool(args.constraint_indicator_fraction) and args.constraint_penalty != "none"
        args.constraint_proxy_indicator = BENCHMARK_DEFAULTS["constraint_proxy_indicator"] and two_split \
            and not no_certificate
        if two_split and no_certificate:
            logger.warning("the proxy indicator is off: it follows the certificate's statistic, and this run has no "
                           "certificate (--certify_fraction 0 or --eval_fraction 0); the indicator follows the loss "
                           "gap")
    elif no_certificate and args.constraint_proxy_indicator:
        raise RecipeConfigError("--constraint_proxy_indicator follows the certificate's statistic on the "
                                "indicator rows, but there is no certificate (--certify_fraction 0 or "
                                "--eval_fraction 0): pass --constraint_proxy_indicator false")


def lora_targets(modules: Optional[Any]) -> Optional[Any]:
    """``--lora_target_modules`` for ``LoraConfig``: a list of names (``q_proj v_proj``, or one comma-separated
    word ``q_proj,v_proj``), the word ``all-linear``, or ``None`` (PEFT's default for the model type)."""
    if modules is None:
        return None
    names = [n.strip() for m in ([modules] if isinstance(modules, str) else modules) for n in str(m).split(",")]
    names = [n for n in names if n]
    return "all-linear" if names == ["all-linear"] else names


# ---------------------------------------------------------------------------------- data
class Splits(NamedTuple):
    """One dataset's disjoint parts: training rows, held-out rows (evaluation and the safety report's values),
    certification rows (read only by the certificate; ``None`` without them)."""

    train: Any
    held_out: Any
    certify: Any


def split_rows(rows: Any, data: ConstraintDataArguments, name: str, source: str, seed: int,
               certify: bool = False) -> Splits:
    """``rows`` split in disjoint parts: ``eval_fraction`` of them held out and, with ``certify``,
    ``certify_fraction`` of those set aside as the certification split by the library's
    ``carve_certification`` (both seeded by ``seed``)."""
    if data.eval_fraction <= 0:
        return Splits(rows, None, None)
    if len(rows) < 2:
        raise ValueError(f"{name} ({source}): {len(rows)} usable row(s); need at least 2 to hold some out")
    parts = rows.train_test_split(test_size=data.eval_fraction, seed=seed)
    train, held_out = parts["train"], parts["test"]
    if not certify or data.certify_fraction <= 0:
        return Splits(train, held_out, None)
    held_out, certify_rows = carve_certification(held_out, data.certify_fraction, seed, name=f"{name} ({source})",
                                                 unit="held-out row(s)", more="a larger --eval_fraction")
    return Splits(train, held_out, certify_rows)


def load_raw(source: str, split: str, config_name: Optional[str], max_rows: Optional[int], seed: int) -> Any:
    """One dataset's rows, untokenised, capped at ``max_rows`` (a seeded random subset)."""
    raw = load_text_dataset(source, split=split, config_name=config_name)
    if max_rows is not None and len(raw) > max_rows:
        raw = raw.shuffle(seed=seed).select(range(max_rows))
    return raw


def load_tokenized(source: str, split: str, tokenizer: Any, config: RecipeArguments, name: str,
                   max_rows: Optional[int], seed: int, certify: bool = False) -> Splits:
    """One dataset, tokenised for per-example losses (:func:`~hf_constrained.text_data.tokenize_sft`: labels
    -100 outside the answer), split by :func:`split_rows`."""
    raw = load_raw(source, split, config.dataset.dataset_config, max_rows, seed)
    rows = tokenize_sft(raw, tokenizer, max_length=config.training.max_length,
                        text_column=config.training.dataset_text_field, name=name)
    return split_rows(rows, config.data, name, source, seed, certify=certify)


def check_arguments(config: RecipeArguments) -> None:
    """Every check that needs no model: a clear error naming the flag before anything heavy loads."""
    data, args, model = config.data, config.training, config.model
    if not config.dataset.dataset_name:
        raise RecipeConfigError("no target data: pass --dataset_name (a Hub dataset id or a local JSON/CSV/parquet "
                                "file)")
    if not model.model_name_or_path:
        raise RecipeConfigError("no model: pass --model_name_or_path (a Hub id or a local folder)")
    if not data.protected_datasets and not data.safety_dataset and args.constraint_penalty != "none":
        raise RecipeConfigError("no constraint: pass --protected_datasets and/or --safety_dataset "
                         "(or --constraint_penalty none for plain SFT)")
    if not 0.0 <= data.eval_fraction < 1.0:
        raise RecipeConfigError(f"--eval_fraction must be in [0, 1), got {data.eval_fraction}")
    if data.protected_rows_kept not in ROWS_KEPT:
        raise RecipeConfigError(f"--protected_rows_kept must be all or old_correct, got {data.protected_rows_kept!r}")
    if not 0.0 <= data.replay_old < 1.0:
        raise RecipeConfigError(f"--replay_old is the old rows' share of the loss, in [0, 1); got {data.replay_old}")
    if data.replay_old and not data.protected_datasets:
        raise RecipeConfigError(f"--replay_old {data.replay_old:g} replays the protected sets' rows, but there is no "
                                "--protected_datasets")
    packed = packed_flags(args)
    if data.replay_old and packed:  # a packed batch is one row: replay would mix one old row into it
        raise RecipeConfigError(f"--replay_old counts a batch's rows; it cannot be used with {' and '.join(packed)}")
    if model.use_peft and model.lora_r < 1:
        raise RecipeConfigError(f"--lora_r must be >= 1 with --use_peft, got {model.lora_r}")
    if model.use_peft and not has_module("peft"):
        raise MissingExtraError(f"--use_peft: LoRA adapters need the optional package 'peft', which is not "
                                f"installed: {install_hint('peft')}")
    for flag in ("constraint_tolerance", "relative_tolerance", "safety_tolerance"):
        if getattr(data, flag) < 0:
            raise RecipeConfigError(f"--{flag} must be >= 0, got {getattr(data, flag)}")
    if args.max_length is not None and args.max_length < 2:
        raise RecipeConfigError(f"--max_length must be >= 2, got {args.max_length}")
    try:
        check_certify_fraction(data.certify_fraction)
    except ValueError as err:
        raise RecipeConfigError(str(err)) from None
    if data.certify_fraction > 0 and data.eval_fraction <= 0:
        raise RecipeConfigError(f"--certify_fraction {data.certify_fraction} splits the held-out rows, but "
                                "--eval_fraction is 0: raise --eval_fraction or pass --certify_fraction 0 (no "
                                "certificate)")
    if not 0.0 <= data.forget_tolerance <= 1.0:
        raise RecipeConfigError(f"--forget_tolerance is a share of examples, in [0, 1]; got {data.forget_tolerance}")
    # a logger whose package is missing would fail when the Trainer is built, after the model loaded
    loggers = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "mlflow": ("mlflow",)}
    for name in args.report_to or []:
        if name in loggers and not any(importlib.util.find_spec(m) is not None for m in loggers[name]):
            raise RecipeConfigError(f"--report_to {name}: the {loggers[name][0]} package is not installed "
                                    f"(pip install {loggers[name][0]}), or pass --report_to none")
    # a mistyped path is an error naming the flag, before the tokenizer or the model loads
    model.model_name_or_path = check_model_path(model.model_name_or_path)


# ---------------------------------------------------------------------------------- model
def load_model_and_tokenizer(config: RecipeArguments) -> tuple[Any, Any]:
    """The tokenizer (with a pad token; TRL's ``--eos_token`` / ``--pad_token`` / ``--chat_template_path``
    applied here, before any data is tokenised, so the constraints' rows and TRL's see one tokenizer) and the
    model (``--dtype``, ``--model_revision``, ``--attn_implementation``, ``--trust_remote_code``, TRL's
    quantisation flags; with ``--use_peft`` wrapped in a LoRA adapter, whose disabled base is the old model)."""
    margs, args = config.model, config.training
    common = dict(revision=margs.model_revision, trust_remote_code=args.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(margs.model_name_or_path, **common)
    kwargs: dict[str, Any] = dict(common, attn_implementation=margs.attn_implementation,
                                  dtype=margs.dtype if margs.dtype in (None, "auto") else getattr(torch, margs.dtype))
    if config.trl:
        from trl import get_quantization_config

        quantization = get_quantization_config(margs)  # --load_in_4bit / --load_in_8bit
        if quantization is not None:
            kwargs.update(quantization_config=quantization)
        kwargs.update(args.model_init_kwargs or {})
    model = AutoModelForCausalLM.from_pretrained(margs.model_name_or_path, **kwargs)
    if config.trl:
        if args.eos_token is not None:
            if args.eos_token not in tokenizer.get_vocab():
                raise ValueError(f"--eos_token {args.eos_token!r} is not in the tokenizer's vocabulary")
            tokenizer.eos_token = args.eos_token
        if args.pad_token is not None:
            tokenizer.pad_token = args.pad_token
        if args.chat_template_path is not None:
            path = args.chat_template_path
            if os.path.isfile(path) and path.endswith((".jinja", ".j2")):
                with open(path, encoding="utf-8") as f:
                    tokenizer.chat_template = f.read()
            else:
                from trl import clone_chat_template

                model, tokenizer, _ = clone_chat_template(model, tokenizer, path)
            args.chat_template_path = None  # applied: the trainer must not apply it a second time
            logger.info("chat template from %s applied to the tokenizer", publishable_path(path))
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"{margs.model_name_or_path}: the tokenizer has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out of every loss
    if margs.use_peft:
        from peft import LoraConfig, get_peft_model

        extra = {} if getattr(margs, "lora_target_parameters", None) is None else {
            "target_parameters": margs.lora_target_parameters}
        model = get_peft_model(model, LoraConfig(
            task_type="CAUSAL_LM", r=margs.lora_r, lora_alpha=margs.lora_alpha, lora_dropout=margs.lora_dropout,
            target_modules=lora_targets(margs.lora_target_modules), bias="none", use_rslora=margs.use_rslora,
            use_dora=margs.use_dora, modules_to_save=margs.lora_modules_to_save, **extra))
    return model, tokenizer


# ---------------------------------------------------------------------------------- main
class RecipeData(NamedTuple):
    """The run's rows: the target's training and held-out rows, each protected set's :class:`Splits` by name, and
    the safety set's (``None`` without one)."""

    train: Any
    eval: Any
    protected: dict[str, Splits]
    safety: Optional[Splits]


def load_data(config: RecipeArguments, tokenizer: Any) -> RecipeData:
    """Every dataset, split; the constraints' rows tokenised here, the target's by TRL when it runs."""
    data, args = config.data, config.training
    target_source = config.dataset.dataset_name
    with args.main_process_first(desc="tokenising"):
        if config.trl:  # TRL prepares the objective's rows (formats, chat template, packing) itself
            raw = load_raw(target_source, config.dataset.dataset_train_split, config.dataset.dataset_config,
                           data.max_target_rows, args.seed)
            train_rows, eval_rows, _ = split_rows(raw, data, "target", target_source, args.seed)
        else:
            train_rows, eval_rows, _ = load_tokenized(target_source, config.dataset.dataset_train_split, tokenizer,
                                                      config, "target", data.max_target_rows, args.seed)
        protected = {name: load_tokenized(src, data.protected_split, tokenizer, config, name,
                                          data.max_constraint_rows, args.seed, certify=True)
                     for name, src in named_sources(data.protected_datasets, "--protected_datasets").items()}
        safety = None
        if data.safety_dataset:
            safety = load_tokenized(data.safety_dataset, data.protected_split, tokenizer, config, "safety",
                                    data.max_constraint_rows, args.seed, certify=True)
    return RecipeData(train_rows, eval_rows, protected, safety)


def build_constraints(config: RecipeArguments, model: Any, collate: Any, rows: RecipeData) -> list[Any]:
    """One non-forgetting constraint per protected set and one for the safety set, all sharing one row function
    (one model call for every sampled constraint). The certificate: per set, the share of its certification rows
    the old model (with LoRA: the adapter-disabled base) answers exactly and the new one does not (teacher-forced
    exact match of the answer)."""
    data, args = config.data, config.training
    gap = ReferenceGap(causal_lm_per_example_loss)  # one row function: every constraint in one group
    certifying = data.certify_fraction > 0
    # a proxy indicator evaluates the certificate's statistic on the constraint rows: they need the old correctness
    statement = dict(batch_size=data.reference_batch_size, forget_tolerance=data.forget_tolerance,
                     old_correct_on_rows=certifying and args.constraint_proxy_indicator)
    constraints = []
    if rows.protected:
        protected = rows.protected
        constraints += non_forgetting_constraints(
            model, causal_lm_per_example_loss, {k: v.train for k, v in protected.items()}, collate,
            eval_datasets=None if data.eval_fraction <= 0 else {k: v.held_out for k, v in protected.items()},
            certify_datasets={k: v.certify for k, v in protected.items()} if certifying else None,
            correct=causal_lm_per_example_correct, row_fn=gap,
            config=NonForgettingConfig(tolerance=data.constraint_tolerance, relative_tolerance=data.relative_tolerance,
                                       rows_kept=data.protected_rows_kept, **statement))
    if rows.safety is not None:
        safety = rows.safety
        constraints += non_forgetting_constraints(
            model, causal_lm_per_example_loss, {"refusals": safety.train}, collate,
            eval_datasets=None if safety.held_out is None else {"refusals": safety.held_out},
            certify_datasets={"refusals": safety.certify} if certifying else None,
            correct=causal_lm_per_example_correct, row_fn=gap,
            config=NonForgettingConfig(tolerance=data.safety_tolerance, name="safety/{task}", **statement))
    return constraints


def certification_splits(config: RecipeArguments, constraints: list[Any]) -> dict[str, dict[str, Any]]:
    """Each certified constraint's split (rows, fraction, seed), with a warning where it is too small to certify
    ``--forget_tolerance`` even with nothing forgotten."""
    data = config.data
    certification = {c.name: {"rows": len(c.certify.dataset), "fraction_of_held_out": data.certify_fraction,
                              "seed": config.training.seed} for c in constraints if c.certifiable}
    for name, split in certification.items():
        floor = 1.0 - data.delta ** (1.0 / split["rows"])  # the bound with nothing forgotten
        if floor > data.forget_tolerance:
            logger.warning("%s: %d certification rows cannot certify --forget_tolerance %g (even with nothing "
                           "forgotten the bound is %.3f): more rows (--eval_fraction, --certify_fraction) or a "
                           "larger tolerance", name, split["rows"], data.forget_tolerance, floor)
    return certification


def build_trainer(config: RecipeArguments, model: Any, tokenizer: Any, collate: Any, rows: RecipeData,
                  constraints: list[Any]) -> tuple[Any, Optional[ConstraintRowReplay]]:
    """TRL's ``ConstrainedSFTTrainer`` where TRL runs (its data preparation, loss and metrics for the objective),
    else ``ConstrainedTrainer``; with replay of the constraints' own rows (returned too, ``None`` without)."""
    data, args = config.data, config.training
    # replay reads the constraints' own rows of each step (never held-out or certification rows): one draw of old
    # rows per step, each row's loss computed once; with the hinge each row carries both weights
    replay = None if not data.replay_old else ConstraintRowReplay(data.replay_old)
    if config.trl:  # TRL's data preparation, loss and metrics (mean_token_accuracy, num_tokens) for the objective
        from hf_constrained.integrations.trl import ConstrainedSFTTrainer

        return ConstrainedSFTTrainer(model=model, args=args, train_dataset=rows.train, eval_dataset=rows.eval,
                                     processing_class=tokenizer, constraints=constraints, regulariser=replay), replay
    return ConstrainedTrainer(model=model, args=args, train_dataset=rows.train, eval_dataset=rows.eval,
                              data_collator=collate, processing_class=tokenizer, constraints=constraints,
                              regulariser=replay), replay


def finish(config: RecipeArguments, trainer: Any, rows: RecipeData, constraints: list[Any],
           command: str) -> tuple[Any, dict[str, Any]]:
    """Held-out evaluation (objective and exact constraint values), safety report, card and figures (a
    non-forgetting constraint is 0 at the old model by definition); without constraints the objective's
    evaluation alone. Returns the report (``None`` without constraints) and the objective's metrics."""
    data, margs = config.data, config.model
    target_source = config.dataset.dataset_name
    if not constraints:
        return None, (trainer.evaluate() if rows.eval is not None else {})
    protected_sources = named_sources(data.protected_datasets, "--protected_datasets").values()
    hub_ids = [s for s in [target_source, *protected_sources, data.safety_dataset] if s and not os.path.exists(s)]
    report = finish_run(
        trainer, old_model_values={c.name: 0.0 for c in constraints}, base_model_name=margs.model_name_or_path,
        dataset_description=(
            f"SFT on {publishable_path(target_source)}; "
            f"protected: {sorted(rows.protected) or 'none'}"
            f"{'; safety set ' + publishable_path(data.safety_dataset) if data.safety_dataset else ''}"
            + (f"; the protected and safety sets' training rows replayed as a share {data.replay_old:g} of the "
               "loss" if data.replay_old else "")
            + f"; a fraction {data.eval_fraction:g} of every dataset held out"
            + (f", a fraction {data.certify_fraction:g} of each protected / safety set's "
               "held-out rows "
               "set aside as its certification split (read only by the certificate: the "
               "share of the set's examples forgotten, teacher-forced exact match, at most "
               f"{data.forget_tolerance:g})" if data.certify_fraction > 0 else "; no certification split")),
        datasets=hub_ids or None,
        reproduce_command=command,
        delta=data.delta,
    )
    return report, dict(report.objective_metrics)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    config = parse_arguments(argv)
    data, args, margs = config.data, config.training, config.model
    logging.basicConfig(level=logging.INFO if args.should_log else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_arguments(config)
    set_seed(args.seed)
    model, tokenizer = load_model_and_tokenizer(config)
    rows = load_data(config, tokenizer)
    collate = SFTPaddingCollator(tokenizer)  # the constraints' rows (and without TRL the objective's)
    if not getattr(model, "is_quantized", False):  # a quantised model is placed when it loads
        model.to(args.device)
    constraints = build_constraints(config, model, collate, rows)
    certification = certification_splits(config, constraints)
    trainer, replay = build_trainer(config, model, tokenizer, collate, rows, constraints)
    train_result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    # the upload comes last, after the results, report and card exist: this save does not push
    push, args.push_to_hub = args.push_to_hub, False
    try:
        trainer.save_model(args.output_dir)  # before the card: a PEFT save writes its own README.md
    finally:
        args.push_to_hub = push
    # the installed entry point after pip install; with --config, a copy of the file saved in --output_dir
    command = publishable_command("accelerate launch recipes/llm_non_forgetting.py",
                                  sys.argv[1:] if argv is None else argv, output_dir=args.output_dir)
    report, metrics = finish(config, trainer, rows, constraints, command)
    results = {
        "command": command,
        "model": publishable_path(margs.model_name_or_path),  # results are shared: no local paths
        "penalty": args.constraint_penalty,
        "penalty_beta": args.penalty_beta,
        "regulariser": None if replay is None else replay.settings(),
        "constraint_step": {k: getattr(args, k) for k in BENCHMARK_DEFAULTS},  # with penalty_beta: the run's method
        "num_processes": trainer.accelerator.num_processes,
        "train_metrics": train_result.metrics,
        "eval_metrics": metrics,
        "constraints": {c.name: {"tolerance": c.tolerance, **c.metadata} for c in constraints},
        "safety_report": None if report is None else report.to_dict(),
        "safe": None if report is None else report.all_satisfied,
        "certified": None if report is None else report.certified,
        "certified_bounds": {} if report is None else report.certified_bounds(),
        "forget_tolerance": data.forget_tolerance,
        "delta": data.delta,
        "certification_splits": certification,
        "script_args": publishable_values({**asdict(config.dataset), **asdict(margs), **asdict(data)},
                                          args.output_dir),
        "trl": config.trl,
    }
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(args.output_dir)
        path = os.path.join(args.output_dir, RESULTS_FILE)
        atomic_write_json(path, results, default=str)
        logger.info("saved the model, tokenizer and %s to %s", RESULTS_FILE, args.output_dir)
    # last, after every local file is written: a refusal uploads nothing, loses nothing and fails the command
    results["exit_status"] = push_last(trainer, data.allow_unsafe_push) if args.push_to_hub else 0
    return results


if __name__ == "__main__":
    exit_after_all_ranks(main()["exit_status"])
