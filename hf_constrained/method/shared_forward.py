"""The objective's forward pass shared with the constraint rows: one model call per step.

Algorithm 1 takes the objective's stochastic gradient G_1 (line 4) and the constraint part
G_2 = grad of ``(1/|B_c|) sum_k weight(u_k) h_k(w_t; B_k^t)`` (lines 6 and 9) at the same
parameters w_t. When the constraints' rows are token batches of a causal LM, as the objective's
rows are, both can come from ONE forward: the constraint rows are appended to the objective's
micro-batch (right-padded to one width), the objective's loss is the model's own ``loss_function`` on
the objective's slice of the logits (:class:`MergedForward`), and each constraint row's per-example
loss is read from its slice. One forward and one backward instead of two of
each: on a GPU a small step is bound by kernel launches more than by rows (docs/scale.md).

It changes no value, so it is used only where that holds:

* the row function declares that it can read its rows from logits (``values_from_logits``, e.g.
  :class:`~hf_constrained.non_forgetting.ReferenceGap` over
  :func:`~hf_constrained.per_sample_loss.causal_lm_per_example_loss`);
* the model has no active dropout or other training-mode noise (:func:`trains_as_it_evaluates`):
  constraint values are measured in eval mode
  (:func:`~hf_constrained.method.draw_values.measured_as_certified`), the objective in training mode,
  and the two agree only without dropout; nor a router whose auxiliary loss the model adds to its loss;
* the model holds a Hugging Face causal-LM module (:func:`causal_lm_head`, through DDP or PEFT wrappers)
  whose own ``loss_function`` :class:`MergedForward` applies to the objective's logits;
* the objective batch holds only ``input_ids``, ``attention_mask`` and ``labels``, as 2-D tensors.

Otherwise (and for the look-ahead, which runs at other parameters) the rows get their own forward. The
values agree with the separate forward up to floating-point reassociation in the batched kernels.
"""

from __future__ import annotations

import numbers
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..per_sample_loss import causal_lm_labels, causal_lm_losses_from_logits, model_inputs

SHAREABLE_KEYS = frozenset({"input_ids", "attention_mask", "labels"})
_NOISE_WORDS = ("dropout", "pdrop", "jitter", "noise")
# configuration entries read only by a sequence-summary or classification head (GPT-2's summary_first_dropout, the
# classifier_dropout of many configurations), which builds an nn.Dropout module of its own: the module check sees
# it where such a head exists, and a causal-LM model has none
_HEAD_ONLY_PREFIXES = ("summary_", "classifier_")


