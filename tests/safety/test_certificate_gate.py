"""The certificate in the safety loop: a certification split nothing else touches, a finite-sample
verdict that the report, the card, the gate and ``hf-constrained report --check`` all state."""

import json

import numpy as np
import pytest
import torch
from datasets import Dataset
from safety_tiny import ThetaConfig, ThetaModel, objective_data

from hf_constrained import ConstrainedTrainer, ConstrainedTrainingArguments, Constraint, finish_run
from hf_constrained.certification.bounds import clopper_pearson_upper_bound, hoeffding_bentkus_upper_bound
from hf_constrained.cli import main
from hf_constrained.constraint import Certification, CertifyStatistic
from hf_constrained.publishing.report import SafetyReport, UnsafeModelError
from hf_constrained.safety.model_fingerprint import weights_fingerprint


def scaled_rate(model, batch):
    """Per-row values x * theta / 5 in [0, 1] for x in [0, 1] and theta in [0, 5]."""
    return batch["x"].float() * model.theta / 5.0


def rows(seed, n, low=0.0, high=0.4):
    return Dataset.from_dict({"x": np.random.default_rng(seed).uniform(low, high, n).tolist()})


def make(tmp_path, *, tolerance=0.2, certify=True, steps=2, value_range=(0.0, 1.0), statistic=None, **constraint_kw):
    kw = dict(dataset=rows(1, 40), eval_dataset=rows(2, 40), tolerance=tolerance)
    if certify:
        kw.update(certify=Certification(dataset=rows(3, 300), statistic=statistic, value_range=value_range))
    kw.update(constraint_kw)
    args = ConstrainedTrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, learning_rate=0.1, optim="sgd",
        weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant", report_to=[], disable_tqdm=True,
        use_cpu=True, seed=0, max_steps=steps, logging_steps=1, save_strategy="no", constraint_penalty="none",
        constraint_batch_size=4)
    torch.manual_seed(0)
    trainer = ConstrainedTrainer(model=ThetaModel(ThetaConfig()), args=args, train_dataset=objective_data(),
                                 constraints=[Constraint("rate", row_fn=scaled_rate, **kw)])
    trainer.train()
    return trainer


def test_certified_run_states_one_verdict_in_report_card_and_cli(tmp_path):
    trainer = make(tmp_path, tolerance=0.2)
    report = finish_run(trainer, plots=False)
    theta = float(trainer.model.theta)
    assert theta == pytest.approx(1.8, abs=1e-6)  # two SGD steps on (theta - 5)^2
    # the bound is the default (Hoeffding-Bentkus) bound of the certification rows' own values, computed here
    # independently, at the delta the split's first look spends (0.9 delta: the ledger's default schedule)
    values = np.asarray(rows(3, 300)["x"]) * theta / 5.0
    expected = hoeffding_bentkus_upper_bound(values, (0.0, 1.0), 0.045)
    assert report.certified_bounds()["rate"] == pytest.approx(expected, abs=1e-6)
    assert (report.certificate["looks"] == {"rate": 1}
            and report.certificate["delta_spent"] == {"rate": pytest.approx(0.045)})
    assert report.certified and report.all_satisfied and report.safety_rule == "certified"
    assert report.summary().startswith("CERTIFIED at delta = 0.05: with probability at least 0.95")
    assert report.certificate["num_rows"] == {"rate": 300}
    fingerprint = report.certificate["split_fingerprints"]["rate"]
    card = (tmp_path / "run" / "README.md").read_text()
    assert "**CERTIFIED at delta = 0.05" in card and fingerprint in card
    assert main(["report", str(tmp_path / "run"), "--check"]) == 0
    on_disk = json.loads((tmp_path / "run" / "safety_report.json").read_text())
    assert on_disk["certified"] is True and on_disk["certificate"]["delta"] == 0.05


def test_a_point_pass_without_a_certified_bound_is_refused(tmp_path, capsys):
    # value about 0.072: within 0.08 on the point estimate, but the bound at n = 300 is not
    trainer = make(tmp_path, tolerance=0.08)
    report = finish_run(trainer, plots=False)
    assert report.with_rule("point").all_satisfied
    assert not report.certified and not report.all_satisfied and report.failed == ["rate"]
    assert report.summary().startswith("NOT CERTIFIED at delta = 0.05: certified bound above tolerance for rate")
    with pytest.raises(UnsafeModelError, match="NOT CERTIFIED"):
        trainer.safety.check_safe_to_push()
    card = (tmp_path / "run" / "README.md").read_text()
    assert "> **NOT CERTIFIED" in card and "not-certified" in card
    assert main(["report", str(tmp_path / "run"), "--check"]) == 1
    # the explicitly uncertified point rule passes, and says it is not certified
    assert main(["report", str(tmp_path / "run"), "--check", "--rule", "point"]) == 0
    assert "PASSES, NOT CERTIFIED" in capsys.readouterr().out


