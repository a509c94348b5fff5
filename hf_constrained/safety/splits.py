"""Fingerprints of data rows: a certification split must share no row with anything else.

A certificate is only as good as the independence of its split: a row that also fed a
gradient (the constraint's or the objective's training data) or chose a checkpoint (the
held-out data of feasible-checkpoint selection) makes its bound optimistic. Each row is
hashed by its content (every field: tensors and arrays by dtype, shape and bytes; strings;
numbers), so a copy of a row is found whatever dataset object holds it. The split's
fingerprint (SHA-256 over its sorted row hashes and its size) is recorded in the report and
the card.

:func:`carve_certification` sets a certification split aside in the first place: a seeded share of
the rows (of each class's rows, when given labels), drawn with a generator that depends on the seed
alone, never on the data, so the split is fixed before anything reads a row.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional, Union

import numpy as np

from ..constraint import collate_examples, fetch_rows
from .certify import DEFAULT_DELTA, Certifiability, certifiability, first_look_delta

logger = logging.getLogger(__name__)

_CHUNK = 512  # rows fetched per call


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


def row_hashes(dataset: Any, keys: Optional[frozenset] = None) -> list[bytes]:
    """The hash of every row of ``dataset`` (indexable with a length): of its content (on ``keys`` only
    when given), or of the identities a dataset gives itself with a ``row_identities()`` method (one
    string per underlying row, e.g. the row's place in the raw data file: rows of tabular data with
    equal features are different people)."""
    identities = getattr(dataset, "row_identities", None)
    if callable(identities):
        return [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in identities()]
    n = len(dataset)
    out: list[bytes] = []
    for start in range(0, n, _CHUNK):
        out.extend(row_hash(r, keys) for r in fetch_rows(dataset, range(start, min(start + _CHUNK, n))))
    return out


def _fields(dataset: Any) -> Optional[frozenset]:
    """The field names of a dataset of dict rows (``None`` for other rows)."""
    if callable(getattr(dataset, "row_identities", None)):
        return None
    first = fetch_rows(dataset, [0])[0] if len(dataset) else None
    return frozenset(k for k in first if k != "sample_index") if isinstance(first, Mapping) else None


def split_fingerprint(hashes: Iterable[bytes]) -> str:
    """``sha256:<hex>`` of a split: its sorted row hashes and its size (order-free)."""
    ordered = sorted(hashes)
    digest = hashlib.sha256(f"{len(ordered)}|".encode())
    for h in ordered:
        digest.update(h)
    return "sha256:" + digest.hexdigest()


def _group_counts(c: Any, group_key: str) -> Optional[tuple[int, int]]:
    """Rows of group 0 and group 1 of a constraint's certification split (its collated rows'
    ``group_key``), or ``None`` when they cannot be read without the model."""
    data, collate = c.certify.dataset, c.collate_fn or collate_examples
    counts = [0, 0]
    try:
        for start in range(0, len(data), _CHUNK):
            batch = collate(fetch_rows(data, range(start, min(start + _CHUNK, len(data)))))
            g = np.asarray(batch[group_key]).reshape(-1)
            counts[0] += int(np.sum(g == 0))
            counts[1] += int(np.sum(g == 1))
    except Exception:  # noqa: BLE001 - a collate that needs more than the rows: no per-group count
        return None
    return counts[0], counts[1]


def check_certifiable(constraints: Sequence[Any], delta: float = DEFAULT_DELTA) -> list[Certifiability]:
    """Before training: can each constraint's certification split ever certify its tolerance?

    A tolerance the certified statistic cannot express (outside its range) is a ``ValueError``
    naming the constraint; a split too small to certify the tolerance even with every row at its
    best value (nothing forgotten), at the first look's delta of the ledger
    (:func:`~hf_constrained.safety.certify.first_look_delta`), gets a warning naming the constraint,
    its split size and the rows it would need. Constraints without a declared range are left to
    the certificate's own error."""
    level = first_look_delta(delta)
    out = []
    for c in constraints:
        if not getattr(c, "certifiable", False) or c.certification_range() is None:
            continue
        stat = c.certify.statistic
        group_key = stat.group_key if stat is not None else c.group_key
        absolute = bool(stat.absolute) if stat is not None else c.outer is not None
        rows: tuple[int, ...] = (len(c.certify.dataset),)
        if group_key is not None:
            counts = _group_counts(c, group_key)
            if counts is None:
                continue
            rows = counts
        check = certifiability(c.name, c.certification_bound(), c.certification_range(), c.certification_tolerance(),
                               rows, level, absolute=absolute)
        if not check.possible:
            logger.warning("%s", check.message())
        out.append(check)
    return out