def trains_as_it_evaluates(model: nn.Module) -> bool:
    """True when training mode computes the same values as eval mode: no dropout module with p > 0 and
    no configuration entry of a dropout, drop probability or router noise above 0 (functional dropout in
    attention reads its probability from the configuration, not from a module)."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return False
        config = getattr(module, "config", None)
        if config is not None and (_config_has_noise(config) or getattr(config, "output_router_logits", False)):
            return False  # a router's auxiliary loss would be added to the model's loss on the objective's rows
    return True


def _config_has_noise(config: Any, depth: int = 0) -> bool:
    for key, value in vars(config).items():
        if hasattr(value, "to_dict") and depth < 2:  # nested configurations (text_config, vision_config)
            if _config_has_noise(value, depth + 1):
                return True
        elif (isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0
              and any(word in key for word in _NOISE_WORDS) and not key.startswith(_HEAD_ONLY_PREFIXES)):
            return True
    return False


class SharedObjectiveForward:
    """The objective's micro-batch, waiting to be run together with one row group's constraint rows.

    Args:
        inputs: the objective's micro-batch (the Trainer's inputs).
        objective: ``objective(model_like) -> (loss, outputs)``: the objective's loss on ``inputs``, computed
            by calling ``model_like(**inputs)`` as it would call the model (the Trainer's ``compute_loss``).

    :meth:`take` says whether a row group's rows can join: its ``row_fn`` names the merge that fits its rows
    (``row_fn.merged_forward(model, batch)``: :class:`MergedForward` for a causal LM's token rows, the CLIP
    package's merge for zero-shot image rows) and reads its values from it (``row_fn.values_from_merged``).
    :meth:`__call__` is then called in place of the group's ``row_fn(model, batch)``: it runs the objective
    through the merge, which makes ONE model call over the objective's and the group's rows. After the engine
    has run, :meth:`objective_result` is the objective's loss (and outputs), or ``None`` when no group joined.
    """

    def __init__(self, inputs: Mapping[str, Any], objective: Callable[[Any], Any]) -> None:
        self.inputs = inputs
        self.objective = objective
        self.loss: Optional[torch.Tensor] = None
        self.outputs: Any = None

    @classmethod
    def for_inputs(cls, inputs: Mapping[str, Any], objective: Callable[[Any], Any]
                   ) -> Optional["SharedObjectiveForward"]:
        """``None`` when the objective's batch has keys other than :data:`SHAREABLE_KEYS` or ragged shapes."""
        if not isinstance(inputs, Mapping) or "labels" not in inputs or not set(inputs) <= SHAREABLE_KEYS:
            return None
        tensors = list(inputs.values())
        if not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in tensors):
            return None
        if len({tuple(t.shape) for t in tensors}) != 1:
            return None
        return cls(inputs, objective)

    def take(self, row_fn: Any) -> bool:
        """Whether ``row_fn``'s rows join the objective's forward (the first group that can, only)."""
        return self.loss is None and getattr(row_fn, "merged_forward", None) is not None

    def __call__(self, model: nn.Module, row_fn: Any, batch: Mapping[str, Any]) -> torch.Tensor:
        merged = row_fn.merged_forward(model, batch)
        self.loss, self.outputs = self.objective(merged)
        return row_fn.values_from_merged(merged, batch)

    def objective_result(self, return_outputs: bool) -> Any:
        if self.loss is None:
            return None
        return (self.loss, self.outputs) if return_outputs else self.loss


class MergedForward:
    """Called as the model with the objective's inputs: ONE forward of the model over the objective's rows
    and ``rows`` (:func:`merge_right_padded`, no labels, so the model reduces no loss), then the causal-LM
    model's own ``loss_function`` on the objective's logits and labels (with ``num_items_in_batch`` when the
    caller passes it), as the model's forward computes its loss. The constraint rows' logits are kept in
    :attr:`row_logits`. Neither the model's loss nor its float32 upcast ever covers the constraint rows."""

    def __init__(self, model: nn.Module, rows: Mapping[str, torch.Tensor]) -> None:
        self.model = model
        self.rows = rows
        self.row_logits: Optional[torch.Tensor] = None

    @classmethod
    def for_rows(cls, model: nn.Module, batch: Mapping[str, Any]) -> "MergedForward":
        """The merge for a constraint batch of token rows (its model inputs: ``input_ids``, ``attention_mask``)."""
        rows = model_inputs(batch)
        if not set(rows) <= SHAREABLE_KEYS:
            raise ValueError(f"constraint rows with keys {sorted(rows)} cannot share the objective's forward")
        return cls(model, rows)

    def row_losses(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """Each constraint row's causal-LM loss (the mean token loss of its labels), from its logits."""
        return causal_lm_losses_from_logits(self.row_logits, causal_lm_labels(batch))

    def __call__(self, **inputs: Any) -> Any:
        labels = inputs.pop("labels")
        loss_kwargs = {k: inputs.pop(k) for k in list(inputs) if k not in SHAREABLE_KEYS}
        n, width = labels.shape
        outputs = self.model(**merge_right_padded(inputs, self.rows))
        logits = outputs["logits"]
        # split, not two slices: one backward node that concatenates the two gradients, where two slices
        # would each scatter into a zero tensor of the full logits' size
        objective_logits, self.row_logits = logits.split([n, logits.shape[0] - n])
        head = causal_lm_head(self.model)
        # narrower than the constraint rows: the slice is a strided view, and a loss function may .view() it
        outputs["logits"] = objective_logits if objective_logits.shape[1] == width \
            else objective_logits[:, :width].contiguous()
        outputs["loss"] = head.loss_function(logits=outputs["logits"], labels=labels,
                                             vocab_size=head.config.get_text_config().vocab_size, **loss_kwargs)
        return outputs


_HEADS: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()


def causal_lm_head(model: nn.Module) -> Any:
    """The Hugging Face causal-LM module inside ``model`` (through DDP, PEFT or other wrappers): the first
    module that has ``loss_function`` and a configuration and whose class is a ``...ForCausalLM`` or
    ``...LMHeadModel``; ``None`` when there is none. Found once per model (the step asks every time)."""
    if model not in _HEADS:
        _HEADS[model] = _find_causal_lm_head(model)
    return _HEADS[model]


def _find_causal_lm_head(model: nn.Module) -> Any:
    for module in model.modules():
        name = type(module).__name__
        if hasattr(module, "loss_function") and hasattr(module, "config") \
                and (name.endswith("ForCausalLM") or name.endswith("LMHeadModel")):
            # outputs as tuples (return_dict off) carry no named logits to split
            return module if getattr(module.config, "return_dict", True) else None
    return None


def merge_right_padded(objective: Mapping[str, torch.Tensor], rows: Mapping[str, torch.Tensor]
                       ) -> dict[str, torch.Tensor]:
    """The objective's rows, then the constraint rows (``input_ids`` and ``attention_mask``), padded on the
    right to one width with attention mask 0. Under the causal mask no real token attends to padding after
    it, and position ids start at 0 in every row, so no row's logits change."""
    width = max(objective["input_ids"].shape[1], rows["input_ids"].shape[1])
    device = objective["input_ids"].device

    def pad(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device)
        return t if t.shape[1] == width else nn.functional.pad(t, (0, width - t.shape[1]), value=0)

    def mask(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        m = batch.get("attention_mask")
        return torch.ones_like(batch["input_ids"]) if m is None else m

    return {"input_ids": torch.cat([pad(objective["input_ids"]), pad(rows["input_ids"])]),
            "attention_mask": torch.cat([pad(mask(objective)), pad(mask(rows)).to(mask(objective).dtype)])}


__all__ = ["SHAREABLE_KEYS", "MergedForward", "SharedObjectiveForward", "causal_lm_head", "merge_right_padded",
           "trains_as_it_evaluates"]
