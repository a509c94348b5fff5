"""Baselines that change the step's gradient, not the objective: A-GEM and replay + A-GEM, as strategy objects.

A-GEM (Averaged Gradient Episodic Memory; Chaudhry, Ranzato, Rohrbach and Elhoseiny, "Efficient Lifelong Learning
with A-GEM", ICLR 2019, arXiv 1812.00420, the A-GEM update rule) keeps the loss on the old tasks from rising to
first order: with ``g`` the step's gradient and ``g_ref`` the gradient of the loss on a reference batch of old rows
(drawn from every old task's memory), the step applies

    g~ = g - (g . g_ref / g_ref . g_ref) g_ref    if g . g_ref < 0,       g~ = g    otherwise,

the projection of ``g`` onto the half-space ``{v : v . g_ref >= 0}`` (A-GEM's problem
``min ||g~ - g||^2 / 2 s.t. g~ . g_ref >= 0``, solved in closed form). Both are gradient projections, so each runs
inside the same :class:`~hf_constrained.ConstrainedTrainer` (``gradient_projection=``) with any
``constraint_penalty`` and any ``regulariser``:

* :class:`AGEM`: ``g_ref`` on a balanced reference batch, ``rows_per_task`` rows of every old task per step
  (the A-GEM paper's episodic memory holds the same number of rows of every task);
* :class:`ReplayAGEM`: replay + A-GEM (Hess, Tuytelaars and van de Ven, "Two Complementary Perspectives to Continual
  Learning: Ask Not Only What to Optimize, But Also How", 2023): the objective also holds the replayed rows
  (:class:`~hf_constrained.method.regularisers.Replay`, passed as the trainer's ``regulariser``), and the replay
  batch of the step doubles as A-GEM's reference batch.

One dispatch point: :meth:`GradientProjection.project`, called once per optimizer step on the whole step's
gradient, by :class:`ProjectedGradient` (the trainer's adapter, a ``TrainerCallback``), from the Trainer's
``on_pre_optimizer_step``:

* **gradient accumulation**: the parameters stay ``w_t`` for the whole window, so ``g_ref`` is the gradient at
  ``w_t`` of the window's reference rows (computed with :func:`torch.autograd.grad` after each micro-batch's
  backward, never touching ``.grad``), and the projection acts once, on the window's accumulated ``.grad``: the
  update is the one a single batch of the whole window would make;
* **processes (DDP)**: ``.grad`` is already averaged over the processes when the optimizer is about to step; the
  processes' reference gradients are summed with their row weights and divided by the summed weight, so every
  process projects the same gradient along the same ``g_ref``;
* **resume**: the reference rows are a function of ``(seed, step, micro-batch, process)`` (the old rows of
  :class:`~hf_constrained.method.regularisers.OldRowStream`), so there is nothing to save: a resumed run projects
  exactly as an uninterrupted one;
* **gradient clipping**: the Trainer clips (``max_grad_norm``) before ``on_pre_optimizer_step``, so the projection
  acts on the clipped gradient. The projection is positively homogeneous (``P(c g) = c P(g)``), so the direction is
  the one projecting first would give; the step is at most ``max_grad_norm`` long (a projection never lengthens a
  gradient), and shorter than clip-after-projection by at most the factor ``||P(g)|| / ||g||``. The ``grad_norm``
  the Trainer logs is the norm before projection.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import nn
from transformers import TrainerCallback

from ..batches import fetch_rows
from .regularisers import ObjectiveRegulariser, OldRowStream, Replay, _batch_rows, _model_loss
from .sampling import _mixed_seed

Collate = Callable[[Sequence[Any]], Any]
ToDevice = Callable[[Any], Any]
LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass(frozen=True)
class MicroBatch:
    """Where a training micro-batch stands: optimizer step ``step`` (the Trainer's ``global_step``), micro-batch
    ``micro`` of its ``accumulation_steps``, on process ``rank`` of ``world``."""

    step: int
    micro: int
    accumulation_steps: int
    world: int = 1
    rank: int = 0

    @property
    def draw(self) -> int:
        """The micro-batch's draw number, as the regularisers number theirs
        (:class:`~hf_constrained.method.regularisers.RegularisedObjective`)."""
        return (self.step * self.accumulation_steps + self.micro) * self.world + self.rank

    @property
    def step_draw(self) -> int:
        """The step's draw number on this process, the same at any accumulation: ``step * world + rank``."""
        return self.step * self.world + self.rank


class GradientProjection(ABC):
    """A change of the step's gradient before the optimizer applies it (a baseline), against a reference gradient.

    :meth:`reference_loss` gives the loss whose gradient at ``w_t`` is the reference (per training micro-batch;
    the adapter :class:`ProjectedGradient` differentiates it and averages over the window and the processes);
    :meth:`project` is the one dispatch point: it changes the step's gradients in place.
    """

    name: str = "projection"

    def bind(self, model: nn.Module, to_device: ToDevice) -> None:
        """Called once by the trainer before training: the model being trained and how batches reach its device."""
        self.to_device = to_device

    def check_regulariser(self, regulariser: Optional[ObjectiveRegulariser]) -> None:
        """Called with the trainer's ``regulariser`` before training; raise if the two cannot run together."""

    @abstractmethod
    def reference_loss(self, model: nn.Module, inputs: Any, where: MicroBatch) -> Optional[tuple[torch.Tensor, int]]:
        """The reference loss of micro-batch ``where`` (``inputs``: its new-task batch) and its weight (its rows),
        or None when this micro-batch adds no reference rows."""

    @abstractmethod
    def project(self, grads: Sequence[Optional[torch.Tensor]], reference: Sequence[torch.Tensor]) -> bool:
        """Change ``grads`` (the step's gradients, one per trainable parameter, None for none) in place given the
        reference gradient ``reference`` (same shapes); True when the step's gradient was changed."""

    def settings(self) -> dict[str, Any]:
        """The projection's settings (recorded in results)."""
        return {"name": self.name}


def agem_project(grads: Sequence[Optional[torch.Tensor]], reference: Sequence[torch.Tensor]) -> tuple[bool, float]:
    """A-GEM's projection (Chaudhry et al. 2019, the A-GEM update rule) of the gradient ``grads`` in place:
    ``g <- g - (g . g_ref / g_ref . g_ref) g_ref`` when ``g . g_ref < 0``, else ``g`` unchanged. The dot products are
    summed over all parameters in float64. A gradient that is None (a parameter the step's loss does not reach)
    counts as zero and stays None: that parameter takes no step. Returns (projected, g . g_ref)."""
    if len(grads) != len(reference):
        raise ValueError(f"agem_project: {len(grads)} gradients but {len(reference)} reference gradients")
    if not reference:
        return False, 0.0
    device = reference[0].device
    dots = [torch.dot(g.reshape(-1).double(), r.reshape(-1).double()).to(device)
            for g, r in zip(grads, reference) if g is not None]
    dot = torch.stack(dots).sum() if dots else torch.zeros((), dtype=torch.float64, device=device)
    ref_sq = torch.stack([torch.dot(r.reshape(-1).double(), r.reshape(-1).double()).to(device)
                          for r in reference]).sum()
    dot_value, ref_sq_value = torch.stack([dot, ref_sq]).tolist()  # one synchronisation for both
    if not (dot_value < 0.0 and ref_sq_value > 0.0):
        return False, dot_value
    coefficient = dot_value / ref_sq_value
    for g, r in zip(grads, reference):
        if g is not None:
            g.sub_((r.double() * coefficient).to(g.dtype))
    return True, dot_value


class _AGEMProjection(GradientProjection):
    """A-GEM's projection (:func:`agem_project`); subclasses choose the reference rows."""

    def project(self, grads: Sequence[Optional[torch.Tensor]], reference: Sequence[torch.Tensor]) -> bool:
        projected, self.last_dot = agem_project(grads, reference)
        return projected


TaskRows = Union[Sequence[Any], Mapping[str, Any]]


class AGEM(_AGEMProjection):
    """A-GEM (Chaudhry et al., ICLR 2019, arXiv 1812.00420): the step's gradient projected when it conflicts with
    the gradient of a balanced reference batch of old rows, ``rows_per_task`` rows of every old task per step.

    Args:
        old_tasks: the old tasks' rows, one dataset per task (a list, or a mapping task name -> dataset), e.g. the
            rows of each old task's constraint. :meth:`from_task_column` splits one dataset by a column.
        rows_per_task: reference rows of every task per step and process (>= 1); under DDP the processes' rows are
            disjoint and their reference gradients averaged: ``world * rows_per_task`` rows of each task per step.
        collate: makes a batch of old rows (the trainer's ``data_collator`` for the same model).
        loss_fn: ``loss_fn(model, batch) -> scalar``, the loss on a batch of old rows; default: the model's own loss
            (``model(**batch).loss``), what the Trainer computes. The reference gradient is its gradient on the
            ``tasks * rows_per_task`` rows, collated as one batch.
        seed: the seed of the old rows' order (each task's rows walk shuffled passes seeded by ``(seed, task)``).

    Cost per optimizer step: one forward and backward over the reference rows (at any gradient accumulation), two
    dot products over the parameters, and one more copy of the trainable parameters' size for ``g_ref``.
    """

    name = "agem"

    def __init__(self, old_tasks: TaskRows, rows_per_task: int, collate: Collate, *,
                 loss_fn: Optional[LossFn] = None, seed: int = 0) -> None:
        if isinstance(old_tasks, Mapping):
            names, datasets = [str(k) for k in old_tasks], list(old_tasks.values())
        elif isinstance(old_tasks, Sequence) and not isinstance(old_tasks, (str, bytes)):
            names, datasets = [str(i) for i in range(len(old_tasks))], list(old_tasks)
        else:
            raise TypeError("AGEM: old_tasks is one dataset per old task (a list or a dict name -> dataset), got "
                            f"{type(old_tasks).__name__}; split one dataset with AGEM.from_task_column")
        if not datasets:
            raise ValueError("AGEM: old_tasks is empty: give the rows of at least one old task")
        for name, dataset in zip(names, datasets):
            if dataset is None or len(dataset) == 0:
                raise ValueError(f"AGEM: old_tasks[{name!r}] is empty: every old task needs at least one row")
        if isinstance(rows_per_task, bool) or not isinstance(rows_per_task, int) or rows_per_task < 1:
            raise ValueError(f"AGEM: rows_per_task must be an integer >= 1 (reference rows of every old task per "
                             f"step), got {rows_per_task!r}")
        self.task_names, self.datasets = names, datasets
        self.rows_per_task, self.collate, self.seed = int(rows_per_task), collate, int(seed)
        self.loss_fn = loss_fn or _model_loss
        self.streams = [OldRowStream(len(d), _mixed_seed(seed, k)) for k, d in enumerate(datasets)]
        self.to_device: ToDevice = lambda b: b
        self.last_dot: Optional[float] = None

    @classmethod
    def from_task_column(cls, dataset: Any, column: str, rows_per_task: int, collate: Collate,
                         **kwargs: Any) -> "AGEM":
        """A-GEM over one dataset whose ``column`` names each row's task (one reference group per distinct value,
        in sorted order); ``dataset`` a ``datasets.Dataset`` or any indexable of dict rows."""
        if dataset is None or len(dataset) == 0:
            raise ValueError("AGEM: the old-task rows are empty")
        if hasattr(dataset, "column_names"):
            if column not in dataset.column_names:
                raise ValueError(f"AGEM: task column {column!r} is not a column of the dataset "
                                 f"({dataset.column_names})")
            labels = list(dataset[column])
        else:
            try:
                labels = [dataset[i][column] for i in range(len(dataset))]
            except (KeyError, TypeError, IndexError):
                raise ValueError(f"AGEM: task column {column!r} is not a key of the dataset's rows") from None
        labels = [v.item() if isinstance(v, torch.Tensor) else v for v in labels]
        tasks: dict[Any, list[int]] = {}
        for i, v in enumerate(labels):
            tasks.setdefault(v, []).append(i)
        ordered = sorted(tasks, key=str)
        if hasattr(dataset, "select"):
            parts = {str(v): dataset.select(tasks[v]) for v in ordered}
        else:
            parts = {str(v): torch.utils.data.Subset(dataset, tasks[v]) for v in ordered}
        return cls(parts, rows_per_task, collate, **kwargs)

    def reference_rows(self, draw: int) -> list[list[int]]:
        """Row indices, per task, of the reference batch of draw ``draw`` (``rows_per_task`` of each task)."""
        return [s.rows(draw, self.rows_per_task) for s in self.streams]

    def reference_batch(self, draw: int) -> Any:
        """The collated reference batch of draw ``draw``: every task's rows, task by task."""
        examples = [ex for d, rows in zip(self.datasets, self.reference_rows(draw)) for ex in fetch_rows(d, rows)]
        return self.to_device(self.collate(examples))

    def reference_loss(self, model: nn.Module, inputs: Any, where: MicroBatch) -> Optional[tuple[torch.Tensor, int]]:
        if where.micro != 0:
            return None  # one reference batch per optimizer step, at w_t
        loss = self.loss_fn(model, self.reference_batch(where.step_draw))
        return loss, len(self.datasets) * self.rows_per_task

    def settings(self) -> dict[str, Any]:
        return {"name": self.name, "rows_per_task": self.rows_per_task, "tasks": len(self.datasets),
                "rows_per_step": len(self.datasets) * self.rows_per_task,
                "rows": {n: len(d) for n, d in zip(self.task_names, self.datasets)}, "seed": self.seed}


class ReplayAGEM(_AGEMProjection):
    """Replay + A-GEM (Hess et al. 2023; A-GEM: Chaudhry et al. 2019): the trainer's ``regulariser`` is
    ``replay`` (old rows mixed into the objective), and the step's replay batch doubles as A-GEM's reference batch:
    ``g_ref`` is the gradient at ``w_t`` of the replay loss on exactly the old rows the replay mixed into the step
    (every micro-batch of the window, every process), weighted by rows.

    Args:
        replay: the :class:`~hf_constrained.method.regularisers.Replay` passed to the trainer as ``regulariser``.

    Cost per optimizer step on top of replay's: one more forward and backward over the replayed rows, two dot
    products over the parameters and a copy of the trainable parameters' size for ``g_ref``.
    """

    name = "replay_agem"

    def __init__(self, replay: Replay) -> None:
        if not isinstance(replay, Replay):
            raise TypeError(f"ReplayAGEM: replay must be a Replay (the trainer's regulariser), got "
                            f"{type(replay).__name__}")
        self.replay = replay
        self.last_dot: Optional[float] = None

    def check_regulariser(self, regulariser: Optional[ObjectiveRegulariser]) -> None:
        if regulariser is not self.replay:
            raise ValueError("ReplayAGEM: its reference batch is the replay batch, so the trainer's regulariser must "
                             "be the same Replay object (ConstrainedTrainer(regulariser=replay, "
                             "gradient_projection=ReplayAGEM(replay)))")

    def reference_rows(self, where: MicroBatch, num_new: int) -> list[int]:
        """The replay's old rows of micro-batch ``where`` with ``num_new`` new rows (those its objective mixes in)."""
        return self.replay.replay_rows(where.draw, num_new)

    def reference_loss(self, model: nn.Module, inputs: Any, where: MicroBatch) -> Optional[tuple[torch.Tensor, int]]:
        rows = self.reference_rows(where, _batch_rows(inputs))
        batch = self.replay.to_device(self.replay.collate(fetch_rows(self.replay.dataset, rows)))
        return self.replay.loss_fn(model, batch), len(rows)

    def settings(self) -> dict[str, Any]:
        return {"name": self.name, "replay": self.replay.settings()}


class ProjectedGradient(TrainerCallback):
    """How a trainer applies a :class:`GradientProjection`: the reference gradient of every training micro-batch
    (:meth:`micro_batch`, after its backward, at the window's ``w_t``: :func:`torch.autograd.grad` on the unwrapped
    model, ``.grad`` untouched) summed with its row weight; at ``on_pre_optimizer_step`` (once per optimizer step,
    after the Trainer's clipping) summed over the processes, divided by the total weight, and the projection applied
    to the parameters' ``.grad`` in place.

    Logs ``projection/projected_share``, the share of optimizer steps since the last log whose gradient was changed.
    """

    def __init__(self, projection: GradientProjection) -> None:
        if not isinstance(projection, GradientProjection):
            raise TypeError(f"gradient_projection must be a GradientProjection, got {type(projection).__name__}")
        self.projection = projection
        self.trainer: Any = None  # the trainer it is attached to (attach), bound when training starts
        self.world, self.rank = 1, 0
        self.params: list[nn.Parameter] = []
        self._last: tuple[int, int] = (-1, 0)  # (global step, micro-batches of it so far)
        self._sum: Optional[list[torch.Tensor]] = None  # sum over the window's micro-batches of weight * gradient
        self._weight = 0.0
        self._step: Optional[int] = None  # the step the sums belong to
        self._reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
        self._add_metrics: Optional[Callable[[dict[str, float]], None]] = None
        self._since_log = [0, 0]  # (steps, projected steps) since the last log
        self.steps = 0  # optimizer steps projected or not, in this process's run
        self.projected_steps = 0

    def bind(self, model: nn.Module, to_device: ToDevice, *, world: int = 1, rank: int = 0,
             reduce_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
             regulariser: Optional[ObjectiveRegulariser] = None, sharded: bool = False,
             add_metrics: Optional[Callable[[dict[str, float]], None]] = None) -> None:
        """Before training: the unwrapped model, its device, this process's place in the run, the sum over
        processes, the trainer's regulariser, whether the parameters are sharded (FSDP, DeepSpeed: refused) and how
        to add metrics to the next log."""
        if sharded:
            raise ValueError("gradient_projection: A-GEM needs every process to hold the whole gradient; it is not "
                             "supported with FSDP or DeepSpeed (use DDP or one process)")
        self.projection.check_regulariser(regulariser)
        self.projection.bind(model, to_device)
        self.world, self.rank = int(world), int(rank)
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("gradient_projection: the model has no trainable parameters")
        self._reduce_sum = reduce_sum or (lambda x: x)
        self._add_metrics = add_metrics
        self._last, self._sum, self._weight, self._step = (-1, 0), None, 0.0, None

    @classmethod
    def attach(cls, trainer: Any, projection: Optional[GradientProjection]) -> Optional["ProjectedGradient"]:
        """The adapter of ``projection`` added to ``trainer``'s callbacks (None without a projection). It binds
        itself when training starts (:meth:`on_train_begin`); the trainer calls :meth:`micro_batch` after every
        training micro-batch's backward."""
        if projection is None:
            return None
        adapter = cls(projection)
        adapter.trainer = trainer
        trainer.add_callback(adapter)
        return adapter

    def bind_to_trainer(self, trainer: Any) -> None:
        """:meth:`bind` with ``trainer``'s model (unwrapped), device, processes, regulariser and logs."""
        regularised = getattr(trainer, "regularised", None)
        self.bind(trainer.model, getattr(trainer, "_to_device", lambda b: b),
                  world=trainer.accelerator.num_processes, rank=trainer.accelerator.process_index,
                  reduce_sum=lambda x: trainer.accelerator.reduce(x, reduction="sum"),
                  regulariser=None if regularised is None else regularised.regulariser,
                  sharded=bool(getattr(trainer, "is_fsdp_enabled", False)
                               or getattr(trainer, "is_deepspeed_enabled", False)),
                  add_metrics=getattr(trainer, "add_metrics_to_next_log", None))

    def micro_batch(self, inputs: Any) -> None:
        """After a training micro-batch's backward: its reference gradient at the window's weights (the trainer's
        step and accumulation, under its autocast context)."""
        t = self.trainer
        with t.compute_loss_context_manager():
            self.micro_batch_at(t.model, inputs, t.state.global_step, t.current_gradient_accumulation_steps)

    def micro_batch_at(self, model: nn.Module, inputs: Any, global_step: int, accumulation_steps: int) -> None:
        """Add micro-batch ``inputs``'s reference gradient at the current (window's) weights; ``model`` unwrapped."""
        step, micro = self._last
        micro = micro + 1 if step == global_step else 0
        self._last = (global_step, micro)
        if self._step != global_step:
            self._sum, self._weight, self._step = None, 0.0, global_step
        where = MicroBatch(global_step, micro, accumulation_steps, self.world, self.rank)
        out = self.projection.reference_loss(model, inputs, where)
        if out is None:
            return
        loss, weight = out
        grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        if self._sum is None:
            self._sum = [torch.zeros_like(p, dtype=_accumulation_dtype(p)) for p in self.params]
        for acc, g in zip(self._sum, grads):
            if g is not None:
                acc.add_(g.detach().to(acc.dtype), alpha=float(weight))
        self._weight += float(weight)

    def reference(self, global_step: int) -> list[torch.Tensor]:
        """The step's reference gradient g_ref: the weighted mean over micro-batches and processes."""
        if self._step != global_step or self._sum is None:
            raise RuntimeError(f"gradient_projection: no reference gradient for step {global_step} (the trainer "
                               "computes it during the step's micro-batches)")
        if self.world > 1:
            flat = torch.cat([s.reshape(-1) for s in self._sum])
            weight = torch.tensor([self._weight], dtype=flat.dtype, device=flat.device)
            total = self._reduce_sum(torch.cat([flat, weight]))
            flat, weight_sum = total[:-1], float(total[-1])
            out, at = [], 0
            for s in self._sum:
                out.append(flat[at:at + s.numel()].view_as(s))
                at += s.numel()
        else:
            out, weight_sum = list(self._sum), self._weight
        if weight_sum <= 0:
            raise RuntimeError(f"gradient_projection: the reference batch of step {global_step} has no rows")
        return [r / weight_sum for r in out]

    def project_step(self, global_step: int) -> bool:
        """Project the parameters' ``.grad`` (the step's whole gradient) against the step's g_ref."""
        reference = self.reference(global_step)
        projected = self.projection.project([p.grad for p in self.params], reference)
        self._sum, self._weight, self._step = None, 0.0, None
        self.steps += 1
        self.projected_steps += int(projected)
        self._since_log[0] += 1
        self._since_log[1] += int(projected)
        return projected

    # ------------------------------------------------------------------ the Trainer's events
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.trainer is not None:
            self.bind_to_trainer(self.trainer)
        return control

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.project_step(state.global_step)
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self._add_metrics is not None and self._since_log[0]:
            self._add_metrics({"projection/projected_share": self._since_log[1] / self._since_log[0]})
        return control

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self._since_log = [0, 0]
        return control


def _accumulation_dtype(p: torch.Tensor) -> torch.dtype:
    """The reference gradient's dtype: the parameter's, at least float32."""
    return torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype


PROJECTIONS: dict[str, type[GradientProjection]] = {"agem": AGEM, "replay_agem": ReplayAGEM}


def make_projection(name: str, **kwargs: Any) -> GradientProjection:
    """A gradient projection from its name (``agem``, ``replay_agem``) and its constructor's arguments."""
    if name not in PROJECTIONS:
        raise ValueError(f"unknown gradient projection {name!r}; one of {sorted(PROJECTIONS)}")
    return PROJECTIONS[name](**kwargs)


__all__ = [
    "AGEM",
    "PROJECTIONS",
    "GradientProjection",
    "MicroBatch",
    "ProjectedGradient",
    "ReplayAGEM",
    "agem_project",
    "make_projection",
]
