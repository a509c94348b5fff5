"""Algorithm 2's gamma' "theory" (Appendix E: gamma' = (n - |B|) / (|B| (1 - gamma)) + 1 - gamma) counts
the anchors of the contrastive objective, the positive pairs, not every row (issue 32, item 7)."""

from __future__ import annotations

import pytest
from scale_tiny import make_contrastive_trainer

from hf_constrained.method.estimators import theory_gamma_prime


def _positives(trainer) -> int:
    return sum(bool(r["is_positive"]) for r in trainer.train_dataset)


@pytest.mark.parametrize("half", [True, False], ids=["half_positive_batches", "plain_shuffling"])
def test_theory_gamma_prime_counts_the_positive_anchors(tmp_path, half):
    from hf_constrained.clip import ContrastiveConstrainedTrainer

    base = make_contrastive_trainer(str(tmp_path), objective_msvr_gamma_prime="theory", per_device_train_batch_size=8)
    trainer = ContrastiveConstrainedTrainer(model=base.model, args=base.args, train_dataset=base.train_dataset,
                                            data_collator=base.data_collator, half_positive_batches=half)
    n_rows, n_pos = len(trainer.train_dataset), _positives(trainer)
    assert 0 < n_pos < n_rows  # the setup has negatives, so the two counts differ
    # per step: half the batch with half-positive batches; else the batch's expected share of positives
    anchors = 4 if half else 8 * n_pos / n_rows
    expected = theory_gamma_prime(n_pos, anchors, 0.8)
    for side in ("image", "text"):
        assert trainer.objective_estimators[side].gamma_prime == pytest.approx(expected)
    every_row = theory_gamma_prime(n_rows, 8, 0.8)
    if half:  # a third of the rows are positive: n / |B| = 16 / 4, not 48 / 8
        assert trainer.objective_estimators["image"].gamma_prime != pytest.approx(every_row)
    else:  # the expected share of positives per batch keeps n / |B| = rows / batch
        assert trainer.objective_estimators["image"].gamma_prime == pytest.approx(every_row)
    assert trainer.objective_estimators["image"].size == n_rows  # one estimator slot per row still


def test_a_numeric_gamma_prime_is_kept(tmp_path):
    trainer = make_contrastive_trainer(str(tmp_path), objective_msvr_gamma_prime=0.3)
    assert trainer.objective_estimators["image"].gamma_prime == pytest.approx(0.3)
