"""Scoring classifier and CLIP rows for ``hf-constrained certify``: each row right or wrong under both models.

A row is right when the model's argmax class is the row's label:

- text classifiers (``AutoModelForSequenceClassification``): the rows' ``text`` tokenised by the model's tokenizer
  (its own folder's, else the base's; the two must give every row the same tokens), never cut, padded on the
  right (:class:`~hf_constrained.per_sample_loss.PaddingCollator`), scored by
  :func:`~hf_constrained.per_sample_loss.sequence_classification_per_example_correct`;
- image classifiers (``AutoModelForImageClassification``): the images through the image processor
  (:class:`~hf_constrained.clip.data.CLIPCollator`, which any image processor serves), argmax of the logits;
- CLIP (``CLIPModel``): the zero-shot head of the library's CLIP constraints
  (:class:`~hf_constrained.clip.non_forgetting.ZeroShotLoss`): the argmax over the cosine similarities of the image
  with each class prompt (``--prompt_template`` filled with each of ``--class_names``), the prompts tokenised by the
  base's tokenizer (the model's own must give the same tokens).

For a PEFT adapter one copy of the base serves both models (the adapter disabled gives the base's answers). Rows
are scored in batches on the model's device, in the weights' dtype, with a progress bar and the resumable cache of
:mod:`~hf_constrained.safety.certify_rows`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from ..per_sample_loss import PaddingCollator, sequence_classification_per_example_correct
from .certify_rows import TOKENIZER_FILES, RowCache, cache_key, paired_per_row

PREPROCESSOR_CONFIG = "preprocessor_config.json"
_PROCESSOR_NAME_KEYS = ("processor_class", "_processor_class", "image_processor_type")


@dataclass
class Scorer:
    """What scores one task's rows: the two models (``base`` ``None``: an adapter, disabled for the base), each
    set's rows as the collator takes them, the collator, the score of a batch (one per model) and what the cache
    key adds."""

    model: Any
    base: Optional[Any]
    items: dict[str, list[dict[str, Any]]]
    collate: Callable[[list], Any]
    score: Callable[[Any, dict[str, Any]], torch.Tensor]
    key: tuple[Any, ...]


def _dtype(name: str) -> Any:
    return "auto" if name == "auto" else getattr(torch, name)


def _device(name: str) -> str:
    if name != "auto":
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_pair(plan: Any, auto_class: Any) -> tuple[Any, Optional[Any]]:
    """(the fine-tuned model, the base) of ``auto_class`` on the device in the weights' dtype; for an adapter
    (the model, ``None``): the adapter on the one copy of the base."""
    settings = plan.settings
    device, dtype = _device(settings.device), _dtype(settings.dtype)
    base = auto_class.from_pretrained(settings.base_model, dtype=dtype).to(device)
    if plan.adapter:
        from peft import PeftModel

        return PeftModel.from_pretrained(base, plan.model_dir).to(device), None
    return auto_class.from_pretrained(plan.model_dir, dtype=dtype).to(device), base


def _own(plan: Any, *files: str) -> bool:
    return any(os.path.isfile(os.path.join(plan.model_dir, f)) for f in files)


def _image_processor(plan: Any) -> Any:
    """The image processor (the model folder's own when it has one, else the base's); a ``ValueError`` when the
    two differ in any setting (the models would not see the same pixels)."""
    from transformers import AutoImageProcessor

    base = AutoImageProcessor.from_pretrained(plan.settings.base_model)
    if not _own(plan, PREPROCESSOR_CONFIG):
        return base
    own = AutoImageProcessor.from_pretrained(plan.model_dir)
    mine, theirs = (({k: v for k, v in p.to_dict().items() if k not in _PROCESSOR_NAME_KEYS}) for p in (own, base))
    differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    if differ:
        raise ValueError(f"the image processors of --model and --base_model differ in {differ}: the two models would "
                         "not see the same pixels; certify against the base whose processor the model was trained with")
    return own


def _tokenizers(plan: Any) -> tuple[Any, Any]:
    from transformers import AutoTokenizer

    base = AutoTokenizer.from_pretrained(plan.settings.base_model)
    own = AutoTokenizer.from_pretrained(plan.model_dir) if _own(plan, *TOKENIZER_FILES) else base
    for tok in {id(base): base, id(own): own}.values():
        if tok.pad_token is None and tok.eos_token is not None:
            tok.pad_token = tok.eos_token  # padding is masked out of every score
    return own, base


def _text_items(plan: Any, tokenizer: Any, base_tokenizer: Any) -> dict[str, list[dict[str, Any]]]:
    """Each set's rows tokenised (``input_ids``, ``attention_mask``, ``labels``); one-line errors for a row longer
    than ``--max_length`` and for tokenizers that give a row other tokens."""
    out = {}
    for name, s in plan.sets.items():
        items = []
        for i, row in enumerate(s.rows, start=1):
            enc = dict(tokenizer(row["text"]))
            if len(enc["input_ids"]) > plan.settings.max_length:
                raise ValueError(f"--protected_datasets {name}: row {i} has {len(enc['input_ids'])} tokens, more "
                                 f"than --max_length {plan.settings.max_length}; raise --max_length (rows are never "
                                 "cut)")
            if base_tokenizer is not tokenizer and list(base_tokenizer(row["text"])["input_ids"]) != enc["input_ids"]:
                raise ValueError(f"the tokenizers of --model and --base_model differ: they turn row {i} of {name} "
                                 "into different tokens; certify against the base whose tokenizer the model was "
                                 "trained with")
            items.append({**enc, "labels": int(row["label"])})
        out[name] = items
    return out


def text_classifier(plan: Any) -> Scorer:
    from transformers import AutoModelForSequenceClassification

    tokenizer, base_tokenizer = _tokenizers(plan)
    items = _text_items(plan, tokenizer, base_tokenizer)
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token: cannot pad a batch of rows")
    model, base = load_pair(plan, AutoModelForSequenceClassification)
    for m in (model, base):
        if m is not None and getattr(m.config, "pad_token_id", None) is None:
            m.config.pad_token_id = tokenizer.pad_token_id  # a decoder classifier finds each row's last token by it
    return Scorer(model, base, items, PaddingCollator(tokenizer), sequence_classification_per_example_correct,
                  ("sequence classification accuracy",))


def _pixels(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    return batch["pixel_values"].to(next(model.parameters()).dtype)


@torch.no_grad()
def _image_correct(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    logits = model(pixel_values=_pixels(model, batch)).logits
    return (logits.argmax(-1) == batch["label"].to(logits.device)).double()


def image_classifier(plan: Any) -> Scorer:
    from transformers import AutoModelForImageClassification

    from ..clip.data import CLIPCollator

    processor = _image_processor(plan)
    model, base = load_pair(plan, AutoModelForImageClassification)
    items = {name: list(s.rows) for name, s in plan.sets.items()}
    return Scorer(model, base, items, CLIPCollator(image_processor=processor), _image_correct,
                  ("image classification accuracy",))


def clip_zero_shot(plan: Any) -> Scorer:
    """CLIP's zero-shot head over ``plan.classes`` with ``--prompt_template`` (module docstring)."""
    from transformers import CLIPModel

    from ..clip.data import CLIPCollator
    from ..clip.non_forgetting import ZeroShotLoss

    processor = _image_processor(plan)
    tokenizer, base_tokenizer = _tokenizers(plan)
    prompts = [plan.settings.prompt_template.format(c) for c in plan.classes]
    encoded = base_tokenizer(prompts, padding=True, return_tensors="pt")
    if tokenizer is not base_tokenizer:
        own = tokenizer(prompts, padding=True, return_tensors="pt")
        if own["input_ids"].shape != encoded["input_ids"].shape or not torch.equal(own["input_ids"],
                                                                                    encoded["input_ids"]):
            raise ValueError("the tokenizers of --model and --base_model differ: they turn the class prompts into "
                             "different tokens; certify against the base whose tokenizer the model was trained with")
    head = ZeroShotLoss(encoded["input_ids"], encoded.get("attention_mask"))
    model, base = load_pair(plan, CLIPModel)

    @torch.no_grad()
    def correct(m: Any, batch: dict[str, Any]) -> torch.Tensor:
        return head.correct(m, {**batch, "pixel_values": _pixels(m, batch)}).double()

    items = {name: list(s.rows) for name, s in plan.sets.items()}
    return Scorer(model, base, items, CLIPCollator(image_processor=processor), correct,
                  ("clip zero-shot accuracy", tuple(prompts)))


