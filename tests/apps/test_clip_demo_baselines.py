"""The demo's baselines (replay and KL to the old model, ``benchmarks/forgetting_frontier_demo.py``): each changes
what is trained, inside the same trainer, and reads only the constraint images D_k, never a selection, held-out or
certification image."""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

import hf_constrained.method.regularisers as regularisers
from hf_constrained.clip import experiment as demo  # the demo's pipeline
from hf_constrained.safety.in_memory_selection import InMemoryFeasibleSelection

TINY = dict(stage1_epochs=2, steps=2, lr=3e-2, constraint_copies=1, eval_copies=1, select_every=0, batch_size=16)


class FinalWeights(TrainerCallback):
    """The trained weights at the end of training (before the demo's selection could load others)."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.weights = {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def old(tmp_path_factory):
    cfg = demo.DemoConfig(**TINY)
    path = demo.pretrain_old_model(cfg, str(tmp_path_factory.mktemp("demo")), log=lambda *a: None)
    return cfg, path, demo.old_pools(cfg, path)


def _run(old, regulariser=None):
    cfg, path, pools = old
    weights = FinalWeights()
    run = demo.finetune(cfg, path, "none", pools=pools, log=lambda *a: None, regulariser=regulariser,
                        callbacks=[weights])
    return run, weights.weights


def _differ(a, b):
    return any(not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("baseline", [("replay", 0.5), ("kl", 3.0)])
def test_each_baseline_changes_the_training_and_reads_only_constraint_images(old, baseline, monkeypatch):
    cfg, _, pools = old
    plain, plain_weights = _run(old)
    again, again_weights = _run(old)
    assert not _differ(plain_weights, again_weights)  # deterministic: a difference below is the baseline's
    assert "regulariser" not in plain  # a run without a baseline records what it always did

    reads = []
    fetch = regularisers.fetch_rows

    def spy(dataset, rows):
        got = fetch(dataset, rows)
        reads.append((dataset, list(rows), got))
        return got

    monkeypatch.setattr(regularisers, "fetch_rows", spy)
    run, weights = _run(old, baseline)
    assert _differ(plain_weights, weights), f"{baseline} trained the same weights as no baseline"
    name, value = baseline
    assert run["regulariser"]["name"] == name
    assert run["regulariser"]["ratio" if name == "replay" else "lam"] == value
    # one read per step (no gradient accumulation), of the constraint pools and nothing else
    assert len(reads) == cfg.steps
    for dataset, rows, got in reads:
        assert isinstance(dataset, torch.utils.data.ConcatDataset)
        assert [id(d) for d in dataset.datasets] == [id(pools.constraint[k]) for k in pools.constraint]
        assert len(rows) == (cfg.batch_size if name == "kl" else round(value / (1 - value) * cfg.batch_size))
    data = demo.digits_split(cfg)
    read = {r["pixel_values"].tobytes() for *_, got in reads for r in got}
    constraint = {data["images"][i].tobytes() for i in data["constraint"]}
    elsewhere = {data["images"][i].tobytes() for split in ("selection", "held_out", "certify", "test")
                 for i in data[split]}
    assert read and read <= constraint and not read & elsewhere
    assert {r["label"] for *_, got in reads for r in got} <= {k for k in range(10) if k != cfg.target}


def test_unknown_baseline_is_an_error_naming_it(old):
    with pytest.raises(ValueError, match="unknown baseline 'ewc'"):
        _run(old, ("ewc", 1.0))


def test_baselines_keep_the_constrained_runs_checkpoint_rule(old, monkeypatch):
    """Replay and KL keep a checkpoint by the rule of the constrained runs (feasible on the selection split
    first); plain fine-tuning keeps the demo's (the best target loss)."""
    cfg, path, pools = old
    seen = []
    original = InMemoryFeasibleSelection.__init__

    def init(self, every, objective, violation=None, **kwargs):
        seen.append(violation is not None)  # feasibility checked, or the target loss alone
        original(self, every, objective, violation, **kwargs)

    monkeypatch.setattr(InMemoryFeasibleSelection, "__init__", init)
    every = demo.DemoConfig(**{**TINY, "select_every": 1})
    for regulariser in (None, ("replay", 0.5), ("kl", 1.0)):
        demo.finetune(every, path, "none", pools=pools, log=lambda *a: None, regulariser=regulariser)
    assert seen == [False, True, True]
