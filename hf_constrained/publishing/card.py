"""Model cards for constrained fine-tunes, built with ``huggingface_hub`` (``ModelCardData``,
``EvalResult``, ``ModelCard.from_template``).

The template is ``model_cards/constrained_model_card.md`` in the repository (the one
source; a wheel carries a build-time copy as ``hf_constrained/model_cards/``, see
``setup.py``). The card holds:

- metadata the Hub reads: ``library_name`` (``peft`` for adapters, with their
  ``base_model``; ``transformers`` otherwise), ``base_model``, license, language,
  datasets, tags and a ``model-index`` as the Hub's spec defines it (:func:`eval_results`):
  per constraint its held-out value (metric type ``constraint_value``) and its certified
  upper bound (``certified_upper_bound`` on the ``certification`` split, with delta, n and
  tolerance as metric arguments), then the held-out objective metrics;
- the verdict (UNSAFE on the first line when a constraint fails), the constraint table of
  the :class:`~hf_constrained.publishing.report.SafetyReport`, the objective metrics, the
  checkpoint selection, a usage snippet that loads the model (naming the module to import
  for an architecture that is not in ``transformers``), the method and its settings, how
  to reproduce, framework versions, and the paper (Yang et al., TMLR 2026) with its link.

Only relative paths appear: local base-model and checkpoint paths are shown by their names.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata, resources
from pathlib import Path
from typing import Any, Optional

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ..atomic_files import atomic_write_text
from ..certification.selection import FeasibleSelection
from ..publishable import redact_secrets
from ..recipe_registry import RECIPES
from ..redact import redact_command
from .report import SafetyReport
from .tables import format_number, format_rows

logger = logging.getLogger(__name__)

TEMPLATE_NAME = "constrained_model_card.md"

PAPER_TITLE = "Single-loop Algorithms for Stochastic Non-Convex Optimization with Weakly-Convex Constraints"
PAPER_URL = "https://openreview.net/forum?id=aCgOR2KvAI"
CITATION = f"""@article{{yang2026singleloop,
  title   = {{{PAPER_TITLE}}},
  author  = {{Yang, Ming and Li, Gang and Hu, Quanqi and Lin, Qihang and Yang, Tianbao}},
  journal = {{Transactions on Machine Learning Research}},
  year    = {{2026}},
  url     = {{{PAPER_URL}}}
}}"""

# the Hub's task ids (pipeline tags) a model-index may name; another task gives no model-index
HUB_TASKS = frozenset({
    "audio-classification", "automatic-speech-recognition", "feature-extraction", "fill-mask", "image-classification",
    "image-segmentation", "image-text-to-text", "image-to-text", "object-detection", "question-answering",
    "sentence-similarity", "summarization", "tabular-classification", "tabular-regression", "text-classification",
    "text-generation", "text2text-generation", "token-classification", "translation", "zero-shot-classification",
    "zero-shot-image-classification"})
# the Hub's metric ids (the evaluate library's) a model-index may carry; other metrics stay in the card's text
HUB_METRICS = frozenset({"accuracy", "bleu", "cer", "exact_match", "f1", "mae", "matthews_correlation", "mse",
                         "pearsonr", "perplexity", "precision", "recall", "roc_auc", "rouge", "spearmanr", "wer"})
HUB_METRIC_ALIASES = {"auc": "roc_auc", "auroc": "roc_auc", "acc": "accuracy"}

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_VERSIONED = ("hf_constrained", "transformers", "torch", "huggingface_hub", "datasets", "accelerate")


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


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else [str(v) for v in value]


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
        task: the Hub task id (e.g. ``"text-generation"``): the card's ``pipeline_tag`` and the
            task of the model-index results.
        eval_dataset: the identifier of the data the constraints and objective were evaluated
            on, the model-index ``dataset.type``: a Hub dataset id or a short name of the data
            (``"digits"``, ``"adult"``); default: the first of ``datasets``. Only a Hub id of
            ``datasets`` reaches the model-index (:func:`eval_dataset_id`).
        population: who the certified statistics are about (the population the certification
            rows were drawn from, e.g. "the scikit-learn digits images of digits 0-7"); the card names it.
    """

    base_model: Optional[str] = None
    dataset_description: Optional[str] = None
    datasets: list[str] = field(default_factory=list)
    reproduce_command: Optional[str] = None
    license: Optional[str] = None
    language: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    task: Optional[str] = None
    eval_dataset: Optional[str] = None
    population: Optional[str] = None

    def with_trainer_card_arguments(self, *, language: Optional[str] = None, license: Optional[str] = None,
                                    tags: Any = None, finetuned_from: Optional[str] = None, tasks: Any = None,
                                    dataset_tags: Any = None, dataset: Any = None) -> "ModelCardInfo":
        """A copy with the arguments of ``Trainer.create_model_card`` / ``push_to_hub`` applied
        (those given win): ``finetuned_from`` is the base model, ``dataset`` / ``dataset_tags``
        the datasets, ``tasks`` the task of the results."""
        changes: dict[str, Any] = {}
        if language is not None:
            changes["language"] = language
        if license is not None:
            changes["license"] = license
        if finetuned_from is not None:
            changes["base_model"] = finetuned_from
        datasets = _as_list(dataset_tags) + _as_list(dataset)
        if datasets:
            changes["datasets"] = list(dict.fromkeys(datasets))
        if tasks is not None:
            changes["task"] = _as_list(tasks)[0]
        if tags is not None:
            changes["tags"] = list(dict.fromkeys(self.tags + _as_list(tags)))
        return dataclasses.replace(self, **changes)


