"""A report records the settings the run used, for every option of the library's arguments.

The options are read from the argument dataclass itself (no hand list of names): an option added
later without being recorded fails here. Reports are built the way every report is, by the safety loop the
trainer holds (``trainer.safety``, reading the run through its typed view), and checked in memory, in the
``safety_report.json`` it writes and in the model card. The engine resolves some options (``constraints_per_step``
unset means all m constraints, ``msvr_gamma_prime="theory"`` a number): the report records the
resolved value the run used, not the configured spelling and not a default.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset
from safety_tiny import ThetaConfig, ThetaModel, objective_data

from hf_constrained import Certification, ConstrainedTrainer, ConstrainedTrainingArguments, Constraint
from hf_constrained.constraint import CertifyStatistic
from hf_constrained.method.estimators import theory_gamma_prime
from hf_constrained.publishing.report import SafetyReport
from hf_constrained.safety.finish import build_safety_report
from hf_constrained.safety.view import library_option_names

M = 4  # constraints: constraints_per_step < M is a real choice


def scaled_rate(model, batch):
    return batch["x"].float() * model.theta / 5.0


def _rows(seed: int, n: int) -> Dataset:
    return Dataset.from_dict({"x": np.random.default_rng(seed).uniform(0.0, 0.4, n).tolist()})


def _report(tmp_path, **options):
    options = {"constraint_batch_size": 4, **options}
    args = ConstrainedTrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, report_to=[], disable_tqdm=True,
        use_cpu=True, seed=0, max_steps=1, save_strategy="no", **options)
    stat = CertifyStatistic(scaled_rate, tolerance=0.2, value_range=(0.0, 1.0), description="rate")
    constraints = [Constraint(f"rate{k}", row_fn=scaled_rate, dataset=_rows(k, 40), eval_dataset=_rows(10 + k, 20),
                              certify=Certification(dataset=_rows(20 + k, 30), statistic=stat, value_range=(0.0, 1.0)),
                              tolerance=0.2) for k in range(M)]
    torch.manual_seed(0)
    trainer = ConstrainedTrainer(model=ThetaModel(ThetaConfig()), args=args, train_dataset=objective_data(),
                                 constraints=constraints)
    return trainer, trainer.safety.build_report(objective_metrics={})


def _changed_value(field: dataclasses.Field):
    """A valid value other than the default, by the option's type; the options that need another
    option with them get it (``needs``). An option of a type this cannot choose for fails the test."""
    special = {"constraints_per_step": 3, "msvr_gamma_prime": "theory", "objective_msvr_gamma_prime": "theory",
               "constraint_penalty": "squared_hinge"}
    needs = {"constraint_indicator_batch_size": {"constraint_indicator_fraction": 0.5},
             "constraint_proxy_indicator": {"constraint_indicator_fraction": 0.5}}
    default = field.default
    if field.name in special:
        value = special[field.name]
    elif isinstance(default, bool):
        value = not default
    elif isinstance(default, int):
        value = default + 1
    elif isinstance(default, float):
        value = default / 2
    elif default is None and "int" in str(field.type):
        value = 3
    elif default is None and "float" in str(field.type):
        value = 0.75
    else:
        pytest.fail(f"no test value for the option {field.name} ({field.type}, default {default!r}): add one")
    return value, needs.get(field.name, {})


# the strategies an option stands for (method/strategies.py), as the report records them: the option's value
# (``_changed_value``) inside the rule's or source's name and parameters
TWO_SPLIT = "two_split(fraction={}, indicator_batch_size={}, proxy_statistic={})"
STRATEGIES = {
    "constraint_margin": {"margin_rule": "fixed(value=0.75)", "margin_rules": {"fixed(value=0.75)": M}},
    "constraint_confidence": {"margin_rule": "calibrated(confidence=0.75)",
                              "margin_rules": {"calibrated(confidence=0.75)": M}},
    # these constraints certify another statistic: a margin sized to the certificate sizes none of them
    "constraint_certificate_delta": {"margin_rule": "certificate(delta=0.75)", "margin_rules": {"none": M}},
    "constraint_indicator_fraction": {"estimate_source": TWO_SPLIT.format(0.75, None, False)},
    "constraint_indicator_batch_size": {"estimate_source": TWO_SPLIT.format(0.5, 3, False)},
    "constraint_proxy_indicator": {"estimate_source": TWO_SPLIT.format(0.5, None, True)},
}


def _expected(name: str, value, trainer) -> object:
    """What the report must record for ``name`` set to ``value``: the value the run used."""
    if name == "msvr_gamma_prime":
        return theory_gamma_prime(M, trainer.engine.sampler.num_per_step, trainer.args.msvr_gamma)
    return value


def test_every_option_is_recorded_as_the_run_used_it(tmp_path):
    fields = {f.name: f for f in dataclasses.fields(ConstrainedTrainingArguments)}
    names = library_option_names()
    assert "constraints_per_step" in names and "constraint_indicator_batch_size" in names
    _, default = _report(tmp_path)
    assert default.method["constraints_per_step"] == M  # unset: every constraint, resolved
    assert (default.method["margin_rule"], default.method["margin_rules"]) == ("none", {"none": M})
    assert default.method["estimate_source"] == "one_split"  # the paper's Algorithm 1
    for name in names:
        value, needs = _changed_value(fields[name])
        trainer, report = _report(tmp_path, **{name: value}, **needs)
        expected = _expected(name, value, trainer)
        recorded = report.method[name]
        assert recorded == pytest.approx(expected) if isinstance(expected, float) else recorded == expected, name
        assert recorded != default.method[name], f"{name}: the report does not follow the option"
        for key, strategy in STRATEGIES.get(name, {}).items():  # the strategy the option stands for
            assert report.method[key] == strategy, (name, key)
        # what the loop writes and what it holds as the weights' report record the same settings
        trainer.safety.save_report(report, str(tmp_path / "written"))
        assert SafetyReport.load(str(tmp_path / "written")).method == report.method, name
        assert trainer.safety.current_report().method == report.method, name


def test_the_card_and_every_report_path_record_the_runs_settings(tmp_path):
    """Every way a report is made (the loop's report, the function form, a report from logged metrics, a
    checkpoint's) records the settings the run used, and the card shows them."""
    trainer, report = _report(tmp_path, constraints_per_step=3, msvr_gamma_prime="theory", penalty_beta=7.5)
    run = trainer.safety.view.method_settings()
    assert run["constraints_per_step"] == 3 and run["penalty_beta"] == 7.5
    assert report.method == run
    assert build_safety_report(trainer, objective_metrics={}).method == run
    assert trainer.safety.report_from_metrics(trainer.evaluate()).method == run
    trainer.save_model(str(tmp_path / "saved"))
    assert trainer.safety.build_report(checkpoint=str(tmp_path / "saved")).method == run
    card = (tmp_path / "saved" / "README.md").read_text(encoding="utf-8")
    assert [k for k, v in run.items() if f"| {k} | {v} |" not in card] == []  # every setting, as the run used it
    assert SafetyReport.load(str(tmp_path / "saved")).method == run


def test_recorded_sampling_is_the_engines(tmp_path):
    """The regression the issue found: 3 constraints sampled per step, the report said m."""
    trainer, report = _report(tmp_path, constraints_per_step=3, msvr_gamma_prime="theory")
    assert report.method["constraints_per_step"] == trainer.engine.sampler.num_per_step == 3
    assert report.method["msvr_gamma_prime"] == pytest.approx(trainer.engine.estimator.gamma_prime)
    assert report.method["msvr_gamma_prime_rule"] == "theory"
    assert report.method["num_constraints"] == M


def _documented_names(doc: str, heading: str) -> set[str]:
    """The names (in backticks) in the first column of the first table under ``heading`` in ``docs/<doc>``."""
    text = (Path(__file__).resolve().parents[2] / "docs" / doc).read_text(encoding="utf-8")
    assert heading in text, f"docs/{doc} has no section {heading!r}"
    rows = []
    for line in text.split(heading, 1)[1].splitlines():
        if line.startswith("|"):
            rows.append(line)
        elif rows:  # the end of the first table
            break
    names = {name for row in rows[2:] for name in re.findall(r"`([a-z_]+)`", row.split("|")[1])}
    assert names, f"no table of names under {heading!r} in docs/{doc}"
    return names


def test_every_recorded_setting_is_documented(tmp_path):
    """Every setting a report and a card record is documented: the options of the arguments in docs/method.md's
    table, the others in docs/safety.md's, and the example card shows them all. A setting recorded later without
    a line there fails here, and a line for a setting no run records fails too. The recorded names come from a
    real run's report, with two-split estimation and a margin rule on, so that no setting is left out for being
    unset."""
    _, report = _report(tmp_path, constraint_indicator_fraction=0.5, constraint_margin=0.1)
    recorded = set(report.method)
    arguments = _documented_names("method.md", "## Training arguments")
    others = _documented_names("safety.md", "### Settings a card and a report record")
    assert sorted(recorded - arguments - others) == [], "recorded but not documented"
    assert sorted(others - recorded) == [], "documented in docs/safety.md but never recorded"
    assert sorted(arguments - set(library_option_names())) == [], "docs/method.md documents an unknown argument"
    # the example card (docs/safety/model_card.md) shows the settings a card records, all of them
    card = (Path(__file__).resolve().parents[2] / "docs" / "safety" / "model_card.md").read_text(encoding="utf-8")
    shown = re.findall(r"^\| ([a-z_]+) \| .* \|$", card.split("## Method and settings", 1)[1].split("\n## ")[0], re.M)
    assert sorted(shown[1:]) == sorted(recorded), "the example card's settings are not those a run records"
