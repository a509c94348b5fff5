"""Row-wise CLIP non-forgetting constraints for the cost benchmarks (the fused step).

Constraint k: h_k(w) = mean over its images of [CE_zero-shot(w; image) - CE_zero-shot(w_old; image)],
the per-sample zero-shot cross-entropy over ``num_classes`` class prompts (logits =
cos(image, prompt_c) / 0.05, :class:`hf_constrained.clip.non_forgetting.ZeroShotLoss`) minus
the stored reference value of the same image. All constraints share ONE ``row_fn`` (the
per-row differences), so the trainer evaluates every sampled constraint in one model call
(and the look-ahead in one no-grad call). ``form="scalar"`` declares the same constraints
with a scalar ``fn`` each (the per-constraint path: one call per sampled constraint).

The model is :class:`BankedCLIP` (images from a bank on the device, by index) extended to
take ``pixel_values`` too, which the zero-shot classifier needs.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from common import CONFIGS, BankedCLIP, base_args, make_train_rows
from datasets import Dataset

from hf_constrained import ConstrainedTrainer, ConstrainedTrainingArguments, Constraint, constraints_per_value
from hf_constrained.clip.non_forgetting import ZeroShotLoss


class ZeroShotBankedCLIP(BankedCLIP):
    """``forward(input_ids, pixel_index)`` -> contrastive loss (the objective);
    ``forward(input_ids=prompts, pixel_values=images)`` -> CLIP output with embeddings."""

    def forward(self, input_ids: torch.Tensor, pixel_index: Optional[torch.Tensor] = None,
                pixel_values: Optional[torch.Tensor] = None) -> Any:
        if pixel_values is None:
            return super().forward(input_ids, pixel_index)
        return self.clip(input_ids=input_ids, pixel_values=pixel_values, return_loss=False)


class ImageRows(torch.utils.data.Dataset):
    """Rows ``{"pixel_index", "label", "reference_loss"}`` over a shared pool (one view per constraint)."""

    def __init__(self, pixel_index: torch.Tensor, label: torch.Tensor, reference: torch.Tensor) -> None:
        self.pixel_index, self.label, self.reference = pixel_index, label, reference

    def __len__(self) -> int:
        return self.pixel_index.numel()

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_index": self.pixel_index[i], "label": self.label[i], "reference_loss": self.reference[i]}


def prompts(model_name: str, num_classes: int, seed: int = 3) -> torch.Tensor:
    spec = CONFIGS[model_name]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec["text"]["vocab_size"], (num_classes, spec["seq_len"]), generator=g)


class NonForgettingRows:
    """The shared ``row_fn``: per-image zero-shot CE now minus the stored reference CE.

    The image bank is read from the model at every call, not kept at construction: the
    Trainer moves the model (and with it the bank buffer) to its device after this object
    exists, and a bank kept here would stay on the host, indexed with device indices."""

    def __init__(self, model: ZeroShotBankedCLIP, prompt_ids: torch.Tensor) -> None:
        self.model = model  # the unwrapped module that owns the bank buffer
        self.loss = ZeroShotLoss(prompt_ids, temperature=0.05)

    @property
    def bank(self) -> torch.Tensor:
        return self.model.bank

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        bank = self.bank
        rows = {"pixel_values": bank[batch["pixel_index"].to(bank.device)], "label": batch["label"]}
        return self.loss.per_sample(model, rows) - batch["reference_loss"].to(device=bank.device, dtype=bank.dtype)


def reference_losses(model: ZeroShotBankedCLIP, loss: ZeroShotLoss, pixel_index: torch.Tensor, device: torch.device,
                     batch_size: int = 64) -> torch.Tensor:
    """The old model's zero-shot CE of every (image, class) pair the rows can ask for: a
    ``(bank_size, num_classes)`` table (``nan`` for bank images no row uses).

    Each distinct image is encoded ONCE, on ``device`` (the run's device), and its CE for every
    class comes from the same logits: CE(image, c) = -log_softmax(logits(image))[c], the value
    :meth:`ZeroShotLoss.per_sample` gives for label c. (Encoding each image once per class on
    the host made one build at ViT-B/16 size take about 50 minutes.)"""
    model.to(device)
    images = torch.unique(pixel_index).to(device)
    table = torch.full((model.bank.shape[0], loss.num_classes), float("nan"), device=device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for i in range(0, images.numel(), batch_size):
            ids = images[i:i + batch_size]
            logits = loss.logits(model, model.bank[ids]).float()
            table[ids] = -torch.log_softmax(logits, dim=1)
    model.train(was_training)
    return table.cpu()


def make_rowwise_constrained(model_name: str, output_dir: str, *, batch: int, steps: int, bf16: bool, cpu: bool,
                             bank_size: int, m: int, per_step: int, constraint_batch: int, gamma_prime: float,
                             form: str = "rowwise", num_classes: int = 10, rows_per_constraint: int = 32,
                             share: bool = False, data: str = "rows") -> ConstrainedTrainer:
    """A ConstrainedTrainer with ``m`` non-forgetting constraints over ``num_classes`` prompts
    (constraint k's images carry label k mod ``num_classes``), ``per_step`` sampled per step.

    ``data="rows"``: each constraint's rows are a torch ``Dataset`` of per-row tensors
    (:class:`ImageRows`; collating a batch indexes and stacks every row). ``data="dataset"``: one
    torch-formatted ``datasets.Dataset`` holding every constraint's rows, split by
    :func:`~hf_constrained.constraints_per_value` on a ``constraint`` column (the fused step then
    reads all sampled rows in one column read)."""
    if data not in ("rows", "dataset"):
        raise ValueError(f"data must be 'rows' or 'dataset', got {data!r}")
    args = ConstrainedTrainingArguments(
        **base_args(output_dir, batch=batch, steps=steps, bf16=bf16, cpu=cpu),
        constraint_penalty="hinge", penalty_beta=10.0, msvr_gamma=0.8, msvr_gamma_prime=gamma_prime,
        constraints_per_step=per_step, constraint_batch_size=constraint_batch, check_constraint_finite=True,
        share_constraint_batches=share,
    )
    model = ZeroShotBankedCLIP(model_name, bank_size)
    row_fn = NonForgettingRows(model, prompts(model_name, num_classes))
    pool_size = max(1024, rows_per_constraint)
    g = torch.Generator().manual_seed(5)
    pool_pixels = torch.randint(0, bank_size, (pool_size,), generator=g)
    constraints = []
    # the reference values: the model before training, each image encoded once on the run's device
    table = reference_losses(model, row_fn.loss, pool_pixels, args.device)
    refs = {c: table[pool_pixels, c] for c in range(min(num_classes, m))}
    if form not in ("rowwise", "scalar"):
        raise ValueError(f"form must be 'rowwise' or 'scalar', got {form!r}")
    columns: dict[str, list] = {"pixel_index": [], "label": [], "reference_loss": [], "constraint": []}
    for k in range(m):
        c = k % num_classes
        start = (k * 37) % (pool_size - rows_per_constraint + 1)
        sl = slice(start, start + rows_per_constraint)
        if data == "dataset":
            columns["pixel_index"] += pool_pixels[sl].tolist()
            columns["label"] += [c] * rows_per_constraint
            columns["reference_loss"] += refs[c][sl].tolist()
            columns["constraint"] += [k] * rows_per_constraint
            continue
        rows = ImageRows(pool_pixels[sl], torch.full((rows_per_constraint,), c, dtype=torch.long), refs[c][sl])
        if form == "rowwise":
            constraints.append(Constraint(name=f"class{k}", row_fn=row_fn, dataset=rows, tolerance=0.0))
        elif form == "scalar":
            constraints.append(Constraint(name=f"class{k}", fn=lambda mdl, b: row_fn(mdl, b).mean(), dataset=rows,
                                          tolerance=0.0))
    if data == "dataset":
        rows_table = Dataset.from_dict(columns).with_format("torch")
        kind = dict(row_fn=row_fn) if form == "rowwise" else dict(fn=lambda mdl, b: row_fn(mdl, b).mean())
        constraints = constraints_per_value(rows_table, "constraint", name="class{value}", **kind)
    return ConstrainedTrainer(model=model, args=args,
                              train_dataset=make_train_rows(model_name, max(4 * batch, 512), bank_size),
                              constraints=constraints)
