"""ROC-fairness batches: every row of both sides visited uniformly, unbiased batch gaps,
the row-wise constraint form and its exact values."""

import numpy as np
import pytest
import torch

from hf_constrained import ConstrainedTrainingArguments
from hf_constrained.batches import collate_examples
from hf_constrained.fairness import (
    GROUP_KEY,
    AUCConstrainedTrainer,
    GroupRows,
    MLPConfig,
    MLPForScoring,
    PairedRows,
    TabularSplit,
    collate_pairs,
    collate_rows,
    objective_pairs,
    roc_fairness_constraints,
    roc_row_scores,
)
from hf_constrained.method.sampling import ConstraintBatchStream

THRESHOLDS = (-1.0, 0.0, 1.0)


class RecordingSplit(TabularSplit):
    """A TabularSplit that records every row it hands out."""

    fetched: list

    def fetch(self, rows):
        self.fetched.append(np.asarray(rows, dtype=np.int64).copy())
        return super().fetch(rows)


def imbalanced_split(n: int = 700, seed: int = 0) -> RecordingSplit:
    """About 1 positive per 3 negatives and 1 group-u row per 3 group-p rows: every side
    length is coprime-ish with the others, so a fixed j % |side| mapping would be biased."""
    rng = np.random.default_rng(seed)
    group = (rng.random(n) < 0.7).astype(np.int64)
    label = (rng.random(n) < np.where(group == 1, 0.35, 0.2)).astype(np.int64)
    x0 = label * 1.5 + group * 1.0 + rng.normal(size=n)
    feats = np.stack([x0, rng.normal(size=n), group * 2.0 - 1.0], axis=1).astype(np.float32)
    split = RecordingSplit(feats, label, group)
    split.fetched = []
    return split


def mlp(seed=0):
    torch.manual_seed(seed)
    return MLPForScoring(MLPConfig(input_dim=3, hidden_sizes=[8]))


def test_objective_epoch_visits_every_negative_once_and_positives_evenly(tmp_path):
    train = imbalanced_split()
    pos, neg = np.flatnonzero(train.label == 1), np.flatnonzero(train.label == 0)
    assert len(neg) > 2 * len(pos) and len(neg) % len(pos) != 0
    obj = objective_pairs(train, seed=3)
    assert len(obj) == len(neg)  # an epoch is one pass over the larger side
    args = ConstrainedTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=32, use_cpu=True,
                                        report_to="none", remove_unused_columns=False, seed=0,
                                        constraint_penalty="none")
    trainer = AUCConstrainedTrainer(model=mlp(), args=args, constraints=[], train_dataset=obj,
                                    data_collator=collate_pairs)
    total = np.zeros(len(pos), dtype=np.int64)
    for epoch in range(2):
        train.fetched = []
        loader = trainer.get_train_dataloader()
        for _ in loader:  # the Trainer's own sampler and collation
            pass
        a = np.concatenate(train.fetched[0::2])  # collate_pairs fetches side A, then side B
        b = np.concatenate(train.fetched[1::2])
        assert set(a) <= set(pos) and set(b) <= set(neg)
        # every negative exactly once per epoch
        assert np.array_equal(np.sort(b), np.sort(neg))
        total += np.bincount(np.searchsorted(pos, a), minlength=len(pos))
        # every positive, and (counted from the start) none more than once more than another
        assert total.min() >= 1 and total.max() - total.min() <= 1
        if epoch == 0:
            first = a.copy()
    assert not np.array_equal(first, a)  # the positives' walk is reshuffled, not a fixed pairing


def test_constraint_batches_visit_both_groups_uniformly():
    train = imbalanced_split()
    cons = roc_fairness_constraints(train, thresholds=THRESHOLDS, kappa=0.0, seed=1)
    tpr = [c for c in cons if c.metadata["kind"] == "tpr"]
    assert all(c.dataset is tpr[0].dataset for c in tpr)  # one dataset object: shareable batches
    assert all(c.row_fn is roc_row_scores for c in cons)  # one row_fn: one forward for all
    data = tpr[0].dataset
    p_rows, u_rows = data.rows_a, data.rows_b
    assert set(train.group[p_rows]) == {1} and set(train.group[u_rows]) == {0}
    assert set(train.label[p_rows]) == {1} and set(train.label[u_rows]) == {1}
    assert len(p_rows) > len(u_rows) and len(p_rows) % len(u_rows) != 0
    streams = [ConstraintBatchStream(len(c.dataset), 0, k) for k, c in enumerate(tpr)]
    p_seen, u_seen = [], []
    for step in range(40):
        for k, c in enumerate(tpr):  # as the trainer draws: one stream per constraint
            batch = (c.collate_fn or collate_examples)([c.dataset[i] for i in streams[k].next_indices(10)])
            rows = np.concatenate(train.fetched[-1:])
            g = batch[GROUP_KEY].numpy()
            assert batch["inputs"].shape == (20, 3) and g.tolist() == [0, 1] * 10
            p_seen.append(rows[g == 0])
            u_seen.append(rows[g == 1])
    u_counts = np.bincount(np.searchsorted(u_rows, np.concatenate(u_seen)), minlength=len(u_rows))
    assert u_counts.max() - u_counts.min() <= 1  # the shorter group: walked without favouring any row
    p_counts = np.bincount(np.searchsorted(p_rows, np.concatenate(p_seen)), minlength=len(p_rows))
    # the longer group: every constraint's stream passes over it once per pass
    assert p_counts.max() - p_counts.min() <= len(tpr)
    assert p_counts.sum() == 40 * 10 * len(tpr)


