"""Step time and peak memory of the LLM recipe's step: constrained against unconstrained.

The set-up of ``recipes/llm_non_forgetting.py`` with ``recipes/configs/llm_non_forgetting_lora.yaml``
(its defaults), without downloads: a Llama-shaped causal LM built from a config (random
weights), LoRA r16 / alpha 32 / no dropout on all linear layers, synthetic prompt/completion
rows (loss on the completion), three non-forgetting constraints (two protected tasks and a
safety set, h_k = L_k(w) - L_k(w_old) <= 0.02 L_k(w_old), the old per-example losses computed
once before training, one shared row function: the fused step), the hinge with beta 10.

* ``unconstrained``: the same trainer with ``constraint_penalty="none"`` and no constraints
  (the recipe with ``--constraint_penalty none``);
* a constrained variant per ``--variants`` entry ``|B_k|:|B_c|:gamma'`` (``all`` for |B_c| = m):
  ``8:all:0`` is the recipe's default (``constraint_batch_size`` 8, every constraint each
  step, gamma' 0: no look-ahead); ``8:all:0.1`` adds the library's default gamma' 0.1, whose
  look-ahead evaluates the next step's constraint rows without grad. The constraint rows join the
  objective's forward (the model has no dropout: :mod:`hf_constrained.method.shared_forward`); a
  ``:separate`` suffix gives them their own forward and backward graph, as on a model with dropout; a
  ``:replayR`` suffix adds the recipe's ``--replay_old R`` (the protected rows mixed into every objective
  micro-batch, a share R of its rows).

Variants alternate for ``--rounds`` rounds in one process; each ratio is of the median step
times (optimizer steps, ``gradient_accumulation_steps`` micro-batches each). On CUDA each
variant's peak ``torch.cuda.max_memory_allocated`` during training is recorded.

Sizes (``--model``): ``tiny`` (tests), ``proxy`` (a 10.1M-parameter Llama-shaped model, the CPU
proxy), ``0.5b`` (Qwen2.5-0.5B's shape as a Llama: hidden 896, 24 layers, 14 heads, 2 KV heads,
MLP 4864, vocabulary 151,936, tied embeddings: 494M parameters).

    python benchmarks/llm_step.py --model proxy --threads 1 \\
        --variants 8:all:0.1,2:all:0.1,2:all:0,1:all:0,2:1:0 --out benchmarks/results/llm_step_proxy_cpu.json
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Any, Optional

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import default_clock, machine, setup_threads, summary, timed_train, write_json  # noqa: E402

from hf_constrained import ConstrainedTrainer, ConstrainedTrainingArguments  # noqa: E402
from hf_constrained.method.regularisers import Replay  # noqa: E402
from hf_constrained.non_forgetting import ReferenceGap, non_forgetting_constraints  # noqa: E402
from hf_constrained.per_sample_loss import PaddingCollator, causal_lm_per_example_loss  # noqa: E402

LLAMA_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=64, vocab_size=256, tie_word_embeddings=True),
    "proxy": dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=704, vocab_size=16384, tie_word_embeddings=True),
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0),
}
# recipes/configs/llm_non_forgetting_lora.yaml
RECIPE = dict(batch=8, accumulation=2, constraint_batch=8, per_step="all", gamma_prime=0.0, relative_tolerance=0.02,
              reference_batch_size=16, lora_r=16, lora_alpha=32, learning_rate=1e-4, penalty_beta=10.0)
TASKS = ("math", "code", "refusals")


def build_model(size: str, seed: int = 0, device: str = "cpu") -> torch.nn.Module:
    """The Llama-shaped model of ``size`` (random weights) with the recipe's LoRA adapter, initialised
    on ``device`` (a 0.5B model's initialisation on the host takes longer than its GPU steps)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=2048, **LLAMA_SIZES[size]))
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=RECIPE["lora_r"], lora_alpha=RECIPE["lora_alpha"],
                                            lora_dropout=0.0, target_modules="all-linear", bias="none"))


