"""What ``hf-constrained certify`` claims, stated before any row is read: the claims and the settings.

A claim is one line in the user's units, for every protected set or for one of them::

    points_lost <= 3            each protected set loses at most 3 points (of exact match, or of accuracy)
    percent_forgotten <= 2      at most 2% of each set's examples forgotten (right under the base, wrong now)
    loss_rise <= 0.05           each set's per-token loss of the answer rises by at most 0.05 nats (causal LMs)
    math: points_lost <= 1      the set named ``math`` only (overrides the claim for all sets)

Every statistic compares the fine-tuned model with its base on the same rows, row by row (paired). A row is
right when the model reproduces its answer exactly (causal LMs: teacher-forced exact match,
:func:`~hf_constrained.per_sample_loss.causal_lm_per_example_correct`) or predicts its label (classifiers, CLIP
zero-shot heads):

- ``points_lost``: the mean of ``base_correct - new_correct`` per row (in {-1, 0, 1}: rows newly right count
  against rows forgotten), bounded by the exact ``paired_change`` bound (two Clopper-Pearson bounds);
- ``percent_forgotten``: the share of rows with ``base_correct = 1`` and ``new_correct = 0``, a 0/1 rate with
  an exact Clopper-Pearson bound;
- ``loss_rise``: the mean of ``min(new_loss, C) - min(base_loss, C)`` per row, each loss the mean next-token
  cross-entropy over the row's answer tokens (nats per token) clipped at ``C = --loss_clip`` (default 10 nats),
  so that every value lies in ``[-C, C]``; bounded by the betting bound of Waudby-Smith & Ramdas (2024), a
  finite-sample bound for the mean of bounded values that adapts to their variance (rows in a random order drawn
  independently of the data, recorded). The claim is about the clipped losses: a row whose loss exceeds ``C``
  counts as ``C``.

This module reads no rows and loads no model (no torch): a claim that cannot be parsed fails before anything
else happens.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Optional

from ..certification.bounds import check_delta
from ..certification.certify import DEFAULT_DELTA
from ..text_data import named_sources

STATISTICS: dict[str, dict[str, object]] = {
    "points_lost": {"bound": "paired_change", "value_range": (-1.0, 1.0),
                    "description": "{metric} lost against the base (share: 0.03 = 3 points)",
                    "words": "loses at most {x} points of {metric}"},
    "percent_forgotten": {"bound": "clopper_pearson", "value_range": (0.0, 1.0),
                          "description": "share of the set's examples forgotten (right under the base, wrong now)",
                          "words": "forgets at most {x}% of its examples"},
    "loss_rise": {"bound": "betting", "value_range": None,
                  "description": "rise of the mean per-token loss of the answer against the base (nats; each "
                                 "row's loss clipped at {clip:g})",
                  "words": "has a per-token loss at most {x} nats above the base's"},
}
"""The statistics a claim may name: the bound, the range of the per-row values (``None``: ``[-C, C]`` with ``C``
the loss clip), and the claim in words."""

TASKS = ("causal_lm", "sequence_classification", "image_classification", "clip")
"""What ``--task`` may name: a causal LM, a text (sequence) classifier, an image classifier, a CLIP zero-shot head."""

METRICS = {"causal_lm": "exact match", "sequence_classification": "accuracy", "image_classification": "accuracy",
           "clip": "zero-shot accuracy"}
"""What a row being right means, per task, in the claim's words."""

DEFAULT_PROMPT_TEMPLATE = "a photo of a {}."
"""``--prompt_template``: the CLIP zero-shot prompt of each class."""

IN_POINTS = frozenset({"points_lost", "percent_forgotten"})
"""The statistics whose amount is in points (percent): the tolerance is the amount / 100."""

DEFAULT_LOSS_CLIP = 10.0
"""``--loss_clip``: each row's per-token loss is clipped at this many nats for ``loss_rise`` (the per-row values
then lie in ``[-10, 10]``; a model guessing uniformly over a 32,000-token vocabulary scores 10.4)."""

_CLAIM = re.compile(r"^\s*(?:(?P<set>[^:<=]+?)\s*:\s*)?(?P<stat>[a-z_]+)\s*<=\s*(?P<x>[0-9]*\.?[0-9]+)\s*%?\s*$")


@dataclass(frozen=True)
class Claim:
    """One claim: ``statistic <= amount`` in points (or percent), for ``set_name`` (``None``: every set)."""

    statistic: str
    amount: float
    set_name: Optional[str] = None
    metric: str = "exact match"
    clip: float = DEFAULT_LOSS_CLIP

    @property
    def tolerance(self) -> float:
        """The amount in the certified statistic's unit: a share for points (3 points -> 0.03), nats for a loss."""
        return self.amount / 100.0 if self.statistic in IN_POINTS else self.amount

    @property
    def bound(self) -> str:
        return str(STATISTICS[self.statistic]["bound"])

    @property
    def value_range(self) -> tuple[float, float]:
        declared = STATISTICS[self.statistic]["value_range"]
        if declared is None:
            return -float(self.clip), float(self.clip)
        low, high = declared  # type: ignore[misc]
        return float(low), float(high)

    @property
    def description(self) -> str:
        return str(STATISTICS[self.statistic]["description"]).format(metric=self.metric, clip=self.clip)

    def words(self) -> str:
        """``loses at most 3 points of exact match``."""
        return str(STATISTICS[self.statistic]["words"]).format(x=f"{self.amount:g}", metric=self.metric)

    def amount_words(self, value: float) -> str:
        """A value of the certified statistic in the claim's unit: ``0.17 points``, ``0.035 nats``."""
        return f"{100 * value:.3g} points" if self.statistic in IN_POINTS else f"{value:.3g} nats"

    def __str__(self) -> str:
        return f"{self.set_name + ': ' if self.set_name else ''}{self.statistic} <= {self.amount:g}"


