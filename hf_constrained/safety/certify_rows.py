"""The certification rows of ``hf-constrained certify``: read, checked, fingerprinted, tokenised and scored.

- :func:`read_set`: one protected set's rows (a local JSON/JSONL/CSV/parquet file or a Hub dataset), with a
  one-line error for an empty file, missing columns or rows without an answer, and repeated rows dropped with a
  count (a row twice in a sample is not two independent draws);
- :func:`rows_in_training`: how many certification rows also appear in the given training files (compared on
  the columns both have): any is refused, since a row the model was fitted to makes the bound optimistic
  (Learn-Then-Test, Angelopoulos et al. 2021, tests on rows nothing else touched);
- :func:`tokenize_rows`: each row as the LLM recipe tokenises it (:func:`hf_constrained.text_data.tokenize_example`),
  never cut: a row longer than ``max_length`` is an error;
- :class:`RowCache` and :func:`correct_per_row`: teacher-forced exact match of each row's answer
  (:func:`~hf_constrained.per_sample_loss.causal_lm_per_example_correct`), or its per-token loss
  (:func:`loss_batch`), or a classifier's correctness (any ``score``), batched (rows sorted by length), on
  the model's device, with a progress bar, saved as it goes so that a killed run resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np
import torch
from tqdm.auto import tqdm

from ..atomic_files import atomic_write_json
from ..certification.splits import row_hash, split_fingerprint
from ..per_sample_loss import IGNORE_INDEX, causal_lm_per_example_correct, causal_lm_per_example_loss
from ..reference_pass import to_device
from ..text_data import drop_repeated_rows, load_text_dataset, sft_format, tokenize_example

logger = logging.getLogger(__name__)

CACHE_DIR = "certify_cache"
"""The folder of per-row values in the output folder (``hf-constrained push`` leaves it out)."""

ANSWER_FORMATS = ("prompt_completion", "messages")

TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")
"""A model folder holding one of these has its own tokenizer (else the base's is used)."""


def _load(source: str, split: str) -> Any:
    """The rows of ``source`` (no repeat dropped), without ``datasets``' progress bars (a file read in a second
    would print its lines between the plan's)."""
    import datasets

    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        return load_text_dataset(source, split, drop_repeats=False)
    finally:
        if shown:
            datasets.enable_progress_bars()


def read_set(name: str, source: str, split: str = "train") -> tuple[Any, int, str]:
    """(rows, repeated rows dropped, format) of the set ``name``; one-line ``ValueError`` /
    ``FileNotFoundError`` naming the set for an empty or missing file, columns of no answer format, or no row."""
    where = f"--protected_datasets {name}={source}"
    if os.path.isfile(source) and os.path.getsize(source) == 0:
        raise ValueError(f"{where}: the file is empty")
    try:
        raw = _load(source, split)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{where}: {exc}") from None
    if len(raw) == 0:
        raise ValueError(f"{where}: no rows")
    fmt = answer_format(raw.column_names, where)
    rows = drop_repeated_rows(raw, source)
    return rows, len(raw) - len(rows), fmt


def answer_format(columns: Sequence[str], where: str) -> str:
    """``"prompt_completion"`` or ``"messages"`` (the formats with an answer to match), else a ``ValueError``."""
    try:
        fmt = sft_format(list(columns))
    except ValueError:
        fmt = None
    if fmt not in ANSWER_FORMATS:
        raise ValueError(f"{where}: the rows have the columns {list(columns)}; exact match of the answer needs "
                         "'prompt' and 'completion' columns, or a 'messages' column (a chat whose last message is "
                         "the answer)")
    return str(fmt)


def set_fingerprint(rows: Any) -> tuple[str, list[bytes]]:
    """The fingerprint of the set's rows (every column, order-free) and each row's hash."""
    hashes = [row_hash(dict(r)) for r in rows]
    return split_fingerprint(hashes), hashes


def rows_in_training(rows: Any, train_files: Sequence[str], split: str = "train") -> dict[str, int]:
    """Per training file, how many of ``rows`` appear in it (equal on every column both have; files with no
    column in common are skipped)."""
    out: dict[str, int] = {}
    columns = set(rows.column_names)
    for path in train_files:
        train = _load(path, split)
        keys = frozenset(columns & set(train.column_names))
        if not keys:
            continue
        seen = {row_hash(dict(r), keys) for r in train}
        count = sum(row_hash(dict(r), keys) in seen for r in rows)
        if count:
            out[path] = count
    return out


def tokenize_rows(rows: Any, tokenizer: Any, fmt: str, max_length: int, where: str) -> list[dict[str, list[int]]]:
    """Each row's ``input_ids``, ``attention_mask`` and ``labels`` (-100 outside the answer); a ``ValueError``
    naming the first row longer than ``max_length`` or without an answer token."""
    out = []
    for i, row in enumerate(rows):
        ex = tokenize_example(dict(row), tokenizer, fmt)
        if len(ex["input_ids"]) > max_length:
            raise ValueError(f"{where}: row {i + 1} has {len(ex['input_ids'])} tokens, more than --max_length "
                             f"{max_length}; raise --max_length (rows are never cut: a cut answer is another claim)")
        if not any(t != IGNORE_INDEX for t in ex["labels"][1:]):
            raise ValueError(f"{where}: row {i + 1} has no answer token to match")
        out.append(ex)
    return out


class RowCache:
    """Per-row values of one set and one model, saved in ``output_dir/certify_cache/`` as they are computed.

    The file is keyed by everything that decides the values (``key``: the model's and the rows' fingerprints,
    the dtype, the statistic): a file with another key is ignored, so a cache never serves another model."""

    def __init__(self, output_dir: str, name: str, role: str, key: str) -> None:
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
        self.path = os.path.join(output_dir, CACHE_DIR, f"{slug}.{role}.json")
        self.key = key
        self.values: dict[int, float] = {}
        if os.path.isfile(self.path):
            try:
                with open(self.path, encoding="utf-8") as f:
                    data = json.load(f)
            except (OSError, ValueError):
                data = {}
            if data.get("key") == key:
                self.values = {int(k): float(v) for k, v in (data.get("values") or {}).items()}

    def save(self) -> None:
        atomic_write_json(self.path, {"key": self.key, "values": {str(k): v for k, v in sorted(self.values.items())}},
                          indent=None)


def cache_key(*parts: Any) -> str:
    """``sha256:<hex>`` of the parts that decide a set's per-row values."""
    return "sha256:" + hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()


def score_batch(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """1.0 per row whose answer the model reproduces exactly (teacher-forced argmax), else 0.0."""
    return causal_lm_per_example_correct(model, batch)


@torch.no_grad()
def loss_batch(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """Each row's mean next-token cross-entropy over its answer tokens (nats per token)."""
    return causal_lm_per_example_loss(model, batch)


@torch.no_grad()
def correct_per_row(model: Any, tokenized: Sequence[dict[str, Any]], collate: Callable[[list], Any],
                    batch_size: int, cache: RowCache, desc: str,
                    score: Optional[Callable[[Any, dict[str, Any]], torch.Tensor]] = None) -> np.ndarray:
    """The value of every row under ``model``, in row order: ``score(model, batch)`` (default
    :func:`score_batch`, exact match 0/1); the rows the cache holds are read from it, the others scored in batches
    of rows of similar length on the model's device and saved to the cache batch by batch."""
    score = score or score_batch
    todo = sorted((i for i in range(len(tokenized)) if i not in cache.values),
                  key=lambda i: -len(tokenized[i].get("input_ids", ())))
    if len(todo) < len(tokenized):
        logger.info("%s: %d of %d rows read from %s", desc, len(tokenized) - len(todo), len(tokenized), cache.path)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        bar = tqdm(total=len(tokenized), initial=len(tokenized) - len(todo), desc=desc, unit="row",
                   dynamic_ncols=True, leave=False)
        for start in range(0, len(todo), batch_size):
            rows = todo[start:start + batch_size]
            values = score(model, to_device(collate([tokenized[i] for i in rows]), device))
            for i, v in zip(rows, values.float().cpu().tolist()):
                cache.values[i] = float(v)
            cache.save()
            bar.update(len(rows))
        bar.close()
    finally:
        model.train(was_training)
    return np.array([cache.values[i] for i in range(len(tokenized))], dtype=np.float64)


def paired_per_row(model: Any, base: Optional[Any], items: Sequence[dict[str, Any]], collate: Callable[[list], Any],
                   score: Optional[Callable[[Any, dict[str, Any]], torch.Tensor]], caches: tuple[RowCache, RowCache],
                   batch_size: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(the base's, the model's) value of every row (:func:`correct_per_row`, ``caches``: the base's and the
    model's); ``base`` ``None``: ``model`` is a PEFT adapter, disabled for the base's values."""
    from ..reference_pass import old_model_context

    if base is None:
        with old_model_context(model):
            old = correct_per_row(model, items, collate, batch_size, caches[0], f"{name}: base", score)
    else:
        old = correct_per_row(base, items, collate, batch_size, caches[0], f"{name}: base", score)
    new = correct_per_row(model, items, collate, batch_size, caches[1], f"{name}: model", score)
    return old, new


__all__ = ["ANSWER_FORMATS", "CACHE_DIR", "TOKENIZER_FILES", "RowCache", "answer_format", "cache_key",
           "correct_per_row", "loss_batch", "paired_per_row", "read_set", "rows_in_training", "score_batch",
           "set_fingerprint", "tokenize_rows"]
