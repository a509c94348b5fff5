"""The two-way global contrastive objective of the CLIP experiment (Setting II, Algorithm 2).

For a positive image-text pair i of the target data and the negatives j of the (global)
batch, with s_ab = <E_1(x_a), E_2(t_b)> (normalised embeddings) and temperature t:

    image side:  g_i^I(w) = mean_j exp((s_ij - s_ii) / t)      (other texts vs. its own)
    text side:   g_i^T(w) = mean_j exp((s_ji - s_ii) / t)      (other images vs. its own)
    F(w) = (1/n) sum_i  t log g_i^I(w) + t log g_i^T(w)        (f_i = t log, Setting II, Appendix E)

Only positives are anchors and other positives are never negatives (the reference code's
choice: the batch is half target pairs, half other pairs). One MSVR estimator u_{1,i} per
training sample and side tracks g_i (Algorithm 2, line 6), and the gradient is

    G_1 = mean_i  mean_j  stop_grad(exp(d_ij / t) / u_i) * grad d_ij      (Algorithm 2, line 9)

which is what the surrogate loss ``mean_i mean_j sg(exp(d_ij/t)/u_i) d_ij`` yields. Every
exponential is computed in fp32 (d/t reaches 40 at t = 0.05).

Multi-process: features are all-gathered with gradients (:func:`gather_with_grad`), every
rank computes the loss and the estimator updates of the whole global batch, so the
estimators stay identical on all ranks, and DDP's gradient average gives the gradient of
the global loss (each rank's slice receives the sum over ranks of the identical loss).

The previous-iterate term g_i(w_{t-1}; B^t) needs the batch of step t while the parameters
are still w_{t-1}: :meth:`ContrastiveConstrainedTrainer.get_batch_samples` fetches one
accumulation window ahead and evaluates it under ``no_grad`` right away (the parameters are
w_{t-1} then). The values are kept per (step, batch of the window), not per sample: a
sample can sit in two consecutive windows (always so when half-positive batches cycle the
positives), and its value on B^{t+1} must not replace the one on B^t that step t still
needs. The correction term is dropped where that value does not exist: the first window of
each epoch and the first window after a resume.
"""

from __future__ import annotations

import logging
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Optional, Union

import torch
from torch import nn

from ..config import ConstrainedTrainingArguments
from ..method.estimators import MSVREstimator, parse_gamma_prime, resolve_gamma_prime, run_precision
from ..method.shared_forward import SharedObjectiveForward, trains_as_it_evaluates
from ..trainer import ConstrainedTrainer
from ..trainer_internals import trainer_num_items_in_batch, trainer_prepare_inputs
from .encode import clip_embeddings

if torch.distributed.is_available():
    from torch.distributed.nn.functional import all_gather as _differentiable_all_gather

logger = logging.getLogger(__name__)

OBJECTIVE_KEYS = ("pixel_values", "input_ids", "is_positive", "sample_index")


def _distributed_world() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """Concatenate ``x`` from all processes along dim 0, keeping the autograd graph.

    Single process: ``x`` itself. Multi-process: torch's differentiable all-gather
    (``torch.distributed.nn.functional.all_gather``), whose backward sums the gradients of
    every rank into the local slice (a reduce-scatter on NCCL), so with every rank computing
    the same global loss and DDP averaging, the update is the gradient of the global loss
    (Algorithm 2 on the global batch). All ranks must pass the same shape (use
    ``dataloader_drop_last`` or accelerate's ``even_batches``).
    """
    if _distributed_world() == 1:
        return x
    with warnings.catch_warnings():
        # recent torch marks it deprecated in favour of a private module
        # (torch.distributed._functional_collectives): the public one is kept, the notice silenced
        warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_gather is deprecated",
                                category=FutureWarning)
        parts = _differentiable_all_gather(x)
    return torch.cat(parts, dim=0)


