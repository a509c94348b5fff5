"""Per-example losses of Hugging Face models, and a padding collator for their batches.

A per-sample loss is ``loss(model, batch) -> tensor of shape (rows,)``: one value per row
of the batch, with grad. It is the L_k of a non-forgetting constraint
h_k(w) = L_k(w, D_k) - L_k(w_old, D_k) (the paper's section 5.2 problem; see
:mod:`hf_constrained.non_forgetting`), and it must not depend on the other rows of the
batch, so that the old model's value of a row can be computed once and looked up later.

* :func:`causal_lm_per_example_loss`: the mean next-token cross-entropy over each
  example's label tokens (``labels`` with ``-100`` on prompt and padding positions);
* :func:`sequence_classification_per_example_loss`: each row's cross-entropy (or squared
  error for a single-output regression head);
* :class:`PaddingCollator`: pads tokenised rows (``input_ids``, ``attention_mask``,
  ``labels`` with ``-100``) on the right and stacks numeric per-row fields such as
  ``reference_loss``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from torch import nn

from .batches import collate_examples

IGNORE_INDEX = -100
"""Label of positions that carry no loss (prompt tokens, padding), as in transformers."""

MODEL_INPUT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")
"""Batch keys passed to the model by the per-example losses (labels and per-row fields are not)."""

_PAD_VALUES = {"attention_mask": 0, "token_type_ids": 0, "labels": IGNORE_INDEX, "position_ids": 0}


def model_inputs(batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The model's inputs in ``batch`` (``input_ids``, ``attention_mask``, ...); never ``labels``,
    so the forward pass returns logits without reducing a loss over the whole batch."""
    if "input_ids" not in batch:
        raise KeyError(f"a per-example loss needs 'input_ids' in the batch; it has {sorted(batch)}")
    return {k: batch[k] for k in MODEL_INPUT_KEYS if k in batch and batch[k] is not None}


def causal_lm_labels(batch: Mapping[str, Any]) -> torch.Tensor:
    """``batch["labels"]``, or ``input_ids`` with padding (``attention_mask == 0``) set to -100."""
    if "labels" in batch and batch["labels"] is not None:
        return batch["labels"]
    labels = batch["input_ids"].clone()
    if "attention_mask" in batch and batch["attention_mask"] is not None:
        labels[batch["attention_mask"] == 0] = IGNORE_INDEX
    return labels


