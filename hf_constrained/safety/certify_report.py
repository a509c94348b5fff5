"""The report and the card of ``hf-constrained certify``: the same ``safety_report.json`` and ``README.md`` as a
training run, for a causal LM, a classifier or a CLIP zero-shot head.

- :func:`build_report`: one row per protected set (the certified statistic on its rows), the certificate, the claim
  in words, each model's exact match / accuracy / loss beside it, and where the weights are;
- :func:`write_card`: the card, with the task's Hub type (``text-generation``, ``text-classification``,
  ``image-classification``, ``zero-shot-image-classification``), the loading snippet of the model's class (``PeftModel``
  for an adapter) and a model-index with real types (``exact_match`` or ``accuracy``) for sets that are Hub datasets.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..publishing.card import ModelCardInfo, ModelSource, render_model_card, write_model_card
from ..publishing.report import ConstraintResult, SafetyReport
from ..redact import redact_command
from ..text_data import named_sources
from .certify_claims import claim_headline
from .loop import HUB_OWNER_PLACEHOLDER

HUB_TASKS = {"causal_lm": "text-generation", "sequence_classification": "text-classification",
             "image_classification": "image-classification", "clip": "zero-shot-image-classification"}
"""The Hub task (pipeline tag) of each certified task."""

MODEL_CLASSES = {"causal_lm": ("AutoModelForCausalLM", "AutoTokenizer"),
                 "sequence_classification": ("AutoModelForSequenceClassification", "AutoTokenizer"),
                 "image_classification": ("AutoModelForImageClassification", "AutoImageProcessor"),
                 "clip": ("CLIPModel", "AutoProcessor")}
"""The class that loads each task's model, and its processor's."""

METHODS = {
    "causal_lm": "teacher-forced exact match of each answer under both models, paired row by row",
    "sequence_classification": "each row's predicted class (argmax) under both models against its label, paired "
                               "row by row",
    "image_classification": "each image's predicted class (argmax) under both models against its label, paired "
                            "row by row",
    "clip": "each image's zero-shot class (the class prompt most similar to it) under both models against its "
            "label, paired row by row",
}


def _method(plan: Any) -> str:
    if any(s.claim.statistic == "loss_rise" for s in plan.sets.values()):
        clip = next(s.claim.clip for s in plan.sets.values() if s.claim.statistic == "loss_rise")
        return (f"{METHODS[plan.task]}; for loss_rise claims each answer's mean per-token loss under both models, "
                f"each clipped at {clip:g} nats, paired row by row")
    return METHODS[plan.task]


def build_report(plan: Any, cert: Any, values: dict[str, np.ndarray],
                 metrics: dict[str, dict[str, float]]) -> SafetyReport:
    """The :class:`SafetyReport` of a certification: one row per set (the certified statistic on its rows), the
    certificate, the claim in words, and where the weights are."""
    settings = plan.settings
    claims = {name: s.claim for name, s in plan.sets.items()}
    constraints = [ConstraintResult(name, float(values[name].mean()), claims[name].tolerance, old_value=0.0,
                                    data="certification", num_rows=int(values[name].size), extra=dict(metrics[name]))
                   for name in plan.sets]
    columns = list(dict.fromkeys(k for m in metrics.values() for k in m))
    out = os.path.abspath(settings.output_dir)
    model_dir = os.path.abspath(plan.model_dir)
    here = os.path.realpath(out) == os.path.realpath(model_dir)
    kind = "PEFT adapter" if plan.adapter else "full model"
    extra_settings: dict[str, Any] = {"task": plan.task}
    if plan.classes:
        extra_settings["classes"] = list(plan.classes)
    if plan.task == "clip":
        extra_settings["prompt_template"] = settings.prompt_template
    if any(c.statistic == "loss_rise" for c in claims.values()):
        extra_settings["loss_clip"] = settings.loss_clip
    return SafetyReport(
        constraints=constraints, split="certification", model_name=os.path.basename(os.path.normpath(model_dir)),
        certificate=cert.to_dict(), certificate_candidate=0, safety_rule="certified",
        statistics={n: {"description": c.description, "proxy": False, "old_value": 0.0} for n, c in claims.items()},
        extra_columns=columns,
        settings={"delta": settings.delta, "safety_rule": "certified", "candidates": "final",
                  "claim": claim_headline(claims), "claims": {n: str(c) for n, c in claims.items()},
                  **extra_settings},
        method={"method": _method(plan), "certified_by": "hf-constrained certify",
                "num_constraints": len(constraints), "model": kind},
        weights_files_fingerprint=plan.model_fingerprint,
        weights_folder=None if here else os.path.relpath(model_dir, out))


def _describe(name: str, rows: int, metrics: dict[str, float]) -> str:
    """``math: 2,000 certification rows, exact match 61.0% (base) -> 60.2% (this model)``."""
    for key, unit in (("exact match", "%"), ("accuracy", "%"), ("loss", " nats per token")):
        if f"base {key}" in metrics:
            old, new = metrics[f"base {key}"], metrics[f"new {key}"]
            shown = (f"{100 * old:.1f}%", f"{100 * new:.1f}%") if unit == "%" else (f"{old:.3f}", f"{new:.3f}")
            words = "per-token loss" if key == "loss" else key
            return (f"{name}: {rows:,} certification rows, {words} {shown[0]} (base) -> {shown[1]} (this model)"
                    + ("" if unit == "%" else unit))
    return f"{name}: {rows:,} certification rows"


def write_card(plan: Any, report: SafetyReport, metrics: dict[str, dict[str, float]]) -> str:
    """The card (``README.md``) of a certification, with a model-index where the sets name Hub datasets."""
    from ..publishing.card import _hub_id

    settings = plan.settings
    hub = {**{n: s.source for n, s in plan.sets.items() if _hub_id(s.source) and not os.path.exists(s.source)},
           **named_sources(settings.hub_datasets, "--hub_datasets")}
    task = HUB_TASKS[plan.task]
    results = [r for n in plan.sets if n in hub for r in [_result(n, hub[n], task, metrics[n], settings.split)]
               if r is not None]
    description = "; ".join(_describe(n, len(s.rows), metrics[n]) for n, s in plan.sets.items())
    info = ModelCardInfo(base_model=settings.base_model, dataset_description=description, task=task,
                         datasets=sorted(set(hub.values())), reproduce_command=redact_command(settings.command))
    model_class, processor_class = MODEL_CLASSES[plan.task]
    if plan.adapter:
        source = ModelSource("peft", "PeftModel", adapter_base_model=settings.base_model,
                             base_class_name=model_class, processor_class=processor_class)
    else:
        source = ModelSource("transformers", model_class, processor_class=processor_class)
    name = report.model_name or "model"
    card = render_model_card(report, model_name=name, info=info, source=source, results=results,
                             repo_id=f"{HUB_OWNER_PLACEHOLDER}/{name}")
    return write_model_card(settings.output_dir, card)


def _result(name: str, dataset_id: str, task: str, metrics: dict[str, float], split: str) -> Any:
    """The model-index result of one set: the new model's exact match or accuracy (``None`` for a loss: the Hub
    has no per-token-loss metric type)."""
    from huggingface_hub import EvalResult

    if "new exact match" in metrics:
        metric, value, words = "exact_match", metrics["new exact match"], f"Exact match ({name}, teacher-forced)"
    elif "new accuracy" in metrics:
        metric, value, words = "accuracy", metrics["new accuracy"], f"Accuracy ({name})"
    else:
        return None
    return EvalResult(task_type=task, dataset_type=dataset_id, dataset_name=name, dataset_split=split,
                      metric_type=metric, metric_name=words, metric_value=value, verified=False)


__all__ = ["HUB_TASKS", "MODEL_CLASSES", "build_report", "write_card"]
