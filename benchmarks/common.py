"""Shared set-up of the cost benchmarks (step overhead, constraint scaling, memory).

The model is a ``CLIPModel`` built from a config (no download): ``small`` for CPU runs,
``clip-b16`` the size of OpenAI CLIP ViT-B/16 (vision 768 x 12 layers, patch 16, image
224; text 512 x 12 layers, 77 tokens; 149.6M parameters). Images live in a bank on the
model's device and each row carries an index into it, so a step's time is the model's
forward/backward and the method's work, not host-side image collation (which would be
the same per sample for both sides of every ratio).

* objective: CLIP's two-way contrastive loss on the Trainer's batch of ``b`` pairs;
* constraint k: the same loss on a batch of ``|B_k|`` pairs of "class" k, tolerance 0,
  so every sampled constraint is active and has a penalty gradient;
* the plain step it is compared with: a plain Trainer step on ``b + |B_c| |B_k|`` pairs
  in one forward (the same samples, no constraint machinery).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import time
from typing import Any, Optional

import torch
from torch import nn
from transformers import CLIPConfig, CLIPModel, Trainer, TrainerCallback, TrainingArguments

from hf_constrained import ConstrainedTrainer, ConstrainedTrainingArguments, Constraint
from hf_constrained.atomic_files import atomic_write_text

CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(  # for checking the scripts quickly
        text=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                  max_position_embeddings=16, vocab_size=512),
        vision=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                    image_size=32, patch_size=16),
        projection_dim=32, seq_len=16,
    ),
    "small": dict(  # the CPU benchmark model: ~7.6M parameters
        text=dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                  max_position_embeddings=16, vocab_size=4096),
        vision=dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                    image_size=64, patch_size=16),
        projection_dim=128, seq_len=16,
    ),
    "clip-b16": dict(  # OpenAI CLIP ViT-B/16 sizes
        text=dict(hidden_size=512, num_hidden_layers=12, num_attention_heads=8, intermediate_size=2048,
                  max_position_embeddings=77, vocab_size=49408),
        vision=dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                    image_size=224, patch_size=16),
        projection_dim=512, seq_len=77,
    ),
}


class BankedCLIP(nn.Module):
    """``CLIPModel`` whose images come from a bank on the model's device, by index."""

    def __init__(self, name: str, bank_size: int = 256, seed: int = 0) -> None:
        super().__init__()
        spec = CONFIGS[name]
        config = CLIPConfig(text_config=spec["text"], vision_config=spec["vision"],
                            projection_dim=spec["projection_dim"])
        torch.manual_seed(seed)
        self.clip = CLIPModel(config)
        size = spec["vision"]["image_size"]
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("bank", torch.randn(bank_size, 3, size, size, generator=g), persistent=False)

    def forward(self, input_ids: torch.Tensor, pixel_index: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.clip(input_ids=input_ids, pixel_values=self.bank[pixel_index], return_loss=True)
        return {"loss": out.loss}


def clip_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """h_k(w; B_k): the contrastive loss on a constraint batch (through the wrapped model)."""
    return model(input_ids=batch["input_ids"], pixel_index=batch["pixel_index"])["loss"]


class PairRows(torch.utils.data.Dataset):
    """``n`` rows ``{"input_ids", "pixel_index"}``, deterministic, from a shared token pool."""

    def __init__(self, n: int, seq_len: int, vocab: int, bank_size: int, offset: int = 0, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (n, seq_len), generator=g)
        self.pixels = (torch.arange(n) + offset) % bank_size
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "pixel_index": self.pixels[i]}


class RowView(torch.utils.data.Dataset):
    """Rows ``[start, start + size)`` of a shared dataset (one constraint's data)."""

    def __init__(self, base: PairRows, start: int, size: int) -> None:
        self.base, self.start, self.size = base, start, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.base[(self.start + i) % len(self.base)]


def make_constraints(name: str, m: int, rows_per_constraint: int, bank_size: int) -> list[Constraint]:
    spec = CONFIGS[name]
    pool = PairRows(max(1024, rows_per_constraint), spec["seq_len"], spec["text"]["vocab_size"], bank_size,
                    offset=7, seed=1)
    return [Constraint(name=f"class{k}", fn=clip_loss, dataset=RowView(pool, (k * 37) % len(pool), rows_per_constraint),
                       tolerance=0.0) for k in range(m)]


def make_train_rows(name: str, n: int, bank_size: int) -> PairRows:
    spec = CONFIGS[name]
    return PairRows(n, spec["seq_len"], spec["text"]["vocab_size"], bank_size, seed=2)


