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
:class:`SFTPaddingCollator` (``transformers.DataCollatorForSeq2Seq``, right padding, labels
-100) or :class:`~hf_constrained.per_sample_loss.PaddingCollator` (the same batches, with no
tokenizer needed).

Why not TRL's own data preparation for these rows: the per-example losses need ``labels`` with
-100 outside the answer, and for ``messages`` rows the loss on the last message only, whatever
the chat template; TRL's ``SFTTrainer`` prepares rows for its own loss (``completion_mask``,
``assistant_masks`` that need a template with generation markers). With TRL installed the
recipe lets TRL prepare the objective's rows and uses :func:`tokenize_sft` for the constraints.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from typing import Any, Optional

import datasets
from tqdm.auto import tqdm
from transformers import DataCollatorForSeq2Seq

from .batches import collate_examples
from .errors import RecipeConfigError
from .per_sample_loss import IGNORE_INDEX

logger = logging.getLogger(__name__)

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet",
                  ".txt": "text"}


def drop_repeated_rows(dataset: datasets.Dataset, source: str) -> datasets.Dataset:
    """``dataset`` without the rows that repeat an earlier row exactly (every column equal), with a
    warning naming ``source``, the count and the first repeat; unchanged (no copy) when none repeats.

    Why: the recipes split every dataset into training, held-out and certification rows, and the
    trainer refuses a certification row that also appears in training (the certificate would test
    rows the model was fitted to). A row written twice in a file could land on both sides; dropped
    here, before any split, it cannot."""
    seen: dict[bytes, int] = {}
    keep: list[int] = []
    first: Optional[tuple[int, int]] = None
    for i, row in enumerate(tqdm(dataset, desc=f"checking {os.path.basename(source) or source} for repeated rows",
                                 disable=len(dataset) < 100_000, leave=False)):
        key = hashlib.sha256(json.dumps(row, sort_keys=True, default=str).encode()).digest()
        if key in seen:
            first = first or (i, seen[key])
            continue
        seen[key] = i
        keep.append(i)
    if len(keep) == len(dataset):
        return dataset
    assert first is not None
    logger.warning("%s: %d repeated row(s) dropped before splitting (row %d repeats row %d, counting from 1; "
                   "%d rows left): a row present twice could otherwise be both trained on and certified on",
                   source, len(dataset) - len(keep), first[0] + 1, first[1] + 1, len(keep))
    return dataset.select(keep)


def load_text_dataset(source: str, split: str = "train", config_name: Optional[str] = None, *,
                      drop_repeats: bool = True) -> datasets.Dataset:
    """Load ``source``: a local file (JSON/JSONL, CSV/TSV, parquet, text), a local data folder
    or a Hub dataset id, as one ``datasets.Dataset`` split.

    A local file is one split whatever ``split`` says (``datasets`` names it ``train``). With
    ``drop_repeats`` (default) rows that repeat an earlier row exactly are dropped with a warning
    (:func:`drop_repeated_rows`).
    """
    raw = _load_text_dataset(source, split, config_name)
    return drop_repeated_rows(raw, source) if drop_repeats else raw


def _load_text_dataset(source: str, split: str, config_name: Optional[str]) -> datasets.Dataset:
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
    out = dataset.map(lambda ex: tokenize_example(ex, tokenizer, fmt, max_length=max_length, add_eos=add_eos,
                                                  **columns),
                      remove_columns=dataset.column_names, desc=f"tokenising {name}")
    keep = [i for i, labels in enumerate(out["labels"]) if any(t != IGNORE_INDEX for t in labels[1:])]
    if len(keep) < len(out):
        logger.warning("%s: %d of %d rows have no token to predict after truncation to max_length=%s; dropped",
                       name, len(out) - len(keep), len(out), max_length)
        out = out.select(keep)
    if len(out) == 0:
        raise ValueError(f"{name}: no row left with a token to predict (max_length={max_length})")
    return out


SEQUENCE_FIELDS = ("input_ids", "attention_mask", "labels", "token_type_ids")
"""The per-token fields :class:`SFTPaddingCollator` pads; every other field is collated as it is."""


class SFTPaddingCollator:
    """Pad tokenised SFT rows on the right into one batch, with ``transformers.DataCollatorForSeq2Seq``.

    ``input_ids`` are padded with the tokenizer's pad token, ``labels`` with -100 (no loss),
    ``attention_mask`` with 0, to the longest row (or a multiple of ``pad_to_multiple_of``), on
    the right whatever the tokenizer's ``padding_side`` (the per-example losses and exact-match
    statistics read answers left-aligned). What this wrapper adds to the library collator:
    the other fields of a row (``reference_loss``, ``row_index``, a class label) are collated by
    :func:`~hf_constrained.batches.collate_examples` instead of being handed to the tokenizer.
    The batches equal those of :class:`~hf_constrained.per_sample_loss.PaddingCollator`.

    Args:
        tokenizer: a tokenizer with a pad token (set ``tokenizer.pad_token = tokenizer.eos_token``
            for a model without one: padding is masked out of every loss).
        pad_to_multiple_of: optional length multiple (tensor-core friendly shapes).
    """

    def __init__(self, tokenizer: Any, *, pad_to_multiple_of: Optional[int] = None) -> None:
        if getattr(tokenizer, "pad_token_id", None) is None:
            raise ValueError("SFTPaddingCollator needs a tokenizer with a pad token: set tokenizer.pad_token "
                             "(e.g. to tokenizer.eos_token)")
        self.tokenizer = tokenizer
        self._collator = DataCollatorForSeq2Seq(tokenizer, padding="longest", pad_to_multiple_of=pad_to_multiple_of,
                                                label_pad_token_id=IGNORE_INDEX, return_tensors="pt")

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        if not examples:
            raise ValueError("SFTPaddingCollator got no rows")
        if "input_ids" not in examples[0]:
            raise KeyError(f"SFTPaddingCollator needs tokenised rows with 'input_ids'; the rows have "
                           f"{sorted(examples[0])}")
        sequences = [{k: _as_list(ex[k]) for k in SEQUENCE_FIELDS if k in ex} for ex in examples]
        side, self.tokenizer.padding_side = self.tokenizer.padding_side, "right"
        try:
            batch = dict(self._collator(sequences))
        finally:
            self.tokenizer.padding_side = side
        for key in examples[0]:
            if key not in SEQUENCE_FIELDS:
                batch[key] = collate_examples([ex[key] for ex in examples])
        return batch


def _as_list(value: Any) -> list[int]:
    return value.tolist() if hasattr(value, "tolist") else list(value)


def named_sources(items: Sequence[str], flag: str) -> dict[str, str]:
    """``NAME=SOURCE`` items as a dict (a bare ``SOURCE`` is named by its file's stem); an empty name or source, or
    a name given twice, is an error naming ``flag`` (:class:`~hf_constrained.errors.RecipeConfigError`)."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, source = item.partition("=")
        if not sep:
            source, name = item, os.path.splitext(os.path.basename(item.rstrip("/")))[0] or item
        name, source = name.strip(), source.strip()
        if not name or not source:
            raise RecipeConfigError(f"{flag} entry {item!r}: expected NAME=SOURCE or SOURCE")
        if name in out:
            raise RecipeConfigError(f"{flag}: two datasets named {name!r}; name them with NAME=SOURCE")
        out[name] = source
    return out

