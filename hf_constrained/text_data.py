"""Text datasets for language-model fine-tuning: loading and tokenising for per-example losses.

* :func:`load_text_dataset`: a Hub dataset by name, or a local JSON/JSONL/CSV/TSV/parquet
  file (or data folder), through ``datasets.load_dataset``;
* :func:`tokenize_sft`: rows in one of the three usual SFT formats (the formats TRL's
  ``SFTTrainer`` reads) tokenised into ``input_ids``, ``attention_mask`` and ``labels``
  (-100 where no loss is taken):

  - ``text``: language modelling on the whole text;
  - ``prompt`` + ``completion``: loss on the completion only;
  - ``messages`` (a chat, rendered with the tokenizer's chat template): loss on the last
    message (the assistant's answer) only.

The tokenised rows feed both the objective (the Trainer's batches) and the non-forgetting
constraints (:func:`hf_constrained.non_forgetting.non_forgetting_constraints` with
:func:`~hf_constrained.per_sample_loss.causal_lm_per_example_loss`), padded by
:class:`~hf_constrained.per_sample_loss.PaddingCollator`.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import datasets

from .per_sample_loss import IGNORE_INDEX

logger = logging.getLogger(__name__)

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet",
                  ".txt": "text"}


def load_text_dataset(source: str, split: str = "train", config_name: Optional[str] = None) -> datasets.Dataset:
    """Load ``source``: a local file (JSON/JSONL, CSV/TSV, parquet, text), a local data folder
    or a Hub dataset id, as one ``datasets.Dataset`` split.

    A local file is one split whatever ``split`` says (``datasets`` names it ``train``).
    """
    if not source:
        raise ValueError("empty dataset source: give a Hub dataset id or a local JSON/CSV/parquet file")
    if os.path.isfile(source):
        ext = os.path.splitext(source)[1].lower()
        if ext not in _FILE_BUILDERS:
            raise ValueError(f"{source}: unsupported file type {ext!r}; use one of {sorted(_FILE_BUILDERS)}")
        kwargs: dict[str, Any] = {"delimiter": "\t"} if ext == ".tsv" else {}
        return datasets.load_dataset(_FILE_BUILDERS[ext], data_files=source, split="train", **kwargs)
    if os.path.isdir(source):
        return datasets.load_dataset(source, split=split)
    if source.startswith((".", "/")) or source.endswith(tuple(_FILE_BUILDERS)):
        raise FileNotFoundError(f"dataset file not found: {source}")
    return datasets.load_dataset(source, config_name, split=split)


def sft_format(column_names: list[str], *, text_column: str = "text", prompt_column: str = "prompt",
               completion_column: str = "completion", messages_column: str = "messages") -> str:
    """Which SFT format rows with these columns are in: ``"messages"``, ``"prompt_completion"`` or ``"text"``."""
    if messages_column in column_names:
        return "messages"
    if prompt_column in column_names and completion_column in column_names:
        return "prompt_completion"
    if text_column in column_names:
        return "text"
    raise ValueError(f"cannot tell the text format of columns {column_names}: expected {text_column!r}, "
                     f"{prompt_column!r} + {completion_column!r}, or {messages_column!r}")


def _encode(tokenizer: Any, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def tokenize_example(example: dict[str, Any], tokenizer: Any, fmt: str, *, max_length: Optional[int] = None,
                     add_eos: bool = True, text_column: str = "text", prompt_column: str = "prompt",
                     completion_column: str = "completion", messages_column: str = "messages") -> dict[str, list[int]]:
    """``input_ids`` / ``attention_mask`` / ``labels`` of one row (see the module docstring)."""
    if fmt == "messages":
        messages = example[messages_column]
        if not messages:
            raise ValueError(f"a row has an empty {messages_column!r} list")
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        if not full.startswith(prompt):
            raise ValueError("the chat template does not render the conversation as its prefix followed by the "
                             "last message; cannot mask the prompt")
        prompt_ids = _encode(tokenizer, prompt, False)
        answer_ids = _encode(tokenizer, full[len(prompt):], False)
        add_eos = False  # the template ends the turn itself
    elif fmt == "prompt_completion":
        prompt_ids = _encode(tokenizer, example[prompt_column], True)
        answer_ids = _encode(tokenizer, example[completion_column], False)
    else:
        prompt_ids, answer_ids = [], _encode(tokenizer, example[text_column], True)
    if add_eos and tokenizer.eos_token_id is not None and (not answer_ids or answer_ids[-1] != tokenizer.eos_token_id):
        answer_ids = answer_ids + [tokenizer.eos_token_id]
    ids = prompt_ids + answer_ids
    labels = [IGNORE_INDEX] * len(prompt_ids) + answer_ids
    if max_length is not None:
        ids, labels = ids[:max_length], labels[:max_length]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


def tokenize_sft(dataset: datasets.Dataset, tokenizer: Any, *, max_length: Optional[int] = None,
                 add_eos: bool = True, text_column: str = "text", prompt_column: str = "prompt",
                 completion_column: str = "completion", messages_column: str = "messages",
                 name: str = "dataset") -> datasets.Dataset:
    """Tokenise ``dataset`` (text, prompt/completion or messages rows) for causal-LM training.

    Returns a dataset with only ``input_ids``, ``attention_mask`` and ``labels``. Rows
    left with fewer than one label token to predict (e.g. a completion cut off by
    ``max_length``) are dropped, with a warning that says how many.
    """
    columns = dict(text_column=text_column, prompt_column=prompt_column, completion_column=completion_column,
                   messages_column=messages_column)
    fmt = sft_format(dataset.column_names, **columns)
    if fmt == "messages" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{name}: rows in the {messages_column!r} format need a tokenizer with a chat template")
    out = dataset.map(lambda ex: tokenize_example(ex, tokenizer, fmt, max_length=max_length, add_eos=add_eos, **columns),
                      remove_columns=dataset.column_names, desc=f"tokenising {name}")
    keep = [i for i, labels in enumerate(out["labels"]) if any(t != IGNORE_INDEX for t in labels[1:])]
    if len(keep) < len(out):
        logger.warning("%s: %d of %d rows have no token to predict after truncation to max_length=%s; dropped",
                       name, len(out) - len(keep), len(out), max_length)
        out = out.select(keep)
    if len(out) == 0:
        raise ValueError(f"{name}: no row left with a token to predict (max_length={max_length})")
    return out
