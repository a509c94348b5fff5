"""The ledger of looks: every certificate on a certification split spends its error budget, counted
across runs and output directories, and "retrain until CERTIFIED" no longer voids the guarantee."""

import json
import math

import numpy as np
import pytest
import torch
from datasets import Dataset
from safety_tiny import ThetaConfig, ThetaModel, objective_data

from hf_constrained import Certification, ConstrainedTrainer, ConstrainedTrainingArguments, Constraint, finish_run
from hf_constrained.certification.bounds import clopper_pearson_upper_bound, clopper_pearson_upper_bounds
from hf_constrained.certification.certify import certify
from hf_constrained.certification.ledger import (
    LEDGER_FILE,
    CertificationLedger,
    GeometricSpending,
    LookRefused,
    SingleLook,
    user_ledger_path,
)

SPLIT = "sha256:" + "ab" * 32


def forgotten(k, n=200):
    x = np.zeros(n)
    x[:k] = 1.0
    return x


def cert(ledger, k, tol=0.1, fingerprint=SPLIT):
    return certify([{"f": forgotten(k)}], {"f": tol}, (0.0, 1.0), 0.05, bound="clopper_pearson",
                   split_fingerprints={"f": fingerprint}, ledger=ledger)


def level(j, delta=0.05):
    """The default schedule, written out: 0.9 of delta at the first look, a tenth of that at each further one."""
    return delta * 0.9 * 0.1 ** (j - 1)


def test_each_further_certificate_on_a_split_spends_a_tenth_of_the_look_before(tmp_path):
    ledger = CertificationLedger([tmp_path / "l.json"])
    for j, k in enumerate((3, 5, 7), start=1):
        c = cert(ledger, k)
        assert c.looks == {"f": j} and c.delta_spent == {"f": pytest.approx(level(j))}
        assert c.upper_bounds[0]["f"] == pytest.approx(clopper_pearson_upper_bound(k, 200, level(j)))
        assert f"look {j}" in c.statement() and c.to_dict()["looks"] == {"f": j}
    # the same certificate again (same values, tolerance, split) is the same look: nothing more is spent
    again = cert(ledger, 5)
    assert again.looks == {"f": 2} and again.delta_spent == {"f": pytest.approx(level(2))}
    assert [look.look for look in ledger.looks(SPLIT)] == [1, 2, 3]
    # another tolerance on the same values is another claim: a new look
    assert cert(ledger, 5, tol=0.2).looks == {"f": 4}
    # another split has its own budget
    assert cert(ledger, 5, fingerprint="sha256:" + "cd" * 32).looks == {"f": 1}


def test_a_spent_budget_is_refused_with_what_to_do(tmp_path):
    single = CertificationLedger([tmp_path / "single.json"], SingleLook())
    first = cert(single, 3)
    assert first.delta_spent == {"f": 0.05} and first.looks == {"f": 1}
    assert cert(single, 3).looks == {"f": 1}  # the same look again is not a new one
    with pytest.raises(LookRefused, match=r"\['f'\].*certified on 1 time.*fresh certification rows"):
        cert(single, 4)
    assert len(single.looks(SPLIT)) == 1  # a refused look records nothing
    capped = CertificationLedger([tmp_path / "capped.json"], GeometricSpending(max_looks=2))
    cert(capped, 1)
    cert(capped, 2)
    with pytest.raises(LookRefused):
        cert(capped, 3)


def test_bad_values_spend_no_look(tmp_path):
    ledger = CertificationLedger([tmp_path / "l.json"])
    with pytest.raises(ValueError, match="constraint 'f'"):
        certify([{"f": np.full(10, 0.5)}], {"f": 0.1}, (0.0, 1.0), bound="clopper_pearson",
                split_fingerprints={"f": SPLIT}, ledger=ledger)
    assert ledger.looks(SPLIT) == []


def test_looks_in_either_file_count_and_reach_both(tmp_path):
    user, run = tmp_path / "user.json", tmp_path / "run" / LEDGER_FILE
    cert(CertificationLedger([run]), 3)  # a look recorded with the run only (e.g. on another machine)
    both = CertificationLedger([user, run])
    assert cert(both, 4).looks == {"f": 2}
    for path in (user, run):
        data = json.loads(path.read_text())
        assert [r["look"] for r in data["splits"][SPLIT]] in ([1, 2], [2])
    assert [r["look"] for r in json.loads(user.read_text())["splits"][SPLIT]] == [2]
    text = run.read_text()
    assert str(tmp_path) not in text  # fingerprints, looks and deltas: no path


def test_a_corrupt_ledger_is_an_error_never_overwritten(tmp_path):
    path = tmp_path / "l.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read"):
        cert(CertificationLedger([path]), 3)
    assert path.read_text() == "{not json"


