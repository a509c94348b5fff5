"""Certify any fine-tune: ``hf-constrained certify`` and :func:`certify_model`.

A certificate is a statement about two models and some rows nothing else read; it does not depend on how the
new model was trained (``transformers.Trainer``, TRL's ``SFTTrainer``, a PEFT adapter, a replay mix). Given a
fine-tuned causal LM (a full model folder, or a PEFT adapter folder on top of its base), the base it was
fine-tuned from, and per protected set the user's certification rows (prompt/completion or chat rows), it

1. states the claim before any row is read (:mod:`~hf_constrained.safety.certify_claims`, e.g.
   ``points_lost <= 3``: each set loses at most 3 points of teacher-forced exact match of the answer);
2. reads and checks the rows before any model loads (:func:`plan_certification`): repeated rows dropped with a
   count, rows also in the training files refused, each set fingerprinted, the look this certificate will be
   at those rows (the ledger of looks) and whether the set can ever support its claim at that look's delta;
3. scores every row under both models (batched, on a GPU when there is one, in the weights' dtype, with a
   progress bar and a cache of per-row values that a rerun resumes from);
4. certifies with Learn-Then-Test (Angelopoulos et al. 2021) on one candidate, with the exact
   ``paired_change`` (points lost) or Clopper-Pearson (share forgotten) bound, each set's look counted in the
   ledger (:mod:`hf_constrained.certification.ledger`: a second certificate at the same rows spends what is
   left of delta; the same model certified again is the same look);
5. writes ``safety_report.json`` and the card (``README.md``) into the output folder, so that
   ``hf-constrained report DIR --check`` and ``hf-constrained push DIR --repo_id owner/name`` work on it as on
   a training run; when the weights are in another folder the report names it and its weights' fingerprint.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ..certification.certify import Certifiability, certifiability, certify
from ..certification.fingerprint import weight_files, weights_files_fingerprint
from ..certification.ledger import CertificationLedger
from ..publishing.card import ModelCardInfo, ModelSource, render_model_card, write_model_card
from ..publishing.report import ConstraintResult, SafetyReport
from ..redact import redact_command
from ..text_data import named_sources
from .certify_claims import CertifySettings, Claim, claim_headline
from .certify_rows import read_set, rows_in_training, set_fingerprint
from .loop import HUB_OWNER_PLACEHOLDER

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


@dataclass
class PlannedSet:
    """One protected set as read before any model loads."""

    name: str
    source: str
    rows: Any
    fmt: str
    dropped: int
    fingerprint: str
    claim: Claim
    look: int
    level: Optional[float]
    check: Optional[Certifiability]

    def lines(self) -> list[str]:
        """What the run will read and whether the rows can ever support the claim, in words."""
        out = [f"{self.name}: {len(self.rows):,} rows will be read ({self.fmt.replace('_', '/')})"
               + (f", {self.dropped} repeated row(s) dropped" if self.dropped else "")
               + f"; claim: {self.claim.statistic} <= {self.claim.amount:g}; "
               + ("first look at these rows" if self.look == 1 else
                  f"look {self.look} at these rows unless this model was certified on them before (then the same "
                  "look again, spending nothing)")
               + ("" if self.level is None else f"; a new look is tested at delta {self.level:.3g}")]
        if self.level is None:
            out.append(f"{self.name}: the error budget of these rows is spent (a new model is refused; the same "
                       "model certified again reuses its look)")
        elif self.check is not None and not self.check.possible:
            need = "" if self.check.rows_needed is None else f"; the claim needs at least {self.check.rows_needed:,}"
            out.append(f"warning: {self.name}: {len(self.rows):,} rows can never certify {self.claim} at delta "
                       f"{self.level:.3g}, whatever the model (even with nothing lost the bound is "
                       f"{100 * (self.check.floor or 0):.3g} points){need}: the verdict will be NOT CERTIFIED")
        elif self.check is not None and self.check.floor is not None:
            out.append(f"{self.name}: with nothing lost the bound would be {100 * self.check.floor:.3g} points "
                       f"(the claim allows {self.claim.amount:g})")
        return out


@dataclass
class CertifyPlan:
    """What :func:`certify_model` will do, known before any model loads."""

    settings: CertifySettings
    model_dir: str
    adapter: bool
    model_fingerprint: str
    base_identity: str
    sets: dict[str, PlannedSet] = field(default_factory=dict)

    def lines(self) -> list[str]:
        kind = "a PEFT adapter" if self.adapter else "a full model"
        head = [f"model: {self.model_dir} ({kind}, weights {self.model_fingerprint[:19]}...); base: "
                f"{self.settings.base_model}; delta {self.settings.delta:g}"]
        return head + [line for s in self.sets.values() for line in s.lines()]


def _same_base(recorded: Optional[str], given: str) -> bool:
    """Whether an adapter's recorded base and the given base name the same model: equal, the same folder, or a
    local copy named as the Hub id's last part."""
    if not recorded:
        return True  # nothing recorded: nothing to contradict
    if recorded == given:
        return True
    if os.path.exists(recorded) and os.path.exists(given):
        return os.path.realpath(recorded) == os.path.realpath(given)
    return os.path.basename(os.path.normpath(recorded)) == os.path.basename(os.path.normpath(given))


