"""TensorBoard with the constraint scalars in their own group.

The stock ``TensorBoardCallback`` files ``constraint/<name>`` under ``train/constraint/<name>``
and ``eval_constraint/<name>`` under ``eval/constraint/<name>``, so a constraint's training
estimate (the MSVR estimate u_k of Algorithm 1, line 6) and its exact held-out value
land in two different sections. :class:`ConstraintTensorBoardCallback` writes them as

- ``constraint/<name>/estimate`` (training estimate) and ``constraint/<name>/heldout``
  (exact value on held-out data),
- ``constraint/summary/<key>`` for the summaries (``max_estimate``, ``active_fraction``,
  ``penalty``, ..., ``heldout_max_violation``, ``heldout_all_satisfied``),

and registers a custom-scalars layout that overlays estimate and held-out value per
constraint in one chart. Every other scalar keeps the stock naming.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from transformers.integrations import TensorBoardCallback
from transformers.integrations.integration_utils import rewrite_logs

from ..publishable import publishable_path, redact_secrets

SUMMARY_KEYS = ("max_estimate", "active_fraction", "penalty", "penalty_loss", "sampled_active_fraction")


def rewrite_constraint_logs(logs: Mapping[str, Any], constraint_names: Sequence[str] = ()) -> dict[str, Any]:
    """Trainer log keys -> TensorBoard tags, constraint scalars grouped under ``constraint/``."""
    names = set(constraint_names)
    constraint_part: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in logs.items():
        if key.startswith("constraint/"):
            name = key[len("constraint/"):]
            if name in SUMMARY_KEYS and name not in names:
                constraint_part[f"constraint/summary/{name}"] = value
            else:
                constraint_part[f"constraint/{name}/estimate"] = value
        elif key.startswith("eval_constraint/"):
            constraint_part[f"constraint/{key[len('eval_constraint/'):]}/heldout"] = value
        elif key == "eval_constraint_max_violation":
            constraint_part["constraint/summary/heldout_max_violation"] = value
        elif key == "eval_constraints_satisfied":
            constraint_part["constraint/summary/heldout_all_satisfied"] = value
        else:
            rest[key] = value
    return {**rewrite_logs(rest), **constraint_part}


def constraint_layout(constraint_names: Sequence[str]) -> dict[str, Any]:
    """Custom-scalars layout: one chart per constraint with its estimate and held-out value."""
    charts = {name: ["Multiline", [f"constraint/{name}/estimate", f"constraint/{name}/heldout"]]
              for name in constraint_names}
    charts["summary"] = ["Multiline", ["constraint/summary/max_estimate", "constraint/summary/heldout_max_violation"]]
    return {"constraints": charts}


class _PublishableArguments:
    """The training arguments as the event files show them: ``to_json_string`` without absolute
    local paths (see :func:`hf_constrained.publishable.publishable_path`); everything else is
    the arguments' own."""

    def __init__(self, args: Any) -> None:
        self._args = args

    def __getattr__(self, name: str) -> Any:
        return getattr(self._args, name)

    def to_json_string(self) -> str:
        shown = {k: (redact_secrets(publishable_path(v, self._args.output_dir)) if isinstance(v, str) else v)
                 for k, v in self._args.to_dict().items()}
        return json.dumps(shown, indent=2, default=str)


class ConstraintTensorBoardCallback(TensorBoardCallback):
    """``TensorBoardCallback`` that groups constraint scalars (see the module docstring)."""

    def __init__(self, constraint_names: Sequence[str] = (), tb_writer: Any = None) -> None:
        super().__init__(tb_writer=tb_writer)
        self.constraint_names = list(constraint_names)
        self._layout_written = False

    def _write_layout(self) -> None:
        if self.tb_writer is not None and not self._layout_written and self.constraint_names:
            self.tb_writer.add_custom_scalars(constraint_layout(self.constraint_names))
            self._layout_written = True

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: D102 (Trainer callback API)
        # the "args" text of the event file: no token (transformers masks it) and no local paths
        super().on_train_begin(_PublishableArguments(args), state, control, **kwargs)
        if state.is_world_process_zero:
            self._write_layout()

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: D102 (Trainer callback API)
        if not state.is_world_process_zero:
            return
        if self.tb_writer is None:
            self._init_summary_writer(args)
        if self.tb_writer is None:
            return
        self._write_layout()
        for tag, value in rewrite_constraint_logs(logs or {}, self.constraint_names).items():
            if isinstance(value, (int, float)):
                self.tb_writer.add_scalar(tag, value, state.global_step)
            elif isinstance(value, str):
                self.tb_writer.add_text(tag, value, state.global_step)
        self.tb_writer.flush()

    def on_train_end(self, args, state, control, **kwargs):  # noqa: D102 (Trainer callback API)
        super().on_train_end(args, state, control, **kwargs)
        self._layout_written = False


__all__ = ["ConstraintTensorBoardCallback", "constraint_layout", "rewrite_constraint_logs"]