SCORERS = {"sequence_classification": text_classifier, "image_classification": image_classifier,
           "clip": clip_zero_shot}


def score_labelled(plan: Any) -> tuple[dict[str, np.ndarray], dict[str, dict[str, float]]]:
    """Per set, the certified statistic's per-row values, and each model's accuracy (``base accuracy``, ``new
    accuracy``)."""
    settings = plan.settings
    scorer = SCORERS[plan.task](plan)
    values, metrics = {}, {}
    for name, s in plan.sets.items():
        common = (s.fingerprint, settings.dtype, *scorer.key)
        caches = (RowCache(settings.output_dir, name, "base", cache_key(plan.base_identity, *common)),
                  RowCache(settings.output_dir, name, "model",
                           cache_key(plan.model_fingerprint, plan.base_identity, *common)))
        old, new = paired_per_row(scorer.model, scorer.base, scorer.items[name], scorer.collate, scorer.score,
                                  caches, settings.batch_size, name)
        values[name] = old - new if s.claim.statistic == "points_lost" else old * (1.0 - new)
        metrics[name] = {"base accuracy": float(old.mean()), "new accuracy": float(new.mean())}
    return values, metrics


__all__ = ["SCORERS", "Scorer", "clip_zero_shot", "image_classifier", "load_pair", "score_labelled",
           "text_classifier"]