class TokenRows(torch.utils.data.Dataset):
    """``n`` prompt/completion rows of ``seq_len`` tokens (the completion is the second half;
    ``labels`` -100 on the prompt), deterministic from ``seed``."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, vocab, (n, seq_len), generator=g)
        self.prompt = seq_len // 2

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        ids = self.ids[i].tolist()
        return {"input_ids": ids, "attention_mask": [1] * len(ids),
                "labels": [-100] * self.prompt + ids[self.prompt:]}


def parse_variant(text: str) -> tuple[int, Optional[int], float, bool, float]:
    """``"|B_k|:|B_c|:gamma'[:separate][:replayR]"`` -> (constraint_batch_size, constraints_per_step or None for
    all, gamma', whether the constraint rows get their own forward instead of the objective's, replay share R
    or 0)."""
    parts = text.split(":")
    try:
        if len(parts) < 3:
            raise ValueError(text)
        bk, bc, gp, *options = parts
        separate, replay = False, 0.0
        for option in options:
            if option == "separate" and not separate:
                separate = True
            elif option.startswith("replay") and not replay and 0.0 < float(option[len("replay"):]) < 1.0:
                replay = float(option[len("replay"):])
            else:
                raise ValueError(option)
        return int(bk), None if bc == "all" else int(bc), float(gp), separate, replay
    except ValueError:
        raise SystemExit(f"--variants: {text!r} is not |B_k|:|B_c|:gamma'[:separate][:replayR] (e.g. 8:all:0.1, "
                         "8:all:0:replay0.5)") from None


def variant_key(text: str) -> str:
    bk, bc, gp, separate, replay = parse_variant(text)
    return (f"bk{bk}_bc{'all' if bc is None else bc}_gp{gp:g}" + ("_separate" if separate else "")
            + (f"_replay{replay:g}" if replay else ""))


def make_trainer(a: argparse.Namespace, variant: Optional[str], steps: int) -> ConstrainedTrainer:
    """The recipe's trainer for ``variant`` (None: unconstrained)."""
    cpu = a.device == "cpu"
    model = build_model(a.model, device=a.device)
    vocab = LLAMA_SIZES[a.model]["vocab_size"]
    collate = PaddingCollator(pad_token_id=0)
    train = TokenRows(max(4 * a.batch * a.accumulation, 64), a.seq_len, vocab, seed=1)
    common: dict[str, Any] = dict(
        output_dir=os.path.join(a.workdir, f"llm_{variant or 'unconstrained'}"), per_device_train_batch_size=a.batch,
        gradient_accumulation_steps=a.accumulation, max_steps=steps, learning_rate=RECIPE["learning_rate"],
        lr_scheduler_type="constant", max_grad_norm=0.0, seed=0, use_cpu=cpu, bf16=a.bf16, report_to=[],
        save_strategy="no", logging_steps=10, disable_tqdm=True, dataloader_num_workers=0,
        dataloader_drop_last=True, remove_unused_columns=False)
    if variant is None:
        args = ConstrainedTrainingArguments(constraint_penalty="none", **common)
        return ConstrainedTrainer(model=model, args=args, train_dataset=train, data_collator=collate)
    bk, bc, gp, separate, replay = parse_variant(variant)
    args = ConstrainedTrainingArguments(constraint_penalty="hinge", penalty_beta=RECIPE["penalty_beta"],
                                        constraint_batch_size=bk, constraints_per_step=bc, msvr_gamma_prime=gp,
                                        **common)
    protected = {task: TokenRows(a.constraint_rows, a.seq_len, vocab, seed=10 + i) for i, task in enumerate(TASKS)}
    constraints = non_forgetting_constraints(
        model, causal_lm_per_example_loss, protected, collate, relative_tolerance=RECIPE["relative_tolerance"],
        batch_size=RECIPE["reference_batch_size"], row_fn=ReferenceGap(causal_lm_per_example_loss))
    replayed = None if not replay else Replay(  # the recipe's --replay_old: the protected rows, replayed
        torch.utils.data.ConcatDataset(list(protected.values())), replay, collate, seed=0)
    trainer = ConstrainedTrainer(model=model, args=args, train_dataset=train, data_collator=collate,
                                 constraints=constraints, regulariser=replayed)
    if separate:
        trainer._forward_shareable = False  # the rows in their own forward (the library shares it where it can)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(LLAMA_SIZES), default="proxy")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (the recipe's bf16: true)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--clock", choices=["auto", "wall", "cpu"], default="auto")
    parser.add_argument("--batch", type=int, default=RECIPE["batch"], help="per_device_train_batch_size (recipe: 8)")
    parser.add_argument("--accumulation", type=int, default=RECIPE["accumulation"],
                        help="gradient_accumulation_steps (recipe: 2)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per row (half prompt, half completion)")
    parser.add_argument("--constraint-rows", type=int, default=64, help="rows per protected task")
    parser.add_argument("--variants", default="8:all:0",
                        help="comma-separated constrained variants |B_k|:|B_c|:gamma' (recipe default: 8:all:0)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--workdir", default="/tmp/hf_constrained_bench")
    a = parser.parse_args()
    setup_threads(a.threads)
    clock = default_clock(a.device, a.threads) if a.clock == "auto" else a.clock
    variants = [v for v in a.variants.split(",") if v]
    keys = {"unconstrained": None, **{variant_key(v): v for v in variants}}
    times: dict[str, list[float]] = {k: [] for k in keys}
    peak: dict[str, int] = {}
    for r in range(a.rounds):
        for key, variant in keys.items():
            trainer = make_trainer(a, variant, a.steps)
            if a.device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            times[key] += timed_train(trainer, a.warmup, clock)
            if a.device == "cuda":
                peak[key] = max(peak.get(key, 0), torch.cuda.max_memory_allocated())
            print(f"round {r} {key}: median so far {summary(times[key])['median_s']:.4f} s", file=sys.stderr)
            del trainer
            gc.collect()
            if a.device == "cuda":
                torch.cuda.empty_cache()
    stats = {k: summary(v) for k, v in times.items()}
    base = stats["unconstrained"]["median_s"]
    params = build_model(a.model, device="meta")  # counts only
    rows = {"objective_rows_per_step": a.batch * a.accumulation}
    for key, variant in keys.items():
        if variant is not None:
            bk, bc, gp, _, replay = parse_variant(variant)
            with_grad = bk * (len(TASKS) if bc is None else bc)
            rows[key] = {"constraint_rows_with_grad": with_grad, "lookahead_rows_no_grad": with_grad if gp > 0 else 0,
                         "replayed_rows": a.accumulation * round(replay / (1 - replay) * a.batch) if replay else 0}
    result = {
        "benchmark": "llm_step",
        "command": "python benchmarks/llm_step.py " + " ".join(sys.argv[1:]),
        "model": a.model, "llama_config": LLAMA_SIZES[a.model],
        "parameters": sum(p.numel() for p in params.parameters()),
        "trainable_parameters": sum(p.numel() for p in params.parameters() if p.requires_grad),
        "device": a.device, "bf16": a.bf16, "clock": clock, "seq_len": a.seq_len,
        "per_device_train_batch_size": a.batch, "gradient_accumulation_steps": a.accumulation,
        "num_constraints": len(TASKS), "constraint_rows_per_task": a.constraint_rows, "rows": rows,
        "recipe_default_variant": "bk8_bcall_gp0",
        "steps_timed_per_round": a.steps - a.warmup, "rounds": a.rounds,
        "step_time": stats,
        "ratio_to_unconstrained": {k: stats[k]["median_s"] / base for k in keys if k != "unconstrained"},
        "peak_allocated_bytes": peak or None,
        "machine": machine(),
    }
    write_json(a.out, result)


if __name__ == "__main__":
    main()
