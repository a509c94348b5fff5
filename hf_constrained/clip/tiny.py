"""A small CLIP built from configs, with a word-level CLIP tokenizer (offline demo and tests).

Saved with ``save_pretrained`` it loads through exactly the ``CLIPModel.from_pretrained`` /
``CLIPProcessor.from_pretrained`` path of a hub checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from transformers import CLIPConfig, CLIPModel, CLIPProcessor, CLIPTokenizer

BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def word_tokenizer(texts: Iterable[str], model_max_length: int = 32) -> CLIPTokenizer:
    """A ``CLIPTokenizer`` whose BPE merges rebuild every word of ``texts`` into one token.

    Characters are in the vocabulary too, so unseen words still tokenise (as pieces).
    """
    words = sorted({w for t in texts for w in re.findall(r"[a-z]+|[0-9]|[^\sa-z0-9]+", t.lower())})
    vocab: dict[str, int] = {BOS: 0, EOS: 1}
    merges: list[tuple[str, str]] = []

    def add(tok: str) -> None:
        if tok not in vocab:
            vocab[tok] = len(vocab)

    for ch in "abcdefghijklmnopqrstuvwxyz0123456789.,'":
        add(ch)
        add(ch + "</w>")
    for w in words:
        pieces = list(w)
        pieces[-1] += "</w>"
        for p in pieces:
            add(p)
        cur = pieces[0]
        for p in pieces[1:]:
            merge = (cur, p)
            if merge not in merges:
                merges.append(merge)
            cur = cur + p
            add(cur)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def tiny_clip(vocab_size: int, *, image_size: int = 8, patch_size: int = 2, num_channels: int = 3,
              hidden_size: int = 64, layers: int = 2, heads: int = 4, projection_dim: int = 32,
              max_text_length: int = 32, seed: int = 0) -> CLIPModel:
    """A CLIPModel with small ViT and text towers (random init, seeded by ``seed``): ``layers`` layers of width
    ``hidden_size`` with ``heads`` attention heads each, embeddings projected to ``projection_dim``."""
    import torch

    text = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=max_text_length,
                bos_token_id=0, eos_token_id=1, pad_token_id=1)
    vision = dict(image_size=image_size, patch_size=patch_size, num_channels=num_channels, hidden_size=hidden_size,
                  intermediate_size=2 * hidden_size, num_hidden_layers=layers, num_attention_heads=heads)
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=projection_dim)
    torch.manual_seed(seed)
    return CLIPModel(config)


def _image_processor_class() -> type:
    """CLIP's image processor: the default (torchvision) backend where torchvision is installed, else the
    PIL one, named directly: asking transformers for the default without torchvision logs a fallback
    message at every import, about the environment rather than anything a user set."""
    import transformers

    from ..extras import has_module

    return transformers.CLIPImageProcessor if has_module("torchvision") else transformers.CLIPImageProcessorPil


def tiny_processor(tokenizer: CLIPTokenizer, image_size: int = 8) -> CLIPProcessor:
    """A ``CLIPProcessor``: resize/crop to ``image_size``, CLIP's normalisation, the tokenizer."""
    image_processor = _image_processor_class()(size={"shortest_edge": image_size},
                                         crop_size={"height": image_size, "width": image_size})
    return CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)
