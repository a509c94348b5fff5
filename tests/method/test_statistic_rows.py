"""A proxy indicator on the gradient's own rows (one split, ``constraint_proxy_indicator``): the estimate follows the
certificate's statistic on the rows B_k^t the gradient reads, scored in the forward the surrogate already makes
(hf_constrained.method.statistic_rows)."""

from __future__ import annotations

import pytest
import torch
from scale_tiny import (
    StopAt,
    count_training_forwards,
    disjoint_trainer,
    error_statistic,
    per_row_ce,
    row_key,
    snapshot,
)
from test_shared_forward import Rows, llama

from hf_constrained import ConstrainedTrainer, ConstrainedTrainingArguments
from hf_constrained.constraint import Certification, CertifyStatistic, Constraint, ConstraintValueError
from hf_constrained.margin import FixedMargin
from hf_constrained.method.regularisers import ConstraintRowReplay
from hf_constrained.method.statistic_rows import RowsWithStatistic
from hf_constrained.method.strategies import OneSplit
from hf_constrained.non_forgetting import (
    ForgottenRows,
    NonForgettingConfig,
    PairedChange,
    ReferenceGap,
    non_forgetting_constraints,
    with_old_correctness,
)
from hf_constrained.per_sample_loss import (
    PaddingCollator,
    causal_lm_per_example_correct,
    causal_lm_per_example_loss,
    model_inputs,
)
from hf_constrained.run_cost import rows_per_step


def test_the_estimate_is_the_statistic_on_the_gradients_own_batch(tmp_path):
    """With gamma = 1 and gamma' = 0, u_k after a step is the statistic (here each row's 0/1 error) on exactly the
    rows the gradient read that step, against the statistic's tolerance; no other row is scored."""
    scored: list[tuple[set[bytes], float]] = []
    gradient_rows: set[bytes] = set()
    holder = {}

    def surrogate(model, batch):
        if holder["trainer"].in_training_step and torch.is_grad_enabled():
            gradient_rows.update(row_key(x) for x in batch["x"])
        return per_row_ce(model, batch)

    def error_rate(model, batch):
        assert not torch.is_grad_enabled()  # the statistic never feeds a gradient
        wrong = (model(x=batch["x"])["logits"].argmax(-1) != batch["labels"]).double()
        if holder["trainer"].in_training_step:  # the step's calls, not the checks and the certificate
            scored.append(({row_key(x) for x in batch["x"]}, float(wrong.mean())))
        return wrong

    stat = CertifyStatistic(error_rate, tolerance=1.0, value_range=(0, 1))
    trainer = disjoint_trainer(str(tmp_path / "run"), surrogate, statistic=stat, constraint_proxy_indicator=True,
                               msvr_gamma=1.0, msvr_gamma_prime=0.0, constraints_per_step=1, max_steps=3)
    assert trainer.engine.settings().estimate_source == "one_split(proxy_statistic=True)"
    assert not trainer.engine.separate_estimate
    holder["trainer"] = trainer
    trainer.train()
    (k,) = [int(i) for i in trainer.engine.sampler.sample(trainer.state.global_step - 1)]
    rows, value = scored[-1]
    assert float(trainer.engine.estimator.values[k]) == pytest.approx(value)
    assert len(scored) == 3  # once per step: in the rows' forward
    assert set().union(*(r for r, _ in scored)) == gradient_rows  # the gradient's rows, and only those
    assert trainer.constraint_estimates()[trainer.constraints[k].name] == pytest.approx(value)


def test_the_statistic_read_from_logits_is_the_statistic_of_its_own_forward(tmp_path):
    model = llama(tmp_path)
    collate = PaddingCollator(pad_token_id=0)
    rows = with_old_correctness(llama(tmp_path), Rows(12, 3), causal_lm_per_example_correct, collate)
    batch = collate([rows[i] for i in range(12)])
    batch["reference_correct"] = torch.tensor([1.0, 0.0] * 6, dtype=torch.float64)  # some rows wrong before
    with torch.no_grad():
        logits = model(**model_inputs(batch)).logits
    wider = torch.cat([logits, logits[:, -2:]], dim=1)  # rows padded further on the right (a merged forward)
    for statistic in (ForgottenRows(causal_lm_per_example_correct), PairedChange(causal_lm_per_example_correct)):
        assert statistic.reads_logits
        expected = statistic(model, batch)
        assert torch.equal(statistic.values_from_logits(logits, batch), expected)
        assert torch.equal(statistic.values_from_logits(wider, batch), expected)
    assert not ForgottenRows(lambda m, b: causal_lm_per_example_correct(m, b)).reads_logits


def proxy_trainer(tmp_path, name: str, **overrides) -> ConstrainedTrainer:
    model = llama(tmp_path)
    collate = PaddingCollator(pad_token_id=0)
    kw = dict(constraint_penalty="hinge", penalty_beta=5.0, constraint_batch_size=3, msvr_gamma=1.0,
              msvr_gamma_prime=0.0, constraint_proxy_indicator=True)
    kw.update(overrides)
    args = ConstrainedTrainingArguments(
        output_dir=str(tmp_path / name), per_device_train_batch_size=4, max_steps=4, learning_rate=0.05,
        lr_scheduler_type="constant", max_grad_norm=0.0, seed=0, use_cpu=True, report_to=[], save_strategy="no",
        disable_tqdm=True, remove_unused_columns=False, **kw)
    config = NonForgettingConfig(tolerance=-1.0, batch_size=8, accuracy_drop_tolerance=0.25,
                                 old_correct_on_rows=True)
    constraints = non_forgetting_constraints(
        model, causal_lm_per_example_loss, {"a": Rows(24, 1), "b": Rows(24, 2)}, collate,
        certify_datasets={"a": Rows(16, 5), "b": Rows(16, 6)}, correct=causal_lm_per_example_correct,
        row_fn=ReferenceGap(causal_lm_per_example_loss), config=config)
    for c in constraints:  # the hinge on from the start: the statistic (accuracy lost, 0 at first) + 0.5 > 0.25
        c.margin = FixedMargin(0.5)
    return ConstrainedTrainer(model=model, args=args, train_dataset=Rows(32, 0), data_collator=collate,
                              constraints=constraints, regulariser=ConstraintRowReplay(0.5))


