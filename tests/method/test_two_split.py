"""Two-split constraint estimation (``constraint_indicator_fraction``): the MSVR estimate, and so the
hinge's indicator, follows rows that no constraint gradient ever uses; resume stays exact."""

import pytest
import torch
from scale_tiny import (
    Recorder,
    StopAt,
    disjoint_trainer,
    indicator_rows,
    make_rowwise_trainer,
    per_row_ce,
    row_key,
    snapshot,
)

from hf_constrained.constraint import CertifyStatistic
from hf_constrained.method.strategies import split_for_indicator


@pytest.mark.parametrize("gamma_prime", [0.0, 0.1])
def test_no_indicator_row_ever_reaches_a_gradient(tmp_path, gamma_prime):
    record = Recorder()
    trainer = disjoint_trainer(str(tmp_path / "run"), record, constraint_indicator_fraction=0.5,
                               msvr_gamma_prime=gamma_prime)
    indicator = indicator_rows(trainer, 0.5)
    all_indicator = set().union(*indicator.values())
    everything = set().union(*({row_key(r["x"]) for r in c.dataset} for c in trainer.constraints))
    trainer.train()
    assert record.with_grad and not (record.with_grad & all_indicator)
    # the estimate read indicator rows (the step's and, with gamma' > 0, the look-ahead's)
    assert record.without_grad & all_indicator
    # and every row the gradient saw is a constraint row of the gradient part
    assert record.with_grad <= everything - all_indicator
    # the split is a partition of each constraint's rows, about half each; one split per dataset object
    for c in trainer.constraints:
        assert len(indicator[c.name]) == round(0.5 * len(c.dataset))
    assert indicator["all0"] == indicator["all1"]


def test_the_estimate_is_the_value_on_the_indicator_batch(tmp_path):
    """With gamma = 1 and gamma' = 0, u_k after a step is h_k(w_t; B_k^ind): the value the no-grad
    call of that step computed on indicator rows, not the gradient batch's value."""
    record = Recorder()
    trainer = disjoint_trainer(str(tmp_path / "run"), record, constraint_indicator_fraction=0.5, msvr_gamma=1.0,
                               msvr_gamma_prime=0.0, constraints_per_step=1, max_steps=1)
    trainer.train()
    (k,) = trainer.engine.estimator.visited.nonzero().flatten().tolist()
    u = float(trainer.engine.estimator.values[k])
    assert u == pytest.approx(record.no_grad_means[-1], rel=1e-6)
    assert u != pytest.approx(record.grad_means[-1], rel=1e-3)  # not the gradient batch's value


def test_resume_with_two_split_estimation_is_bitwise_exact(tmp_path):
    common = dict(max_steps=8, constraint_indicator_fraction=0.4, save_strategy="steps", save_steps=4)
    straight = make_rowwise_trainer(str(tmp_path / "straight"), **common)
    straight.train()
    stopped = make_rowwise_trainer(str(tmp_path / "stopped"), **common)
    stopped.add_callback(StopAt(4))
    stopped.train()
    resumed = make_rowwise_trainer(str(tmp_path / "resumed"), **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "stopped" / "checkpoint-4"))
    a, b = snapshot(straight), snapshot(resumed)
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name])
    assert torch.equal(a["estimator_values"], b["estimator_values"])
    # a run without two-split estimation refuses the checkpoint instead of continuing on other streams
    other = make_rowwise_trainer(str(tmp_path / "other"), max_steps=8)
    with pytest.raises(ValueError, match="two-split estimation"):
        other.train(resume_from_checkpoint=str(tmp_path / "stopped" / "checkpoint-4"))


def test_bad_fractions_are_errors_naming_the_setting(tmp_path):
    with pytest.raises(ValueError, match="constraint_indicator_fraction must be in \\(0, 1\\)"):
        make_rowwise_trainer(str(tmp_path / "a"), constraint_indicator_fraction=1.0)
    trainer = make_rowwise_trainer(str(tmp_path / "b"))
    with pytest.raises(ValueError, match="constraint 'group0': .* rows cannot be split"):
        split_for_indicator(trainer.constraints, 0.001, 0)


def test_a_proxy_indicator_tracks_the_certification_statistic(tmp_path):
    """With proxy indicators the estimate follows the declared statistic (here the 0/1 error of each
    row) on indicator rows, against the statistic's tolerance; the gradient still follows the
    surrogate (cross-entropy) on the gradient rows."""
    surrogate = Recorder()
    errors_seen = []

    def error_rate(model, batch):
        assert not torch.is_grad_enabled()  # the statistic never feeds a gradient
        wrong = (model(x=batch["x"])["logits"].argmax(-1) != batch["labels"]).double()
        errors_seen.append(float(wrong.mean()))
        return wrong

    # a lenient statistic tolerance: the surrogate's (cross-entropy <= 0.25) would switch the hinge on
    stat = CertifyStatistic(error_rate, tolerance=1.0, value_range=(0, 1))
    trainer = disjoint_trainer(str(tmp_path / "run"), surrogate, statistic=stat, constraint_indicator_fraction=0.5,
                               constraint_proxy_indicator=True, msvr_gamma=1.0, msvr_gamma_prime=0.0,
                               constraints_per_step=1, max_steps=1)
    trainer.train()
    (k,) = trainer.engine.estimator.visited.nonzero().flatten().tolist()
    u = float(trainer.engine.estimator.values[k])
    assert u == pytest.approx(errors_seen[-1])  # the error rate of the indicator batch, not a cross-entropy
    assert surrogate.grad_means  # the gradient followed the surrogate
    name = trainer.constraints[k].name
    assert trainer.constraint_estimates()[name] == pytest.approx(u)
    # the hinge's indicator compares the statistic with its own tolerance: off, though the surrogate is violated
    assert u <= 1.0 and surrogate.grad_means[-1] > 0.25
    assert float(trainer.engine.current_weights()[k]) == 0.0


def test_the_indicator_batch_has_its_own_size(tmp_path):
    """``constraint_indicator_batch_size``: the no-grad batches of the indicator part hold that many
    rows, all from the indicator part (the gradient's keep ``constraint_batch_size``)."""
    sizes: dict[bool, list[int]] = {True: [], False: []}
    record, holder = Recorder(), {}

    def row_fn(model, batch):
        if holder["trainer"].in_training_step:  # the step's calls, not the checks and evaluations
            sizes[torch.is_grad_enabled()].append(len(batch["x"]))
            return record(model, batch)
        return per_row_ce(model, batch)

    trainer = disjoint_trainer(str(tmp_path / "run"), row_fn, constraint_indicator_fraction=0.5, msvr_gamma=1.0,
                               msvr_gamma_prime=0.0, constraints_per_step=1, max_steps=3,
                               constraint_indicator_batch_size=20)
    holder["trainer"] = trainer
    trainer.train()
    assert sizes[True] and set(sizes[True]) == {6}
    assert sizes[False] and set(sizes[False]) == {20}
    assert record.without_grad <= set().union(*indicator_rows(trainer, 0.5).values())


@pytest.mark.parametrize("kw, match", [
    (dict(constraint_indicator_batch_size=8), "give constraint_indicator_fraction"),
    (dict(constraint_indicator_fraction=0.5, constraint_indicator_batch_size=0), "must be >= 1"),
    (dict(constraint_indicator_fraction=0.5, constraint_indicator_batch_size=2.5), "must be an integer"),
])
def test_indicator_batch_size_needs_two_split(tmp_path, kw, match):
    from hf_constrained import ConstrainedTrainingArguments

    with pytest.raises((ValueError, TypeError), match=match):
        ConstrainedTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kw)