@dataclass
class ModelSource:
    """How the saved model is loaded: its library, class, the module that defines a class
    ``transformers`` does not know, and, for an adapter, its base model."""

    library_name: Optional[str]
    class_name: str
    module: Optional[str] = None
    adapter_base_model: Optional[str] = None
    from_pretrained: bool = True
    base_class_name: Optional[str] = None
    no_argument_constructor: bool = False
    processor_class: Optional[str] = None  # the transformers Auto class that loads the saved processor/tokenizer

    @property
    def is_adapter(self) -> bool:
        return self.library_name == "peft"


def _custom_module(cls: type) -> Optional[str]:
    """The module to import for ``cls`` (``None`` for a ``transformers`` class); a class
    defined in the script that ran (``__main__``) is named by the script's file, and a shipped
    recipe run as a script (``python recipes/x.py``) by its installed module, which imports
    after ``pip install`` too."""
    module = cls.__module__
    if module == "__main__":
        script = getattr(sys.modules.get("__main__"), "__file__", None)
        if not script:
            return module
        name = os.path.splitext(os.path.basename(script))[0]
        recipe = next((r for r in RECIPES if r.module == name), None)
        return recipe.module_name if recipe is not None else name
    return None if module.split(".")[0] == "transformers" else module


def _no_argument_constructor(cls: type) -> bool:
    """Whether ``cls()`` builds the model: its constructor needs no argument."""
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in parameters)


# the Auto class that loads a processing class, by the base classes transformers gives it (no import needed)
_PROCESSOR_LOADERS = (("ProcessorMixin", "AutoProcessor"), ("PreTrainedTokenizerBase", "AutoTokenizer"),
                      ("BaseImageProcessor", "AutoImageProcessor"), ("ImageProcessingMixin", "AutoImageProcessor"),
                      ("FeatureExtractionMixin", "AutoFeatureExtractor"))
# the same from the files a save_pretrained wrote (first match wins)
_PROCESSOR_FILES = (("processor_config.json", "AutoProcessor"), ("tokenizer_config.json", "AutoTokenizer"),
                    ("preprocessor_config.json", "AutoImageProcessor"))


def processor_loader(processing_class: Any = None, folder: Optional[str] = None) -> Optional[str]:
    """The ``transformers`` Auto class that loads the run's processor or tokenizer: from the
    trainer's ``processing_class`` (by its base classes), else from the files saved in ``folder``
    (a tokenizer and an image processor saved side by side are a processor); ``None`` when none."""
    if processing_class is not None:
        bases = {cls.__name__ for cls in type(processing_class).__mro__}
        for base, loader in _PROCESSOR_LOADERS:
            if base in bases:
                return loader
    if folder and os.path.isdir(folder):
        names = set(os.listdir(folder))
        if "tokenizer_config.json" in names and "preprocessor_config.json" in names:
            return "AutoProcessor"
        for name, loader in _PROCESSOR_FILES:
            if name in names:
                return loader
    return None


