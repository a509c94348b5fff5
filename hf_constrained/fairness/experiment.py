"""One ROC-fairness run (paper section 5.1): data, model, constraints, a method, results.

:func:`run_roc_fairness` is what ``recipes/roc_fairness.py`` and the benchmark call. The
method is one of

* ``hinge``: the single-loop hinge exact penalty with MSVR estimators (Algorithm 1);
* ``squared_hinge``: the squared-hinge penalty baseline (Li et al. 2024);
* ``none``: the AUC objective alone (constraints evaluated, not trained on);
* ``icppac``: the double-loop ICPPAC baseline (:mod:`hf_constrained.fairness.icppac`).

All four use the same model, data, batches, number of epochs and learning-rate
schedule (constant, then x ``lr_decay_factor`` at each fraction in ``lr_decay_at``;
the paper decays x0.1 at 50% and 75%): torch's ``MultiStepLR`` for the penalty methods,
the same multipliers (:func:`step_decay`) in ICPPAC's own loop.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch
from transformers import TrainerCallback

from ..atomic_files import atomic_write_json
from ..certification.splits import check_certify_fraction
from ..config import ConstrainedTrainingArguments
from ..extras import require_extra
from ..publishable import publishable_command
from ..safety.finish import certify_models, finish_run, push_last
from ..safety.settings import CertificateArguments
from .data import TABULAR_LOADERS, TabularColumns, TabularSplit, load_tabular_csv
from .evaluation import ROCHistoryCallback
from .icppac import ICPPACConfig, ICPPACTrainer
from .model import MLPConfig, MLPForScoring
from .roc import (
    DEFAULT_KAPPA,
    AUCConstrainedTrainer,
    collate_pairs,
    objective_pairs,
    pairwise_auc_loss,
    roc_fairness_constraints,
    roc_fairness_values,
    score_rows,
    smallest_certified_gap,
)

logger = logging.getLogger(__name__)

METHODS = ("hinge", "squared_hinge", "none", "icppac")
SHIFT_WARNING_FRACTION = 0.5
"""Above this fraction of scores outside the thresholds, a run's results say so (and log it)."""


