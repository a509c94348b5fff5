"""The fused constraint step (hf_constrained.method.rows) against the per-constraint step.

The same constraints are declared twice: row-wise (one shared ``row_fn``: the trainer
evaluates every sampled constraint of the group in one model call, per-constraint values
by segment sums) and as the equivalent scalar ``fn`` (one call per constraint, the
reference path). In float64, with sampled constraints (|B_c| < m), tolerances, ``outer``,
a ``group_key`` difference, a scalar data-free constraint mixed in, the look-ahead
(gamma' > 0) and gradient accumulation, both runs must end with the same parameters,
estimators and streams to float64 round-off.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from conftest import Net64
from conftest import args64 as make_args
from conftest import per_row_ce64 as per_row_ce
from conftest import rows64 as make_data
from datasets import Dataset
from torch import nn

import hf_constrained.batches as batches_module
from hf_constrained import ConstrainedTrainer, Constraint, constraints_per_value
from hf_constrained.batches import collate_examples


def rowwise_constraints(data: Dataset, gap_rows: int = 40) -> list[Constraint]:
    cons = constraints_per_value(data, "cls", row_fn=per_row_ce, name="ce_cls{value}",
                                 tolerance={0: 0.2, 1: 0.35, 2: 0.5})
    cons.append(Constraint("soft_rate", row_fn=per_row_ce, dataset=data, tolerance=0.02,
                           row_transform=lambda o: torch.sigmoid(4.0 * (o - 0.6)),
                           outer=lambda x: torch.abs(x - 0.3)))
    cons.append(Constraint("ce_gap", row_fn=per_row_ce,
                           dataset=data if gap_rows is None else data.select(range(gap_rows)),
                           tolerance=-0.05,
                           group_key="g"))
    cons.append(Constraint("weight_norm", fn=lambda m, b: 0.05 * (m.lin1.weight ** 2).sum(), tolerance=0.1))
    return cons


def scalar_twin(c: Constraint) -> Constraint:
    """The same constraint through the per-constraint path (one call of its own per step)."""
    if not c.rowwise:
        return c
    return Constraint(c.name, fn=c._reduced_row_fn, dataset=c.dataset, tolerance=c.tolerance, outer=c.outer,
                      metadata=dict(c.metadata))


def run(tmp_path, name: str, constraints: list[Constraint], holder: dict | None = None, **kw) -> ConstrainedTrainer:
    train = make_data(64, 1)
    trainer = ConstrainedTrainer(model=Net64(), args=make_args(tmp_path, name, **kw), train_dataset=train,
                                 constraints=constraints)
    if holder is not None:
        holder["trainer"] = trainer
    trainer.train()
    return trainer


def count_calls(fn, calls: list, holder: dict):
    def counted(model, batch):
        if holder["trainer"].in_training_step:  # not the preflight check before training
            calls.append((len(batch["sample_index"]), torch.is_grad_enabled()))
        return fn(model, batch)
    return counted


@pytest.mark.parametrize("accumulation,torch_format", [(1, False), (2, False), (1, True)])
def test_fused_step_equals_per_constraint_step(tmp_path, monkeypatch, accumulation, torch_format):
    data = make_data(90, 0)
    if torch_format:  # the fused step reads the rows of all sampled constraints as one column batch
        data = data.with_format("torch")
    gap_rows = None if torch_format else 40  # torch: every row-wise constraint reads from one parent
    fused_cons = rowwise_constraints(data, gap_rows)
    calls: list = []
    holder: dict = {}
    shared_fn = count_calls(per_row_ce, calls, holder)
    for c in fused_cons:
        if c.rowwise:
            c.row_fn = shared_fn
    reference_cons = [scalar_twin(c) for c in rowwise_constraints(data, gap_rows)]
    fast_reads: list = []
    if torch_format:
        original = batches_module._column_read

        def counted(units, collate):
            batch = original(units, collate)
            fast_reads.append(batch is not None)
            return batch

        monkeypatch.setattr(batches_module, "_column_read", counted)
    kw = dict(gradient_accumulation_steps=accumulation, per_device_train_batch_size=16 // accumulation)
    fused = run(tmp_path, f"fused{accumulation}{torch_format}", fused_cons, holder, **kw)
    reference = run(tmp_path, f"ref{accumulation}{torch_format}", reference_cons, **kw)

    assert len(fused.engine.values.row_groups) == 1 and len(fused.engine.values.row_groups[0].members) == 5
    if torch_format:  # the column-batch read was taken, every step and look-ahead
        assert len(fast_reads) >= 8 and all(fast_reads)
    assert reference.engine.values.row_groups == []
    # one row_fn call with grad and one without (the look-ahead) per step, on all sampled rows at once
    grad_calls = [n for n, g in calls if g]
    assert len(grad_calls) == 8 and len([n for n, g in calls if not g]) == 8
    assert max(grad_calls) > 8  # several constraints in one call
    for name, p in reference.model.named_parameters():
        q = dict(fused.model.named_parameters())[name]
        torch.testing.assert_close(q, p, rtol=1e-12, atol=1e-13, msg=lambda m, n=name: f"{n}: {m}")
    assert torch.equal(fused.engine.estimator.visited, reference.engine.estimator.visited)
    torch.testing.assert_close(fused.engine.estimator.values, reference.engine.estimator.values, rtol=1e-6, atol=1e-7)
    def streams(t):
        return [None if s is None else s.state_dict() for s in t.engine.streams]

    assert streams(fused) == streams(reference)
    assert fused.engine.next_draw.sample_indices == reference.engine.next_draw.sample_indices
    torch.testing.assert_close(fused.engine.next_draw.previous, reference.engine.next_draw.previous,
                               rtol=1e-6, atol=1e-7)
    # the comparison is not vacuous: the penalty moved the parameters
    plain = run(tmp_path, f"plain{accumulation}{torch_format}", rowwise_constraints(data), constraint_penalty="none",
                **kw)
    gap = max((dict(plain.model.named_parameters())[n] - p).abs().max().item()
              for n, p in reference.model.named_parameters())
    assert gap > 1e-3


def test_fused_values_are_segment_means_of_the_rows(tmp_path):
    """h_k(w; B_k) from the fused call equals a direct computation on each constraint's rows,
    including the group difference and the row_transform."""
    data = make_data(90, 0)
    cons = rowwise_constraints(data)
    trainer = ConstrainedTrainer(model=Net64(), args=make_args(tmp_path, "direct", constraints_per_step=6),
                                 train_dataset=make_data(16, 1), constraints=cons)
    draw = trainer.engine.draw(0)
    with torch.no_grad():
        _, current, stats = trainer.engine.values.evaluate(trainer.model, draw, need_grad=False)
        for p, k in enumerate(draw.constraint_ids.tolist()):
            c = cons[k]
            rows = draw.sample_indices[p]
            batch = (c.collate_fn or collate_examples)([c.dataset[i] for i in rows]) if rows is not None else None
            direct = c.fn(trainer.model, batch)
            # the scalar path keeps its float32 values (as before the fused step)
            assert abs(float(current[p]) - float(direct)) < (1e-12 if c.rowwise else 1e-7), c.name


def test_row_fn_output_errors_name_the_constraints(tmp_path):
    data = make_data(30, 0)
    bad = constraints_per_value(data, "cls", row_fn=lambda m, b: per_row_ce(m, b).mean())
    trainer = ConstrainedTrainer(model=Net64(), args=make_args(tmp_path, "bad"), train_dataset=make_data(16, 1),
                                 constraints=bad)
    with pytest.raises(Exception, match="cls=0"):
        trainer.engine.values.evaluate(trainer.model, trainer.engine.draw(0), need_grad=True)


def test_non_finite_look_ahead_is_an_error_naming_constraint_and_step(tmp_path):
    data = make_data(60, 0)
    state = {"calls": 0}

    def flaky(model, batch):
        out = per_row_ce(model, batch)
        if not torch.is_grad_enabled():  # the look-ahead (previous-iterate) call
            state["calls"] += 1
            if state["calls"] == 2:
                out = out + float("inf")
        return out

    cons = constraints_per_value(data, "cls", row_fn=flaky)
    trainer = ConstrainedTrainer(model=Net64(), args=make_args(tmp_path, "inf", max_steps=5, constraints_per_step=None),
                                 train_dataset=make_data(16, 1), constraints=cons)
    with pytest.raises(Exception, match=r"look-ahead.*step 1") as err:
        trainer.train()
    assert "cls=0" in str(err.value)


def test_constraints_per_value_is_fast_for_many_values(tmp_path):
    """200 constraints of one formula (rows A_k x <= b_k) declared in one call: set-up is one
    pass over the column, and each step evaluates every sampled one in one row_fn call."""
    n, m = 40000, 200
    rng = np.random.default_rng(0)
    data = Dataset.from_dict({"a": rng.normal(size=(n, 3)).tolist(), "k": (np.arange(n) % m).tolist(),
                              "b": rng.normal(size=n).tolist()})
    start = time.perf_counter()
    calls: list = []

    def row_fn(model, batch):
        calls.append(len(batch["sample_index"]))
        return batch["a"].to(model.w) @ model.w - batch["b"].to(model.w)

    # one scan per value, row-by-row column reads and hashed index lists took ~8 s here
    cons = constraints_per_value(data, "k", row_fn=row_fn, name="row{value}", eval_dataset=data)
    elapsed = time.perf_counter() - start
    assert len(cons) == m and elapsed < 4.0, elapsed
    assert len(cons[7].dataset) == n // m and set(cons[7].dataset["k"]) == {7}
    assert cons[7].eval_dataset["b"] == cons[7].dataset["b"]
    assert all(c.row_fn is row_fn for c in cons)

    class Lin(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(3))

        def forward(self, x, labels=None):
            return {"loss": ((x @ self.w - labels) ** 2).mean()}

    train = Dataset.from_dict({"x": rng.normal(size=(32, 3)).tolist(), "labels": rng.normal(size=32).tolist()})
    trainer = ConstrainedTrainer(model=Lin(), args=make_args(tmp_path, "many", constraints_per_step=20, max_steps=3,
                                                             msvr_gamma_prime=0.0),
                                 train_dataset=train, constraints=cons)
    trainer.train()
    assert calls[-3:] == [20 * 8] * 3  # one call per step on all 20 sampled constraints' rows


# ------------------------------------------------------------------ shared constraint batches
def soft_rate_constraints(data: Dataset, row_fn) -> list[Constraint]:
    """Three soft rates of one score at three thresholds, all on the SAME dataset object (ROC style)."""
    return [Constraint(f"rate@{tau}", row_fn=row_fn, dataset=data, tolerance=0.3,
                       row_transform=lambda o, tau=tau: torch.sigmoid(o - tau)) for tau in (-1.0, 0.0, 1.0)]


def score_rows(model, batch):
    return model(batch["x"].double())["logits"][:, 1]


@pytest.mark.parametrize("share", [False, True])
def test_shared_constraint_batches_score_one_batch_per_step(tmp_path, share):
    data = make_data(50, 0)
    calls: list = []
    holder: dict = {}
    cons = soft_rate_constraints(data, count_calls(score_rows, calls, holder))
    trainer = run(tmp_path, f"share{share}", cons, holder, share_constraint_batches=share, constraints_per_step=None,
                  max_steps=4)
    grad_rows = [n for n, g in calls if g]
    assert len(grad_rows) == 4
    assert grad_rows == ([8] * 4 if share else [24] * 4)  # one batch for the three, or one each
    positions = [s.state_dict()["position"] + 50 * s.state_dict()["epoch"] for s in trainer.engine.streams]
    # 5 draws of 8 rows (steps 0-3 and step 4's, drawn early for the look-ahead); shared: only the
    # first constraint's stream moved
    assert positions == ([40, 0, 0] if share else [40, 40, 40])
    # each constraint's value is its transform's mean over the ONE shared batch
    draw = trainer.engine.draw(99)
    if share:
        assert draw.sample_indices[0] is draw.sample_indices[1] is draw.sample_indices[2]
    with torch.no_grad():
        _, current, _ = trainer.engine.values.evaluate(trainer.model, draw, need_grad=False)
        for p, c in enumerate(cons):
            rows = draw.sample_indices[p]
            batch = (c.collate_fn or collate_examples)([data[i] for i in rows])
            direct = torch.sigmoid(score_rows(trainer.model, batch) - [-1.0, 0.0, 1.0][p]).mean()
            assert abs(float(current[p]) - float(direct)) < 1e-12


def test_constraint_batches_use_the_trainers_data_collator(tmp_path):
    """Without its own collate_fn a constraint's rows go through the trainer's data_collator
    (when it is not the default one), in the step and in the exact evaluation."""
    seen: list = []

    def collator(examples):
        seen.append(len(examples))
        return {"x": torch.tensor([e["x"] for e in examples]), "labels": torch.tensor([e["labels"] for e in examples])}

    data = make_data(40, 0)
    cons = constraints_per_value(data, "cls", row_fn=per_row_ce, tolerance=0.3)
    trainer = ConstrainedTrainer(model=Net64(), args=make_args(tmp_path, "coll", max_steps=2), data_collator=collator,
                                 train_dataset=make_data(16, 1).remove_columns(["g", "cls"]), constraints=cons)
    assert all(trainer.batches.collate_of(c) is collator for c in cons)
    seen.clear()
    trainer.train()
    assert 24 in seen  # a fused constraint batch: 3 constraints x 8 rows in one collate call


# ------------------------------------------------------------------ exact evaluation with statistics
def test_constraint_statistics_match_numpy(tmp_path):
    """Per-row values over the whole eval data give the value, standard error and upper bound of
    :func:`~hf_constrained.statistics.constraint_statistic`; recomputed here with numpy."""
    from scipy.stats import norm

    data, held_out = make_data(90, 0), make_data(77, 5)
    cons = rowwise_constraints(data)
    cons[3] = Constraint("soft_rate", row_fn=per_row_ce, dataset=data, eval_dataset=held_out, tolerance=0.02,
                         row_transform=lambda o: torch.sigmoid(4.0 * (o - 0.6)), outer=lambda x: torch.abs(x - 0.3))
    cons[4] = Constraint("ce_gap", row_fn=per_row_ce, dataset=data, eval_dataset=held_out, tolerance=-0.05,
                         group_key="g")
    trainer = ConstrainedTrainer(model=Net64(), args=make_args(tmp_path, "stats", constraint_eval_batch_size=16),
                                 train_dataset=make_data(16, 1), constraints=cons)
    stats = trainer.constraint_statistics(split="eval", confidence=0.9)
    z = norm.ppf(0.9)
    model = trainer.model
    with torch.no_grad():
        full = {"x": torch.tensor(held_out["x"]).double(), "labels": torch.tensor(held_out["labels"])}
        ce = per_row_ce(model, full).numpy()
        ce_train = per_row_ce(model, {"x": torch.tensor(data["x"]).double(),
                                      "labels": torch.tensor(data["labels"])}).numpy()
    g = np.array(held_out["g"])
    # soft rate with outer |x - 0.3|: bound = max over the ends of the inner interval
    soft = 1 / (1 + np.exp(-4.0 * (ce - 0.6)))
    se = soft.std(ddof=1) / np.sqrt(soft.size)
    inner = soft.mean()
    s = stats["soft_rate"]
    assert s.num_rows == 77 and abs(s.value - abs(inner - 0.3)) < 1e-12 and abs(s.std_error - se) < 1e-12
    assert abs(s.upper_bound - max(abs(inner - z * se - 0.3), abs(inner + z * se - 0.3))) < 1e-12
    # group difference: se = sqrt(s0^2/n0 + s1^2/n1)
    a, b = ce[g == 0], ce[g == 1]
    se = np.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size)
    s = stats["ce_gap"]
    assert abs(s.value - (a.mean() - b.mean())) < 1e-12 and abs(s.upper_bound - (a.mean() - b.mean() + z * se)) < 1e-12
    # per-class constraints (no eval_dataset: their training rows)
    cls = np.array(data["cls"])
    for v in range(3):
        rows = ce_train[cls == v]
        s = stats[f"ce_cls{v}"]
        assert s.num_rows == rows.size and abs(s.value - rows.mean()) < 1e-12
        assert abs(s.upper_bound - (rows.mean() + z * rows.std(ddof=1) / np.sqrt(rows.size))) < 1e-12
    # scalar, data-free: value only
    assert stats["weight_norm"].upper_bound is None
    assert abs(stats["weight_norm"].value - float(0.05 * (model.lin1.weight.detach() ** 2).sum())) < 1e-6
    # evaluate_constraints: the values
    assert trainer.evaluate_constraints() == {n: st.value for n, st in trainer.constraint_statistics().items()}


def test_constraints_per_value_groups_tensor_values():
    """0-d tensor values (a torch dataset of dicts) are grouped by the number they hold, not by identity."""
    rows = [{"x": torch.randn(3), "labels": torch.tensor(i % 3)} for i in range(30)]
    cons = constraints_per_value(rows, "labels", row_fn=per_row_ce)
    assert [c.name for c in cons] == ["labels=0", "labels=1", "labels=2"]
    assert [len(c.dataset) for c in cons] == [10, 10, 10]


def test_a_batch_without_one_group_is_the_same_error_in_every_path(tmp_path):
    """A ``group_key`` constraint is a difference of two group means: a batch (or an evaluation
    set) without rows of one group has no value. The fused step, the scalar form and the exact
    evaluation all stop with the same error naming the constraint."""
    from hf_constrained.constraint import EmptyGroupError

    data = make_data(40, 0)
    # two group-1 rows among 40, the first two rows one of each group (so the check before
    # training passes): most batches of 2 rows have no group-1 row
    groups = [0] * 40
    groups[1] = groups[30] = 1
    data = data.remove_columns("g").add_column("g", groups)
    gap = Constraint("gap", row_fn=per_row_ce, dataset=data, group_key="g", tolerance=0.0,
                     eval_dataset=data.select(range(2, 30)))
    args = make_args(tmp_path, "empty", max_steps=8, constraint_batch_size=2, constraints_per_step=None)
    trainer = ConstrainedTrainer(model=Net64(), args=args, train_dataset=make_data(16, 1), constraints=[gap])
    match = r"constraint 'gap'.* both groups of 'g'"
    with pytest.raises(EmptyGroupError, match=match):  # the fused step
        trainer.train()
    batch = collate_examples([data[i] for i in range(2, 6)])
    with pytest.raises(EmptyGroupError, match=match):  # the scalar form
        gap.fn(trainer.model, batch)
    with pytest.raises(EmptyGroupError, match=match):  # the exact evaluation
        trainer.constraint_statistics()
