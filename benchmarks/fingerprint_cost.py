"""Cost of the weights fingerprint that ties a safety report to its weights.

``hf_constrained.safety.model_fingerprint.weights_fingerprint`` (SHA-256 over every tensor of
the state dict) on a tiny BERT built from a config and on larger stacks of linear layers,
CPU, float32. Prints the median of 5 repetitions per model.

    python benchmarks/fingerprint_cost.py
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import BertConfig, BertModel

from hf_constrained.safety.model_fingerprint import weights_fingerprint


def timed(model: torch.nn.Module, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        weights_fingerprint(model)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    torch.manual_seed(0)
    models = {
        "tiny BERT (2 layers, hidden 32)": BertModel(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                                                num_attention_heads=2, intermediate_size=64)),
        "MLP 10M parameters": torch.nn.Sequential(*[torch.nn.Linear(1000, 1000) for _ in range(10)]),
        "MLP 100M parameters": torch.nn.Sequential(*[torch.nn.Linear(2000, 2000) for _ in range(25)]),
    }
    for name, model in models.items():
        n = sum(p.numel() for p in model.parameters())
        seconds = timed(model)
        print(f"{name}: {n / 1e6:.3g}M parameters, {seconds * 1e3:.3g} ms "
              f"({n * 4 / seconds / 1e9:.2g} GB/s)")


if __name__ == "__main__":
    main()
