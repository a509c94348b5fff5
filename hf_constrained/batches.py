"""The one way rows of a dataset become a batch on the device.

Every constraint batch goes through :class:`BatchMaker`: the training step's B_k^t
(Algorithm 1, line 5), its look-ahead, the check before training, the exact evaluation and
the diagnostics. One collate rule (:meth:`BatchMaker.collate_of`): a constraint's own
``collate_fn``; else the trainer's ``data_collator`` when one other than
``default_data_collator`` was given (e.g. padding tokenized text); else
:func:`collate_examples`. Dict-like batches get ``batch["sample_index"]``, each row's index
in its own dataset.

Rows of several constraints that are subsets of one parent dataset (a
``torch.utils.data.Subset`` or a subset made by
:func:`~hf_constrained.constraints_per_value`) are read from the parent in ONE call
(per-call formatting dominates small reads).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import numpy as np
import torch

Collate = Callable[[Sequence[Any]], Any]


def collate_examples(examples: Sequence[Any]) -> Any:
    """Stack a list of examples into a batch.

    Dict examples become a dict of stacked tensors; numbers, numpy arrays and tensors are
    stacked; anything else (strings, images) stays a list for the constraint function
    to process. Rows that cannot be stacked (a key missing from some rows, or values of
    different shapes, e.g. unpadded token ids) give an error naming the key and the shapes.
    """
    first = examples[0]
    if isinstance(first, Mapping):
        batch = {}
        for key in first:
            lacking = [i for i, ex in enumerate(examples) if key not in ex]
            if lacking:
                raise KeyError(f"collate_examples: {len(lacking)} of {len(examples)} rows have no key {key!r} "
                               f"(the first row has {sorted(first)})")
            try:
                batch[key] = collate_examples([ex[key] for ex in examples])
            except (ValueError, KeyError) as e:
                msg = e.args[0] if e.args else str(e)
                raise type(e)(f"key {key!r}: {msg}") from None
        return batch
    if isinstance(first, (torch.Tensor, np.ndarray)) or (
            isinstance(first, (list, tuple)) and first and isinstance(first[0], (int, float, np.number))):
        shapes = sorted({tuple(np.shape(ex)) for ex in examples})
        if len(shapes) > 1:
            raise ValueError(f"collate_examples: rows of different shapes {shapes[:5]} cannot be stacked; pad them "
                             "to one length (e.g. a tokenizer with padding) or give the constraint a collate_fn")
    if isinstance(first, torch.Tensor):
        return torch.stack(list(examples))
    if isinstance(first, np.ndarray):
        return torch.as_tensor(np.stack(examples))
    if isinstance(first, (bool, int, float, np.number)):
        return torch.as_tensor(examples)
    if isinstance(first, (list, tuple)) and first and isinstance(first[0], (int, float, np.number)):
        return torch.as_tensor(examples)
    return list(examples)


def fetch_rows(dataset: Any, rows: Sequence[int]) -> list:
    """The examples at ``rows``, fetched in one call where the dataset supports it
    (``datasets.Dataset.__getitems__`` reads a whole batch at once)."""
    getitems = getattr(dataset, "__getitems__", None)
    if getitems is not None:
        return list(getitems(list(rows)))
    return [dataset[i] for i in rows]


@dataclass
class RowUnit:
    """One set of rows of one dataset in a batch, and the sampled constraints evaluated on them.

    ``positions`` are the constraints' positions in the step's B_c^t (the draw's order);
    ``rows`` are this process's row indices into ``dataset``.
    """

    dataset: Any
    rows: list[int]
    positions: list[int] = field(default_factory=list)
    constraints: list[int] = field(default_factory=list)


ROW_SOURCE_ATTR = "hfc_row_source"
"""Attribute :func:`~hf_constrained.constraints_per_value` sets on each constraint's subset of a
``datasets.Dataset``: ``(parent, absolute rows)``, so rows of many constraints drawn from one
parent are read in ONE ``parent.__getitems__`` call."""


class _Identity:
    """Row i of a dataset is row i of itself."""

    def __getitem__(self, i: int) -> int:
        return i


_IDENTITY = _Identity()


def row_source(dataset: Any) -> Optional[tuple[Any, Any]]:
    """``(parent, absolute row of each local row)`` when ``dataset`` is a row subset of ``parent``
    with the same output format (a ``torch.utils.data.Subset``, or a subset made by
    ``constraints_per_value``); else ``None``."""
    source = getattr(dataset, ROW_SOURCE_ATTR, None)
    if source is not None:
        parent, rows = source
        # a format changed on one side since the subset was made: read the subset itself
        return (parent, rows) if getattr(dataset, "format", None) == getattr(parent, "format", None) else None
    if isinstance(dataset, torch.utils.data.Subset):
        return dataset.dataset, dataset.indices
    if hasattr(dataset, "column_names") and hasattr(dataset, "format"):  # a datasets.Dataset: its own parent
        return dataset, _IDENTITY
    return None


def fetch_unit_examples(units: Sequence[RowUnit]) -> list[list[Any]]:
    """The examples of every unit, reading the units that share a parent dataset in one call."""
    reads: dict[int, tuple[Any, list[int], list[tuple[int, int, int]]]] = {}
    out: list[Optional[list[Any]]] = [None] * len(units)
    for u, unit in enumerate(units):
        source = row_source(unit.dataset)
        if source is None:
            out[u] = fetch_rows(unit.dataset, unit.rows)
            continue
        parent, absolute = source
        parent_rows = reads.setdefault(id(parent), (parent, [], []))
        start = len(parent_rows[1])
        parent_rows[1].extend(int(absolute[i]) for i in unit.rows)
        parent_rows[2].append((u, start, len(parent_rows[1])))
    for parent, rows, spans in reads.values():
        examples = fetch_rows(parent, rows)
        for u, start, end in spans:
            out[u] = examples[start:end]
    return out  # type: ignore[return-value]


def _column_read(units: Sequence[RowUnit], collate: Collate) -> Optional[dict[str, Any]]:
    """The batch of all units read as ONE column batch, where that equals collating the rows.

    Only for the default collate (:func:`collate_examples`) over subsets of ONE torch-formatted
    ``datasets.Dataset``: ``parent[rows]`` then gives the same stacked tensors without splitting
    the read into per-row dicts and stacking them again. ``None`` otherwise.
    """
    if collate is not collate_examples:
        return None
    sources = [row_source(u.dataset) for u in units]
    if any(src is None for src in sources) or len({id(src[0]) for src in sources}) != 1:
        return None
    parent = sources[0][0]
    fmt = getattr(parent, "format", None)
    if not isinstance(fmt, Mapping) or fmt.get("type") != "torch" or not hasattr(parent, "column_names"):
        return None
    rows = [int(src[1][i]) for src, u in zip(sources, units) for i in u.rows]
    batch = parent[rows]
    if not isinstance(batch, Mapping) or not all(
            isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == len(rows) for v in batch.values()):
        return None  # ragged or non-numeric columns: collate the rows
    return dict(batch)


def collate_units(units: Sequence[RowUnit], collate: Collate) -> tuple[Any, list[tuple[int, int]]]:
    """The rows of all units in ONE collate call (on the host), and each unit's (start, end)
    slice of the batch. Dict-like batches get ``batch["sample_index"]``."""
    slices, sample_index, start = [], [], 0
    for unit in units:
        slices.append((start, start + len(unit.rows)))
        sample_index.extend(unit.rows)
        start += len(unit.rows)
    batch = _column_read(units, collate)
    if batch is None:
        batch = collate([ex for examples in fetch_unit_examples(units) for ex in examples])
    if isinstance(batch, MutableMapping):
        batch["sample_index"] = torch.as_tensor(sample_index, dtype=torch.long)
    return batch, slices


def pinned_to(data: Any, device: torch.device) -> Any:
    """``data`` (nested dicts/lists of tensors) on ``device``, copied from pinned memory without blocking."""
    if isinstance(data, Mapping):
        return type(data)({k: pinned_to(v, device) for k, v in data.items()})
    if isinstance(data, (list, tuple)):
        return type(data)(pinned_to(v, device) for v in data)
    if isinstance(data, torch.Tensor):
        if data.device.type == "cpu":
            return data.pin_memory().to(device, non_blocking=True)
        return data.to(device)
    return data


def shallow_copy(batch: Any) -> Any:
    """A new dict around the same tensors, so a function that pops keys cannot change a kept batch."""
    return type(batch)(batch) if isinstance(batch, MutableMapping) else batch


class ConstraintRows(Protocol):
    """What a batch maker reads of a constraint (:class:`~hf_constrained.Constraint`): its training rows and
    its own collate function, if any."""

    dataset: Any
    collate_fn: Optional[Collate]


class BatchMaker:
    """Rows to a device batch, with the one collate rule.

    Args:
        data_collator: the trainer's ``data_collator`` (used for constraints without a
            ``collate_fn`` unless it is ``default_data_collator``), or ``None``.
        to_device: puts a collated host batch on the device (the trainer's placement).
    """

    def __init__(self, data_collator: Optional[Collate], to_device: Callable[[Any], Any]) -> None:
        from transformers import default_data_collator

        self.data_collator = None if data_collator is default_data_collator else data_collator
        self.to_device = to_device

    def collate_of(self, c: ConstraintRows) -> Collate:
        """The collate function of constraint ``c``'s batches."""
        if c.collate_fn is not None:
            return c.collate_fn
        return self.data_collator if self.data_collator is not None else collate_examples

    def units(self, units: Sequence[RowUnit], collate: Collate) -> tuple[Any, list[tuple[int, int]]]:
        """The device batch of all ``units`` (one collate call) and each unit's slice of it."""
        batch, slices = collate_units(units, collate)
        return self.to_device(batch), slices

    def rows(self, dataset: Any, rows: list[int], collate: Collate) -> Any:
        """The device batch of ``rows`` of ``dataset``."""
        return self.units([RowUnit(dataset, rows)], collate)[0]

    def constraint_rows(self, c: ConstraintRows, rows: list[int]) -> Any:
        """The device batch of ``rows`` of constraint ``c``'s training data."""
        return self.rows(c.dataset, rows, self.collate_of(c))

    def in_order(self, data: Any, collate: Collate, batch_size: int,
                 progress: Optional[Callable[[range], Any]] = None) -> Iterator[tuple[list[int], Any]]:
        """Every row of ``data`` in order, ``batch_size`` rows per device batch (exact evaluation);
        ``progress`` may wrap the batch starts (a progress bar)."""
        starts = range(0, len(data), batch_size)
        for start in (starts if progress is None else progress(starts)):
            rows = list(range(start, min(start + batch_size, len(data))))
            yield rows, self.rows(data, rows, collate)


__all__ = ["BatchMaker", "Collate", "ConstraintRows", "RowUnit", "collate_examples", "collate_units", "fetch_rows",
           "pinned_to", "row_source", "shallow_copy"]