def _config(folder: str) -> dict[str, Any]:
    import json

    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return dict(json.load(f))


def check_model_folder(settings: CertifySettings) -> tuple[bool, str]:
    """(is an adapter, the weight files' fingerprint) of the model folder; one-line errors for a missing folder,
    no weights, an adapter whose base is not the given base, or a full model of another architecture."""
    import json

    folder = settings.model
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"--model {folder}: no such folder (the fine-tuned model's save_pretrained folder)")
    if not weight_files(folder):
        raise FileNotFoundError(f"--model {folder}: no weight files (model.safetensors, adapter_model.safetensors, "
                                "...): pass the folder save_pretrained wrote")
    adapter = os.path.isfile(os.path.join(folder, ADAPTER_CONFIG))
    if adapter:
        with open(os.path.join(folder, ADAPTER_CONFIG), encoding="utf-8") as f:
            recorded = json.load(f).get("base_model_name_or_path")
        if not _same_base(recorded, settings.base_model):
            raise ValueError(f"--model {folder} is an adapter of {recorded!r}, not of --base_model "
                             f"{settings.base_model!r}: certify it against the base it was trained on")
    elif os.path.isdir(settings.base_model):
        configs = [_config(folder), _config(settings.base_model)]
        for key in ("model_type", "vocab_size"):
            mine, theirs = configs[0].get(key), configs[1].get(key)
            if mine is not None and theirs is not None and mine != theirs:
                raise ValueError(f"--model {folder} and --base_model {settings.base_model} differ in {key} "
                                 f"({configs[0][key]} vs {configs[1][key]}): not a fine-tune of that base")
    fingerprint = weights_files_fingerprint(folder)
    assert fingerprint is not None
    return adapter, fingerprint


def plan_certification(settings: CertifySettings) -> CertifyPlan:
    """Everything before any model loads: the claims (parsed first, before a row is read), the model folder's
    checks, each set read, checked against the training files and fingerprinted, and the look and delta each set
    will be certified at, with whether its rows can ever support its claim there."""
    claims = settings.claims_per_set()  # stated before any row is read
    adapter, fingerprint = check_model_folder(settings)
    base_identity = (weights_files_fingerprint(settings.base_model) if os.path.isdir(settings.base_model)
                     else None) or settings.base_model  # a Hub id: known by its name
    plan = CertifyPlan(settings, settings.model, adapter, fingerprint, base_identity)
    ledger = CertificationLedger.for_run(settings.output_dir)
    for name, source in settings.sets().items():
        rows, dropped, fmt = read_set(name, source, settings.split)
        if settings.train_files:
            found = rows_in_training(rows, settings.train_files, settings.split)
            if found:
                where = ", ".join(f"{n} in {os.path.basename(p)}" for p, n in found.items())
                raise ValueError(f"--protected_datasets {name}: {sum(found.values())} of its {len(rows)} rows also "
                                 f"appear in the training files ({where}): certification rows must be rows the "
                                 "model never trained on; remove them (or certify on fresh rows)")
        fp, _ = set_fingerprint(rows)
        looks = ledger.looks(fp)
        budget = looks[0].budget if looks else settings.delta
        level = ledger.spending.level(budget, len(looks) + 1)
        claim = claims[name]
        check = None if level is None else certifiability(name, claim.bound, claim.value_range, claim.tolerance,
                                                           (len(rows),), level)
        plan.sets[name] = PlannedSet(name, source, rows, fmt, dropped, fp, claim, len(looks) + 1, level, check)
    return plan


# ---------------------------------------------------------------------------------- models
def _device(name: str) -> str:
    import torch

    if name != "auto":
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_tokenizers(plan: CertifyPlan) -> tuple[Any, Any]:
    """(the fine-tuned model's tokenizer, the base's): the model folder's own when it has one, else the base's;
    each with a pad token."""
    from transformers import AutoTokenizer

    base = AutoTokenizer.from_pretrained(plan.settings.base_model)
    own = any(os.path.isfile(os.path.join(plan.model_dir, f)) for f in TOKENIZER_FILES)
    model = AutoTokenizer.from_pretrained(plan.model_dir) if own else base
    for tok in {id(base): base, id(model): model}.values():
        if tok.pad_token is None:
            if tok.eos_token is None:
                raise ValueError("the tokenizer has neither a pad nor an EOS token")
            tok.pad_token = tok.eos_token  # padding is masked out of every score
    return model, base


