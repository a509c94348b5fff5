"""MSVR recurrence (Algorithm 1, line 6), penalties and samplers against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from hf_constrained.method.estimators import MSVREstimator, resolve_gamma_prime, theory_gamma_prime
from hf_constrained.method.penalties import HingePenalty, SquaredHingePenalty, make_penalty
from hf_constrained.method.sampling import ConstraintBatchStream, ConstraintSampler


def test_msvr_recurrence_hand_computed():
    est = MSVREstimator(4, gamma=0.8, gamma_prime=0.1)
    idx = torch.tensor([1, 3])
    # first visit initialises with the current value, whatever the previous one
    new = est.update(idx, torch.tensor([2.0, -1.0]), previous=torch.tensor([100.0, 100.0]))
    assert torch.allclose(new, torch.tensor([2.0, -1.0]))
    # u <- 0.2 u + 0.8 h_t + 0.1 (h_t - h_{t-1})
    new = est.update(idx, torch.tensor([1.0, 0.5]), previous=torch.tensor([3.0, 0.0]))
    expected = [0.2 * 2.0 + 0.8 * 1.0 + 0.1 * (1.0 - 3.0), 0.2 * -1.0 + 0.8 * 0.5 + 0.1 * (0.5 - 0.0)]
    assert torch.allclose(new, torch.tensor(expected))
    assert torch.allclose(est.values[idx], torch.tensor(expected))


def test_unsampled_estimators_unchanged():
    est = MSVREstimator(5, gamma=0.5, gamma_prime=0.3)
    est.update(torch.arange(5), torch.arange(5, dtype=torch.float32))
    before = est.values.clone()
    est.update(torch.tensor([2]), torch.tensor([10.0]), torch.tensor([1.0]))
    changed = (est.values != before).nonzero().flatten().tolist()
    assert changed == [2]
    assert est.values[2].item() == pytest.approx(0.5 * 2 + 0.5 * 10 + 0.3 * 9)
    assert est.visited.tolist() == [True] * 5


def test_missing_previous_drops_correction_term():
    est = MSVREstimator(2, gamma=0.8, gamma_prime=0.5)
    est.update(torch.tensor([0, 1]), torch.tensor([1.0, 1.0]))
    est.update(torch.tensor([0, 1]), torch.tensor([2.0, 2.0]), torch.tensor([float("nan"), 0.0]))
    assert est.values.tolist() == pytest.approx([0.2 + 1.6, 0.2 + 1.6 + 0.5 * 2.0])


def test_get_uses_fallback_on_first_visit_only():
    est = MSVREstimator(3)
    est.update(torch.tensor([0]), torch.tensor([5.0]))
    u = est.get(torch.tensor([0, 2]), fallback=torch.tensor([-7.0, -7.0]))
    assert u.tolist() == [5.0, -7.0]


def test_theory_gamma_prime_formula():
    # (m - |B_c|) / (|B_c| (1 - g)) + (1 - g)
    assert theory_gamma_prime(10, 2, 0.8) == pytest.approx(8 / (2 * 0.2) + 0.2)
    assert theory_gamma_prime(5, 5, 0.8) == pytest.approx(0.2)
    assert resolve_gamma_prime("theory", 10, 2, 0.8) == pytest.approx(20.2)
    assert resolve_gamma_prime("0.25", 10, 2, 0.8) == 0.25
    with pytest.raises(ValueError, match="0 < gamma < 1"):
        theory_gamma_prime(10, 2, 1.0)
    with pytest.raises(ValueError, match="'theory'"):
        resolve_gamma_prime("fast", 10, 2, 0.8)


def test_estimator_state_dict_roundtrip_and_mismatch():
    est = MSVREstimator(3, 0.8, 0.1)
    est.update(torch.tensor([0, 2]), torch.tensor([1.5, -2.5]))
    other = MSVREstimator(3, 0.8, 0.1)
    other.load_state_dict(est.state_dict())
    assert torch.equal(other.values, est.values) and torch.equal(other.visited, est.visited)
    with pytest.raises(ValueError, match="different set of constraints"):
        MSVREstimator(4).load_state_dict(est.state_dict())
    with pytest.raises(ValueError, match="duplicate"):
        est.update(torch.tensor([1, 1]), torch.tensor([0.0, 0.0]))


@pytest.mark.parametrize("gamma", [0.0, -0.1, 1.5])
def test_estimator_rejects_bad_gamma(gamma):
    with pytest.raises(ValueError, match="gamma"):
        MSVREstimator(3, gamma=gamma)


def test_penalty_weights():
    u = torch.tensor([-1.0, 0.0, 0.5, 2.0])
    assert HingePenalty(10.0).weight(u).tolist() == [0.0, 0.0, 10.0, 10.0]
    assert SquaredHingePenalty(10.0).weight(u).tolist() == [0.0, 0.0, 5.0, 20.0]
    assert HingePenalty(10.0).value(u).tolist() == [0.0, 0.0, 5.0, 20.0]
    assert SquaredHingePenalty(10.0).value(u).tolist() == [0.0, 0.0, 1.25, 20.0]
    with pytest.raises(ValueError, match="beta > 0"):
        make_penalty("hinge", 0.0)
    with pytest.raises(ValueError, match="unknown penalty"):
        make_penalty("l1", 1.0)


def test_sampler_is_a_function_of_seed_and_step():
    s = ConstraintSampler(100, 7, seed=3)
    a, b = s.sample(5), ConstraintSampler(100, 7, seed=3).sample(5)
    assert torch.equal(a, b) and a.numel() == 7 and a.unique().numel() == 7
    assert not torch.equal(s.sample(5), s.sample(6))
    counts = torch.zeros(100)
    for t in range(2000):
        counts[s.sample(t)] += 1
    # uniform: each constraint visited 2000 * 7 / 100 = 140 times on average
    assert counts.min() > 90 and counts.max() < 200
    assert torch.equal(ConstraintSampler(4, 4, 0).sample(9), torch.arange(4))
    with pytest.raises(ValueError, match=r"\[1, 4\]"):
        ConstraintSampler(4, 5, 0)


def test_batch_stream_covers_each_epoch_and_resumes():
    s = ConstraintBatchStream(10, seed=1, key=2)
    first = s.next_indices(4) + s.next_indices(4) + s.next_indices(2)
    assert sorted(first) == list(range(10))  # one epoch = a permutation
    s.next_indices(3)
    state = s.state_dict()
    expected = s.next_indices(9)
    t = ConstraintBatchStream(10, seed=1, key=2)
    t.load_state_dict(state)
    assert t.next_indices(9) == expected
    assert len(ConstraintBatchStream(3, 0, 0).next_indices(7)) == 7  # batches larger than the data wrap
