"""A small MLP scorer as a Hugging Face model (saves, loads and pushes like any hub model).

The paper's model for Adult and COMPAS is "a simple neural network with 2 hidden
layers" (section 5.1) whose logit is the score s_w(a) of the AUC objective and of the
ROC-fairness constraints. ``MLPForScoring(features).logits`` has shape (batch,).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import ModelOutput


class MLPConfig(PretrainedConfig):
    """Configuration of :class:`MLPForScoring`.

    Args:
        input_dim: number of input features.
        hidden_sizes: widths of the hidden layers (the paper uses 2 hidden layers).
        activation: ``"relu"``, ``"gelu"`` or ``"tanh"``.
        dropout: dropout after each hidden activation.
        score_bound: if set, B > 0: the score is B * tanh(z / B) of the last layer's output z,
            so |s| < B. With B = max |Gamma| the ROC-fairness constraints cannot be met by
            moving every score past the thresholds (where the soft rates saturate and every
            gap vanishes while the pairwise AUC ignores the shift): a bounded score can only
            bunch at the bound, and bunching costs the AUC objective. ``None``: the plain
            logit, as in the paper.
    """

    model_type = "hfc_mlp"

    def __init__(self, input_dim: int = 1, hidden_sizes: Sequence[int] = (64, 32), activation: str = "relu",
                 dropout: float = 0.0, score_bound: Optional[float] = None, **kwargs: Any) -> None:
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        if int(input_dim) < 1 or any(int(h) < 1 for h in hidden_sizes):
            raise ValueError(f"input_dim and hidden_sizes must be positive, got {input_dim}, {list(hidden_sizes)}")
        if score_bound is not None and not (math.isfinite(float(score_bound)) and float(score_bound) > 0):
            raise ValueError(f"score_bound must be a positive finite number or None, got {score_bound!r}")
        self.input_dim = int(input_dim)
        self.hidden_sizes = [int(h) for h in hidden_sizes]
        self.activation = activation
        self.dropout = float(dropout)
        self.score_bound = None if score_bound is None else float(score_bound)
        super().__init__(**kwargs)


_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


@dataclass
class ScoringOutput(ModelOutput):
    """``logits``: one score per row, shape (batch,)."""

    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None


class MLPForScoring(PreTrainedModel):
    """features (batch, input_dim) -> score (batch,), bounded by ``config.score_bound`` when set."""

    config_class = MLPConfig
    base_model_prefix = "mlp"
    main_input_name = "features"

    def __init__(self, config: MLPConfig) -> None:
        super().__init__(config)
        layers: list[nn.Module] = []
        width = config.input_dim
        for h in config.hidden_sizes:
            layers += [nn.Linear(width, h), _ACTIVATIONS[config.activation]()]
            if config.dropout > 0:
                layers.append(nn.Dropout(config.dropout))
            width = h
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.reset_parameters()

    def forward(self, features: torch.Tensor, labels: Optional[torch.Tensor] = None, **kwargs: Any) -> ScoringOutput:
        if features.dim() != 2 or features.shape[-1] != self.config.input_dim:
            raise ValueError(
                f"MLPForScoring expects features of shape (batch, {self.config.input_dim}), got {tuple(features.shape)}"
            )
        logits = self.mlp(features.to(self.mlp[0].weight.dtype)).squeeze(-1)
        bound = getattr(self.config, "score_bound", None)  # configs saved before the option have none
        if bound is not None:
            logits = bound * torch.tanh(logits / bound)
        loss = None
        if labels is not None:
            loss = nn.functional.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))
        return ScoringOutput(loss=loss, logits=logits)


try:  # make AutoConfig / AutoModel resolve "hfc_mlp" after `import hf_constrained.fairness`
    AutoConfig.register(MLPConfig.model_type, MLPConfig)
    AutoModel.register(MLPConfig, MLPForScoring)
except ValueError:  # already registered (module imported twice under different names)
    pass


def model_scores(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """Scores s_w(a) of a batch for any scoring model: ``model(<main_input_name>=inputs).logits``
    flattened to (batch,); an image-classification backbone must have one output (num_labels=1)."""
    base = getattr(model, "module", model)  # DDP wraps; the input name lives on the inner model
    name = getattr(base, "main_input_name", "features")
    logits = model(**{name: inputs}).logits
    if logits.dim() == 2:
        if logits.shape[1] != 1:
            raise ValueError(
                f"a scoring model needs one output per row (num_labels=1), got logits {tuple(logits.shape)}")
        logits = logits[:, 0]
    return logits.float()
