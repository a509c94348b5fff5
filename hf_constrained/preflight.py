"""Every constraint run once on a few of its rows, before the first optimizer step.

Catches non-scalar values, values without grad, NaN/inf, batches that lack a key the
constraint reads, rows that cannot be collated and any error the constraint's function raises
(a :class:`~hf_constrained.constraint.ConstraintValueError` naming the constraint, the
original error chained), without advancing any data stream.
Every constraint is checked (not each distinct function once): constraints that share one
function differ in their data. Row-wise constraints of one group are checked together, up to
:data:`PREFLIGHT_CHUNK` per no-grad ``row_fn`` call (the group's first constraint also runs
alone with grad); a chunk that fails is re-run constraint by constraint to name the culprit.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn

from .batches import RowUnit
from .constraint import ConstraintValueError
from .method.draw_values import DrawValues
from .method.rows import RowGroup, row_values_and_owners
from .row_sums import inner_values, segment_sums

PREFLIGHT_CHUNK = 64  # row-wise constraints checked per no-grad row_fn call


def preflight_constraints(model: nn.Module, values: DrawValues, batch_size: int,
                          context: Callable[[], Any] = contextlib.nullcontext) -> None:
    """Check every constraint on its first ``batch_size`` rows (see the module docstring)."""
    was_training = model.training
    model.train()
    try:
        pending: list[int] = []
        for group in values.row_groups:
            _check_one(model, values, group.members[0], batch_size, context)  # the gradient path, once per group
            for start in range(0, len(group.members), PREFLIGHT_CHUNK):
                chunk = group.members[start:start + PREFLIGHT_CHUNK]
                if not _chunk_passes(model, values, group, chunk, batch_size, context):
                    pending.extend(chunk)
        pending.extend(k for k in range(len(values.constraints)) if k not in values.group_of)
        for k in sorted(pending):
            _check_one(model, values, k, batch_size, context)
    finally:
        model.train(was_training)


def _chunk_passes(model: nn.Module, values: DrawValues, group: RowGroup, chunk: list[int], b: int,
                  context: Callable[[], Any]) -> bool:
    """One no-grad ``row_fn`` call on ``b`` rows of each constraint of ``chunk``; False when
    anything about it fails (the caller then checks the constraints one by one)."""
    units = [RowUnit(values.constraints[k].dataset, list(range(min(len(values.constraints[k].dataset), b))),
                     positions=[p], constraints=[k]) for p, k in enumerate(chunk)]
    try:
        with torch.no_grad(), context():
            batch, slices, outputs = values.row_outputs(model, group, units, need_grad=False)
            row_values, owners = row_values_and_owners(values.constraints, units, slices, outputs, batch)
            _, stats = segment_sums(row_values, owners, len(chunk), need_grad=False)
        return bool(torch.isfinite(inner_values(stats)).all().item())
    except Exception:  # noqa: BLE001 - any failure is re-diagnosed per constraint, with its name
        return False


def _check_one(model: nn.Module, values: DrawValues, k: int, b: int, context: Callable[[], Any]) -> None:
    c = values.constraints[k]
    batch = None
    where = ""
    if not c.data_free:
        rows = list(range(min(len(c.dataset), b)))
        where = f" on rows {rows[0]}..{rows[-1]} of its dataset" if rows else ""
        try:
            batch = values.batches.constraint_rows(c, rows)
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise ConstraintValueError(
                f"constraint {c.name!r}: rows {rows[0]}..{rows[-1]} of its dataset cannot be made into a "
                f"batch: {type(e).__name__}: {e}"
            ) from e
    try:
        with context():
            value = values.check_value(k, c.fn(model, batch), need_grad=True)
    except KeyError as e:
        keys = sorted(batch) if isinstance(batch, dict) else None
        missing = e.args[0] if e.args else None
        what = (f"its function reads key {missing!r}, which its batches do not have"
                if isinstance(missing, str) and " " not in missing else f"KeyError: {missing}")
        raise ConstraintValueError(
            f"constraint {c.name!r}: {what} (batch keys: {keys}); check the constraint's dataset "
            "columns or its collate_fn"
        ) from e
    except ConstraintValueError:
        raise  # already names the constraint
    except Exception as e:  # noqa: BLE001 - a user's function failed: say which constraint, keep the cause chained
        why = " ".join(f"{type(e).__name__}: {e}".split())
        raise ConstraintValueError(f"constraint {c.name!r} failed{where} before training: {why}") from e
    if not torch.isfinite(value.detach()).item():
        raise ConstraintValueError(f"constraint {c.name!r} is {value.item()} before training")


__all__ = ["PREFLIGHT_CHUNK", "preflight_constraints"]
