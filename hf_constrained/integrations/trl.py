"""Constrained supervised fine-tuning with TRL's ``SFTTrainer`` (``pip install 'hf_constrained[trl]'``).

:class:`ConstrainedSFTTrainer` is ``SFTTrainer`` with the constrained step of
:class:`~hf_constrained.ConstrainedTrainer` (Algorithm 1: MSVR estimates of the constraints,
hinge exact penalty added to the loss, one backward). TRL keeps doing everything about
the objective: dataset preparation (chat templates, completion-only loss, packing,
padding-free batches), its loss and metrics. The constraints bring their own data and
collate function, so a packed objective does not affect them.

The class composes by inheritance, ``ConstrainedSFTTrainer(ConstrainedTrainer, SFTTrainer)``,
whose method resolution order is ConstrainedTrainer -> TrainerInternals -> SFTTrainer -> Trainer:
``ConstrainedTrainer.compute_loss`` asks the next class in that order for the objective, so
the objective is ``SFTTrainer.compute_loss`` and the penalty is added on top; the safety
report, model cards and gated ``push_to_hub`` are this library's (the trainer's safety loop, ``trainer.safety``).

:class:`ConstrainedSFTConfig` is ``SFTConfig`` plus the constraint fields of
:class:`~hf_constrained.ConstrainedTrainingArguments` (``constraint_penalty``,
``penalty_beta``, ``msvr_gamma``, ...), with TRL's defaults for the rest.

Example (non-forgetting constraints on protected data, tokenised like TRL's rows)::

    from hf_constrained.integrations.trl import ConstrainedSFTConfig, ConstrainedSFTTrainer
    from hf_constrained.non_forgetting import NonForgettingConfig, non_forgetting_constraints
    from hf_constrained.per_sample_loss import causal_lm_per_example_loss
    from hf_constrained.text_data import SFTPaddingCollator, tokenize_sft

    protected = {name: tokenize_sft(ds, tokenizer) for name, ds in raw_protected.items()}
    constraints = non_forgetting_constraints(model, causal_lm_per_example_loss, protected,
                                             SFTPaddingCollator(tokenizer),
                                             config=NonForgettingConfig(relative_tolerance=0.02))
    trainer = ConstrainedSFTTrainer(model=model, args=ConstrainedSFTConfig(output_dir="out", packing=True),
                                    train_dataset=target, processing_class=tokenizer,
                                    constraints=constraints)
    trainer.train()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

try:
    from trl import SFTConfig, SFTTrainer
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "hf_constrained.integrations.trl needs TRL; install it with: pip install 'hf_constrained[trl]'"
    ) from exc

from ..config import ConstrainedTrainingArguments
from ..constraint import Constraint
from ..trainer import ConstrainedTrainer

__all__ = ["ConstrainedSFTConfig", "ConstrainedSFTTrainer"]


@dataclass
class ConstrainedSFTConfig(SFTConfig, ConstrainedTrainingArguments):
    """``trl.SFTConfig`` (packing, ``max_length``, ``completion_only_loss``, chat templates,
    ...) plus the constraint settings of :class:`~hf_constrained.ConstrainedTrainingArguments`.

    Defaults are TRL's where TRL changes the Trainer's (e.g. ``learning_rate`` 2e-5,
    ``gradient_checkpointing``, ``bf16`` when ``fp16`` is off) and the paper's for the
    constraint fields (hinge penalty, beta 10, gamma 0.8, gamma' 0.1). Parse it from the
    command line with ``HfArgumentParser`` or ``trl.TrlParser`` like ``SFTConfig`` (the LLM
    recipe, ``hf-constrained llm``, parses it with ``TrlParser`` beside TRL's ``ScriptArguments``
    and ``ModelConfig``). TRL turns ``bf16`` on by default; the recipes turn it off, with a
    warning, where no GPU supports it (:mod:`hf_constrained.recipe_args`).
    """


class ConstrainedSFTTrainer(ConstrainedTrainer, SFTTrainer):
    """TRL's ``SFTTrainer`` trained under constraints ``h_k(w) <= tol_k`` (Algorithm 1).

    Args:
        model, train_dataset, eval_dataset, processing_class, peft_config, ...: as for
            ``SFTTrainer`` (``model`` may be a Hub id or a path).
        args: a :class:`ConstrainedSFTConfig` (default: one with ``output_dir`` from the model name).
        constraints: the constraints, each with its own data and collate function (e.g.
            :func:`hf_constrained.non_forgetting.non_forgetting_constraints`).
        **kwargs: passed to ``SFTTrainer`` (and ``model_card_info`` /
            ``reference_constraint_values`` to the safety loop, ``trainer.safety``).

    With ``peft_config`` TRL wraps the model in PEFT inside the constructor, after the
    constraints were built: compute the old model's reference values on the plain model
    first (it is the base the adapter starts from).
    """

    args: ConstrainedSFTConfig

    def __init__(self, model: Any = None, args: Optional[ConstrainedSFTConfig] = None, *,
                 constraints: Sequence[Constraint] = (), **kwargs: Any) -> None:
        if args is None:
            name = (model if isinstance(model, str)
                    else getattr(getattr(model, "config", None), "_name_or_path", "model"))
            args = ConstrainedSFTConfig(output_dir=f"{str(name).rstrip('/').split('/')[-1] or 'model'}-constrained-SFT")
        if not isinstance(args, ConstrainedSFTConfig):
            raise TypeError(
                f"ConstrainedSFTTrainer needs ConstrainedSFTConfig arguments, got {type(args).__name__}: SFTTrainer "
                "would rebuild them as a plain SFTConfig and drop the constraint settings"
            )
        super().__init__(model=model, args=args, constraints=constraints, **kwargs)