def test_retraining_until_certified_keeps_the_error_below_delta():
    """An adversary certifies 6 models (the most the default schedule allows) on one split, each violating the
    tolerance (true forgotten share 0.051 > 0.05), and publishes any that certifies. At delta each, one certifies far
    more often than delta; at the ledger's delta_j, the chance that any does stays below delta."""
    rng = np.random.default_rng(0)
    reps, n, p, tol, looks = 4000, 400, 0.051, 0.05, 6
    counts = rng.binomial(n, p, (reps, looks))
    every_at_delta = (clopper_pearson_upper_bounds(counts, n, 0.05) <= tol).any(axis=1).mean()
    spending = GeometricSpending()
    levels = np.array([spending.level(0.05, j) for j in range(1, looks + 1)])
    spent = (clopper_pearson_upper_bounds(counts, n, levels[None, :]) <= tol).any(axis=1).mean()
    assert every_at_delta > 0.05 + 3 * math.sqrt(0.05 * 0.95 / reps)
    assert spent <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / reps)


# ---------------------------------------------------------------------- through the trainer
def rows(seed, n, low=0.0, high=0.4):
    return Dataset.from_dict({"x": np.random.default_rng(seed).uniform(low, high, n).tolist()})


def scaled_rate(model, batch):
    return batch["x"].float() * model.theta / 5.0


def train(out, steps):
    args = ConstrainedTrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, learning_rate=0.1, optim="sgd", weight_decay=0.0,
        max_grad_norm=0.0, lr_scheduler_type="constant", report_to=[], disable_tqdm=True, use_cpu=True, seed=0,
        max_steps=steps, logging_steps=1, save_strategy="no", constraint_penalty="none", constraint_batch_size=4)
    torch.manual_seed(0)
    constraint = Constraint("rate", row_fn=scaled_rate, dataset=rows(1, 40), eval_dataset=rows(2, 40), tolerance=0.2,
                            certify=Certification(dataset=rows(3, 300), value_range=(0.0, 1.0)))
    trainer = ConstrainedTrainer(model=ThetaModel(ThetaConfig()), args=args, train_dataset=objective_data(),
                                 constraints=[constraint])
    trainer.train()
    return trainer


def test_three_models_certified_on_one_split_in_three_output_directories_count_as_three_looks(tmp_path):
    reports = [finish_run(train(tmp_path / f"model{j}", steps), plots=False) for j, steps in enumerate((1, 2, 3))]
    looks = [r.certificate["looks"]["rate"] for r in reports]
    spent = [r.certificate["delta_spent"]["rate"] for r in reports]
    assert looks == [1, 2, 3] and spent == pytest.approx([level(1), level(2), level(3)])
    fingerprint = reports[0].certificate["split_fingerprints"]["rate"]
    user = json.loads(open(user_ledger_path()).read())
    assert [r["look"] for r in user["splits"][fingerprint]] == [1, 2, 3]
    # each run's own ledger holds its look
    own = json.loads((tmp_path / "model1" / LEDGER_FILE).read_text())
    assert [r["look"] for r in own["splits"][fingerprint]] == [2]
    # a report written again for the same weights is the same look
    again = finish_run(train(tmp_path / "model1", 2), plots=False)
    assert again.certificate["looks"] == {"rate": 2}


def test_another_model_with_the_same_values_is_another_look(tmp_path):
    """Two different models whose per-row values coincide (common for a 0/1 rate: nothing forgotten) make two
    claims: with their identities (the weights' fingerprints) they are two looks; the same model again is the
    same look. Without identities the call is known by its values alone."""
    ledger = CertificationLedger([tmp_path / "l.json"])

    def by(identity, k=0):
        return certify([{"f": forgotten(k)}], {"f": 0.1}, (0.0, 1.0), 0.05, bound="clopper_pearson",
                       split_fingerprints={"f": SPLIT}, ledger=ledger, candidate_ids=[identity])

    assert by("model-a").looks == {"f": 1}
    second = by("model-b")
    assert second.looks == {"f": 2} and second.upper_bounds[0]["f"] == pytest.approx(
        clopper_pearson_upper_bound(0, 200, level(2)))
    assert by("model-a").looks == {"f": 1}  # the same model and values: the same look, nothing spent
    assert [look.look for look in ledger.looks(SPLIT)] == [1, 2]
    with pytest.raises(ValueError, match="candidate_ids"):
        certify([{"f": forgotten(0)}], {"f": 0.1}, (0.0, 1.0), candidate_ids=["a", "b"])


def test_changed_weights_with_unchanged_values_are_a_new_look_through_the_trainer(tmp_path):
    """The trainer certifies its model under the weights' fingerprint: weights that changed where the statistic
    does not look (here a buffer the constraint never reads) give the same per-row values, yet another look."""
    trainer = train(tmp_path / "model", 2)
    first = finish_run(trainer, plots=False)
    trainer.model.register_buffer("unread", torch.ones(1))
    second = finish_run(trainer, plots=False)
    assert first.certificate["values"] == second.certificate["values"]
    assert (first.certificate["looks"], second.certificate["looks"]) == ({"rate": 1}, {"rate": 2})
    assert second.certificate["delta_spent"]["rate"] == pytest.approx(level(2))