class StepTimer(TrainerCallback):
    """Time between consecutive ends of optimizer steps: everything a step costs (data,
    forward, backward, constraint work, optimizer, logging).

    ``times``: wall-clock (``perf_counter``; the GPU numbers, synchronised). ``cpu_times``:
    this process's CPU time (``process_time``); with one torch thread it is the step's
    compute and barely moves when other processes share the cores, so the CPU ratios
    use it.
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self._last: Optional[tuple[float, float]] = None

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = (time.perf_counter(), time.process_time())
        if self._last is not None and state.global_step > self.warmup:
            self.times.append(now[0] - self._last[0])
            self.cpu_times.append(now[1] - self._last[1])
        self._last = now


def base_args(output_dir: str, *, batch: int, steps: int, bf16: bool, cpu: bool) -> dict[str, Any]:
    return dict(
        output_dir=output_dir, per_device_train_batch_size=batch, max_steps=steps, learning_rate=1e-5,
        lr_scheduler_type="constant", optim="adamw_torch", weight_decay=0.1, seed=0, use_cpu=cpu, bf16=bf16,
        report_to=[], save_strategy="no", logging_steps=10, disable_tqdm=True, dataloader_num_workers=0,
        dataloader_pin_memory=not cpu, dataloader_drop_last=True,  # every timed step has a full batch
    )


def make_plain(model_name: str, output_dir: str, *, batch: int, steps: int, bf16: bool, cpu: bool,
               bank_size: int) -> Trainer:
    """A plain Trainer on ``batch`` pairs: the baseline step."""
    model = BankedCLIP(model_name, bank_size)
    args = TrainingArguments(**base_args(output_dir, batch=batch, steps=steps, bf16=bf16, cpu=cpu))
    return Trainer(model=model, args=args, train_dataset=make_train_rows(model_name, max(4 * batch, 512), bank_size))


def make_constrained(model_name: str, output_dir: str, *, batch: int, steps: int, bf16: bool, cpu: bool,
                     bank_size: int, m: int, per_step: int, constraint_batch: int, gamma_prime: float,
                     rows_per_constraint: int = 32) -> ConstrainedTrainer:
    """A ConstrainedTrainer with ``m`` constraints, ``per_step`` (|B_c|) of them sampled per step."""
    model = BankedCLIP(model_name, bank_size)
    args = ConstrainedTrainingArguments(
        **base_args(output_dir, batch=batch, steps=steps, bf16=bf16, cpu=cpu),
        constraint_penalty="hinge", penalty_beta=10.0, msvr_gamma=0.8, msvr_gamma_prime=gamma_prime,
        constraints_per_step=per_step, constraint_batch_size=constraint_batch,
        check_constraint_finite=True,
    )
    return ConstrainedTrainer(model=model, args=args,
                              train_dataset=make_train_rows(model_name, max(4 * batch, 512), bank_size),
                              constraints=make_constraints(model_name, m, rows_per_constraint, bank_size))


def timed_train(trainer: Trainer, warmup: int, clock: str = "wall") -> list[float]:
    """Train and return the per-step times of ``clock``: ``"wall"`` or ``"cpu"`` (process CPU time)."""
    timer = StepTimer(warmup)
    trainer.add_callback(timer)
    trainer.train()
    return timer.cpu_times if clock == "cpu" else timer.times


def train_measuring_memory(trainer: Trainer, *, cpu: bool, gpu_peak_key: str = "peak_allocated") -> dict[str, Any]:
    """Train and return the memory before training and at its peak during it, and the CPU time.

    CPU: the resident set (``rss_before_train``, ``peak_rss``: the process's high-water mark);
    CUDA: ``allocated_before_train`` and ``max_memory_allocated`` (under ``gpu_peak_key``).
    ``peak_growth`` is the peak minus the memory before training; ``train_cpu_seconds`` the
    process CPU time of ``trainer.train()``.
    """
    res: dict[str, Any] = {}
    if cpu:
        res["rss_before_train"] = rss_bytes()
    else:
        trainer.model.to("cuda")
        torch.cuda.synchronize()
        res["allocated_before_train"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    start = time.process_time()
    trainer.train()
    res["train_cpu_seconds"] = time.process_time() - start
    if cpu:
        res["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        res["peak_growth"] = res["peak_rss"] - res["rss_before_train"]
    else:
        torch.cuda.synchronize()
        res[gpu_peak_key] = torch.cuda.max_memory_allocated()
        res["peak_growth"] = res[gpu_peak_key] - res["allocated_before_train"]
    return res


def rss_bytes() -> int:
    """This process's resident set now (Linux ``/proc``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def default_clock(device: str, threads: Optional[int]) -> str:
    """CPU time on CPU with one thread (robust to a shared machine), wall time otherwise."""
    return "cpu" if device == "cpu" and threads == 1 else "wall"


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "torch_threads": torch.get_num_threads(), "os_cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        info["cpu"] = names[0] if names else platform.processor()
    except OSError:
        info["cpu"] = platform.processor()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def summary(times: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(times), "mean_s": statistics.fmean(times), "min_s": min(times),
            "n": len(times)}


def write_json(path: Optional[str], result: dict[str, Any], echo: bool = True) -> None:
    """Write ``result`` to ``path`` atomically (tmp file + rename); ``echo`` also prints it."""
    text = json.dumps(result, indent=2)
    if echo:
        print(text)
    if path:
        atomic_write_text(path, text + "\n")


def add_common_arguments(parser: Any) -> None:
    parser.add_argument("--model", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (the Trainer's bf16=True)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--clock", choices=["auto", "wall", "cpu"], default="auto",
                        help="step time from the wall clock or this process's CPU time; auto: CPU time on CPU "
                        "with --threads 1, else wall")
    parser.add_argument("--bank-size", type=int, default=256)
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    parser.add_argument("--workdir", default="/tmp/hf_constrained_bench")


def setup_threads(threads: Optional[int]) -> None:
    if threads:
        torch.set_num_threads(threads)
