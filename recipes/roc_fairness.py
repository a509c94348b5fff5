"""AUC maximisation under ROC-fairness constraints (paper section 5.1).

    python recipes/roc_fairness.py --dataset adult --method hinge --penalty_beta 4 --output_dir outputs/adult
    accelerate launch recipes/roc_fairness.py --dataset compas --method squared_hinge --penalty_beta 800 ...
    python recipes/roc_fairness.py --dataset csv --csv_path my.csv --label_column y --group_column sex \
        --group_value F --positive_label 1 --method hinge --output_dir outputs/mine

Methods: hinge (the paper's method), squared_hinge, none, icppac, chosen with ``--method``;
``--constraint_penalty`` (hinge, squared_hinge, none), the flag the other recipes share, chooses
the same penalty methods when ``--method`` is not given (both given must agree). Writes
<output_dir>/results.json (final exact train/validation/test constraint values, largest
violation, AUCs, the shift-proof fairness measures and where the scores lie relative to
the thresholds, wall time, per-epoch history) and the trained model with its safety report
and model card (default folder: outputs/roc_fairness). With ``--push_to_hub true`` the
model is pushed last, behind the safety gate: a run that is not certified uploads nothing,
keeps every local file and exits with status 1; ``--allow_unsafe_push true`` publishes it
(the card says NOT CERTIFIED).

Defaults: the paper's setting (section 5.1: kappa 0.005, thresholds -3..3, batch 128 =
64 positive / negative pairs, 64 rows per group in each constraint batch, 60 epochs, lr
decayed x0.1 at 50% and 75%, gamma' = 0.1) with four changes that make every seed's final
model feasible at the smallest feasible beta on Adult and COMPAS (docs/roc_fairness.md,
"Every seed feasible at the smallest feasible beta"):

* ``--score_bound auto``: the score is B * tanh(z / B) with B the largest |threshold|, so
  the constraints cannot be met by moving every score past the thresholds, where the soft
  rates saturate (the pairwise AUC ignores such a shift);
* ``--msvr_gamma 0.05`` (paper 0.8): the constraint estimate averages about 40 batches
  (Algorithm 1, line 6); with 64 rows per group one batch's gap has a standard deviation of
  several kappa, and with 0.8 the hinge's indicator 1[|u| > kappa] is nearly a coin flip;
* ``--constraint_margin 0.004``: the hinge acts once the estimate exceeds kappa - 0.004, so
  the final model ends inside the constraint, not on its edge (0 turns it off; it is not
  applied with ``--constraint_confidence``);
* ``--learning_rate 1e-4`` (the paper's other rate; at 1e-3 the seeds part at the
  smallest feasible beta).

Per data set (``DATASET_DEFAULTS``, unless given): ``--penalty_beta`` 20 on COMPAS, 4 on Adult;
on COMPAS ``--rate_temperature 0.1`` (soft rates sigmoid((s - tau) / 0.1), closer to the hard
rates 1[s > tau] that the certificate bounds; docs/roc_fairness.md, "The certificate").

``--learning_rate 1e-3 --msvr_gamma 0.8 --constraint_margin 0 --score_bound none --rate_temperature 1``
reproduces the paper's setting. Rule for other data: take a margin of a few standard
deviations of the estimate, about sd(batch gap) * sqrt(gamma / (2 - gamma)); the trainer
logs each constraint's batch dispersion next to its estimate.
"""

import json
import logging
from collections.abc import Collection

from hf_constrained import ConstrainedTrainingArguments
from hf_constrained.distributed import exit_after_all_ranks
from hf_constrained.fairness.experiment import ROCFairnessArguments, run_roc_fairness
from hf_constrained.recipe_args import given_flags, parse_recipe_args