def test_one_forward_serves_the_gradient_the_replay_and_the_statistic(tmp_path):
    """float64: reading the statistic from the rows' logits in the objective's merged forward gives the step that
    scoring it in a forward of its own gives (parameters and estimates within 1e-12), at one model call per step
    (replay of the same rows without the proxy makes one too; indicator rows of their own make two)."""
    results = {}
    for one_forward in (True, False):
        trainer = proxy_trainer(tmp_path, f"run_{one_forward}")
        (wrapper,) = {c.row_fn for c in trainer.engine.gradient_rows.views}
        assert isinstance(wrapper, RowsWithStatistic) and wrapper.one_forward
        wrapper.one_forward = one_forward
        calls = count_training_forwards(trainer)
        trainer.train()
        params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        results[one_forward] = (params, trainer.engine.estimator.values.clone(), calls[0])
        assert float(trainer.engine.current_weights().max()) > 0  # the hinge acts (the margin puts it on)
        # the rows a step forwards: the statistic's own pass counts as indicator rows where it takes one
        assert rows_per_step(trainer)["indicator"] == (0 if one_forward else 2 * 3)
    (p1, u1, c1), (p0, u0, c0) = results[True], results[False]
    assert torch.allclose(p1, p0, rtol=0, atol=1e-12), (p1 - p0).abs().max()
    assert torch.equal(u1, u0)  # 0/1 statistics: the same rows scored the same
    assert c1 == 4 and c0 == 4 + 4 * 2, (c1, c0)  # shared: one call; else objective+rows, rows, statistic... per step
    # the estimate is the statistic (accuracy lost, in [-1, 1]), not a loss change
    assert bool(((u1 >= -1) & (u1 <= 1)).all())
    plain = proxy_trainer(tmp_path, "plain", constraint_proxy_indicator=False)
    calls = count_training_forwards(plain)
    plain.train()
    assert calls[0] == 4
    two_split = proxy_trainer(tmp_path, "two_split", constraint_indicator_fraction=0.25)
    calls = count_training_forwards(two_split)
    two_split.train()
    assert calls[0] == 2 * 4


def test_a_scalar_constraint_cannot_carry_the_proxy_on_its_gradient_rows(tmp_path):
    stat = CertifyStatistic(lambda m, b: torch.zeros(len(b["x"]), dtype=torch.float64), tolerance=0.1,
                            value_range=(0, 1))
    trainer = disjoint_trainer(str(tmp_path / "ok"), per_row_ce, statistic=stat, constraint_proxy_indicator=True)
    assert trainer.engine.settings().constraint_proxy_indicator
    scalar = Constraint("scalar", fn=lambda m, b: m(**b)["loss"], dataset=[{"x": 1}] * 4, tolerance=0.1,
                        certify=Certification(statistic=stat))
    with pytest.raises(ValueError, match="constraint 'scalar': a proxy indicator on the gradient's own rows"):
        OneSplit(True).views([scalar], 0)


def test_resume_with_the_proxy_on_the_gradient_rows_is_bitwise_exact(tmp_path):
    stat = error_statistic()
    common = dict(max_steps=8, constraint_proxy_indicator=True, save_strategy="steps", save_steps=4)
    straight = disjoint_trainer(str(tmp_path / "straight"), per_row_ce, statistic=stat, **common)
    straight.train()
    stopped = disjoint_trainer(str(tmp_path / "stopped"), per_row_ce, statistic=stat, **common)
    stopped.add_callback(StopAt(4))
    stopped.train()
    resumed = disjoint_trainer(str(tmp_path / "resumed"), per_row_ce, statistic=stat, **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "stopped" / "checkpoint-4"))
    a, b = snapshot(straight), snapshot(resumed)
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name])
    assert torch.equal(a["estimator_values"], b["estimator_values"])
    assert bool((a["estimator_values"] > 0).any())  # error rates, not all zero

    # the estimates are shares of rows wrong, not losses: a run without the proxy refuses the checkpoint
    other = disjoint_trainer(str(tmp_path / "other"), per_row_ce, statistic=stat,
                             **dict(common, constraint_proxy_indicator=False))
    with pytest.raises(ValueError, match="a proxy statistic's .*resume with the same setting"):
        other.train(resume_from_checkpoint=str(tmp_path / "stopped" / "checkpoint-4"))


def test_a_statistic_with_the_wrong_number_of_rows_is_an_error_naming_the_constraints(tmp_path):
    stat = CertifyStatistic(lambda model, batch: torch.zeros(1, dtype=torch.float64), tolerance=0.2, value_range=(0, 1))
    trainer = disjoint_trainer(str(tmp_path / "run"), per_row_ce, statistic=stat, constraint_proxy_indicator=True,
                               max_steps=1)
    with pytest.raises(ConstraintValueError, match="row_fn of constraints .*group0.* returned shape \\(1,\\)"):
        trainer.train()


def test_constraints_without_a_statistic_are_named(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        trainer = disjoint_trainer(str(tmp_path / "run"), per_row_ce, constraint_proxy_indicator=True)
    assert "5 of 5 constraints declare no certification statistic" in caplog.text and "'group0'" in caplog.text
    assert all(not isinstance(v.row_fn, RowsWithStatistic) for v in trainer.engine.gradient_rows.views)