def tokenize_both(plan: CertifyPlan, tokenizer: Any, base_tokenizer: Any) -> dict[str, list[dict[str, list[int]]]]:
    """Each set's rows tokenised by the model's tokenizer; a ``ValueError`` when the base's tokenizer turns any
    row into other tokens (the two models would not be answering the same question)."""
    from .certify_rows import tokenize_rows

    out = {}
    for name, s in plan.sets.items():
        where = f"--protected_datasets {name}"
        rows = tokenize_rows(s.rows, tokenizer, s.fmt, plan.settings.max_length, where)
        if base_tokenizer is not tokenizer:
            other = tokenize_rows(s.rows, base_tokenizer, s.fmt, plan.settings.max_length, where)
            differ = sum(a["input_ids"] != b["input_ids"] or a["labels"] != b["labels"] for a, b in zip(rows, other))
            if differ:
                raise ValueError(f"the tokenizers of --model and --base_model differ: they turn {differ} of the "
                                 f"{len(rows)} rows of {name} into different tokens; certify against the base whose "
                                 "tokenizer the model was trained with")
        out[name] = rows
    return out


def load_models(plan: CertifyPlan) -> tuple[Any, Any]:
    """(the fine-tuned model, the base) on the device, in the weights' dtype (``--dtype auto``); for an adapter
    one copy of the base serves both (the adapter disabled for the base's scores)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = "auto" if plan.settings.dtype == "auto" else getattr(torch, plan.settings.dtype)
    device = _device(plan.settings.device)
    base = AutoModelForCausalLM.from_pretrained(plan.settings.base_model, dtype=dtype).to(device)
    if plan.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(base, plan.model_dir).to(device)
        return model, None
    model = AutoModelForCausalLM.from_pretrained(plan.model_dir, dtype=dtype).to(device)
    return model, base


# ---------------------------------------------------------------------------------- certify
@dataclass
class CertifyResult:
    """What :func:`certify_model` wrote and found: the plan, the report, the files, the exit status
    (0 certified, 1 not certified)."""

    plan: CertifyPlan
    report: SafetyReport
    report_path: str
    card_path: str

    @property
    def exit_code(self) -> int:
        return 0 if self.report.certified else 1


def certify_model(settings: CertifySettings, echo: Optional[Callable[[str], None]] = None) -> CertifyResult:
    """Certify a fine-tuned causal LM against its base on the user's certification rows (module docstring):
    ``safety_report.json`` and ``README.md`` in ``settings.output_dir``; ``echo`` receives the plan and the
    verdict line by line (default: the log)."""
    echo = echo or logger.info
    plan = plan_certification(settings)
    for line in plan.lines():
        echo(line)
    tokenizer, base_tokenizer = load_tokenizers(plan)
    tokenized = tokenize_both(plan, tokenizer, base_tokenizer)
    model, base = load_models(plan)
    values, accuracy = score_sets(plan, tokenized, tokenizer, model, base)
    identity = f"{plan.model_fingerprint}|base:{plan.base_identity}"
    claims = {name: s.claim for name, s in plan.sets.items()}
    cert = certify([values], {n: c.tolerance for n, c in claims.items()},
                   {n: c.value_range for n, c in claims.items()}, settings.delta,
                   bound={n: c.bound for n, c in claims.items()},
                   split_fingerprints={n: s.fingerprint for n, s in plan.sets.items()},
                   ledger=CertificationLedger.for_run(settings.output_dir), candidate_ids=[identity])
    report = build_report(plan, cert, values, accuracy)
    report_path = report.save(settings.output_dir)
    card_path = write_card(plan, report, accuracy)
    echo(report.headline())
    return CertifyResult(plan, report, report_path, card_path)


def score_sets(plan: CertifyPlan, tokenized: dict[str, list], tokenizer: Any, model: Any,
               base: Optional[Any]) -> tuple[dict[str, np.ndarray], dict[str, tuple[float, float]]]:
    """Per set, the certified statistic's per-row values, and (base, model) exact-match accuracy."""
    from ..reference_pass import old_model_context
    from ..text_data import SFTPaddingCollator
    from .certify_rows import RowCache, cache_key, correct_per_row

    settings = plan.settings
    collate = SFTPaddingCollator(tokenizer)
    values, accuracy = {}, {}
    for name, s in plan.sets.items():
        common = (s.fingerprint, settings.dtype, settings.max_length, "teacher-forced exact match")
        base_key = cache_key(plan.base_identity, *common)
        model_key = cache_key(plan.model_fingerprint, plan.base_identity, *common)
        base_cache = RowCache(settings.output_dir, name, "base", base_key)
        model_cache = RowCache(settings.output_dir, name, "model", model_key)
        if base is None:  # an adapter: its base is the adapter-disabled model
            with old_model_context(model):
                old = correct_per_row(model, tokenized[name], collate, settings.batch_size, base_cache,
                                      f"{name}: base")
        else:
            old = correct_per_row(base, tokenized[name], collate, settings.batch_size, base_cache, f"{name}: base")
        new = correct_per_row(model, tokenized[name], collate, settings.batch_size, model_cache, f"{name}: model")
        values[name] = old - new if s.claim.statistic == "points_lost" else old * (1.0 - new)
        accuracy[name] = (float(old.mean()), float(new.mean()))
    return values, accuracy