def test_a_run_without_a_certification_split_is_never_safe(tmp_path):
    trainer = make(tmp_path, certify=False)
    report = finish_run(trainer, plots=False)
    assert report.with_rule("point").all_satisfied and not report.all_satisfied
    assert report.not_certifiable == ["rate"]
    assert "NOT CERTIFIED: no constraint has a certification split" in report.summary()
    assert main(["report", str(tmp_path / "run"), "--check"]) == 1


@pytest.mark.parametrize("where", ["dataset", "eval_dataset", "objective"])
def test_certification_rows_shared_with_training_or_selection_are_refused_before_training(tmp_path, where):
    certify_rows = rows(3, 30)
    overlap = Dataset.from_dict({"x": list(certify_rows["x"][:5]) + list(rows(9, 20)["x"])})
    constraint_kw = dict(dataset=rows(1, 40), eval_dataset=rows(2, 40),
                         certify=Certification(dataset=certify_rows, value_range=(0, 1)))
    train = objective_data()
    if where == "objective":
        train = Dataset.from_dict({"x": list(overlap["x"]), "labels": [0.0] * len(overlap)})
    else:
        constraint_kw[where] = overlap
    args = ConstrainedTrainingArguments(output_dir=str(tmp_path / "r"), report_to=[], use_cpu=True, max_steps=1,
                                        constraint_penalty="none")
    what = {"dataset": "training rows of constraint 'rate'", "eval_dataset": "held-out \\(selection\\) rows",
            "objective": "the objective's train_dataset"}[where]
    with pytest.raises(ValueError, match=f"constraint 'rate': 5 of the 30 rows of its certification split "
                                         f"\\(certify.dataset\\) also appear in .*{what}"):
        ConstrainedTrainer(model=ThetaModel(ThetaConfig()), args=args, train_dataset=train,
                           constraints=[Constraint("rate", row_fn=scaled_rate, **constraint_kw)])


def test_certification_needs_a_declared_range_and_never_clips(tmp_path):
    with pytest.raises(ValueError, match=r"constraint 'rate': certify=Certification\(dataset=...\) needs value_range"):
        Constraint("rate", row_fn=scaled_rate, dataset=rows(1, 5), certify=Certification(dataset=rows(3, 5)))
    with pytest.raises(TypeError, match="certify_dataset"):  # the one field is certify: no other spelling
        Constraint("rate", row_fn=scaled_rate, dataset=rows(1, 5), certify_dataset=rows(3, 5))
    # a tolerance above the declared range says nothing: an error naming the constraint before training
    with pytest.raises(ValueError, match="constraint 'rate': tolerance 0.2 cannot be expressed"):
        make(tmp_path, tolerance=0.2, value_range=(0.0, 0.05))
    # a range the values leave is an error naming the constraint, not a clipped bound
    trainer = make(tmp_path, tolerance=0.04, value_range=(0.0, 0.05))
    with pytest.raises(ValueError, match="constraint 'rate'.*outside the declared value_range"):
        finish_run(trainer, plots=False)


def test_a_proxy_statistic_is_what_gets_certified(tmp_path):
    # trained on the surrogate's tolerance, certified on a 0/1 statistic with its own tolerance
    def above_half_theta(model, batch):
        return (batch["x"].float() * model.theta > 0.5).double()

    stat = CertifyStatistic(above_half_theta, tolerance=0.5, value_range=(0, 1), bound="clopper_pearson",
                            description="share of rows with x * theta > 0.5")
    trainer = make(tmp_path, tolerance=0.2, statistic=stat)
    report = finish_run(trainer, plots=False)
    x = np.asarray(rows(3, 300)["x"])
    k = int(np.sum(x * float(trainer.model.theta) > 0.5))
    assert report.certificate["tolerance"] == {"rate": 0.5}
    assert report.certificate["bound"] == {"rate": "clopper_pearson"}
    assert report.certified_bounds()["rate"] == pytest.approx(clopper_pearson_upper_bound(k, 300, 0.045))
    assert report.certified == (clopper_pearson_upper_bound(k, 300, 0.045) <= 0.5)
    assert SafetyReport.load(str(tmp_path / "run")).certified == report.certified