def parse_claim(text: str) -> Claim:
    """A :class:`Claim` from ``"points_lost <= 3"`` or ``"math: percent_forgotten <= 2"``; a ``ValueError``
    naming the accepted forms otherwise."""
    match = _CLAIM.match(text or "")
    if match is None or match.group("stat") not in STATISTICS:
        raise ValueError(f"--claim {text!r}: write STATISTIC <= AMOUNT (or SET: STATISTIC <= AMOUNT), with "
                         f"STATISTIC one of {', '.join(STATISTICS)} and AMOUNT in points (percent), or in nats "
                         "for loss_rise, e.g. \"points_lost <= 3\" or \"loss_rise <= 0.05\"")
    amount = float(match.group("x"))
    if match.group("stat") in IN_POINTS and not 0.0 <= amount <= 100.0:
        raise ValueError(f"--claim {text!r}: the amount is in points (percent), between 0 and 100")
    if match.group("stat") not in IN_POINTS and text.strip().endswith("%"):
        raise ValueError(f"--claim {text!r}: loss_rise is in nats per token, not in percent")
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
            rows of each protected set, read by nothing else: prompt/completion or chat (``messages``) rows for a
            causal LM; ``text`` + ``label`` rows for a text classifier; ``image`` (a path) + ``label`` rows or a
            folder of class subfolders for an image classifier or CLIP
            (:mod:`~hf_constrained.safety.certify_tasks`).
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
        task: ``"auto"`` (from the model's ``config.json``: ``*ForCausalLM``, ``*ForSequenceClassification``,
            ``*ForImageClassification``, ``CLIPModel``) or one of :data:`TASKS`.
        per_class: classifiers and CLIP: every class of the rows is its own protected set (named by the class,
            ``SET/CLASS`` with several sets), so a claim holds per class.
        class_names: CLIP: the zero-shot head's classes, in order (default: the labels found in the rows, sorted).
        prompt_template: CLIP: the prompt of each class, with one ``{}`` for the class name.
        text_column, image_column, label_column: the columns of classifier and CLIP rows (``image_column``
            ``None``: ``image``, else ``filepath``, the CLIP recipe's CSV column).
        loss_clip: ``loss_rise``: each row's per-token loss is clipped at this many nats.
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
    task: str = "auto"
    per_class: bool = False
    class_names: tuple[str, ...] = ()
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE
    text_column: str = "text"
    image_column: Optional[str] = None
    label_column: str = "label"
    loss_clip: float = DEFAULT_LOSS_CLIP
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
        if self.task not in ("auto", *TASKS):
            raise ValueError(f"--task must be auto or one of {', '.join(TASKS)}, got {self.task!r}")
        if not (isinstance(self.loss_clip, (int, float)) and 0 < float(self.loss_clip) < float("inf")):
            raise ValueError(f"--loss_clip must be a positive number of nats, got {self.loss_clip!r}")
        if self.prompt_template.count("{}") != 1:
            raise ValueError(f"--prompt_template needs exactly one '{{}}' for the class name, got "
                             f"{self.prompt_template!r}")
        if len(set(self.class_names)) != len(self.class_names):
            raise ValueError(f"--class_names: a class is named twice in {list(self.class_names)}")
        object.__setattr__(self, "parsed", tuple(replace(parse_claim(c), clip=float(self.loss_clip))
                                                 for c in self.claims))

    def sets(self) -> dict[str, str]:
        """Set name -> source, from ``NAME=SOURCE`` (or the source's file stem)."""
        return named_sources(self.protected_datasets, "--protected_datasets")

    def claims_per_set(self, sets: Optional[Sequence[str]] = None, task: str = "causal_lm") -> dict[str, Claim]:
        """The claim of each set (``sets``: default the named sources; with ``per_class`` the classes), in the
        words of ``task``; a ``ValueError`` for a claim the task cannot make (``loss_rise`` is for causal LMs)."""
        claims = claims_per_set(self.parsed, list(self.sets()) if sets is None else list(sets))
        for claim in claims.values():
            if claim.statistic == "loss_rise" and task != "causal_lm":
                raise ValueError(f"--claim {str(claim)!r}: loss_rise is a claim about a causal LM's per-token loss; "
                                 f"a {task.replace('_', ' ')} model is certified in points_lost or percent_forgotten")
        return {name: replace(claim, metric=METRICS[task]) for name, claim in claims.items()}


__all__ = ["DEFAULT_LOSS_CLIP", "DEFAULT_PROMPT_TEMPLATE", "METRICS", "STATISTICS", "TASKS", "CertifySettings",
           "Claim", "claim_headline", "claims_per_set", "parse_claim"]
