"""Step time and peak memory of the LLM recipe's step: constrained against unconstrained.

The set-up of ``recipes/llm_non_forgetting.py`` with ``recipes/configs/llm_non_forgetting_lora.yaml``
(its defaults), without downloads: a Llama-shaped causal LM built from a config (random
weights), LoRA r16 / alpha 32 / no dropout on all linear layers, synthetic prompt/completion
rows (loss on the completion), three non-forgetting constraints (two protected tasks and a
safety set, h_k = L_k(w) - L_k(w_old) <= 0.02 L_k(w_old), the old per-example losses computed
once before training, one shared row function: the fused step), the hinge at the recipe's settings
(``BENCHMARK_DEFAULTS``: beta 0.25, gamma 0.2, margin 0.02; step time does not depend on them).

* ``unconstrained``: the same trainer with ``constraint_penalty="none"`` and no constraints
  (the recipe with ``--constraint_penalty none``);
* a constrained variant per ``--variants`` entry ``|B_k|:|B_c|:gamma'`` (``all`` for |B_c| = m), with options:
  ``:replayR`` adds the recipe's ``--replay_old R`` (replay of the constraints' own rows of each step at share R of
  the loss: ``ConstraintRowReplay``, one draw of old rows); ``:ownreplayR`` replay drawing rows of its own instead
  (``Replay``: the protected rows mixed into every objective micro-batch, a share R of its rows, the recipe's replay
  before the one-draw step); ``:nopenalty`` runs it with ``constraint_penalty="none"`` (with ``:replayR``: the
  recipe's ``--constraint_penalty none --replay_old R``, replay of the same rows without the hinge);
  ``:splitF`` two-split estimation with the proxy indicator
  (``--constraint_indicator_fraction F --constraint_proxy_indicator true``: |B_k| indicator rows per constraint
  and step, forward only, scored by the old model's exact match); ``:proxy`` the proxy indicator with one split
  (``--constraint_proxy_indicator true`` alone: the statistic scored on the gradient's own rows, in their forward);
  ``:separate`` gives the constraint rows their
  own forward and backward graph, as on a model with dropout (otherwise they join the objective's forward where
  :mod:`hf_constrained.method.shared_forward` allows it: no regulariser but replay of the constraint rows).
  ``8:all:0:replay0.5:split0.25`` is the recipe's default (:data:`RECIPE_DEFAULT_VARIANT`; ``8:all:0.1:...`` the
  default before the twentieth tuning round, with the look-ahead); ``8:all:0`` its earlier default (no replay, one
  split, no look-ahead); gamma' > 0 adds the look-ahead (the next step's constraint rows, forward only).

Variants alternate for ``--rounds`` rounds in one process; each ratio is of the median step
times (optimizer steps, ``gradient_accumulation_steps`` micro-batches each). On CUDA each
variant's peak ``torch.cuda.max_memory_allocated`` during training is recorded.

Sizes (``--model``): ``tiny`` (tests), ``proxy`` (a 10.1M-parameter Llama-shaped model, the CPU
proxy), ``0.5b`` (Qwen2.5-0.5B's shape as a Llama: hidden 896, 24 layers, 14 heads, 2 KV heads,
MLP 4864, vocabulary 151,936, tied embeddings: 494M parameters).

    python benchmarks/llm_step.py --model proxy --threads 1 \\
        --variants 8:all:0:replay0.5:split0.25,8:all:0 --out /tmp/llm_step.json
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Any, NamedTuple, Optional

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import default_clock, machine, setup_threads, summary, timed_train, write_json  # noqa: E402

from hf_constrained import ConstrainedTrainer, ConstrainedTrainingArguments  # noqa: E402
from hf_constrained.method.regularisers import ConstraintRowReplay, Replay  # noqa: E402
from hf_constrained.non_forgetting import NonForgettingConfig, ReferenceGap, non_forgetting_constraints  # noqa: E402
from hf_constrained.per_sample_loss import (  # noqa: E402
    PaddingCollator,
    causal_lm_per_example_correct,
    causal_lm_per_example_loss,
)
from hf_constrained.recipes.llm_non_forgetting import BENCHMARK_DEFAULTS  # noqa: E402

LLAMA_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=64, vocab_size=256, tie_word_embeddings=True),
    "proxy": dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=704, vocab_size=16384, tie_word_embeddings=True),
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0),
}
# recipes/configs/llm_non_forgetting_lora.yaml
RECIPE = dict(batch=8, accumulation=2, relative_tolerance=0.02, forget_tolerance=0.05, reference_batch_size=16,
              lora_r=16, lora_alpha=32, learning_rate=1e-4)
RECIPE_DEFAULT_VARIANT = "8:all:0:replay0.5:split0.25"  # BENCHMARK_DEFAULTS and the recipe's --replay_old 0.5
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


class Variant(NamedTuple):
    """A constrained variant of the step (``--variants``)."""

    constraint_batch_size: int
    constraints_per_step: Optional[int]  # None: all
    gamma_prime: float
    separate: bool  # the constraint rows in their own forward
    replay: float  # the recipe's --replay_old (0: none): replay of the constraints' rows
    split: float  # two-split estimation with the proxy indicator (0: one split)
    own_replay: float = 0.0  # replay drawing rows of its own (Replay)
    no_penalty: bool = False  # constraint_penalty "none"
    proxy: bool = False  # the proxy indicator with one split (the statistic on the gradient's rows)


def parse_variant(text: str) -> Variant:
    """``"|B_k|:|B_c|:gamma'[:separate][:nopenalty][:proxy][:replayR][:ownreplayR][:splitF]"`` -> :class:`Variant`."""
    parts = text.split(":")
    try:
        if len(parts) < 3:
            raise ValueError(text)
        bk, bc, gp, *options = parts
        flags = {"separate": False, "nopenalty": False, "proxy": False}
        shares = {"ownreplay": 0.0, "replay": 0.0, "split": 0.0}
        for option in options:
            name = next((n for n in shares if option.startswith(n)), None)
            if option in flags and not flags[option]:
                flags[option] = True
            elif name and not shares[name] and 0.0 < float(option[len(name):]) < 1.0:
                shares[name] = float(option[len(name):])
            else:
                raise ValueError(option)
        if (shares["replay"] and shares["ownreplay"]) or (flags["proxy"] and shares["split"]):
            raise ValueError(text)
        return Variant(int(bk), None if bc == "all" else int(bc), float(gp), flags["separate"], shares["replay"],
                       shares["split"], shares["ownreplay"], flags["nopenalty"], flags["proxy"])
    except ValueError:
        raise SystemExit(f"--variants: {text!r} is not |B_k|:|B_c|:gamma'[:separate][:nopenalty][:replayR or "
                         f":ownreplayR][:splitF or :proxy] (e.g. 8:all:0, {RECIPE_DEFAULT_VARIANT})") from None


def variant_key(text: str) -> str:
    v = parse_variant(text)
    return (f"bk{v.constraint_batch_size}_bc{'all' if v.constraints_per_step is None else v.constraints_per_step}"
            f"_gp{v.gamma_prime:g}" + ("_separate" if v.separate else "")
            + ("_nopenalty" if v.no_penalty else "") + ("_proxy" if v.proxy else "")
            + (f"_replay{v.replay:g}" if v.replay else "")
            + (f"_ownreplay{v.own_replay:g}" if v.own_replay else "") + (f"_split{v.split:g}" if v.split else ""))


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
    v = parse_variant(variant)
    estimation = dict(BENCHMARK_DEFAULTS, constraint_indicator_fraction=v.split or None,
                      constraint_proxy_indicator=bool(v.split) or v.proxy,
                      constraint_batch_size=v.constraint_batch_size, msvr_gamma_prime=v.gamma_prime)
    args = ConstrainedTrainingArguments(constraint_penalty="none" if v.no_penalty else "hinge",
                                        constraints_per_step=v.constraints_per_step, **estimation, **common)
    protected = {task: TokenRows(a.constraint_rows, a.seq_len, vocab, seed=10 + i) for i, task in enumerate(TASKS)}
    # the proxy indicator scores the certificate's statistic (rows forgotten): it needs certification rows (64: a
    # split that can certify the recipe's 0.05, so the library does not warn; never read while the step is timed)
    certify = None if not (v.split or v.proxy) else {task: TokenRows(64, a.seq_len, vocab, seed=20 + i)
                                        for i, task in enumerate(TASKS)}
    constraints = non_forgetting_constraints(
        model, causal_lm_per_example_loss, protected, collate, row_fn=ReferenceGap(causal_lm_per_example_loss),
        certify_datasets=certify, correct=causal_lm_per_example_correct if certify else None,
        config=NonForgettingConfig(relative_tolerance=RECIPE["relative_tolerance"],
                                   batch_size=RECIPE["reference_batch_size"],
                                   forget_tolerance=RECIPE["forget_tolerance"] if certify else None,
                                   old_correct_on_rows=bool(certify)))
    replayed = ConstraintRowReplay(v.replay) if v.replay else None if not v.own_replay else Replay(
        torch.utils.data.ConcatDataset(list(protected.values())), v.own_replay, collate, seed=0)
    trainer = ConstrainedTrainer(model=model, args=args, train_dataset=train, data_collator=collate,
                                 constraints=constraints, regulariser=replayed)
    if v.separate:
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
    parser.add_argument("--variants", default=RECIPE_DEFAULT_VARIANT,
                        help="comma-separated constrained variants "
                             "|B_k|:|B_c|:gamma'[:separate][:nopenalty][:replayR][:splitF or :proxy] "
                             f"(the recipe's default: {RECIPE_DEFAULT_VARIANT})")
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
            v = parse_variant(variant)
            per_step = v.constraint_batch_size * (len(TASKS) if v.constraints_per_step is None
                                                  else v.constraints_per_step)
            hinge = not v.no_penalty
            rows[key] = {"constraint_rows_with_grad": per_step,
                         "lookahead_rows_no_grad": per_step if hinge and v.gamma_prime > 0 else 0,
                         "indicator_rows_no_grad": per_step if hinge and v.split else 0,
                         # replay of the constraints' rows adds none; replay of its own draws these
                         "replayed_rows": (a.accumulation * round(v.own_replay / (1 - v.own_replay) * a.batch)
                                           if v.own_replay else 0)}
    result = {
        "benchmark": "llm_step",
        "command": "python benchmarks/llm_step.py " + " ".join(sys.argv[1:]),
        "model": a.model, "llama_config": LLAMA_SIZES[a.model],
        "parameters": sum(p.numel() for p in params.parameters()),
        "trainable_parameters": sum(p.numel() for p in params.parameters() if p.requires_grad),
        "device": a.device, "bf16": a.bf16, "clock": clock, "seq_len": a.seq_len,
        "per_device_train_batch_size": a.batch, "gradient_accumulation_steps": a.accumulation,
        "num_constraints": len(TASKS), "constraint_rows_per_task": a.constraint_rows, "rows": rows,
        "recipe_default_variant": variant_key(RECIPE_DEFAULT_VARIANT),
        "steps_timed_per_round": a.steps - a.warmup, "rounds": a.rounds,
        "step_time": stats,
        "ratio_to_unconstrained": {k: stats[k]["median_s"] / base for k in keys if k != "unconstrained"},
        "peak_allocated_bytes": peak or None,
        "machine": machine(),
    }
    write_json(a.out, result)


if __name__ == "__main__":
    main()