def causal_lm_per_example_loss(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """Mean next-token cross-entropy over each example's label tokens, shape (rows,).

    Token t+1 is predicted from tokens <= t (the shift the transformers causal-LM loss
    does); positions whose label is -100 (prompt, padding) carry no loss. Padding on the
    right does not change a row's value: under the causal mask the real tokens never
    attend to the padding after them. Unlike the model's own loss (a mean over all label
    tokens of the batch), every row gets its own mean, so the value of a row does not
    depend on which rows share its batch.

    Raises ``ValueError`` when a row has no label token (nothing to measure).
    """
    return causal_lm_losses_from_logits(model(**model_inputs(batch)).logits, causal_lm_labels(batch))


def causal_lm_losses_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """:func:`causal_lm_per_example_loss` from the logits of a forward pass already made, shape (rows,).
    ``logits`` may be wider than ``labels`` (rows padded further on the right): the extra positions are
    ignored."""
    logits = logits[:, : labels.shape[1]]
    shift_labels = labels[:, 1:].to(logits.device)
    scored = shift_labels != IGNORE_INDEX
    counts = scored.sum(dim=1)
    if bool((counts == 0).any()):
        rows = torch.nonzero(counts == 0).flatten().tolist()
        raise ValueError(f"rows {rows} of the batch have no label token (all labels -100 after the first "
                         "position): a per-example loss needs at least one token to predict")
    # only the scored positions go to float32: (tokens, vocab), not (rows, length, vocab)
    token_loss = nn.functional.cross_entropy(logits[:, :-1, :][scored].float(), shift_labels[scored], reduction="none")
    row_of_token = torch.nonzero(scored)[:, 0]
    totals = torch.zeros(labels.shape[0], dtype=token_loss.dtype, device=token_loss.device)
    return totals.index_add(0, row_of_token, token_loss) / counts.to(token_loss.dtype)


def sequence_classification_per_example_loss(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """Each row's classification loss, shape (rows,): cross-entropy over the classes for
    integer labels, squared error for a single-output head with float labels (regression).

    Labels come from ``batch["labels"]`` (or ``batch["label"]``).
    """
    key = "labels" if "labels" in batch else "label" if "label" in batch else None
    if key is None:
        raise KeyError(f"a classification loss needs 'labels' (or 'label') in the batch; it has {sorted(batch)}")
    logits = model(**model_inputs(batch)).logits.float()
    labels = torch.as_tensor(batch[key]).to(logits.device)
    if logits.shape[-1] == 1 and labels.is_floating_point():
        return (logits.squeeze(-1) - labels.float()) ** 2
    labels = labels.long().reshape(-1)
    bad = labels[(labels < 0) | (labels >= logits.shape[-1])]
    if bad.numel():
        raise ValueError(f"label {int(bad[0])} outside the model's {logits.shape[-1]} classes")
    return nn.functional.cross_entropy(logits, labels, reduction="none")


@torch.no_grad()
def causal_lm_per_example_correct(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """1.0 where every label token of the row is the model's argmax next-token prediction
    (teacher-forced exact match of the answer), else 0.0; shape (rows,). The 0/1 statistic a
    non-forgetting certificate bounds (:class:`~hf_constrained.non_forgetting.ForgottenRows`)."""
    return causal_lm_correct_from_logits(model(**model_inputs(batch)).logits, causal_lm_labels(batch))


@torch.no_grad()
def causal_lm_correct_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """:func:`causal_lm_per_example_correct` from the logits of a forward pass already made (possibly wider
    than ``labels``), shape (rows,): a proxy indicator reads it from the constraint rows' own forward."""
    logits = logits[:, : labels.shape[1]]
    shift_labels = labels[:, 1:].to(logits.device)
    scored = shift_labels != IGNORE_INDEX
    hit = (logits[:, :-1, :].argmax(-1) == shift_labels) | ~scored
    return hit.all(dim=1).double()


@torch.no_grad()
def sequence_classification_per_example_correct(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """1.0 where the argmax class is the row's label, else 0.0; shape (rows,)."""
    key = "labels" if "labels" in batch else "label" if "label" in batch else None
    if key is None:
        raise KeyError(f"a classification statistic needs 'labels' (or 'label') in the batch; it has {sorted(batch)}")
    logits = model(**model_inputs(batch)).logits
    labels = torch.as_tensor(batch[key]).to(logits.device).long().reshape(-1)
    return (logits.argmax(-1) == labels).double()


class PaddingCollator:
    """Pad tokenised rows on the right into one batch.

    Sequence fields (``input_ids``, ``attention_mask``, ``token_type_ids``, ``position_ids``
    and sequence ``labels``) are padded to the longest row (or a multiple of
    ``pad_to_multiple_of``): ``input_ids`` with the pad token, ``labels`` with -100 (no loss),
    the others with 0; ``attention_mask`` is created when the rows have none. Every other
    field goes through :func:`~hf_constrained.constraint.collate_examples` (numbers such as
    ``reference_loss`` or a class ``label`` become tensors, strings stay lists).

    Args:
        tokenizer: gives ``pad_token_id`` (or pass ``pad_token_id``); a tokenizer without a
            pad token pads with its EOS token (padding positions are masked either way).
        pad_to_multiple_of: optional length multiple (tensor-core friendly shapes).
    """

    def __init__(self, tokenizer: Any = None, *, pad_token_id: Optional[int] = None,
                 pad_to_multiple_of: Optional[int] = None) -> None:
        if pad_token_id is None and tokenizer is not None:
            pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_token_id is None:
            raise ValueError("PaddingCollator needs a pad token id: pass a tokenizer with a pad or EOS token, "
                             "or pad_token_id=...")
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of

    def _is_sequence_field(self, key: str, values: Sequence[Any]) -> bool:
        if key not in ("input_ids", "attention_mask", "token_type_ids", "position_ids", "labels"):
            return False
        first = values[0]
        return isinstance(first, (list, tuple)) or (isinstance(first, torch.Tensor) and first.dim() == 1)

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not examples:
            raise ValueError("PaddingCollator got no rows")
        if "input_ids" not in examples[0]:
            raise KeyError(
                f"PaddingCollator needs tokenised rows with 'input_ids'; the rows have {sorted(examples[0])}")
        lengths = [len(ex["input_ids"]) for ex in examples]
        width = max(lengths)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch: dict[str, Any] = {}
        for key in examples[0]:
            missing = [i for i, ex in enumerate(examples) if key not in ex]
            if missing:
                raise KeyError(f"rows {missing} have no {key!r} field while row 0 has one: rows of one batch need "
                               "the same fields")
            values = [ex[key] for ex in examples]
            if not self._is_sequence_field(key, values):
                batch[key] = collate_examples(values)
                continue
            pad = self.pad_token_id if key == "input_ids" else _PAD_VALUES[key]
            out = torch.full((len(values), width), pad, dtype=torch.long)
            for i, v in enumerate(values):
                v = torch.as_tensor(v, dtype=torch.long)
                if v.numel() != lengths[i]:
                    raise ValueError(f"row {i}: {key!r} has {v.numel()} entries for {lengths[i]} input_ids")
                out[i, : v.numel()] = v
            batch[key] = out
        if "attention_mask" not in batch:
            batch["attention_mask"] = (torch.arange(width)[None, :] < torch.as_tensor(lengths)[:, None]).long()
        return batch
