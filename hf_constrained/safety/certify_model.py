"""Certify any fine-tune: ``hf-constrained certify`` and :func:`certify_model`.

A certificate is a statement about two models and some rows nothing else read; it does not depend on how the
new model was trained (``transformers.Trainer``, TRL's ``SFTTrainer``, a PEFT adapter, a replay mix). Given a
fine-tuned model (a full model folder, or a PEFT adapter folder on top of its base): a causal LM, a text or image
classifier or a CLIP model's zero-shot head (:mod:`~hf_constrained.safety.certify_tasks`,
:mod:`~hf_constrained.safety.certify_labelled`), the base it was fine-tuned from, and per protected set the user's
certification rows (prompt/completion or chat rows; text or image rows with a label), it

1. states the claim before any row is read (:mod:`~hf_constrained.safety.certify_claims`, e.g.
   ``points_lost <= 3``: each set loses at most 3 points of teacher-forced exact match of the answer, or of
   accuracy; ``loss_rise <= 0.05``: its per-token loss rises by at most 0.05 nats);
2. reads and checks the rows before any model loads (:func:`plan_certification`): repeated rows dropped with a
   count, rows also in the training files refused, each set fingerprinted, the look this certificate will be
   at those rows (the ledger of looks) and whether the set can ever support its claim at that look's delta;
3. scores every row under both models (batched, on a GPU when there is one, in the weights' dtype, with a
   progress bar and a cache of per-row values that a rerun resumes from);
4. certifies with Learn-Then-Test (Angelopoulos et al. 2021) on one candidate, with the exact
   ``paired_change`` (points lost), Clopper-Pearson (share forgotten) or betting (loss rise) bound, each set's
   look counted in the ledger (:mod:`hf_constrained.certification.ledger`: a second certificate at the same rows
   spends what is left of delta; the same model certified again is the same look);
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
from ..publishing.report import SafetyReport
from .certify_claims import CertifySettings, Claim
from .certify_rows import TOKENIZER_FILES, read_set, rows_in_training, set_fingerprint
from .certify_tasks import detect_task

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"


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
                       f"{self.level:.3g}, whatever the model (even with nothing lost or changed the bound is "
                       f"{self.claim.amount_words(self.check.floor or 0)}){need}: the verdict will be NOT CERTIFIED")
        elif self.check is not None and self.check.floor is not None:
            nothing = "no row's loss changed" if self.claim.statistic == "loss_rise" else "nothing lost"
            out.append(f"{self.name}: with {nothing} the bound would be {self.claim.amount_words(self.check.floor)} "
                       f"(the claim allows {self.claim.amount:g})")
        return out


@dataclass
class CertifyPlan:
    """What :func:`certify_model` will do, known before any model loads: the task (:data:`TASKS`) and, for a
    classifier or CLIP head, its classes."""

    settings: CertifySettings
    model_dir: str
    adapter: bool
    model_fingerprint: str
    base_identity: str
    sets: dict[str, PlannedSet] = field(default_factory=dict)
    task: str = "causal_lm"
    classes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        kind = "a PEFT adapter" if self.adapter else "a full model"
        head = [f"model: {self.model_dir} ({kind}, {self.task.replace('_', ' ')}, weights "
                f"{self.model_fingerprint[:19]}...); base: {self.settings.base_model}; delta {self.settings.delta:g}"]
        if self.task == "clip":
            head.append(f"zero-shot head: {len(self.classes)} classes {self.classes}, prompts "
                        f"{self.settings.prompt_template!r}")
        elif self.classes:
            head.append(f"classes: {self.classes}")
        return head + self.notes + [line for s in self.sets.values() for line in s.lines()]


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
    checks, the task and its classes, each set read, checked against the training files and fingerprinted, and the
    look and delta each set will be certified at, with whether its rows can ever support its claim there."""
    if not settings.per_class:
        settings.claims_per_set()  # stated before any row is read
    adapter, fingerprint = check_model_folder(settings)
    task = detect_task(settings.model, settings.base_model, adapter, settings.task)
    base_identity = (weights_files_fingerprint(settings.base_model) if os.path.isdir(settings.base_model)
                     else None) or settings.base_model  # a Hub id: known by its name
    plan = CertifyPlan(settings, settings.model, adapter, fingerprint, base_identity, task=task)
    read = _read_lm_sets(settings) if task == "causal_lm" else _read_labelled_sets(plan)
    claims = settings.claims_per_set(list(read), task)
    ledger = CertificationLedger.for_run(settings.output_dir)
    for name, (source, rows, fmt, dropped, fp) in read.items():
        looks = ledger.looks(fp)
        budget = looks[0].budget if looks else settings.delta
        level = ledger.spending.level(budget, len(looks) + 1)
        claim = claims[name]
        check = None if level is None else _certifiability(name, claim, len(rows), level)
        plan.sets[name] = PlannedSet(name, source, rows, fmt, dropped, fp, claim, len(looks) + 1, level, check)
    return plan