@dataclass
class ROCFairnessArguments(CertificateArguments):
    """What to train on and with which method (the Trainer settings are in
    :class:`~hf_constrained.ConstrainedTrainingArguments`)."""

    dataset: str = field(default="adult", metadata={"help": "'adult', 'compas' or 'csv' (then set --csv_path)."})
    method: str = field(default="hinge", metadata={"help": f"One of {METHODS}.", "choices": list(METHODS)})
    kappa: float = field(default=DEFAULT_KAPPA, metadata={"help": "Allowed group-rate gap kappa (paper: 0.005)."})
    thresholds: str = field(default="-3,-2,-1,0,1,2,3",
                            metadata={"help": "Comma-separated score thresholds Gamma (paper: -3..3)."})
    hidden_sizes: str = field(default="64,32", metadata={"help": "Widths of the MLP's hidden layers."})
    score_bound: Optional[str] = field(default="none", metadata={
        "help": "Bound B of the scores, s = B * tanh(z / B): a number >= the largest |threshold|, 'auto' (the "
                "largest |threshold|, 1 if all are 0) or 'none' (the plain logit, the paper's model). A bound keeps "
                "the constraints from being met by moving every score past the thresholds, where the soft rates "
                "saturate."})
    rate_temperature: float = field(default=1.0, metadata={
        "help": "Temperature T of the constraints' soft rates sigmoid((s - tau) / T) (paper: 1). A smaller T brings "
                "the trained soft rates closer to the hard rates 1[s > tau] that the certificate bounds."})
    lr_decay_at: str = field(default="0.5,0.75",
                             metadata={"help": "Fractions of training at which the learning rate is decayed."})
    lr_decay_factor: float = field(default=0.1, metadata={"help": "Multiplier applied at each decay point."})
    csv_path: Optional[str] = field(default=None, metadata={"help": "--dataset csv: the CSV file (train, or all)."})
    csv_test_path: Optional[str] = field(default=None, metadata={"help": "--dataset csv: optional test CSV."})
    label_column: Optional[str] = field(default=None, metadata={"help": "--dataset csv: the label column."})
    positive_label: str = field(default="1", metadata={"help": "--dataset csv: value of the positive label."})
    group_column: Optional[str] = field(default=None, metadata={"help": "--dataset csv: the group column."})
    group_value: str = field(default="1", metadata={"help": "--dataset csv: value that marks group p."})
    drop_columns: str = field(default="", metadata={"help": "--dataset csv: comma-separated non-feature columns."})
    drop_group_feature: bool = field(default=False, metadata={"help": "Leave the group attribute out of the features."})
    split_seed: int = field(default=0, metadata={"help": "Seed of the validation/test split (fixed across seeds)."})
    icppac_eta: float = field(default=0.1, metadata={"help": "ICPPAC primal step size (paper grid 0.1, 0.01)."})
    icppac_tau: float = field(default=10.0, metadata={"help": "ICPPAC dual parameter tau (paper grid 1, 10, 100)."})
    icppac_mu: float = field(default=1e-3, metadata={"help": "ICPPAC proximal weight mu (paper 1e-2, 1e-3, 1e-4)."})
    icppac_theta: float = field(default=0.1, metadata={"help": "ICPPAC extrapolation theta (paper 0.1)."})
    icppac_inner_steps: int = field(default=100, metadata={"help": "ConEx iterations per ICPPAC outer step."})
    icppac_inner_output: str = field(default="average", metadata={
        "help": "What an ICPPAC outer step returns: 'average' (mean of its ConEx iterates, as ConEx) or 'last'."})
    results_file: str = field(default="results.json",
                              metadata={"help": "Results JSON, relative to output_dir unless absolute."})
    save_model: bool = field(default=True, metadata={"help": "Save the final model to output_dir, with a safety "
                                                      "report and model card (hinge, squared_hinge, none)."})
    certify_fraction: float = field(default=0.5, metadata={
        "help": "Share of the test split (stratified by label and group, seeded by --split_seed) set aside as the "
                "certification split, read only by the certificate; the rest stays the test split. 0: no "
                "certificate (the run is then NOT CERTIFIED)."})
    allow_unsafe_push: bool = field(default=False, metadata={
        "help": "With --push_to_hub: publish even when the run is not certified (the card then says so)."})

    def __post_init__(self) -> None:
        super().__post_init__()  # --delta: read only by the certificate, after training; checked here, before it
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.dataset not in (*TABULAR_LOADERS, "csv"):
            raise ValueError(f"dataset must be one of {sorted(TABULAR_LOADERS)} or 'csv', got {self.dataset!r}")
        if self.dataset == "csv" and not (self.csv_path and self.label_column and self.group_column):
            raise ValueError("--dataset csv needs --csv_path, --label_column and --group_column")
        self.threshold_list = _floats(self.thresholds, "thresholds")
        self.hidden_list = [int(h) for h in _floats(self.hidden_sizes, "hidden_sizes")]
        self.score_bound_value = _score_bound(self.score_bound, self.threshold_list)
        if not (math.isfinite(float(self.rate_temperature)) and float(self.rate_temperature) > 0):
            raise ValueError(f"--rate_temperature must be a finite number > 0, got {self.rate_temperature}")
        self.decay_list = _floats(self.lr_decay_at, "lr_decay_at") if self.lr_decay_at.strip() else []
        if any(not 0 < f < 1 for f in self.decay_list):
            raise ValueError(f"lr_decay_at fractions must be in (0, 1), got {self.decay_list}")
        check_certify_fraction(self.certify_fraction)


