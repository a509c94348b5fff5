"""Model cards for constrained fine-tunes, rendered with ``huggingface_hub.ModelCard``.

The template is ``model_cards/constrained_model_card.md`` in the repository (the one
source; a wheel carries a build-time copy as ``hf_constrained/model_cards/``, see
``setup.py``). The card holds the base model, the data, the method and its settings
(penalty, beta, gammas, sampling), the constraint table of the
:class:`~hf_constrained.safety.report.SafetyReport`, the held-out objective metrics, how to
reproduce the run and the paper's citation. When any constraint fails on held-out data
the card's first line says UNSAFE.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Optional

from huggingface_hub import ModelCard, ModelCardData

from .report import SafetyReport, format_number
from .selection import FeasibleSelection

TEMPLATE_NAME = "constrained_model_card.md"

CITATION = """@article{yang2026singleloop,
  title   = {Single-loop Algorithms for Stochastic Non-Convex Optimization with Weakly-Convex Constraints},
  author  = {Yang, Ming and Li, Gang and Hu, Quanqi and Lin, Qihang and Yang, Tianbao},
  journal = {Transactions on Machine Learning Research},
  year    = {2026},
  url     = {https://openreview.net/forum?id=aCgOR2KvAI}
}"""

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def template_path() -> str:
    """Where the card template is: inside the installed package (wheel), else the
    repository's ``model_cards/`` (editable install, source checkout)."""
    packaged = resources.files("hf_constrained").joinpath("model_cards", TEMPLATE_NAME)
    if packaged.is_file():
        return str(packaged)
    repo = Path(__file__).resolve().parents[2] / "model_cards" / TEMPLATE_NAME
    if repo.is_file():
        return str(repo)
    raise FileNotFoundError(
        f"model card template {TEMPLATE_NAME} not found in the package or in {repo.parent}; "
        "reinstall hf_constrained"
    )


@dataclass
class ModelCardInfo:
    """What the trainer cannot know by itself: where the model and data come from.

    Args:
        base_model: Hub id or path of the model that was fine-tuned (default: the
            model config's ``_name_or_path``).
        dataset_description: a sentence or two on training, constraint and held-out data.
        datasets: Hub dataset ids for the card metadata.
        reproduce_command: the command that reproduces the run.
        license, language, tags: card metadata.
    """

    base_model: Optional[str] = None
    dataset_description: Optional[str] = None
    datasets: list[str] = field(default_factory=list)
    reproduce_command: Optional[str] = None
    license: Optional[str] = None
    language: Optional[str] = None
    tags: list[str] = field(default_factory=list)


def card_status(report: Optional[SafetyReport]) -> str:
    """``safe``, ``unsafe`` or ``unchecked`` (no held-out evaluation of these weights)."""
    if report is None:
        return "unchecked"
    return "safe" if report.all_satisfied else "unsafe"


def render_model_card(
    report: Optional[SafetyReport],
    *,
    model_name: str,
    method: Optional[dict[str, Any]] = None,
    info: Optional[ModelCardInfo] = None,
    allow_unsafe: bool = False,
    extra_tags: Optional[list[str]] = None,
) -> ModelCard:
    """Render the card for ``report`` (``None``: weights not checked on held-out data).

    Numbers are printed with :func:`~hf_constrained.safety.report.format_number`, the same
    formatting as ``hf-constrained report``.
    """
    info = info or ModelCardInfo()
    method = dict(method if method is not None else (report.method if report is not None else {}))
    method.setdefault("method", "single-loop hinge exact penalty with MSVR constraint estimators (Algorithm 1)")
    method.setdefault("num_constraints", len(report.constraints) if report is not None else "unknown")
    status = card_status(report)
    tags = ["hf_constrained", "constrained-fine-tuning"] + list(info.tags) + list(extra_tags or [])
    if status == "unsafe":
        tags.append("constraints-violated")
    base_model = info.base_model
    card_data = ModelCardData(
        library_name="transformers",
        base_model=base_model if base_model and _HUB_ID.match(base_model) and not os.path.exists(base_model) else None,
        datasets=info.datasets or None,
        license=info.license,
        language=info.language,
        tags=list(dict.fromkeys(tags)),
        model_name=model_name,
    )
    selection = report.selection if report is not None else None
    selection_message = None
    if selection:
        known = {k: v for k, v in selection.items() if k in FeasibleSelection.__dataclass_fields__}
        selection_message = FeasibleSelection(**known).message()
    checkpoint = None if report is None or not report.checkpoint else os.path.basename(os.path.normpath(report.checkpoint))
    return ModelCard.from_template(
        card_data,
        template_path=template_path(),
        status=status,
        report=report,
        failed=report.failed if report is not None else [],
        allow_unsafe=allow_unsafe,
        model_name=model_name,
        base_model=base_model,
        constraint_table=report.format_table(markdown=True) if report is not None else "",
        objective_metrics=report.objective_metrics if report is not None else {},
        selection=selection,
        selection_message=selection_message,
        checkpoint_name=checkpoint,
        method=method,
        dataset_description=info.dataset_description,
        reproduce_command=info.reproduce_command,
        citation=CITATION,
        fmt=format_number,
    )


def write_model_card(directory: str, card: ModelCard) -> str:
    """Write ``README.md`` into ``directory`` through a temporary file; returns the path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "README.md")
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(str(card))
    os.replace(tmp, path)
    return path


__all__ = ["CITATION", "ModelCardInfo", "TEMPLATE_NAME", "card_status", "render_model_card", "template_path",
           "write_model_card"]
