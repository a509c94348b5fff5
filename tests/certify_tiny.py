"""Tiny causal LMs fine-tuned with PLAIN ``transformers.Trainer`` (no hf_constrained trainer), for the tests of
``hf-constrained certify``.

The base learns an old task (``WORD=`` -> ``ok``); then three fine-tunes on a new task (``WORD>`` -> ``no``):
``kept`` (the old training rows replayed beside the new ones: nothing forgotten), ``forgot`` (the new task is
``WORD=`` -> ``no``: the old answer is overwritten) and ``adapter`` (a LoRA adapter trained with replay).
Certification rows are old-task rows on words no training file holds.
"""

from __future__ import annotations

import json
import os
import random

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from hf_constrained.recipes.tiny_lm import char_tokenizer, tiny_causal_lm
from hf_constrained.text_data import SFTPaddingCollator, tokenize_sft

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def words(n: int, seed: int, length: int = 5) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        w = "".join(rng.choice(LETTERS) for _ in range(length))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def fit_and_save(model, tokenizer, data, collator, out: str, steps: int, lr: float) -> None:
    """Plain ``transformers.Trainer`` (batch 16, seed 0, CPU) on tokenized ``data``, then ``save_pretrained`` of the
    model and the tokenizer: how a user fine-tunes outside the library, for every tiny model the certify tests read."""
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=16, learning_rate=lr,
                             use_cpu=True, report_to="none", save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, seed=0)
    Trainer(model=model, args=args, train_dataset=data, data_collator=collator).train()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def train(model, tokenizer, rows: list[dict], out: str, steps: int, lr: float) -> None:
    """:func:`fit_and_save` on prompt/completion (or chat) rows."""
    fit_and_save(model, tokenizer, tokenize_sft(Dataset.from_list(rows), tokenizer, name="train"),
                 SFTPaddingCollator(tokenizer), out, steps, lr)


def build(root: str) -> dict[str, str]:
    """The base, the three fine-tunes, the training files and the certification rows, under ``root``."""
    torch.manual_seed(0)
    tok = char_tokenizer()
    vocab = words(240, seed=1)
    old_train, cert, spare = vocab[:120], vocab[120:200], vocab[200:]
    new_words = words(120, seed=2, length=4)
    paths = {"root": root}
    paths["old_train"] = write_jsonl(os.path.join(root, "old_train.jsonl"),
                                     [{"prompt": f"{w}=", "completion": "ok"} for w in old_train])
    paths["cert"] = write_jsonl(os.path.join(root, "cert.jsonl"),
                                [{"prompt": f"{w}=", "completion": "ok"} for w in cert])
    paths["cert2"] = write_jsonl(os.path.join(root, "cert2.jsonl"),
                                 [{"prompt": f"{w}=", "completion": "ok"} for w in spare])
    new_rows = [{"prompt": f"{w}>", "completion": "no"} for w in new_words]
    paths["new_train"] = write_jsonl(os.path.join(root, "new_train.jsonl"), new_rows)
    old_rows = [{"prompt": f"{w}=", "completion": "ok"} for w in old_train]
    paths["base"] = os.path.join(root, "base")
    train(tiny_causal_lm(len(tok), hidden_size=32, layers=1, heads=2), tok, old_rows, paths["base"], 80, 1e-2)
    paths["kept"] = os.path.join(root, "kept")
    train(AutoModelForCausalLM.from_pretrained(paths["base"]), tok, new_rows + old_rows, paths["kept"], 40, 5e-3)
    paths["forgot"] = os.path.join(root, "forgot")
    overwrite = [{"prompt": f"{w}=", "completion": "no"} for w in new_words]
    train(AutoModelForCausalLM.from_pretrained(paths["base"]), tok, overwrite, paths["forgot"], 40, 1e-2)
    from peft import LoraConfig, get_peft_model

    paths["adapter"] = os.path.join(root, "adapter")
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(paths["base"]),
                                LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=["c_attn"]))
    train(peft_model, tok, new_rows + old_rows, paths["adapter"], 30, 5e-3)
    return paths


def chat(prompt: str, answer: str) -> dict:
    """A chat row (the LLM recipe's ``messages`` format): the user's prompt, the assistant's answer."""
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


def build_chat(root: str) -> dict[str, str]:
    """The old task as chat rows (rendered by the character tokenizer's chat template, ``u:WORD=|a:ok</s>``): a base
    trained on them with plain ``transformers.Trainer``, ``kept`` (the new task with the old rows replayed) and
    ``forgot`` (the old prompts now answered ``no``), the training files and the chat certification rows."""
    torch.manual_seed(0)
    tok = char_tokenizer()
    vocab = words(200, seed=11)
    old_train, cert = vocab[:120], vocab[120:]
    new_words = words(120, seed=12, length=4)
    old_rows = [chat(f"{w}=", "ok") for w in old_train]
    new_rows = [chat(f"{w}>", "no") for w in new_words]
    paths = {"root": root}
    paths["old_train"] = write_jsonl(os.path.join(root, "chat_old_train.jsonl"), old_rows)
    paths["new_train"] = write_jsonl(os.path.join(root, "chat_new_train.jsonl"), new_rows)
    paths["cert"] = write_jsonl(os.path.join(root, "chat_cert.jsonl"), [chat(f"{w}=", "ok") for w in cert])
    paths["base"] = os.path.join(root, "chat_base")
    train(tiny_causal_lm(len(tok), hidden_size=32, layers=2, heads=2), tok, old_rows, paths["base"], 80, 1e-2)
    paths["kept"] = os.path.join(root, "chat_kept")
    train(AutoModelForCausalLM.from_pretrained(paths["base"]), tok, new_rows + old_rows, paths["kept"], 120, 5e-3)
    paths["forgot"] = os.path.join(root, "chat_forgot")
    overwrite = [chat(f"{w}=", "no") for w in new_words]
    train(AutoModelForCausalLM.from_pretrained(paths["base"]), tok, overwrite, paths["forgot"], 40, 1e-2)
    return paths