def test_expected_batch_gap_equals_exact_gap():
    train = imbalanced_split(seed=4)
    model = mlp(1)
    with torch.no_grad():
        model.mlp[0].weight.mul_(3.0)  # sizeable gaps, so a bias would show
        r = torch.sigmoid(model(features=torch.from_numpy(train.features)).logits.double()).numpy()
    cons = roc_fairness_constraints(train, thresholds=(0.0,), kappa=0.0, seed=2)
    for c in cons:
        data = c.dataset
        exact_signed = r[data.rows_a].mean() - r[data.rows_b].mean()  # group p minus group u, all rows
        assert abs(exact_signed) == pytest.approx(c.exact_fn(model, data), rel=1e-6)
        stream = ConstraintBatchStream(len(data), 5, 0)
        with torch.no_grad():  # the constraint's own mini-batch value agrees with the rows it drew
            for _ in range(5):
                train.fetched = []
                batch = (c.collate_fn or collate_examples)([data[i] for i in stream.next_indices(8)])
                rows, g = train.fetched[-1], batch[GROUP_KEY].numpy()
                assert float(c.fn(model, batch)) == pytest.approx(r[rows][g == 0].mean() - r[rows][g == 1].mean(),
                                                                  rel=1e-5, abs=1e-7)
        values = []
        for _ in range(20000):  # the same draws, without the model calls
            rows, g = data.rows(stream.next_indices(8))
            values.append(r[rows][g == 0].mean() - r[rows][g == 1].mean())
        values = np.array(values)
        se = values.std(ddof=1) / np.sqrt(len(values))
        assert abs(values.mean() - exact_signed) < 4 * se, (c.name, values.mean(), exact_signed, se)
        # the former fixed pairing (item j -> shorter-side row j % |side|) misses by more than that
        short = data.rows_b if data.a_is_long else data.rows_a
        fixed = r[short[np.arange(len(data)) % len(short)]].mean()
        biased = (r[data.rows_a].mean() - fixed) if data.a_is_long else (fixed - r[data.rows_b].mean())
        assert abs(biased - exact_signed) > 4 * se, (c.name, biased, exact_signed, se)


def test_collate_rows_keeps_item_order_across_datasets_and_exact_rows():
    train = imbalanced_split()
    cons = roc_fairness_constraints(train, train, thresholds=THRESHOLDS, kappa=0.0)
    tpr, fpr = cons[0].dataset, cons[-1].dataset
    ev = cons[0].eval_dataset
    assert isinstance(tpr, PairedRows) and isinstance(ev, GroupRows)
    batch = collate_rows([tpr[0], tpr[1], fpr[2], ev[0], ev[len(ev) - 1]])
    assert batch["inputs"].shape[0] == 2 + 2 + 2 + 1 + 1
    assert batch[GROUP_KEY].tolist() == [0, 1, 0, 1, 0, 1, 0, 1]
    assert len(ev) == len(ev.rows_a) + len(ev.rows_b)


def test_exact_fn_equals_row_wise_reduction_and_scores_once_per_dataset():
    train, val = imbalanced_split(seed=0), imbalanced_split(n=400, seed=9)
    model = mlp(2)
    cons = roc_fairness_constraints(train, val, thresholds=THRESHOLDS, kappa=0.01)
    calls = []
    handle = model.register_forward_hook(lambda m, i, o: calls.append(1))
    try:
        values = {c.name: c.exact_fn(model, c.eval_dataset) for c in cons}
    finally:
        handle.remove()
    assert len(calls) == 2  # one scoring pass per dataset (positives, negatives), not one per constraint
    for c in cons:
        ev = c.eval_dataset
        batch = collate_rows([ev[i] for i in range(len(ev))])  # every row once, with its group
        with torch.no_grad():
            inner = float(c.fn(model, batch))  # the row-wise reduction: mean over p - mean over u
        assert values[c.name] == pytest.approx(abs(inner), rel=1e-5, abs=1e-7)
    with torch.no_grad():  # a parameter update invalidates the shared scores
        model.mlp[-1].bias.add_(0.5)
    moved = {c.name: c.exact_fn(model, c.eval_dataset) for c in cons}
    assert any(abs(moved[n] - values[n]) > 1e-4 for n in values)