def _gather_plain(x: torch.Tensor) -> torch.Tensor:
    """All-gather without gradients (indices, flags)."""
    world = _distributed_world()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=0)


@dataclass
class ContrastiveTerms:
    """The pieces of the global contrastive loss on one batch (P positives, N negatives).

    ``d_image[i, j] = s(x_i, t_j) - s(x_i, t_i)``, ``d_text[i, j] = s(x_j, t_i) - s(x_i, t_i)``
    (with grad); ``g_image``/``g_text`` = mean_j exp(d/t), detached: g_i(w_t; B^t).
    """

    d_image: torch.Tensor
    d_text: torch.Tensor
    exp_image: torch.Tensor
    exp_text: torch.Tensor
    positive: torch.Tensor

    @property
    def g_image(self) -> torch.Tensor:
        return self.exp_image.mean(dim=1)

    @property
    def g_text(self) -> torch.Tensor:
        return self.exp_text.mean(dim=1)

    @property
    def num_positives(self) -> int:
        return self.d_image.shape[0]

    @property
    def num_negatives(self) -> int:
        return self.d_image.shape[1]


def contrastive_terms(image_embeds: torch.Tensor, text_embeds: torch.Tensor, is_positive: torch.Tensor,
                      temperature: float) -> ContrastiveTerms:
    """Pairwise differences and inner-function values g_i on a (global) batch.

    Args:
        image_embeds, text_embeds: (N, d) normalised embeddings of the batch's pairs, row a
            of one matching row a of the other.
        is_positive: (N,) bool; positives are the anchors, the others the negatives.
        temperature: t (0.05 in the paper).
    """
    # at least fp32 (float64 in a float64 run): the exponentials reach exp(40) at t = 0.05
    dtype = torch.promote_types(image_embeds.dtype, torch.float32)
    image_embeds, text_embeds = image_embeds.to(dtype), text_embeds.to(dtype)
    pos = is_positive.bool().to(image_embeds.device)
    neg = ~pos
    sim = image_embeds @ text_embeds.T  # sim[a, b] = <E_1(x_a), E_2(t_b)>
    own = sim.diagonal()[pos]  # s_ii of the positives
    d_image = sim[pos][:, neg] - own[:, None]
    d_text = sim[neg][:, pos].T - own[:, None]
    exp_image = torch.exp(d_image.detach() / temperature)
    exp_text = torch.exp(d_text.detach() / temperature)
    return ContrastiveTerms(d_image, d_text, exp_image, exp_text, pos)


def contrastive_surrogate(terms: ContrastiveTerms, u_image: torch.Tensor, u_text: torch.Tensor) -> torch.Tensor:
    """``mean_i mean_j sg(exp(d_ij/t) / u_i) d_ij`` over both sides: its gradient is G_1."""
    eps = torch.finfo(torch.float32).tiny
    w_image = terms.exp_image / u_image.clamp_min(eps)[:, None]
    w_text = terms.exp_text / u_text.clamp_min(eps)[:, None]
    return (w_image * terms.d_image).mean(dim=1).mean() + (w_text * terms.d_text).mean(dim=1).mean()


def contrastive_value(terms: ContrastiveTerms, temperature: float) -> torch.Tensor:
    """The mini-batch objective value mean_i t log g_i^I + t log g_i^T (detached)."""
    return temperature * (torch.log(terms.g_image).mean() + torch.log(terms.g_text).mean())


def _first_occurrence(index: torch.Tensor) -> torch.Tensor:
    """Mask of the first occurrence of each value (padding of uneven last batches repeats rows)."""
    if index.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=index.device)
    order = torch.argsort(index, stable=True)
    sorted_idx = index[order]
    first_sorted = torch.ones_like(sorted_idx, dtype=torch.bool)
    first_sorted[1:] = sorted_idx[1:] != sorted_idx[:-1]
    mask = torch.zeros_like(first_sorted)
    mask[order] = first_sorted
    return mask