def build_report(plan: CertifyPlan, cert: Any, values: dict[str, np.ndarray],
                 accuracy: dict[str, tuple[float, float]]) -> SafetyReport:
    """The :class:`SafetyReport` of a certification: one row per set (the certified statistic on its rows), the
    certificate, the claim in words, and where the weights are."""
    settings = plan.settings
    claims = {name: s.claim for name, s in plan.sets.items()}
    constraints = [ConstraintResult(name, float(values[name].mean()), claims[name].tolerance, old_value=0.0,
                                    data="certification", num_rows=int(values[name].size),
                                    extra={"base exact match": accuracy[name][0],
                                           "new exact match": accuracy[name][1]})
                   for name in plan.sets]
    out = os.path.abspath(settings.output_dir)
    model_dir = os.path.abspath(plan.model_dir)
    here = os.path.realpath(out) == os.path.realpath(model_dir)
    kind = "PEFT adapter" if plan.adapter else "full model"
    return SafetyReport(
        constraints=constraints, split="certification", model_name=os.path.basename(os.path.normpath(model_dir)),
        certificate=cert.to_dict(), certificate_candidate=0, safety_rule="certified",
        statistics={n: {"description": c.description, "proxy": False, "old_value": 0.0} for n, c in claims.items()},
        extra_columns=["base exact match", "new exact match"],
        settings={"delta": settings.delta, "safety_rule": "certified", "candidates": "final",
                  "claim": claim_headline(claims), "claims": {n: str(c) for n, c in claims.items()}},
        method={"method": "teacher-forced exact match of each answer under both models, paired row by row",
                "certified_by": "hf-constrained certify", "num_constraints": len(constraints), "model": kind},
        weights_files_fingerprint=plan.model_fingerprint,
        weights_folder=None if here else os.path.relpath(model_dir, out))


def write_card(plan: CertifyPlan, report: SafetyReport, accuracy: dict[str, tuple[float, float]]) -> str:
    """The card (``README.md``) of a certification, with a model-index where the sets name Hub datasets."""
    from ..publishing.card import _hub_id

    settings = plan.settings
    hub = {**{n: s.source for n, s in plan.sets.items() if _hub_id(s.source) and not os.path.exists(s.source)},
           **named_sources(settings.hub_datasets, "--hub_datasets")}
    results = [_exact_match_result(n, hub[n], accuracy[n][1], settings.split) for n in plan.sets if n in hub]
    description = "; ".join(
        f"{n}: {len(s.rows):,} certification rows, exact match {100 * accuracy[n][0]:.1f}% (base) -> "
        f"{100 * accuracy[n][1]:.1f}% (this model)" for n, s in plan.sets.items())
    info = ModelCardInfo(base_model=settings.base_model, dataset_description=description, task="text-generation",
                         datasets=sorted(set(hub.values())), reproduce_command=redact_command(settings.command))
    if plan.adapter:
        source = ModelSource("peft", "PeftModel", adapter_base_model=settings.base_model,
                             base_class_name="AutoModelForCausalLM", processor_class="AutoTokenizer")
    else:
        source = ModelSource("transformers", "AutoModelForCausalLM", processor_class="AutoTokenizer")
    name = report.model_name or "model"
    card = render_model_card(report, model_name=name, info=info, source=source, results=results,
                             repo_id=f"{HUB_OWNER_PLACEHOLDER}/{name}")
    return write_model_card(settings.output_dir, card)


def _exact_match_result(name: str, dataset_id: str, value: float, split: str) -> Any:
    from huggingface_hub import EvalResult

    return EvalResult(task_type="text-generation", dataset_type=dataset_id, dataset_name=name, dataset_split=split,
                      metric_type="exact_match", metric_name=f"Exact match ({name}, teacher-forced)",
                      metric_value=value, verified=False)


__all__ = ["CertifyPlan", "CertifyResult", "PlannedSet", "certify_model", "check_model_folder", "load_models",
           "load_tokenizers", "plan_certification", "score_sets", "tokenize_both"]
