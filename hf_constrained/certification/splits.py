"""Certification splits: rows set aside for the certificate alone, and their fingerprints.

A certificate is only as good as the independence of its split (Learn-Then-Test, Angelopoulos et al.
2021, tests on rows that nothing else touched): a row that also fed a gradient or chose a checkpoint
makes its bound optimistic. Each row is hashed by its content (:func:`row_hash`:
every field; arrays and tensors by dtype, shape and bytes; strings; numbers), so a copy of a row is found
whatever container holds it; a split's fingerprint (:func:`split_fingerprint`: SHA-256 over its sorted row
hashes and its size) names it in the ledger of looks, the report and the card.

:func:`carve_certification` sets a certification split aside in the first place: a seeded share of
the rows (of each class's rows, when given labels), drawn with a generator that depends on the seed
alone, never on the data, so the split is fixed before anything reads a row. :func:`partition_by_class`
cuts a labelled pool into every split of an experiment at once (per class: held-out, selection, constraint
data, ...), its certification split the last share of each class's held-out rows (:func:`certification_tail`).

Plain numpy: no torch (a tensor row is hashed through its ``.numpy()`` without importing torch). The check
that a run's certification rows appear in none of its other data is the run's
(:mod:`hf_constrained.safety.split_checks`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional, Union

import numpy as np


def _feed(digest: Any, value: Any, keys: Optional[frozenset] = None) -> None:
    if isinstance(value, Mapping):
        for key in sorted(value, key=str):
            if key == "sample_index" or (keys is not None and key not in keys):  # a position, not content
                continue
            digest.update(f"<{key}>".encode())
            _feed(digest, value[key])
        return
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor, without importing torch here
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        digest.update(f"a{value.dtype.str}{value.shape}".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
        return
    if isinstance(value, (bytes, bytearray)):
        digest.update(b"b" + bytes(value))
        return
    if isinstance(value, str):
        digest.update(b"s" + value.encode())
        return
    if isinstance(value, (list, tuple)):
        digest.update(f"l{len(value)}".encode())
        for item in value:
            _feed(digest, item)
        return
    if isinstance(value, (bool, int, float, np.generic)) or value is None:
        digest.update(f"n{value!r}".encode())
        return
    tobytes = getattr(value, "tobytes", None)  # e.g. a PIL image
    if callable(tobytes):
        digest.update(f"o{type(value).__name__}{getattr(value, 'size', '')}".encode() + tobytes())
        return
    digest.update(f"r{value!r}".encode())


def row_hash(row: Any, keys: Optional[frozenset] = None) -> bytes:
    """A 16-byte content hash of one example (of its fields in ``keys`` only, when given)."""
    digest = hashlib.blake2b(digest_size=16)
    _feed(digest, row, keys)
    return digest.digest()


def split_fingerprint(hashes: Iterable[bytes]) -> str:
    """``sha256:<hex>`` of a split: its sorted row hashes and its size (order-free)."""
    ordered = sorted(hashes)
    digest = hashlib.sha256(f"{len(ordered)}|".encode())
    for h in ordered:
        digest.update(h)
    return "sha256:" + digest.hexdigest()


SeedLike = Union[int, Sequence[int], np.random.Generator]


def check_certify_fraction(fraction: float, flag: str = "--certify_fraction") -> float:
    """``fraction`` as a float in [0, 1) (0: no certification split), or a ``ValueError`` naming ``flag``."""
    value = float(fraction)
    if not 0.0 <= value < 1.0:  # NaN fails both comparisons
        raise ValueError(f"{flag} must be in [0, 1), got {fraction}")
    return value


def _take(rows: Any, positions: np.ndarray) -> Any:
    """The rows at ``positions`` (sorted), in the container ``rows`` came in."""
    if hasattr(rows, "select") and callable(rows.select):  # a datasets.Dataset
        return rows.select(positions.tolist())
    if isinstance(rows, np.ndarray):
        return rows[positions]
    return [rows[int(i)] for i in positions]


def carve_certification(rows: Any, fraction: float, seed: SeedLike, *, labels: Optional[Sequence[Any]] = None,
                        classes: Optional[Sequence[Any]] = None, flag: str = "--certify_fraction",
                        name: str = "the data", unit: str = "row(s)", more: str = "more rows"
                        ) -> tuple[Any, Optional[Any]]:
    """(rows left, certification rows): ``round(fraction * n)`` of the n rows, clipped to keep at least one
    on each side, set aside as a certification split, drawn with ``seed`` alone (not the data).

    The draw is ``numpy.random.default_rng(seed).permutation(n)``, its first rows certify (``seed`` may
    also be a ``numpy.random.Generator``, to draw several carvings from one stream). Both parts keep
    the rows' stored order and the container they came in (a ``datasets.Dataset`` by ``select``, a numpy
    array by index, anything else indexable as a list); the certificate permutes its rows again with
    its own recorded seed before any order-dependent bound.

    With ``labels`` (one per row), each class in ``classes`` (default: the sorted distinct labels) is
    carved on its own, in that order from one generator, so every class gets its share; rows of other
    classes stay in the rows left. ``fraction`` 0 returns ``(rows, None)``.

    Raises ``ValueError`` naming ``flag`` when ``fraction`` is outside [0, 1), and naming ``name`` (with
    ``labels``: ``name`` and the class) and its count of ``unit`` when fewer than 2 rows are there to
    share out; ``more`` says how to get more rows (e.g. the flag that sets them).
    """
    fraction = check_certify_fraction(fraction, flag)
    if fraction == 0:
        return rows, None
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    n_rows = len(rows)
    if labels is None:
        groups = [(name, np.arange(n_rows))]
    else:
        labels = np.asarray(labels)
        if len(labels) != n_rows:
            raise ValueError(f"carve_certification: {len(labels)} labels for {n_rows} rows of {name}")
        order = sorted(set(labels.tolist())) if classes is None else list(classes)
        groups = [(f"{name} {c}", np.flatnonzero(labels == c)) for c in order]
    chosen = []
    for what, positions in groups:
        if len(positions) < 2:
            raise ValueError(f"{flag} {fraction:g}: {what} has {len(positions)} {unit}; certifying needs at least "
                             f"2 (one to certify, one left): {more}, or {flag} 0 (no certificate)")
        n = min(len(positions) - 1, max(1, int(round(fraction * len(positions)))))
        chosen.append(positions[rng.permutation(len(positions))[:n]])
    certify = np.sort(np.concatenate(chosen))
    left = np.setdiff1d(np.arange(n_rows), certify, assume_unique=True)
    return _take(rows, left), _take(rows, certify)


def certification_tail(positions: Sequence[int], fraction: float, *, flag: str = "--certify_fraction",
                       unit: str = "rows") -> tuple[np.ndarray, np.ndarray]:
    """(rows kept, certification rows): the last ``round(fraction * n)`` of the n ``positions``, in their order,
    certify; the others are kept (e.g. to report on).

    Unlike :func:`carve_certification` it draws nothing: ``positions`` are already in a seeded order (one class's
    held-out rows of :func:`partition_by_class`) or independent draws (a generator's images), so their tail is a
    random share fixed before any row is read. ``fraction`` may be 1 (every held-out row certifies: the reported
    numbers are read after the model is fixed and change nothing the certificate depends on) or 0 (none);
    outside [0, 1] it is a ``ValueError`` naming ``flag``.
    """
    if not 0 <= fraction <= 1:
        raise ValueError(f"{flag} must be in [0, 1] (a share of the held-out {unit}), got {fraction}")
    positions = np.asarray(positions)
    n_kept = len(positions) - int(round(len(positions) * fraction))
    return positions[:n_kept], positions[n_kept:]


def partition_by_class(labels: Sequence[int], shares: Sequence[tuple[str, float]], seed: int, *, rest: str,
                       certify_from: Optional[str] = None, certify_fraction: float = 0.0,
                       flag: str = "--certify_fraction", unit: str = "rows") -> dict[str, list[int]]:
    """Every split of a labelled pool at once, as sorted row positions per split name.

    Each class (the distinct labels in sorted order) is permuted by one generator,
    ``numpy.random.default_rng(seed)`` (the seed alone, never the data), and cut into consecutive parts of
    ``round(n_c * share)`` rows, one per ``(name, share)`` of ``shares`` in that order; the rows left are ``rest``.
    With ``certify_from`` (the name of the held-out part), the last ``certify_fraction`` of each class's rows of
    that part become the certification split ``"certify"`` (:func:`certification_tail`), which nothing but the
    certificate reads; the other parts do not depend on ``certify_fraction``. Raises ``ValueError`` when the shares
    leave no row for ``rest``, and one naming ``flag`` (and the held-out ``unit``) when ``certify_fraction`` is
    outside [0, 1].
    """
    if sum(share for _, share in shares) >= 1:
        raise ValueError(f"the shares of {[name for name, _ in shares]} must leave rows for {rest!r}")
    certification_tail([], certify_fraction, flag=flag, unit=unit)  # checked before any row is drawn
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    parts: dict[str, list[int]] = {name: [] for name, _ in shares}
    parts.update({rest: [], **({"certify": []} if certify_from is not None else {})})
    for c in sorted(set(labels.tolist())):
        idx = rng.permutation(np.flatnonzero(labels == c))
        bounds = np.cumsum([0] + [int(round(len(idx) * share)) for _, share in shares])
        for (name, _), start, end in zip(shares, bounds[:-1], bounds[1:]):
            part = idx[start:end]
            if name == certify_from:
                part, certify = certification_tail(part, certify_fraction, flag=flag, unit=unit)
                parts["certify"] += certify.tolist()
            parts[name] += part.tolist()
        parts[rest] += idx[bounds[-1]:].tolist()
    return {name: sorted(rows) for name, rows in parts.items()}


__all__ = ["SeedLike", "carve_certification", "certification_tail", "check_certify_fraction", "partition_by_class",
           "row_hash", "split_fingerprint"]