class PreviousIterate(NamedTuple):
    """g_i(w_{t-1}; B^t) of the positives of one batch of window t, computed at w_{t-1}.

    ``step`` is t (the optimizer step that consumes it), ``index`` the positives' dataset
    indices (first occurrences, in batch order), ``image``/``text`` their values.
    """

    step: int
    index: torch.Tensor
    image: torch.Tensor
    text: torch.Tensor


class HalfPositiveSampler(torch.utils.data.Sampler):
    """Row order with positives and negatives alternating, so every batch of even size is half
    positives (the reference code's target batches). An epoch has ``2 * max(P, N)`` rows: the
    smaller side is cycled through fresh permutations. Seeded by ``(seed, epoch)``."""

    def __init__(self, is_positive: list[bool], seed: int = 0) -> None:
        flags = torch.as_tensor([bool(x) for x in is_positive])
        self.positives = torch.nonzero(flags).flatten()
        self.negatives = torch.nonzero(~flags).flatten()
        if len(self.positives) == 0 or len(self.negatives) == 0:
            raise ValueError(f"half-positive batches need both kinds of rows; got {len(self.positives)} positives "
                             f"and {len(self.negatives)} negatives")
        self.seed, self.epoch, self._epoch_set = int(seed), 0, False

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._epoch_set = int(epoch), True

    def __len__(self) -> int:
        return 2 * max(len(self.positives), len(self.negatives))

    def _cycled(self, rows: torch.Tensor, length: int, gen: torch.Generator) -> torch.Tensor:
        reps = -(-length // len(rows))
        return torch.cat([rows[torch.randperm(len(rows), generator=gen)] for _ in range(reps)])[:length]

    def __iter__(self) -> Iterator[int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        if not self._epoch_set:
            self.epoch += 1
        half = len(self) // 2
        order = torch.stack([self._cycled(self.positives, half, gen), self._cycled(self.negatives, half, gen)], dim=1)
        return iter(order.flatten().tolist())


class ContrastiveConstrainedTrainer(ConstrainedTrainer):
    """:class:`~hf_constrained.ConstrainedTrainer` with the global contrastive objective (Algorithm 2).

    The train dataset's rows are collated into batches with ``pixel_values``, ``input_ids``
    (optionally ``attention_mask``, ``text_class_ids``), ``is_positive`` and
    ``sample_index`` (the row's position in the train dataset, which indexes its two MSVR
    estimators); :class:`~hf_constrained.clip.data.CLIPCollator` makes them.

    Args:
        contrastive_temperature: t of the contrastive loss (paper: 0.05).
        half_positive_batches: order the rows so every batch is half positives, half negatives
            (:class:`HalfPositiveSampler`, as the reference code); default: plain shuffling.
        **kwargs: as for :class:`~hf_constrained.ConstrainedTrainer`. The objective
            estimators use ``args.objective_msvr_gamma`` / ``args.objective_msvr_gamma_prime``.
    """

    def __init__(self, model: Union[nn.Module, None] = None, args: Optional[ConstrainedTrainingArguments] = None,
                 *, contrastive_temperature: float = 0.05, half_positive_batches: bool = False,
                 **kwargs: Any) -> None:
        if not contrastive_temperature > 0:
            raise ValueError(f"contrastive_temperature must be > 0, got {contrastive_temperature}")
        super().__init__(model, args, **kwargs)
        self.contrastive_temperature = float(contrastive_temperature)
        self.half_positive_batches = half_positive_batches
        if half_positive_batches and self.args.per_device_train_batch_size % 2:
            raise ValueError("half_positive_batches needs an even per_device_train_batch_size, got "
                             f"{self.args.per_device_train_batch_size}")
        self.objective_estimators: dict[str, MSVREstimator] = {}
        # look-ahead window: (epoch iterator, its batches, their previous-iterate values)
        self._lookahead: Optional[tuple[Iterator, list, list[Optional[PreviousIterate]]]] = None
        # the previous-iterate values of the window being trained on, one entry per batch, in order
        self._window_previous: deque[Optional[PreviousIterate]] = deque()
        if self.train_dataset is not None:
            n = len(self.train_dataset)  # one estimator slot per row (indexed by sample_index)
            configured = parse_gamma_prime(self.args.objective_msvr_gamma_prime, "objective_msvr_gamma_prime")
            # the theory value counts the anchors (positives); a number needs no count
            counts = self._anchor_counts() if configured == "theory" else (n, min(n, 1))
            gamma_prime = resolve_gamma_prime(configured, *counts, self.args.objective_msvr_gamma)
            for side in ("image", "text"):
                self.objective_estimators[side] = MSVREstimator(n, self.args.objective_msvr_gamma, gamma_prime,
                                                                device=self.args.device,
                                                                dtype=run_precision(self.model))

    def _positive_flags(self, data: Any) -> list[bool]:
        column = data.column("is_positive") if hasattr(data, "column") else [data[i]["is_positive"]
                                                                             for i in range(len(data))]
        return [bool(x) for x in column]

    def _anchor_counts(self) -> tuple[int, float]:
        """(n, |B|) of Algorithm 2's theory value of gamma' (Appendix E:
        ``gamma' = (n - |B|) / (|B| (1 - gamma)) + 1 - gamma``): F averages over the n anchors i,
        which are the positive pairs, and B^t is the set of anchors of one step's global batch: half
        of it with ``half_positive_batches``, else its expected share of positives (at least one; then
        n / |B| equals rows / batch, so counting rows gave the same value). Counting every row
        (negatives too) misstates n / |B| with half-positive batches unless half the rows are positive."""
        positives = sum(self._positive_flags(self.train_dataset))
        if positives == 0:
            raise ValueError("objective_msvr_gamma_prime='theory': the train dataset has no positive rows "
                             "(is_positive), so the contrastive objective has no anchors to count")
        global_batch = self.args.per_device_train_batch_size * max(self.args.world_size, 1)
        if self.half_positive_batches:
            anchors = float(global_batch // 2)
        else:
            anchors = global_batch * positives / len(self.train_dataset)
        return positives, min(max(anchors, 1.0), float(positives))

    # ------------------------------------------------------------------ data plumbing
    def train_sampler(self, train_dataset: Any = None) -> Any:
        if not self.half_positive_batches:
            return super().train_sampler(train_dataset)
        data = self.train_dataset if train_dataset is None else train_dataset
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        return HalfPositiveSampler(self._positive_flags(data), seed=seed)

    def drop_unused_columns(self, dataset: Any, description: Optional[str] = None) -> Any:
        return dataset  # the collator needs the raw columns (image, caption, is_positive, ...)

    def collator_without_unused_columns(self, data_collator: Any, description: Optional[str] = None) -> Any:
        return data_collator

    @property
    def _uses_previous_iterate(self) -> bool:
        est = self.objective_estimators.get("image")
        return est is not None and est.gamma_prime > 0

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int, device: torch.device) -> tuple[list, Any]:
        """Return this window's batches and evaluate the NEXT window at the current parameters.

        The current parameters are w_t and the next window is B^{t+1}, so this computes
        g_i(w_t; B^{t+1}): the previous-iterate term of step t+1 (Algorithm 2, line 6). It
        is kept with that window's batches and handed to step t+1 only, batch by batch.
        """
        if not self._uses_previous_iterate:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._lookahead is not None and self._lookahead[0] is epoch_iterator:
            _, batches, previous = self._lookahead
        else:  # first window of an epoch or after a resume: no value at the previous iterate
            batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
            previous = [None] * len(batches)
        self._window_previous = deque(previous)
        upcoming, _ = super().get_batch_samples(epoch_iterator, self.args.gradient_accumulation_steps, device)
        if upcoming:
            step = self.state.global_step + 1
            self._lookahead = (epoch_iterator, upcoming, [self._evaluate_previous(b, step) for b in upcoming])
        else:
            self._lookahead = None
        return batches, trainer_num_items_in_batch(self, batches, device)

    @torch.no_grad()
    def _evaluate_previous(self, batch: Any, step: int) -> Optional[PreviousIterate]:
        """g_i(w; B) of the positives of ``batch`` at the current parameters w."""
        model = self.model_wrapped if self.model_wrapped is not None else self.model
        terms, index = self._global_terms(model, trainer_prepare_inputs(self, batch))
        if terms.num_positives == 0 or terms.num_negatives == 0:
            return None
        keep = _first_occurrence(index)
        return PreviousIterate(step, index[keep], terms.g_image[keep], terms.g_text[keep])

    def _take_previous(self, index: torch.Tensor) -> dict[str, Optional[torch.Tensor]]:
        """The previous-iterate values for this batch's positives ``index`` (first occurrences).

        Consumes the next batch's entry of the window; ``None`` (correction dropped) where
        there is none or it was computed for another step or other rows.
        """
        entry = self._window_previous.popleft() if self._window_previous else None
        if entry is None:
            return {"image": None, "text": None}
        if entry.step != self.state.global_step or not torch.equal(entry.index.to(index.device), index):
            logger.warning("the previous-iterate values of step %d do not match this batch (step %d): MSVR "
                           "correction dropped for it", entry.step, self.state.global_step)
            return {"image": None, "text": None}
        return {"image": entry.image, "text": entry.text}

    # ------------------------------------------------------------------ objective
    def _check_batch(self, inputs: dict[str, Any]) -> None:
        missing = [k for k in OBJECTIVE_KEYS if k not in inputs]
        if missing:
            raise KeyError(
                f"the contrastive objective needs batch keys {list(OBJECTIVE_KEYS)}; missing {missing}. "
                "Collate the train rows with hf_constrained.clip.data.CLIPCollator"
            )

    def _global_terms(self, model: nn.Module, inputs: dict[str, Any]) -> tuple[ContrastiveTerms, torch.Tensor]:
        """One forward, gather over processes, and the terms on the global batch.

        Returns the terms and the global dataset indices of the positives.
        """
        self._check_batch(inputs)
        image, text = clip_embeddings(model, inputs["pixel_values"], inputs["input_ids"],
                                      inputs.get("attention_mask"), inputs.get("text_class_ids"))
        return self._terms_from_embeddings(image, text, inputs)

    def _terms_from_embeddings(self, image: torch.Tensor, text: torch.Tensor,
                               inputs: dict[str, Any]) -> tuple[ContrastiveTerms, torch.Tensor]:
        """The terms on the global batch from this process's embeddings of ``inputs``."""
        image, text = gather_with_grad(image), gather_with_grad(text)
        positive = _gather_plain(inputs["is_positive"].to(image.device).long()).bool()  # NCCL-safe dtype
        index = _gather_plain(inputs["sample_index"].to(image.device).long())
        terms = contrastive_terms(image, text, positive, self.contrastive_temperature)
        return terms, index[positive]

    def compute_objective_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                               num_items_in_batch: Optional[Union[torch.Tensor, int]] = None) -> Any:
        """G_1 of Algorithm 2 (lines 3-9) on the global batch; the returned value is the batch
        objective mean_i t log g_i, the gradient that of the surrogate with u^t."""
        terms, index = self._global_terms(model, inputs)
        return self._objective_from_terms(terms, index, return_outputs)

    def _objective_from_terms(self, terms: ContrastiveTerms, index: torch.Tensor, return_outputs: bool) -> Any:
        """Algorithm 2, lines 3-9, on the global batch's terms (see :meth:`compute_objective_loss`)."""
        training = self.in_training_step and bool(self.objective_estimators)
        previous: dict[str, Optional[torch.Tensor]] = {"image": None, "text": None}
        if training and self._uses_previous_iterate:
            # consumed for every batch of the window (also one without anchors) to stay aligned
            previous = self._take_previous(index[_first_occurrence(index)])
        if terms.num_positives == 0 or terms.num_negatives == 0:
            # nothing to contrast in this batch: a zero loss that keeps the graph (DDP needs a backward)
            loss = 0.0 * (terms.d_image.sum() + terms.d_text.sum())
            logger.debug("batch without positives or negatives: zero objective")
            return (loss, None) if return_outputs else loss
        g_image, g_text = terms.g_image, terms.g_text
        if training:
            n = self.objective_estimators["image"].size
            if int(index.max()) >= n or int(index.min()) < 0:
                raise IndexError(f"sample_index {int(index.max())} outside the train dataset of {n} rows")
            keep = _first_occurrence(index)
            u = {}
            for side, g in (("image", g_image), ("text", g_text)):
                est = self.objective_estimators[side]
                u_t = est.get(index, fallback=g).to(g)  # u_{1,i}^t: Algorithm 2 weighs with it (line 9)
                # g_i > 0 but the MSVR correction can push u below 0 when g moves by orders of
                # magnitude between iterates; f_i = t log needs u > 0, so such entries use g_i(w_t; B)
                u[side] = torch.where(torch.isfinite(u_t) & (u_t > 0), u_t, g)
                est.update(index[keep], g[keep], previous[side])
            u_image, u_text = u["image"].to(g_image), u["text"].to(g_text)
        else:  # evaluation: no state change, u = the batch value
            u_image, u_text = g_image, g_text
        surrogate = contrastive_surrogate(terms, u_image, u_text)
        value = contrastive_value(terms, self.contrastive_temperature)
        if self.in_training_step and not torch.isfinite(surrogate.detach()).item():
            raise FloatingPointError(
                f"the contrastive objective is {surrogate.item()} at step {self.state.global_step} "
                f"(exp(d/t) with t = {self.contrastive_temperature} over-/underflowed or the embeddings are NaN): "
                "lower the learning rate or clip gradients (max_grad_norm)"
            )
        loss = surrogate + (value - surrogate).detach()  # value for logs, gradient of the surrogate
        return (loss, None) if return_outputs else loss

    def objective_forward_shareable(self) -> bool:
        """Whether constraint rows may join the contrastive objective's forward (one vision and one text tower
        call for the batch's and the constraint rows' images and texts: :class:`~.non_forgetting.MergedCLIPForward`):
        the objective is this class's own and the model trains as it evaluates (no dropout)."""
        if self._forward_shareable is None:
            self._forward_shareable = (
                type(self).compute_objective_loss is ContrastiveConstrainedTrainer.compute_objective_loss
                and trains_as_it_evaluates(self.model))
            logger.info("constraint rows %s the objective's forward", "share" if self._forward_shareable else "skip")
        return self._forward_shareable

    def shared_objective_forward(self, inputs: dict[str, Any], objective: Any) -> Optional[SharedObjectiveForward]:
        """Every contrastive batch can take constraint images, except one with per-class text heads."""
        return None if "text_class_ids" in inputs else SharedObjectiveForward(inputs, objective)

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: Optional[list[str]] = None) -> tuple:
        inputs = trainer_prepare_inputs(self, inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    # ------------------------------------------------------------------ state
    def constraint_state_dict(self) -> dict[str, Any]:
        state = super().constraint_state_dict()
        state["objective"] = {side: est.state_dict() for side, est in self.objective_estimators.items()}
        return state

    def load_constraint_state_dict(self, state: dict[str, Any]) -> None:
        super().load_constraint_state_dict(state)
        for side, est_state in state.get("objective", {}).items():
            if side in self.objective_estimators:
                self.objective_estimators[side].load_state_dict(est_state)
