"""The many-class vision example: the demo's CLIP pipeline on 32 generated classes, 31 of them protected.

With many protected classes the question is no longer the average: it is the *worst* class, and whether each
one keeps what it knew. This example runs the demo's pipeline (stage-1 old model, noisy target data, one
non-forgetting constraint per old class, checkpoint selection, certificate, safety report and card: the demo's
own functions, with ``--data many_shapes``) on 32 generated classes (:mod:`hf_constrained.clip.many_shapes`: the
eight shapes in two sizes and two tones, e.g. ``small dark triangle``), learns ``large bright ring`` and
protects the other 31, each step sampling ``--constraints_per_step 6`` of the 31 constraints (the paper's
|B_c| < m; the estimates of the others are kept).

**The claim, stated before any data:** every old class loses at most 3 points of accuracy
(``--forget_tolerance 0.03``: the share of its certification images that the old model classified right and the
fine-tuned model gets wrong, which bounds the points lost from above), exact Clopper-Pearson at delta 0.05, each
class at the first look's level of the library's ledger (0.045), a model certified when all 31 classes pass.

**The certification split, sized for all 31 classes at once** (``benchmarks/certification_size.py --tasks 30
--power 0.95``, the many-task LLM example's rule: the smallest n of its grid at which a model that truly forgets
half the tolerance, 1.5%, of every class certifies them all with probability >= 0.95): 2,000 images per old class
(0.96; 1,500 gives 0.67), which certify the 3-point claim with up to 46 forgotten (2.3%) at the first look's level.

The old model has seen 3 large bright rings; fine-tuning learns them from noisy captions (some large bright
circles captioned "a photo of a large bright ring"), beside classes that differ from the new one only in size
(small bright ring), in tone (large dark ring) or in shape (large bright circle, the noisy one).

    python -m hf_constrained.recipes.shapes_many_classes_example --penalties hinge,none --seeds 0
    hf-constrained shapes-many-classes --seeds 100,101,102,103,104 --penalties hinge,none --workers 2

Every option of the demo is an option here (``--help``); only the defaults below differ. Per run it prints the
new class's accuracy, the worst and the mean change of the old classes, the share of old classes that lost more
than 3 points, the certificate, and the seconds and rows per step. See docs/many_classes.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Optional

from hf_constrained.recipe_args import run_plain_command
from hf_constrained.recipes import demo_clip_digits as demo

FOLDER = "shapes_many_classes_example"
MODULE_COMMAND = "python -m hf_constrained.recipes.shapes_many_classes_example"
WIDER_FLAGS = "--penalties hinge,none --seeds 100,101,102,103,104 --workers 2"

MANY_CLASSES_DEFAULTS: dict[str, Any] = {
    "data": "many_shapes",
    "target": 6,  # large bright ring
    "pulled": 2,  # large bright circle: the noisy captions call some of them rings
    # the claim (stated before any data): every old class loses at most 3 points
    "forget_tolerance": 0.03,
    # sized for all 31 old classes at once (module docstring): 2,000 held-out images per class, all certification
    "held_out_images": 2000,
    "certify_fraction": 1.0,
    # stage 1 on 31 classes within about two minutes of one CPU core
    "pretrain_images": 300,
    "stage1_epochs": 30,
    # the paper's sampled constraints: 6 of the 31 per step (|B_c| well below m), 32 rows each
    "constraints_per_step": 6,
    # the target data in the eight-shape example's balance: 600 large bright rings and 300 large bright circles
    # captioned as them (positives) against 30 negatives of each of the 30 other classes (900)
    "negatives_per_class": 30,
    # the eight-shape example's selection rule and data design (docs/generated_images.md)
    "select_forget_rate": 0.02,
    "constraint_copies": 1,
    "eval_copies": 1,
    # no MSVR look-ahead: the example's tuning round on seeds 0-4 (docs/many_classes.md), as the digits demo's
    # twenty-first round chose
    "msvr_gamma_prime": 0.0,
    # and as many indicator images per step as constraint images (the demo reads 8 since its twenty-second round)
    "indicator_batch_size": 0,
}
"""The example's defaults: every other setting is the demo's (``DemoConfig``); gamma' chosen on seeds 0-4 (docs)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options with the example's defaults (:data:`MANY_CLASSES_DEFAULTS`) and its own output folder."""
    demo.add_demo_arguments(parser)
    parser.set_defaults(**MANY_CLASSES_DEFAULTS, cache_dir=os.path.join("outputs", FOLDER))


def _points(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:+.1f}"


def per_run_table(results: dict[str, Any]) -> list[str]:
    """One line per run (seed and penalty): the new class's held-out accuracy and gain, the worst and the mean change
    of the old classes, the share that lost more than the claim, the certificate (classes certified, largest bound)
    and the cost per step (seconds, rows forwarded / backpropagated)."""
    claim = 100 * results["config"]["forget_tolerance"]
    lines = [f"| seed | penalty | new class (gain) | worst old class | mean old change | old classes over {claim:g} "
             "points | certified (largest bound) | s/step | rows/step fwd/bwd |", "|---" * 9 + "|"]
    for entry in results["per_seed"]:
        for run in entry["runs"]:
            s = results["summary"][run["penalty"]][results["seeds"].index(entry["seed"])]  # in the seeds' order
            target = run["accuracy"][s["target_class"]]
            cert, rows = run["certificate"], s.get("rows_per_step") or {}
            m = len(cert["rows"] or {})
            passed = m - len(cert["failing"])
            bound = "-" if cert["largest_bound"] is None else f"{100 * cert['largest_bound']:.1f} pts"
            sps = "-" if s.get("seconds_per_step") is None else f"{s['seconds_per_step']:.3f}"
            lines.append(f"| {entry['seed']} | {run['penalty']} | {100 * target:.1f}% ({_points(s['target_gain'])}) | "
                         f"{_points(-s['worst_protected_drop'])} ({s['worst_protected_class']}) | "
                         f"{_points(s['mean_protected_change'])} | {100 * s['share_over_tolerance']:.0f}% "
                         f"({len(s['classes_over_tolerance'])}) | {'yes' if cert['certified'] else 'no'}, {passed}/{m}"
                         f" ({bound}) | {sps} | {rows.get('forward', '-')}/{rows.get('backward', '-')} |")
    return lines


def run(ns: argparse.Namespace, echo: Optional[Callable[[str], None]] = None,
        command: Optional[str] = None) -> dict[str, Any]:
    """Run the example with the options in ``ns`` (:func:`demo_clip_digits.run_demo`), then print one line per run
    (:func:`per_run_table`)."""
    if ns.data != "many_shapes":
        raise ValueError(f"--data: this example runs on the 32 generated classes (many_shapes), got {ns.data!r} "
                         "(the eight shapes: hf-constrained shapes-example; the digits: hf-constrained demo)")
    echo = echo or demo.print_line
    results = demo.run_demo(ns, echo=echo, command=command, wider=f"{MODULE_COMMAND} {WIDER_FLAGS}")
    echo("")
    echo("Per run (held-out images; changes in points against the old model on the same images):")
    for line in per_run_table(results):
        echo(line)
    return results


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m hf_constrained.recipes.shapes_many_classes_example``, as ``hf-constrained shapes-many-classes``."""
    prog = sys.argv[0] if os.path.basename(sys.argv[0]).startswith("hf-constrained") else MODULE_COMMAND
    return run_plain_command(argv, prog, __doc__.split("\n")[0], add_arguments, run, MODULE_COMMAND, demo.print_line)


if __name__ == "__main__":
    sys.exit(main())
