"""A character-level tokenizer and small causal LMs built from configs (offline example and tests).

Saved with ``save_pretrained`` they load through exactly the ``AutoModelForCausalLM`` /
``AutoTokenizer.from_pretrained`` path of a Hub checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}{% if m['role'] != 'assistant' %}|"
    "{% else %}" + EOS + "{% endif %}{% endfor %}{% if add_generation_prompt %}a:{% endif %}"
)
"""A minimal chat template for the character tokenizer ("u:question|a:answer</s>")."""

DEFAULT_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 +-=:|>?.,"


def char_tokenizer(alphabet: str = DEFAULT_ALPHABET, model_max_length: int = 64) -> PreTrainedTokenizerFast:
    """One token per character of ``alphabet`` plus ``<pad>``, ``<s>``, ``</s>``, ``<unk>``; with a chat template."""
    vocab = {PAD: 0, BOS: 1, EOS: 2, UNK: 3}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
                                   model_max_length=model_max_length)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_causal_lm(vocab_size: int, kind: str = "gpt2", *, hidden_size: int = 64, layers: int = 2, heads: int = 4,
                   max_positions: int = 64, seed: int = 0, **extra: Any) -> torch.nn.Module:
    """A GPT-2 or Llama causal LM with a few small layers (random init, seeded)."""
    torch.manual_seed(seed)
    if kind == "gpt2":
        config = GPT2Config(vocab_size=vocab_size, n_embd=hidden_size, n_layer=layers, n_head=heads,
                            n_positions=max_positions, bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra)
        return GPT2LMHeadModel(config)
    if kind == "llama":
        config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                             max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                             **extra)
        return LlamaForCausalLM(config)
    raise ValueError(f"kind must be 'gpt2' or 'llama', got {kind!r}")