def _certifiability(name: str, claim: Claim, n: int, level: float) -> Certifiability:
    """Whether ``n`` rows can ever support ``claim`` at ``level``: for a loss rise, the betting bound with no row's
    loss changed (its floor at ``-C`` would say nothing), else :func:`certifiability`."""
    if claim.statistic != "loss_rise":
        return certifiability(name, claim.bound, claim.value_range, claim.tolerance, (n,), level)
    from ..certification.bounds import upper_bound

    floor = upper_bound(np.zeros(n), claim.value_range, level, claim.bound, order_seed=0)
    return Certifiability(name, (n,), claim.tolerance, level, floor)


def _refuse_training_rows(name: str, total: int, found: dict[str, int]) -> None:
    if found:
        where = ", ".join(f"{n} in {os.path.basename(os.path.normpath(p))}" for p, n in found.items())
        raise ValueError(f"--protected_datasets {name}: {sum(found.values())} of its {total} rows also appear in the "
                         f"training files ({where}): certification rows must be rows the model never trained on; "
                         "remove them (or certify on fresh rows)")


def _read_lm_sets(settings: CertifySettings) -> dict[str, tuple[str, Any, str, int, str]]:
    """Per set of a causal LM: (source, rows, format, repeats dropped, fingerprint)."""
    out = {}
    for name, source in settings.sets().items():
        rows, dropped, fmt = read_set(name, source, settings.split)
        if settings.train_files:
            _refuse_training_rows(name, len(rows), rows_in_training(rows, settings.train_files, settings.split))
        out[name] = (source, rows, fmt, dropped, set_fingerprint(rows)[0])
    return out