def describe_model(model: Any, processing_class: Any = None, folder: Optional[str] = None) -> ModelSource:
    """:class:`ModelSource` of a model, by duck typing (no import of peft or transformers):
    a ``peft`` model has ``peft_config`` (its adapters) and ``get_base_model()``; the processor or
    tokenizer is found from ``processing_class`` or the files in ``folder`` (:func:`processor_loader`)."""
    processor = processor_loader(processing_class, folder)
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, Mapping) and peft_config:
        config = next(iter(peft_config.values()))
        base = model.get_base_model() if hasattr(model, "get_base_model") else None
        return ModelSource("peft", "PeftModel", None if base is None else _custom_module(type(base)),
                           getattr(config, "base_model_name_or_path", None),
                           base_class_name=None if base is None else type(base).__name__, processor_class=processor)
    cls = type(model)
    if not hasattr(cls, "from_pretrained"):
        return ModelSource(None, cls.__name__, _custom_module(cls) or cls.__module__, from_pretrained=False,
                           no_argument_constructor=_no_argument_constructor(cls), processor_class=processor)
    return ModelSource("transformers", cls.__name__, _custom_module(cls), processor_class=processor)


def usage_snippet(source: ModelSource, repo_id: str) -> str:
    """Python that loads the published model, and its processor or tokenizer when the run saved
    one; ``repo_id`` is named once, on the first line after the imports."""
    imports, lines = [], [f'repo_id = "{repo_id}"  # the Hub repository', ""]
    if source.is_adapter:
        # PeftModel.from_pretrained picks the PEFT class of the adapter's task type (AutoPeftModel
        # refuses a task type, e.g. a causal-LM adapter, and base models AutoModel does not map)
        base_class = source.base_class_name or "AutoModel"
        where = source.module or "transformers"
        comment = "  # the base model's architecture" if source.module else ""
        imports += ["from peft import PeftConfig, PeftModel", f"from {where} import {base_class}{comment}"]
        lines += ["config = PeftConfig.from_pretrained(repo_id)",
                  f"base = {base_class}.from_pretrained(config.base_model_name_or_path)",
                  "model = PeftModel.from_pretrained(base, repo_id)  # the base model, with the adapters"]
    elif not source.from_pretrained:
        build = (f"model = {source.class_name}()" if source.no_argument_constructor
                 else f"model = {source.class_name}(...)  # the constructor arguments used for training")
        imports += ["from huggingface_hub import hf_hub_download", "from safetensors.torch import load_model",
                    f"from {source.module} import {source.class_name}"]
        lines += [build, 'load_model(model, hf_hub_download(repo_id, "model.safetensors"))']
    else:
        where = source.module or "transformers"
        comment = "  # the architecture is defined there, not in transformers" if source.module else ""
        imports += [f"from {where} import {source.class_name}{comment}"]
        lines += [f"model = {source.class_name}.from_pretrained(repo_id)"]
    if source.processor_class:
        # named for what it is: `processor = AutoTokenizer...` read as if an image processor were loaded
        name = "tokenizer" if "Tokenizer" in source.processor_class else "processor"
        imports.append(f"from transformers import {source.processor_class}")
        lines.append(f"{name} = {source.processor_class}.from_pretrained(repo_id)  # what the inputs go through")
    return "\n".join(imports + [""] + lines)


def framework_versions(with_peft: bool = False) -> dict[str, str]:
    """Installed versions of the libraries the model was trained with."""
    out = {}
    for name in _VERSIONED + (("peft",) if with_peft else ()):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def _display_name(path_or_id: Optional[str]) -> Optional[str]:
    """A Hub id as is; a local path by its last component (cards carry no local paths)."""
    if not path_or_id:
        return None
    if os.path.isabs(path_or_id) or os.path.exists(path_or_id) or not _HUB_ID.match(path_or_id):
        return os.path.basename(os.path.normpath(path_or_id))
    return path_or_id


def _hub_id(path_or_id: Optional[str]) -> Optional[str]:
    if path_or_id and _HUB_ID.match(path_or_id) and not os.path.exists(path_or_id):
        return path_or_id
    return None


