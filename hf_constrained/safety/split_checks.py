"""A run's certification splits checked before training: no row shared with other data, enough rows.

The certificate (:mod:`hf_constrained.certification`) needs rows that nothing else touched. When the trainer
is built, each constraint's ``certify.dataset`` is hashed row by row (:func:`row_hashes`, content hashes of
:func:`~hf_constrained.certification.splits.row_hash`) and compared with every other dataset of the run (the
constraints' training and selection rows, the objective's data): a shared row is an error naming the
constraint. Each split's fingerprint keys its ledger of looks. A split too small to ever certify its
tolerance gets a warning (:func:`check_certifiable`).

The datasets are read through the run's row fetch and collate (:mod:`hf_constrained.batches`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np

from ..batches import collate_examples, fetch_rows
from ..certification.certify import DEFAULT_DELTA, Certifiability, certifiability, first_look_delta
from ..certification.splits import row_hash, split_fingerprint

logger = logging.getLogger(__name__)

_CHUNK = 512  # rows fetched per call


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
    (:func:`~hf_constrained.certification.certify.first_look_delta`), gets a warning naming the constraint,
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


__all__ = ["check_certifiable", "check_certification_splits", "row_hashes"]
