"""What ``hf-constrained certify`` claims, stated before any row is read: the claims and the settings.

A claim is one line in the user's units, for every protected set or for one of them::

    points_lost <= 3            each protected set loses at most 3 points of exact match
    percent_forgotten <= 2      at most 2% of each set's examples forgotten (right under the base, wrong now)
    math: points_lost <= 1      the set named ``math`` only (overrides the claim for all sets)

Both statistics compare the fine-tuned model with its base on the same rows, row by row (paired), with
teacher-forced exact match of the answer (:func:`~hf_constrained.per_sample_loss.causal_lm_per_example_correct`):

- ``points_lost``: the mean of ``base_correct - new_correct`` per row (in {-1, 0, 1}: rows newly right count
  against rows forgotten), bounded by the exact ``paired_change`` bound (two Clopper-Pearson bounds);
- ``percent_forgotten``: the share of rows with ``base_correct = 1`` and ``new_correct = 0``, a 0/1 rate with
  an exact Clopper-Pearson bound.

This module reads no rows and loads no model (no torch): a claim that cannot be parsed fails before anything
else happens.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

from ..certification.bounds import check_delta
from ..certification.certify import DEFAULT_DELTA
from ..text_data import named_sources

STATISTICS: dict[str, dict[str, object]] = {
    "points_lost": {"bound": "paired_change", "value_range": (-1.0, 1.0),
                    "description": "exact-match accuracy lost against the base (share: 0.03 = 3 points)",
                    "words": "loses at most {x} points of exact match"},
    "percent_forgotten": {"bound": "clopper_pearson", "value_range": (0.0, 1.0),
                          "description": "share of the set's examples forgotten (right under the base, wrong now)",
                          "words": "forgets at most {x}% of its examples"},
}
"""The statistics a claim may name: the bound, the range of the per-row values, and the claim in words."""

_CLAIM = re.compile(r"^\s*(?:(?P<set>[^:<=]+?)\s*:\s*)?(?P<stat>[a-z_]+)\s*<=\s*(?P<x>[0-9]*\.?[0-9]+)\s*%?\s*$")


@dataclass(frozen=True)
class Claim:
    """One claim: ``statistic <= amount`` in points (or percent), for ``set_name`` (``None``: every set)."""

    statistic: str
    amount: float
    set_name: Optional[str] = None

    @property
    def tolerance(self) -> float:
        """The amount as a share (3 points -> 0.03), the unit of the certified statistic."""
        return self.amount / 100.0

    @property
    def bound(self) -> str:
        return str(STATISTICS[self.statistic]["bound"])

    @property
    def value_range(self) -> tuple[float, float]:
        low, high = STATISTICS[self.statistic]["value_range"]  # type: ignore[misc]
        return float(low), float(high)

    @property
    def description(self) -> str:
        return str(STATISTICS[self.statistic]["description"])

    def words(self) -> str:
        """``loses at most 3 points of exact match``."""
        return str(STATISTICS[self.statistic]["words"]).format(x=f"{self.amount:g}")

    def __str__(self) -> str:
        return f"{self.set_name + ': ' if self.set_name else ''}{self.statistic} <= {self.amount:g}"


def parse_claim(text: str) -> Claim:
    """A :class:`Claim` from ``"points_lost <= 3"`` or ``"math: percent_forgotten <= 2"``; a ``ValueError``
    naming the accepted forms otherwise."""
    match = _CLAIM.match(text or "")
    if match is None or match.group("stat") not in STATISTICS:
        raise ValueError(f"--claim {text!r}: write STATISTIC <= AMOUNT (or SET: STATISTIC <= AMOUNT), with "
                         f"STATISTIC one of {', '.join(STATISTICS)} and AMOUNT in points (percent), e.g. "
                         "\"points_lost <= 3\"")
    amount = float(match.group("x"))
    if not 0.0 <= amount <= 100.0:
        raise ValueError(f"--claim {text!r}: the amount is in points (percent), between 0 and 100")
    return Claim(match.group("stat"), amount, match.group("set"))


def claims_per_set(claims: Sequence[Claim], sets: Sequence[str]) -> dict[str, Claim]:
    """The claim of each set: its own (``SET: ...``), else the one for every set; a ``ValueError`` when a set has
    none, when a claim names no given set, or when two claims are for the same sets."""
    general = [c for c in claims if c.set_name is None]
    own: dict[str, Claim] = {}
    for c in claims:
        if c.set_name is None:
            continue
        if c.set_name not in sets:
            raise ValueError(f"--claim {str(c)!r} names the set {c.set_name!r}, which is none of the protected "
                             f"sets {list(sets)}")
        if c.set_name in own:
            raise ValueError(f"two claims for the set {c.set_name!r}: {own[c.set_name]} and {c}")
        own[c.set_name] = c
    if len(general) > 1:
        raise ValueError(f"two claims for every set: {general[0]} and {general[1]}; give one (and SET: ... for a set "
                         "with its own)")
    out = {}
    for name in sets:
        claim = own.get(name) or (general[0] if general else None)
        if claim is None:
            raise ValueError(f"no claim for the set {name!r}: add --claim \"points_lost <= 3\" (every set) or "
                             f"--claim \"{name}: points_lost <= 3\"")
        out[name] = claim
    return out


def claim_headline(claims: Mapping[str, Claim]) -> str:
    """The claim of every set in a few words: ``each protected set loses at most 3 points of exact match``."""
    distinct = {(c.statistic, c.amount) for c in claims.values()}
    if len(distinct) == 1:
        claim = next(iter(claims.values()))
        return ("each protected set " if len(claims) > 1 else f"{next(iter(claims))} ") + claim.words()
    return "; ".join(f"{name} {claim.words()}" for name, claim in claims.items())


@dataclass(frozen=True)
class CertifySettings:
    """Everything ``hf-constrained certify`` (and :func:`~hf_constrained.safety.certify_model.certify_model`)
    needs, checked when built.

    Args:
        model: the fine-tuned model's folder: a full model (``save_pretrained``) or a PEFT adapter (with
            ``adapter_config.json``), with its tokenizer or without (then the base's is used).
        base_model: the model it was fine-tuned from (a folder or a Hub id): the reference of every claim.
        protected_datasets: ``NAME=SOURCE`` (or ``SOURCE``: the name is the file's stem): the certification
            rows of each protected set, prompt/completion or chat (``messages``) rows, read by nothing else.
        claims: ``"points_lost <= 3"`` (every set) or ``"SET: percent_forgotten <= 2"`` (:func:`parse_claim`).
        output_dir: where the report, the card, the ledger and the cache of per-row values go (may be ``model``).
        delta: the certificate's error level over every look at these rows (a ledger of looks spends it).
        train_files: the files the model was trained on: a certification row found in them is refused.
        batch_size, max_length: rows per forward pass; the longest row allowed, in tokens (a longer row is an
            error, never cut).
        device, dtype: ``"auto"`` (a GPU when there is one; the dtype the weights were saved in) or a name.
        split: the split of a Hub dataset source.
        hub_datasets: ``NAME=HUB_ID`` of sets read from local files that were drawn from a Hub dataset (the
            card's model-index names it).
        command: the command line, for the card's "how to reproduce" (recorded without secrets or paths).
    """

    model: str
    base_model: str
    protected_datasets: tuple[str, ...]
    claims: tuple[str, ...]
    output_dir: str
    delta: float = DEFAULT_DELTA
    train_files: tuple[str, ...] = ()
    batch_size: int = 16
    max_length: int = 2048
    device: str = "auto"
    dtype: str = "auto"
    split: str = "train"
    hub_datasets: tuple[str, ...] = ()
    command: Optional[str] = None
    parsed: tuple[Claim, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "delta", check_delta(self.delta, "--delta"))
        if not self.protected_datasets:
            raise ValueError("--protected_datasets: give at least one set of certification rows, NAME=FILE")
        if not self.claims:
            raise ValueError("--claim: state the claim before any row is read, e.g. --claim \"points_lost <= 3\"")
        if self.batch_size < 1:
            raise ValueError(f"--batch_size must be >= 1, got {self.batch_size}")
        if self.max_length < 2:
            raise ValueError(f"--max_length must be >= 2, got {self.max_length}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        object.__setattr__(self, "parsed", tuple(parse_claim(c) for c in self.claims))

    def sets(self) -> dict[str, str]:
        """Set name -> source, from ``NAME=SOURCE`` (or the source's file stem)."""
        return named_sources(self.protected_datasets, "--protected_datasets")

    def claims_per_set(self) -> dict[str, Claim]:
        return claims_per_set(self.parsed, list(self.sets()))


__all__ = ["STATISTICS", "CertifySettings", "Claim", "claim_headline", "claims_per_set",
           "parse_claim"]