def _read_labelled_sets(plan: CertifyPlan) -> dict[str, tuple[str, Any, str, int, str]]:
    """Per set of a classifier or CLIP head (``--per_class``: per class): (source, rows, format, repeats dropped,
    fingerprint); ``plan.classes`` set. The label sets of the two models are compared first."""
    from .certify_tasks import (
        clip_classes,
        index_labels,
        inputs_in_training,
        model_classes,
        read_labelled_set,
        split_per_class,
    )

    settings = plan.settings
    columns = (settings.text_column, settings.image_column, settings.label_column)
    classes = None if plan.task == "clip" else model_classes(settings.model, settings.base_model)
    if plan.task == "clip" and settings.class_names:
        classes = list(settings.class_names)
    sources = settings.sets()
    sets = {name: read_labelled_set(name, source, plan.task, classes, columns, settings.split)
            for name, source in sources.items()}
    if classes is None:
        classes = clip_classes(sets, settings.class_names)
        for name, data in sets.items():
            index_labels(name, data, classes)
    plan.classes = list(classes)
    for name, data in sets.items():
        if settings.train_files:
            _refuse_training_rows(name, len(data), inputs_in_training(data, settings.train_files, plan.task, columns,
                                                                      settings.split))
    dropped = {name: data.dropped for name, data in sets.items()}
    if settings.per_class:
        plan.notes += [f"{name}: {n} repeated row(s) dropped" for name, n in dropped.items() if n]
        owner = {}
        for set_name in sets:
            owner.update({c if len(sets) == 1 else f"{set_name}/{c}": set_name for c in classes})
        sets = split_per_class(sets, classes)
        return {name: (sources[owner[name]], data.rows, data.fmt, 0, data.fingerprint) for name, data in sets.items()}
    return {name: (sources[name], data.rows, data.fmt, dropped[name], data.fingerprint) for name, data in sets.items()}


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
    """Certify a fine-tuned model (a causal LM, a classifier or a CLIP zero-shot head) against its base on the
    user's certification rows (module docstring): ``safety_report.json`` and ``README.md`` in
    ``settings.output_dir``; ``echo`` receives the plan and the verdict line by line (default: the log)."""
    from .certify_report import build_report, write_card

    echo = echo or logger.info
    plan = plan_certification(settings)
    for line in plan.lines():
        echo(line)
    if plan.task == "causal_lm":
        tokenizer, base_tokenizer = load_tokenizers(plan)
        tokenized = tokenize_both(plan, tokenizer, base_tokenizer)
        model, base = load_models(plan)
        values, metrics = score_sets(plan, tokenized, tokenizer, model, base)
    else:
        from .certify_labelled import score_labelled

        values, metrics = score_labelled(plan)
    identity = f"{plan.model_fingerprint}|base:{plan.base_identity}"
    claims = {name: s.claim for name, s in plan.sets.items()}
    cert = certify([values], {n: c.tolerance for n, c in claims.items()},
                   {n: c.value_range for n, c in claims.items()}, settings.delta,
                   bound={n: c.bound for n, c in claims.items()},
                   split_fingerprints={n: s.fingerprint for n, s in plan.sets.items()},
                   ledger=CertificationLedger.for_run(settings.output_dir), candidate_ids=[identity])
    report = build_report(plan, cert, values, metrics)
    report_path = report.save(settings.output_dir)
    card_path = write_card(plan, report, metrics)
    echo(report.headline())
    return CertifyResult(plan, report, report_path, card_path)


def score_sets(plan: CertifyPlan, tokenized: dict[str, list], tokenizer: Any, model: Any,
               base: Optional[Any]) -> tuple[dict[str, np.ndarray], dict[str, dict[str, float]]]:
    """Per set of a causal LM, the certified statistic's per-row values, and each model's exact match (or, for a
    ``loss_rise`` claim, its mean per-token loss, clipped)."""
    from ..text_data import SFTPaddingCollator
    from .certify_rows import RowCache, cache_key, loss_batch, paired_per_row

    settings = plan.settings
    collate = SFTPaddingCollator(tokenizer)
    values, metrics = {}, {}
    for name, s in plan.sets.items():
        loss = s.claim.statistic == "loss_rise"
        what = "per-token loss of the answer" if loss else "teacher-forced exact match"
        common = (s.fingerprint, settings.dtype, settings.max_length, what)
        caches = (RowCache(settings.output_dir, name, "base", cache_key(plan.base_identity, *common)),
                  RowCache(settings.output_dir, name, "model",
                           cache_key(plan.model_fingerprint, plan.base_identity, *common)))
        old, new = paired_per_row(model, base, tokenized[name], collate, loss_batch if loss else None, caches,
                                  settings.batch_size, name)
        if loss:  # each row's loss clipped at C: the values lie in [-C, C] (certify_claims)
            old, new = np.minimum(old, s.claim.clip), np.minimum(new, s.claim.clip)
            values[name] = new - old
            metrics[name] = {"base loss": float(old.mean()), "new loss": float(new.mean())}
        else:
            values[name] = old - new if s.claim.statistic == "points_lost" else old * (1.0 - new)
            metrics[name] = {"base exact match": float(old.mean()), "new exact match": float(new.mean())}
    return values, metrics


__all__ = ["CertifyPlan", "CertifyResult", "PlannedSet", "certify_model", "check_model_folder", "load_models",
           "load_tokenizers", "plan_certification", "score_sets", "tokenize_both"]