def _score_bound(text: Any, thresholds: Sequence[float]) -> Optional[float]:
    """``--score_bound`` as a number or None ('none'); 'auto' is the largest |threshold| (1 when every
    threshold is 0)."""
    word = str(text).strip().lower()
    largest = max((abs(t) for t in thresholds), default=0.0)
    if word in ("none", ""):
        return None
    if word == "auto":
        return largest if largest > 0 else 1.0
    try:
        bound = float(word)
    except ValueError:
        raise ValueError(f"--score_bound must be a number, 'auto' or 'none', got {text!r}") from None
    if not (math.isfinite(bound) and bound > 0):
        raise ValueError(f"--score_bound must be a positive finite number, 'auto' or 'none', got {text!r}")
    if bound < largest:
        raise ValueError(f"--score_bound {bound:g} is below the largest |threshold| {largest:g} (--thresholds): "
                         f"the soft rate at that threshold could not pass 1/2; use a bound >= {largest:g}, "
                         "'auto' or 'none'")
    return bound


def _floats(text: str, what: str) -> list[float]:
    try:
        return [float(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated numbers, got {text!r}") from None


def load_splits(args: ROCFairnessArguments) -> dict[str, TabularSplit]:
    """train / validation / test arrays of the chosen data set."""
    if args.dataset == "csv":
        columns = TabularColumns(
            label_column=args.label_column, group_column=args.group_column, positive_label=args.positive_label,
            group_value=args.group_value, drop_columns=[c for c in args.drop_columns.split(",") if c],
            drop_group_feature=args.drop_group_feature)
        ds = load_tabular_csv(args.csv_path, columns, test_path=args.csv_test_path, split_seed=args.split_seed)
    else:
        ds = TABULAR_LOADERS[args.dataset](split_seed=args.split_seed, drop_group_feature=args.drop_group_feature)
    return {split: TabularSplit.from_dataset(ds[split]) for split in ("train", "validation", "test")}


def decay_milestones(total_steps: int, at: Sequence[float]) -> list[int]:
    """Optimizer steps at which the learning rate is decayed: round(f * total_steps) per fraction f."""
    return [int(round(f * total_steps)) for f in at]


def step_decay(total_steps: int, at: Sequence[float], factor: float) -> Callable[[int], float]:
    """lr multiplier of step ``step``: ``factor`` to the number of milestones <= step.

    The same schedule as ``torch.optim.lr_scheduler.MultiStepLR(optimizer,
    decay_milestones(total_steps, at), gamma=factor)``, which the penalty methods use;
    ICPPAC's own loop, which has no torch optimizer, uses this function.
    """
    milestones = sorted(decay_milestones(total_steps, at))
    return lambda step: factor ** bisect.bisect_right(milestones, step)


@dataclass
class _Run:
    """One run's pieces, built once by :func:`_prepare` and read by each step of :func:`run_roc_fairness`."""

    args: ROCFairnessArguments
    training_args: ConstrainedTrainingArguments
    splits: dict[str, TabularSplit]
    certify_split: Optional[TabularSplit]
    model: MLPForScoring
    constraints: list[Any]
    objective: Any
    history: ROCHistoryCallback
    epochs: int
    total_steps: int

    @property
    def batch(self) -> int:
        return self.training_args.per_device_train_batch_size


def run_roc_fairness(args: ROCFairnessArguments, training_args: ConstrainedTrainingArguments,
                     splits: Optional[dict[str, TabularSplit]] = None,
                     callbacks: Sequence[TrainerCallback] = (),
                     argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Train one method on one data set and return (and write) its results.

    The results hold the final exact h = |gap| - kappa of every constraint on train /
    validation / test, the largest violation, AUCs, the shift-proof measures and the
    fraction of scores outside the thresholds per split (``scores_shifted_outside_thresholds``
    lists the splits where it exceeds one half), wall time (training only, per epoch too)
    and the per-epoch history. ``callbacks`` are extra Trainer callbacks (penalty
    methods only; ICPPAC has its own loop).
    """
    check_push(args, training_args)
    run = _prepare(args, training_args, splits)
    t_start = time.perf_counter()
    certificate: Optional[dict[str, Any]] = None
    if args.method == "icppac":
        trainer, train_seconds = _train_icppac(run)
    else:
        trainer = _train_with_penalty(run, callbacks)
        train_seconds = run.history.train_seconds
        if run.certify_split is not None:
            certificate = _certificate(run, trainer)
        if args.save_model:
            _save_with_report(run, trainer, argv)
    results = _results(run, train_seconds, time.perf_counter() - t_start, certificate)
    if training_args.should_save:
        path = args.results_file if os.path.isabs(args.results_file) else os.path.join(
            training_args.output_dir, args.results_file)
        atomic_write_json(path, results, indent=1)  # never a half-written results file
        if args.method == "icppac" and args.save_model:
            run.model.save_pretrained(training_args.output_dir)
    # last, after every local file is written: a refusal uploads nothing, loses nothing and fails the command
    results["exit_status"] = push_last(trainer, args.allow_unsafe_push) if training_args.push_to_hub else 0
    return results


def _prepare(args: ROCFairnessArguments, training_args: ConstrainedTrainingArguments,
             splits: Optional[dict[str, TabularSplit]]) -> _Run:
    """The splits (the certification rows carved out of the test split), the model, the constraints, the
    objective's pairs, the history and the number of optimizer steps."""
    splits = dict(splits or load_splits(args))
    certify_split = None
    if args.certify_fraction > 0 and args.method != "icppac":
        # the certification rows leave the test split: nothing but the certificate reads them (not the
        # per-epoch history either); the rest of the test split is data that neither training nor the certificate saw
        test = splits["test"]
        split_module = require_extra("sklearn.model_selection", "fairness", "the certification split")
        keep, held = split_module.train_test_split(np.arange(len(test)), test_size=args.certify_fraction,
                                                   stratify=test.label * 2 + test.group,
                                                   random_state=args.split_seed + 2)
        splits["test"], certify_split = test.subset(np.sort(keep)), test.subset(np.sort(held))
    torch.manual_seed(training_args.seed)
    np.random.seed(training_args.seed)
    train = splits["train"]
    model = MLPForScoring(MLPConfig(input_dim=train.features.shape[1], hidden_sizes=args.hidden_list,
                                    score_bound=args.score_bound_value))
    constraints = roc_fairness_constraints(train, splits["validation"], thresholds=args.threshold_list,
                                           kappa=args.kappa, seed=training_args.seed, certify_data=certify_split,
                                           temperature=args.rate_temperature)
    objective = objective_pairs(train, seed=training_args.seed)
    history = ROCHistoryCallback(splits, thresholds=args.threshold_list, kappa=args.kappa,
                                 temperature=args.rate_temperature)
    epochs = int(math.ceil(training_args.num_train_epochs))
    # optimizer steps the Trainer will take: the batches are sharded across processes and
    # grouped by gradient accumulation; max_steps, when set, wins
    batches_per_epoch = math.ceil(len(objective) / (training_args.per_device_train_batch_size
                                                    * training_args.world_size))
    steps_per_epoch = max(1, batches_per_epoch // training_args.gradient_accumulation_steps)
    total = training_args.max_steps if training_args.max_steps > 0 else steps_per_epoch * epochs
    return _Run(args, training_args, splits, certify_split, model, constraints, objective, history, epochs, total)


def _train_icppac(run: _Run) -> tuple[ICPPACTrainer, float]:
    """The ICPPAC baseline in its own single-process loop, on the same pairs, batches and step decay."""
    args, training_args, history = run.args, run.training_args, run.history
    if training_args.world_size > 1:
        raise ValueError("--method icppac runs its own single-process loop; launch it with python, not "
                         f"with {training_args.world_size} processes")
    run.model.to(training_args.device)
    gen = torch.Generator().manual_seed(training_args.seed)
    loader = torch.utils.data.DataLoader(run.objective, batch_size=run.batch, shuffle=True, generator=gen,
                                         collate_fn=collate_pairs)
    history.on_train_begin(None, None, None, model=run.model)
    cfg = ICPPACConfig(eta=args.icppac_eta, tau=args.icppac_tau, mu=args.icppac_mu, theta=args.icppac_theta,
                       inner_steps=args.icppac_inner_steps, inner_output=args.icppac_inner_output)
    trainer = ICPPACTrainer(
        run.model, pairwise_auc_loss, loader, run.constraints, cfg,
        constraint_batch_size=training_args.constraint_batch_size, seed=training_args.constraint_sampling_seed,
        lr_factor=step_decay(run.total_steps, args.decay_list, args.lr_decay_factor),
        disable_tqdm=training_args.disable_tqdm,
        callbacks=[lambda ep, mdl, secs: (setattr(history, "train_seconds", secs), history.record(mdl, ep))],
    )
    summary = trainer.train(run.epochs)
    return trainer, summary["train_seconds"]


def _train_with_penalty(run: _Run, callbacks: Sequence[TrainerCallback]) -> AUCConstrainedTrainer:
    """A penalty method (or none) through the Trainer, with AdamW and the paper's step decay."""
    args, training_args = run.args, run.training_args
    training_args.constraint_penalty = args.method
    training_args.remove_unused_columns = False
    optimizer = torch.optim.AdamW(run.model.parameters(), lr=training_args.learning_rate,
                                  weight_decay=training_args.weight_decay)
    # the paper's step decay (x lr_decay_factor at each fraction of training): torch's MultiStepLR,
    # stepped once per optimizer step by the Trainer
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, decay_milestones(run.total_steps, args.decay_list),
                                                     gamma=args.lr_decay_factor)
    trainer = AUCConstrainedTrainer(
        model=run.model, args=training_args, constraints=run.constraints, train_dataset=run.objective,
        data_collator=collate_pairs, optimizers=(optimizer, scheduler), callbacks=[run.history, *callbacks],
    )
    trainer.train()
    return trainer


def _certificate(run: _Run, trainer: AUCConstrainedTrainer) -> dict[str, Any]:
    """The certificate of the trained model on the certification split, and the same hard gaps on the test
    split, which the certificate never read."""
    cert = certify_models(trainer, delta=run.args.delta)
    test = run.splits["test"]
    return {"certified": cert.certified == [0], "delta": run.args.delta, "bounds": cert.upper_bounds[0],
            "values": cert.values[0], "smallest_certified_gap": smallest_certified_gap(cert.upper_bounds[0]),
            "certify_rows": len(run.certify_split), "audit_rows": len(test),
            # the certified statistic (hard gaps) on the test split, which the certificate never read
            "test_values": roc_fairness_values(score_rows(run.model, test), test.label, test.group,
                                               run.args.threshold_list, hard=True),
            "split_fingerprints": cert.split_fingerprints}


def _save_with_report(run: _Run, trainer: AUCConstrainedTrainer, argv: Optional[Sequence[str]]) -> None:
    """The model, then its safety report and card (constraints on the validation split, objective metrics on
    all splits); any push waits until the results are written (:func:`push_last`)."""
    args, training_args = run.args, run.training_args
    if training_args.should_save:
        # the upload comes last, after the results, report and card exist: this save does not push
        push, training_args.push_to_hub = training_args.push_to_hub, False
        try:
            trainer.save_model(training_args.output_dir)
        finally:
            training_args.push_to_hub = push
    final = run.history.history[-1]
    finish_run(trainer, base_model_name=f"MLPForScoring {args.hidden_list} (trained from scratch)",
               delta=args.delta,
               eval_dataset=args.dataset if args.dataset != "csv"
               else os.path.splitext(os.path.basename(args.csv_path))[0],
               dataset_description=f"{args.dataset}: objective and constraints on train, constraint check "
                                   f"on the validation split (kappa={args.kappa}, thresholds "
                                   f"{args.threshold_list})",
               reproduce_command=publishable_command("python recipes/roc_fairness.py",
                                                     sys.argv[1:] if argv is None else argv,
                                                     output_dir=training_args.output_dir),
               objective_metrics={f"{split}_auc": final[split]["auc"] for split in run.splits})


def _shifted_splits(run: _Run, outside: dict[str, float]) -> list[str]:
    """The splits where more than :data:`SHIFT_WARNING_FRACTION` of the scores lie outside the thresholds,
    where the soft rates saturate (logged, with what to read instead)."""
    args = run.args
    shifted = [split for split, frac in outside.items() if frac > SHIFT_WARNING_FRACTION]
    if shifted:
        logger.warning(
            "%s: more than %.0f%% of the scores on %s lie outside the thresholds [%g, %g]; the soft-rate constraints "
            "saturate there and say little about fairness: read the shift-proof measures (hard gaps at score "
            "quantiles, ROC gap) in results.json instead%s", args.method, 100 * SHIFT_WARNING_FRACTION,
            ", ".join(shifted), min(args.threshold_list), max(args.threshold_list),
            ", or bound the scores (--score_bound auto)" if args.score_bound_value is None else "")
    return shifted


def _results(run: _Run, train_seconds: float, wall: float, certificate: Optional[dict[str, Any]]) -> dict[str, Any]:
    """``results.json``: the run's settings, the final history entry per split, times and the certificate."""
    args, training_args, splits = run.args, run.training_args, run.splits
    final = run.history.history[-1]
    outside = {split: final[split]["shift_proof"]["fraction_outside_thresholds"] for split in splits}
    penalty = args.method != "icppac"
    return {
        "dataset": args.dataset,
        "method": args.method,
        "beta": training_args.penalty_beta if args.method in ("hinge", "squared_hinge") else None,
        "seed": training_args.seed,
        "kappa": args.kappa,
        "thresholds": args.threshold_list,
        "rate_temperature": args.rate_temperature,
        "epochs": run.epochs,
        "batch_size": run.batch,
        "num_processes": training_args.world_size,
        "constraint_batch_size": training_args.constraint_batch_size,  # pairs: rows per group
        "msvr_gamma": training_args.msvr_gamma if penalty else None,
        "msvr_gamma_prime": training_args.msvr_gamma_prime if penalty else None,
        "constraint_margin": training_args.constraint_margin if penalty else None,
        "learning_rate": training_args.learning_rate if penalty else args.icppac_eta,
        "icppac": (None if penalty else
                   {"eta": args.icppac_eta, "tau": args.icppac_tau, "mu": args.icppac_mu,
                    "theta": args.icppac_theta, "inner_steps": args.icppac_inner_steps,
                    "inner_output": args.icppac_inner_output}),
        "score_bound": args.score_bound_value,
        "num_parameters": sum(p.numel() for p in run.model.parameters()),
        "final": {split: final[split] for split in splits},
        "test_auc": final["test"]["auc"],
        "train_max_violation": final["train"]["max_violation"],
        "test_max_violation": final["test"]["max_violation"],
        "feasible_on_train": final["train"]["feasible"],
        # fairness that a common shift of the scores cannot fake (hard gaps at score quantiles, ROC gap)
        "shift_proof": {split: {k: final[split]["shift_proof"][k] for k in ("hard_tpr_gap_max", "hard_fpr_gap_max",
                                                                            "hard_gap_max", "roc_gap")}
                        for split in splits},
        "scores_outside_thresholds": outside,
        "scores_shifted_outside_thresholds": _shifted_splits(run, outside),
        "train_seconds": train_seconds,
        "seconds_per_epoch": train_seconds / max(run.epochs, 1),
        "wall_seconds": wall,
        "history": run.history.history,
        "certificate": certificate,
    }


def check_push(args: ROCFairnessArguments, training_args: ConstrainedTrainingArguments) -> None:
    """``--push_to_hub`` publishes the saved model behind the safety gate, so it needs a saved
    model with a safety report: an error before any data loads, never a run that skips the push."""
    if not training_args.push_to_hub:
        if args.allow_unsafe_push:
            raise ValueError("--allow_unsafe_push only applies with --push_to_hub true")
        return
    if args.method == "icppac":
        raise ValueError("--push_to_hub is not available with --method icppac: its own loop has no safety gate; "
                         "push a hinge, squared_hinge or none run")
    if not args.save_model:
        raise ValueError("--push_to_hub needs the saved model, its report and card: leave --save_model true")


__all__ = ["METHODS", "ROCFairnessArguments", "check_push", "decay_milestones", "load_splits", "run_roc_fairness",
           "step_decay"]