def make_saving(tmp_path, tolerance):
    """A run that saves (and evaluates) a checkpoint at each of its 5 steps."""
    kw = dict(dataset=rows(1, 40), eval_dataset=rows(2, 40), tolerance=tolerance,
              certify=Certification(dataset=rows(3, 300), value_range=(0.0, 1.0)))
    args = ConstrainedTrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, learning_rate=0.1, optim="sgd",
        weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant", report_to=[], disable_tqdm=True,
        use_cpu=True, seed=0, max_steps=5, logging_steps=1, eval_strategy="steps", eval_steps=1,
        save_strategy="steps", save_steps=1, metric_for_best_model="loss", constraint_penalty="none",
        constraint_batch_size=4, save_only_model=True)
    torch.manual_seed(0)
    return ConstrainedTrainer(model=ThetaModel(ThetaConfig()), args=args, train_dataset=objective_data(),
                              eval_dataset=objective_data(8),
                              constraints=[Constraint("rate", row_fn=scaled_rate, **kw)])


def test_checkpoints_are_certified_in_training_order_and_the_best_certified_is_released(tmp_path):
    """theta grows with every step (1.0, 1.8, 2.44, 2.95, ...), and so does the rate: fixed-sequence
    testing in training order certifies the early checkpoints, stops at the first that fails, and
    the release is the certified checkpoint with the best selection objective (the latest certified)."""
    trainer = make_saving(tmp_path, tolerance=0.13)
    trainer.train()
    x = np.asarray(rows(3, 300)["x"])
    thetas = [5.0 * (1 - 0.8 ** t) for t in range(1, 6)]
    bounds = [hoeffding_bentkus_upper_bound(x * th / 5.0, (0, 1), 0.045) for th in thetas]  # the split's first look
    expected = []
    for j, b in enumerate(bounds):
        if b > 0.13:
            break
        expected.append(j)
    assert expected and len(expected) < 5  # the tolerance cuts the sequence inside the run
    final = weights_fingerprint(trainer.model)
    report = finish_run(trainer, plots=False, candidates="checkpoints")
    assert report.certificate["certified"] == expected
    assert report.certificate["num_candidates"] == 5 and len(report.certificate["upper_bounds"]) == len(expected) + 1
    assert report.certified and report.certificate_candidate == expected[-1]
    assert float(trainer.model.theta) == pytest.approx(thetas[expected[-1]], abs=1e-5)
    assert report.global_step == expected[-1] + 1 and report.checkpoint == f"checkpoint-{expected[-1] + 1}"
    # the report names the released checkpoint's weights, not the final ones it hashed first
    assert report.weights_fingerprint == weights_fingerprint(trainer.model) != final


def test_certified_checkpoints_are_known_by_their_own_weights_each_hashed_once(tmp_path, monkeypatch):
    """Every checkpoint certifies and the last (the final weights) is released: the ledger's identities are the
    candidates' own weights fingerprints (certifying the same checkpoints again, each hashed afresh, is the same
    look), the report's fingerprint is the weights in the trainer, and each candidate's weights are hashed once
    (5 checkpoints; the final weights, which are the last of them, once more, to know that they are)."""
    from hf_constrained.safety import evaluation, run_end

    trainer = make_saving(tmp_path, tolerance=0.5)
    trainer.train()
    hashed = []

    def counted(model):
        hashed.append(model)
        return weights_fingerprint(model)

    for module in (run_end, evaluation):
        monkeypatch.setattr(module, "weights_fingerprint", counted)
    report = finish_run(trainer, plots=False, candidates="checkpoints")
    assert report.certificate["certified"] == [0, 1, 2, 3, 4] and report.certificate_candidate == 4
    assert report.checkpoint is None and report.weights_fingerprint == weights_fingerprint(trainer.model)
    assert len(hashed) == 6 and report.certificate["looks"] == {"rate": 1}
    monkeypatch.undo()
    folders = [str(tmp_path / "run" / f"checkpoint-{step}") for step in range(1, 6)]
    again = trainer.safety.certify([trainer.safety.checkpoint_model(f) for f in folders])
    assert again.looks == {"rate": 1} and again.upper_bounds == report.certificate["upper_bounds"]


def test_license_and_pipeline_tag_reach_the_card(tmp_path):
    from huggingface_hub import ModelCard

    trainer = make(tmp_path)
    finish_run(trainer, plots=False, license="apache-2.0", task="tabular-regression")
    data = ModelCard.load(str(tmp_path / "run" / "README.md")).data
    assert data.license == "apache-2.0" and data.pipeline_tag == "tabular-regression"
    assert data.eval_results is None  # no Hub dataset named: no model-index rather than an invented one