DEFAULTS = dict(  # the paper's setting where the user does not say otherwise, and the four changes above
    per_device_train_batch_size=64, learning_rate=1e-4, num_train_epochs=60, constraint_batch_size=64,
    logging_strategy="epoch", save_strategy="no", report_to="none", lr_scheduler_type="constant",
    weight_decay=0.0, disable_tqdm=True, msvr_gamma=0.05, score_bound="auto",
    max_grad_norm=0.0,  # no clipping, as the exact penalty expects (clipping shrinks its beta; the library warns)
    # independent constraint batches: with one shared batch of positives (negatives) for the 7 TPR (FPR)
    # constraints the hinge lost feasibility at beta 20 and 40 on COMPAS (docs/roc_fairness.md, "Shared
    # constraint batches"); --share_constraint_batches trades that for a faster step on large scorers
    share_constraint_batches=False,
)
DATASET_DEFAULTS = {"compas": {"penalty_beta": 20.0, "rate_temperature": 0.1}, "adult": {"penalty_beta": 4.0}}
"""Per data set, unless given: ``--penalty_beta``, the hinge's smallest beta at which every seed 0-4 was feasible
on the training data (docs/roc_fairness.md, "Every seed feasible at the smallest feasible beta"); on COMPAS
``--rate_temperature 0.1``, the temperature at which the hinge's smallest certified hard gap was at most half the
unconstrained model's on seeds 0-4 (docs/roc_fairness.md, "The certificate")."""
OUTPUT_DIR = "outputs/roc_fairness"
"""``--output_dir`` unless given: ``outputs/<recipe module>``, as every recipe."""
DEFAULT_MARGIN = 0.004
"""``--constraint_margin`` unless given (or ``--constraint_confidence`` or ``--constraint_certificate_delta`` is,
which exclude a margin)."""


def check_recipe_flags(script_args: ROCFairnessArguments, training_args: ConstrainedTrainingArguments,
                       given: Collection[str] = ()) -> None:
    """Flags this recipe cannot honour are errors, never silently replaced: the method is
    ``--method``, or ``--constraint_penalty`` when ``--method`` is not given (``given``: the
    flags the user set, :func:`~hf_constrained.recipe_args.given_flags`), and both given must
    agree; the optimizer is AdamW with the paper's step decay (``--lr_decay_at``,
    ``--lr_decay_factor``). Sets ``script_args.method`` to the method chosen."""
    penalty = training_args.constraint_penalty
    # without ``given``, a penalty other than the default "hinge" counts as given
    penalty_given = "constraint_penalty" in given or penalty != "hinge"
    if penalty_given and "method" not in given:
        script_args.method = penalty  # hinge, squared_hinge or none: each one of the recipe's methods
    elif penalty_given and penalty != script_args.method:
        raise ValueError(f"--constraint_penalty {penalty} contradicts --method {script_args.method}: give one of them "
                         "(--method: hinge, squared_hinge, none, icppac; --constraint_penalty: hinge, squared_hinge, "
                         "none), or both with the same method")
    scheduler = str(getattr(training_args.lr_scheduler_type, "value", training_args.lr_scheduler_type))
    if scheduler != "constant":
        raise ValueError(f"--lr_scheduler_type {scheduler} is not used by this recipe: its "
                         "learning rate follows the paper's step decay (--lr_decay_at, --lr_decay_factor)")
    optim = str(getattr(training_args.optim, "value", training_args.optim))
    if optim not in ("adamw_torch", "adamw_torch_fused"):
        raise ValueError(f"--optim {optim} is not used by this recipe: it trains with torch.optim.AdamW "
                         "(ICPPAC: its own SGD steps)")


def main(argv=None) -> dict:
    script_args, training_args = parse_recipe_args([ROCFairnessArguments, ConstrainedTrainingArguments], argv,
                                                   description=__doc__,
                                                   defaults={**DEFAULTS, "output_dir": OUTPUT_DIR})
    given = given_flags(argv)
    check_recipe_flags(script_args, training_args, given)
    for name, value in DATASET_DEFAULTS.get(script_args.dataset, {}).items():
        if name not in given:
            setattr(script_args if hasattr(script_args, name) else training_args, name, value)
    if (training_args.constraint_margin is None and training_args.constraint_confidence is None
            and training_args.constraint_certificate_delta is None):
        training_args.constraint_margin = DEFAULT_MARGIN
    logging.basicConfig(level=logging.INFO if training_args.should_log else logging.WARNING)
    results = run_roc_fairness(script_args, training_args, argv=argv)
    if training_args.should_save:
        summary = {k: results[k] for k in ("dataset", "method", "beta", "seed", "test_auc", "train_max_violation",
                                           "test_max_violation", "feasible_on_train", "seconds_per_epoch")}
        print(json.dumps(summary, indent=1))
    return results


if __name__ == "__main__":
    exit_after_all_ranks(main()["exit_status"])
