"""Every use of a private ``transformers.Trainer`` member, in one place.

The rest of the package overrides and calls only public names: :class:`TrainerInternals`
turns each private member that has to be overridden into a public hook of ours, and the
``trainer_*`` functions make the private calls. A ``transformers`` release that renames or
changes one of these members breaks this module only; importing it checks that every
member still exists (:data:`PRIVATE_MEMBERS`). Checked against ``transformers`` 5.24; the
tested range is in ``pyproject.toml`` (``transformers>=5.0,<6``).

Why no public hook serves, per member:

- ``_save_checkpoint`` (override, hook :meth:`TrainerInternals.save_checkpoint`): no public
  hook runs between the last file of a checkpoint and the rotation of old ones (``on_save``
  fires after both), so a complete-or-ignored checkpoint (constraint state and completeness
  marker written before the rotation) needs the save itself.
- ``_push_from_checkpoint`` (override, hook :meth:`TrainerInternals.push_checkpoint`): the
  Trainer pushes checkpoints during training (``hub_strategy``) from here only; the public
  ``push_to_hub`` is the end-of-training push, so the safety gate must sit here too.
- ``_determine_best_metric`` (override, hook :meth:`TrainerInternals.is_new_best`): the
  only place that decides the best checkpoint for ``load_best_model_at_end`` /
  ``save_strategy="best"``; callbacks see the decision only after it is made.
- ``_get_train_sampler`` (override, hook :meth:`TrainerInternals.train_sampler`): the only
  way to give the train dataloader another sampler without rewriting the public
  ``get_train_dataloader`` (workers, pinning, accelerate preparation).
- ``_remove_unused_columns`` and ``_get_collator_with_removed_columns`` (overrides, hooks
  :meth:`TrainerInternals.drop_unused_columns` and
  :meth:`TrainerInternals.collator_without_unused_columns`): the public switch is
  ``args.remove_unused_columns``, which the user owns; a trainer whose collator needs
  columns the model's ``forward`` does not take must keep them whatever the arguments say.
- ``_get_output_dir`` (call, :func:`trainer_run_dir`): the run folder of a hyperparameter
  search trial, where the Trainer writes the checkpoints; not exposed publicly.
- ``_prepare_input`` / ``_prepare_inputs`` (calls, :func:`trainer_prepare_input` /
  :func:`trainer_prepare_inputs`): the Trainer's placement of a batch on its device and dtype
  (DeepSpeed, mixed precision); no public equivalent.
- ``_get_num_items_in_batch`` (call, :func:`trainer_num_items_in_batch`): the token count
  that scales the loss under gradient accumulation; the public ``get_batch_samples`` computes
  it only for the batches it fetched itself.
- ``_load_from_checkpoint`` (call, :func:`trainer_load_checkpoint`): loads a checkpoint's
  weights in every format the Trainer saves (safetensors, sharded, adapters, FSDP) into a
  given model; ``from_pretrained`` knows only some of them.
- ``_update_auto_batch_size`` (call, :func:`trainer_restore_batch_size`): a run resumed at
  ``max_steps`` trains nothing (the Trainer would take one more step), so the Trainer's own
  restore of the batch size ``auto_find_batch_size`` found (read from the checkpoint's
  ``trainer_state.json`` in ``train``) must be done by the package; the Trainer sets it only
  through this member.

This module imports only ``transformers`` and ``torch``; the trainer and the safety gate
import it, never the reverse.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import transformers
from torch import nn
from transformers import Trainer

PRIVATE_MEMBERS = (
    "_save_checkpoint",
    "_push_from_checkpoint",
    "_determine_best_metric",
    "_get_train_sampler",
    "_remove_unused_columns",
    "_get_collator_with_removed_columns",
    "_get_output_dir",
    "_prepare_input",
    "_prepare_inputs",
    "_get_num_items_in_batch",
    "_load_from_checkpoint",
    "_update_auto_batch_size",
)
"""The private ``Trainer`` members this package overrides or calls (all of them: see the module docstring)."""

_missing = [name for name in PRIVATE_MEMBERS if not callable(getattr(Trainer, name, None))]
if _missing:  # an override of a vanished member would silently never run
    raise ImportError(
        f"transformers {transformers.__version__}: Trainer has no {', '.join(_missing)}, which hf_constrained "
        "overrides or calls (checked against transformers 5.24; supported: transformers>=5.0,<6)"
    )


class TrainerInternals(Trainer):
    """``Trainer`` whose private members that this package overrides forward to public hooks.

    Subclasses (and mixins placed before this class in the method resolution order, such as
    the safety gate) override the hooks and call ``super().<hook>(...)`` for the Trainer's
    behaviour; each hook's default is exactly the Trainer's private member. Nothing else
    changes: a trainer built on this class behaves as the ``Trainer`` (or the ``Trainer``
    subclass after it in the method resolution order, e.g. TRL's ``SFTTrainer``).
    """

    # ------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        self.save_checkpoint(model, trial)

    def save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """Hook: save a checkpoint during training (default: ``Trainer._save_checkpoint``)."""
        super()._save_checkpoint(model, trial)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        self.push_checkpoint(checkpoint_folder)

    def push_checkpoint(self, checkpoint_folder: str) -> None:
        """Hook: push a checkpoint saved during training to the Hub (``hub_strategy``;
        default: ``Trainer._push_from_checkpoint``)."""
        super()._push_from_checkpoint(checkpoint_folder)

    def _determine_best_metric(self, metrics: dict[str, float], trial: Any) -> bool:
        return self.is_new_best(metrics, trial)

    def is_new_best(self, metrics: dict[str, float], trial: Any) -> bool:
        """Hook: whether the evaluation ``metrics`` make the current weights the best so far,
        updating ``state.best_metric`` / ``state.best_global_step`` (default:
        ``Trainer._determine_best_metric``)."""
        return super()._determine_best_metric(metrics, trial)

    # ------------------------------------------------------------------ train data
    def _get_train_sampler(self, train_dataset: Any = None) -> Optional[torch.utils.data.Sampler]:
        return self.train_sampler(train_dataset)

    def train_sampler(self, train_dataset: Any = None) -> Optional[torch.utils.data.Sampler]:
        """Hook: the sampler of the train dataloader (default: ``Trainer._get_train_sampler``)."""
        return super()._get_train_sampler(train_dataset)

    def _remove_unused_columns(self, dataset: Any, description: Optional[str] = None) -> Any:
        return self.drop_unused_columns(dataset, description)

    def drop_unused_columns(self, dataset: Any, description: Optional[str] = None) -> Any:
        """Hook: ``dataset`` without the columns the model's ``forward`` does not take
        (default: ``Trainer._remove_unused_columns``, which obeys ``args.remove_unused_columns``)."""
        return super()._remove_unused_columns(dataset, description=description)

    def _get_collator_with_removed_columns(self, data_collator: Callable, description: Optional[str] = None
                                           ) -> Callable:
        return self.collator_without_unused_columns(data_collator, description)

    def collator_without_unused_columns(self, data_collator: Callable, description: Optional[str] = None
                                        ) -> Callable:
        """Hook: ``data_collator`` wrapped to drop the columns the model does not take (used for
        datasets that are not a ``datasets.Dataset``; default:
        ``Trainer._get_collator_with_removed_columns``)."""
        return super()._get_collator_with_removed_columns(data_collator, description=description)


# ---------------------------------------------------------------------- private calls
def trainer_run_dir(trainer: Trainer, trial: Any) -> str:
    """The folder the Trainer saves this run's checkpoints in (``args.output_dir``, or a
    hyperparameter search trial's subfolder): ``Trainer._get_output_dir``."""
    return trainer._get_output_dir(trial=trial)


def trainer_prepare_input(trainer: Trainer, data: Any) -> Any:
    """``data`` (a tensor or nested mapping/sequence of tensors) on the trainer's device and
    dtype: ``Trainer._prepare_input``."""
    return trainer._prepare_input(data)


def trainer_prepare_inputs(trainer: Trainer, inputs: dict[str, Any]) -> dict[str, Any]:
    """A model input batch prepared as the Trainer prepares its own: ``Trainer._prepare_inputs``."""
    return trainer._prepare_inputs(inputs)


def trainer_num_items_in_batch(trainer: Trainer, batches: list, device: torch.device) -> Any:
    """The number of label tokens in ``batches`` (one accumulation window), summed over
    processes where the Trainer does so: ``Trainer._get_num_items_in_batch``."""
    return trainer._get_num_items_in_batch(batches, device)


def trainer_load_checkpoint(trainer: Trainer, checkpoint: str, model: nn.Module) -> None:
    """Load the weights of ``checkpoint`` (any format the Trainer saves) into ``model``:
    ``Trainer._load_from_checkpoint``."""
    trainer._load_from_checkpoint(checkpoint, model=model)


def trainer_objective_is_model_loss(trainer: Trainer, owner: type) -> bool:
    """The objective is the model's own loss on the Trainer's batch: ``owner.compute_objective_loss`` is not
    overridden, the next ``compute_loss`` after ``owner`` in the class order is ``Trainer.compute_loss`` (not a
    subclass's, e.g. TRL's, which reads more than the loss from the outputs), and neither ``label_smoother``
    nor ``compute_loss_func`` is set."""
    order = type(trainer).__mro__
    next_loss = next(c for c in order[order.index(owner) + 1:] if "compute_loss" in c.__dict__)
    return (type(trainer).compute_objective_loss is owner.compute_objective_loss and next_loss is Trainer
            and trainer.label_smoother is None and trainer.compute_loss_func is None)


def trainer_loss_scaled_for_accumulation(trainer: Trainer, num_items_in_batch: Any) -> bool:
    """Whether a micro-batch's loss is already scaled for gradient accumulation, as ``Trainer.training_step``
    decides: when not, the Trainer divides the loss by the accumulation steps."""
    if trainer.loss_is_scaled_for_ga is not None:
        return trainer.loss_is_scaled_for_ga
    return bool(trainer.model_accepts_loss_kwargs and num_items_in_batch is not None) \
        or trainer.compute_loss_func is not None


def trainer_restore_batch_size(trainer: Trainer, batch_size: Optional[int]) -> None:
    """Restore the train batch size a checkpoint's ``trainer_state.json`` records, as ``Trainer.train``
    does on resume: only with ``auto_find_batch_size`` and a recorded size
    (``Trainer._update_auto_batch_size``)."""
    if batch_size is not None and trainer.args.auto_find_batch_size:
        trainer._update_auto_batch_size(batch_size)


__all__ = [
    "PRIVATE_MEMBERS",
    "TrainerInternals",
    "trainer_load_checkpoint",
    "trainer_num_items_in_batch",
    "trainer_objective_is_model_loss",
    "trainer_prepare_input",
    "trainer_prepare_inputs",
    "trainer_restore_batch_size",
    "trainer_run_dir",
]