def metric_id(text: str) -> str:
    """A model-index ``metric.type``: lower_snake_case (``"eval_accuracy"`` -> ``"accuracy"``,
    ``"AUC (test)"`` -> ``"auc_test"``), as the Hub's metric ids are spelled."""
    text = re.sub(r"^eval_", "", text)
    slug = re.sub(r"[^0-9a-z]+", "_", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", text).lower()).strip("_")
    return slug or "metric"


_SPLIT_PREFIXES = {"eval": "validation", "validation": "validation", "val": "validation", "test": "test",
                   "train": "train"}


def _objective_split(key: str) -> tuple[str, str]:
    """An objective metric's split and name: ``"test_auc"`` -> ``("test", "auc")``, ``"eval_loss"``
    -> ``("validation", "loss")``; a key without a split prefix is a held-out (``validation``) metric."""
    prefix, _, rest = key.partition("_")
    if rest and prefix.lower() in _SPLIT_PREFIXES:
        return _SPLIT_PREFIXES[prefix.lower()], rest
    return "validation", key


def _readable(key: str) -> str:
    """``"eval_accuracy"`` -> ``"Accuracy"``: a metric's display name (``metric.name``)."""
    words = re.sub(r"^eval_", "", key).replace("_", " ").strip()
    return words[:1].upper() + words[1:] if words else key


def eval_dataset_id(info: ModelCardInfo) -> Optional[str]:
    """The model-index ``dataset.type``: a Hub dataset id the caller declared (``info.datasets``):
    ``info.eval_dataset`` when it is one of them, else the first of them; ``None`` (no
    model-index) when no Hub dataset is named: a short name such as ``"digits"`` is no Hub id."""
    if not info.datasets:
        return None
    name = info.eval_dataset if info.eval_dataset in info.datasets else info.datasets[0]
    return _hub_id(name)


def hub_metric_type(key: str) -> Optional[str]:
    """The Hub metric id of an objective metric (``eval_accuracy`` -> ``accuracy``, ``test_auc`` ->
    ``roc_auc``), ``None`` for a metric the Hub does not know (a loss, a per-class score)."""
    _, metric = _objective_split(key)
    slug = metric_id(metric)
    slug = HUB_METRIC_ALIASES.get(slug, slug)
    return slug if slug in HUB_METRICS else None


def eval_results(report: SafetyReport, *, model_name: str, info: ModelCardInfo) -> list[EvalResult]:
    """The ``model-index`` results, with real types only: a Hub task (:data:`HUB_TASKS`, from
    ``info.task``), a Hub dataset (:func:`eval_dataset_id`) and, per objective metric the Hub
    knows (:func:`hub_metric_type`), its value on the split its key names (``eval_accuracy`` ->
    ``accuracy`` on ``validation``, ``test_auc`` -> ``roc_auc`` on ``test``). Empty (the card
    then has no model-index) when the task or the dataset is not named: invented types would
    fill the Hub's results panel with noise. Constraint values and certified bounds are in the
    card's tables and ``safety_report.json``, not here (the Hub has no metric type for them).
    Every result has ``verified: false`` (the Hub did not compute it)."""
    dataset_id = eval_dataset_id(info)
    if info.task not in HUB_TASKS or dataset_id is None:
        return []
    results = []
    for key, value in report.objective_metrics.items():
        metric_type = hub_metric_type(key)
        if metric_type is None:
            continue
        split, metric = _objective_split(key)
        results.append(EvalResult(task_type=info.task, dataset_type=dataset_id, dataset_name=dataset_id,
                                  dataset_split=split, metric_type=metric_type,
                                  metric_name=f"{_readable(metric)} ({split})", metric_value=value, verified=False))
    return results


def card_status(report: Optional[SafetyReport]) -> str:
    """``certified`` (the certificate holds), ``passes`` (an uncertified rule passes: NOT
    CERTIFIED), ``not_certified`` (the default rule fails), ``unsafe`` (an uncertified rule
    fails) or ``unchecked`` (no held-out evaluation of these weights)."""
    if report is None or not report.checked:
        return "unchecked"
    if report.safety_rule == "certified":
        return "certified" if report.certified else "not_certified"
    return "passes" if report.all_satisfied else "unsafe"


def _card_data(report: Optional[SafetyReport], status: str, base_model: Optional[str], *, model_name: str,
               info: ModelCardInfo, source: ModelSource, extra_tags: Optional[Sequence[str]],
               results: Sequence[EvalResult]) -> ModelCardData:
    """The card's metadata (the YAML header the Hub reads): library, base model, tags with the status's own
    (``constraints-violated``, ``not-certified``, ``certified-constraints``) and the model-index results."""
    tags = ["hf_constrained", "constrained-fine-tuning"] + list(info.tags) + list(extra_tags or [])
    if status in ("unsafe", "not_certified"):
        tags.append("constraints-violated" if status == "unsafe" else "not-certified")
    elif status == "certified":
        tags.append("certified-constraints")
    return ModelCardData(
        library_name=source.library_name,
        base_model=_hub_id(base_model),
        datasets=info.datasets or None,
        license=info.license,
        language=info.language,
        pipeline_tag=info.task,
        tags=list(dict.fromkeys(tags)),
        model_name=model_name,
        eval_results=(eval_results(report, model_name=model_name, info=info) + list(results) or None)
        if report is not None and report.checked else None,
    )


def _selection_message(selection: Optional[Mapping[str, Any]]) -> Optional[str]:
    """How the weights were selected, in words, from the report's ``selection`` (entries that
    :class:`FeasibleSelection` does not declare are left out)."""
    if not selection:
        return None
    known = {k: v for k, v in selection.items() if k in FeasibleSelection.__dataclass_fields__}
    return FeasibleSelection(**known).message()


def render_model_card(
    report: Optional[SafetyReport],
    *,
    model_name: str,
    method: Optional[dict[str, Any]] = None,
    info: Optional[ModelCardInfo] = None,
    allow_unsafe: bool = False,
    extra_tags: Optional[Sequence[str]] = None,
    source: Optional[ModelSource] = None,
    repo_id: Optional[str] = None,
    versions: Optional[Mapping[str, str]] = None,
    results: Sequence[EvalResult] = (),
) -> ModelCard:
    """Render the card for ``report`` (``None``: weights not checked on held-out data).

    Args:
        source: how the model loads (:func:`describe_model`); default: a ``transformers`` model.
        repo_id: the Hub repository for the usage snippet (default: ``model_name``).
        versions: framework versions (default: :func:`framework_versions`).
        results: further model-index results, with real types (e.g. ``hf-constrained certify``'s exact match
            per protected set drawn from a Hub dataset), after those of :func:`eval_results`.

    Numbers are printed with :func:`~hf_constrained.publishing.report.format_number`, the same
    formatting as ``hf-constrained report``.
    """
    info = info or ModelCardInfo()
    source = source or ModelSource("transformers", "AutoModel")
    method = dict(method if method is not None else (report.method if report is not None else {}))
    method.setdefault("method", "single-loop hinge exact penalty with MSVR constraint estimators (Algorithm 1)")
    method.setdefault("num_constraints", len(report.constraints) if report is not None else "unknown")
    status = card_status(report)
    base_model = source.adapter_base_model if source.is_adapter and source.adapter_base_model else info.base_model
    card_data = _card_data(report, status, base_model, model_name=model_name, info=info, source=source,
                           extra_tags=extra_tags, results=results)
    selection = report.selection if report is not None else None
    checkpoint = (None if report is None or not report.checkpoint
                  else os.path.basename(os.path.normpath(report.checkpoint)))
    return ModelCard.from_template(
        card_data,
        template_path=template_path(),
        status=status,
        report=report,
        summary=report.summary() if report is not None else "",
        headline=report.headline() if report is not None else "Not checked: no safety report for these weights",
        failed=report.failed if report is not None else [],
        allow_unsafe=allow_unsafe,
        model_name=model_name,
        base_model=_display_name(base_model),
        source=source,
        usage=usage_snippet(source, repo_id or model_name),
        versions=dict(versions if versions is not None else framework_versions(source.is_adapter)),
        constraint_table=report.format_table(markdown=True) if report is not None else "",
        diagnostics_table=_diagnostics_table(report),
        objective_metrics=report.objective_metrics if report is not None else {},
        selection=selection,
        selection_message=_selection_message(selection),
        checkpoint_name=checkpoint,
        method=method,
        dataset_description=info.dataset_description,
        population=info.population,
        reproduce_command=redact_command(info.reproduce_command),  # set by a caller: no secret, no local path
        citation=CITATION,
        paper_title=PAPER_TITLE,
        paper_url=PAPER_URL,
        fmt=format_number,
    )


def _diagnostics_table(report: Optional[SafetyReport]) -> str:
    """The diagnostics table in Markdown (no caption: the template gives it its section)."""
    rows = report.diagnostic_rows() if report is not None else []
    return format_rows(rows, markdown=True) if rows else ""


def write_model_card(directory: str, card: ModelCard) -> str:
    """Write ``README.md`` into ``directory`` through a temporary file; returns the path.

    A string shaped like a Hugging Face token is never written: it is replaced by
    ``<redacted>`` (with a warning), wherever it came from (a reproduce command, a description)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "README.md")
    text = str(card)
    safe_text = redact_secrets(text)
    if safe_text != text:
        logger.warning("the model card for %s contained a Hugging Face token: it was replaced by <redacted>", directory)
    return atomic_write_text(path, safe_text)


__all__ = ["CITATION", "HUB_METRICS", "HUB_TASKS", "ModelCardInfo", "ModelSource", "PAPER_TITLE", "PAPER_URL",
           "TEMPLATE_NAME", "card_status", "describe_model", "eval_dataset_id", "eval_results", "framework_versions",
           "hub_metric_type", "metric_id", "processor_loader", "render_model_card", "template_path", "usage_snippet",
           "write_model_card"]