def check_certification_splits(constraints: Sequence[Any], others: Optional[Mapping[str, Any]] = None, *,
                               train_dataset: Any = None, eval_dataset: Any = None) -> dict[str, str]:
    """Refuse certification rows that also appear in training or selection rows, and check that each
    split can certify its tolerance at all (:func:`check_certifiable`, at the default delta).

    Args:
        constraints: the run's constraints; those with a ``certify.dataset`` are checked
            against every constraint's ``dataset`` and ``eval_dataset`` and against ``others``.
        others: further datasets by name.
        train_dataset, eval_dataset: the objective's data (``eval_dataset`` may be a dict of them).

    Returns:
        constraint name -> fingerprint of its certification split.

    Raises:
        ValueError naming the constraint, how many rows overlap and with which data.
    """
    certifying = [c for c in constraints if getattr(c, "certifiable", False)]
    if not certifying:
        return {}
    check_certifiable(certifying)
    others = dict(others or {})
    others["the objective's train_dataset"] = train_dataset
    evals = eval_dataset if isinstance(eval_dataset, Mapping) else {"": eval_dataset}
    others.update({f"the objective's eval_dataset {k}".rstrip(): v for k, v in evals.items()})
    used: list[tuple[str, Any]] = []
    for c in constraints:
        used.append((f"the training rows of constraint {c.name!r}", c.dataset))
        used.append((f"the held-out (selection) rows of constraint {c.name!r}", c.eval_dataset))
    for name, data in others.items():
        used.append((name, data))
    sources = [(what, data) for what, data in used if data is not None and hasattr(data, "__len__") and len(data)]
    # rows of dicts are compared on the fields both datasets have, so that a dataset with other columns (the
    # objective's labels, a stored reference loss) still matches a copied row
    seen: dict[tuple[int, Optional[frozenset]], set[bytes]] = {}

    def hashed(data: Any, keys: Optional[frozenset]) -> set[bytes]:
        if (id(data), keys) not in seen:
            seen[(id(data), keys)] = set(row_hashes(data, keys))
        return seen[(id(data), keys)]

    fingerprints = {}
    for c in certifying:
        fields = _fields(c.certify.dataset)
        hashes = row_hashes(c.certify.dataset)
        for what, data in sources:
            other = _fields(data)
            keys = None if fields is None or other is None else fields & other
            if keys is not None and not keys:
                continue  # no field in common: rows of another kind
            common = hashed(c.certify.dataset, keys) & hashed(data, keys)
            own = hashed(c.certify.dataset, keys)
            if common:
                raise ValueError(
                    f"constraint {c.name!r}: {len(common)} of the {len(own)} rows of its certification split "
                    f"(certify.dataset) also appear in {what}. Certification rows must be touched by nothing else "
                    "(no gradient, no evaluation during training, no checkpoint selection): split them off before "
                    "training")
        fingerprints[c.name] = split_fingerprint(hashes)
    return fingerprints


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


__all__ = ["carve_certification", "check_certifiable", "check_certification_splits", "check_certify_fraction",
           "row_hash", "row_hashes", "split_fingerprint"]
