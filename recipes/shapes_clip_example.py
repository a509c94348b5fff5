"""The generated-shapes example: the demo's CLIP pipeline on images drawn as needed, certified at 3 points.

The digits demo (``recipes/demo_clip_digits.py``) can certify only what 44-46 held-out images per digit allow,
about 10-15 points lost per digit. This example runs the same pipeline (stage-1 old model, noisy target data,
one non-forgetting constraint per old class, checkpoint selection, certificate, safety report and card: the
demo's own functions, with ``--data shapes``) on generated images (:mod:`hf_constrained.clip.shapes`: circle,
ring, square, frame, triangle, cross, diamond, bar, with random size, position, rotation, intensity and noise),
whose generator draws as many independent images per class as the claim needs.

**The claim, stated before any data:** every old shape loses at most 3 points of accuracy
(``--forget_tolerance 0.03``: the share of its certification images that the old model classified right and the
fine-tuned model gets wrong, which bounds the points lost from above), exact Clopper-Pearson at delta 0.05, each
class at the first look's level of the library's ledger (0.045), a model certified when every class passes.

**The certification split, sized from the claim** (``benchmarks/certification_size.py``'s rule: the smallest
n of its grid at which a model that truly forgets half the tolerance, 1.5%, of each of the 7 old classes
certifies them all with probability >= 0.99): 3,000 images per old class (2,000 gives 0.984), which certify the
3-point claim with up to 73 forgotten (2.4%). A 3-point claim needs at least 102 images with none forgotten.

The old model learns 7 shapes in stage 1 and has seen 3 rings; fine-tuning learns ``ring`` from noisy captions
(some circles captioned "a photo of a ring"), under one non-forgetting constraint per other shape.

    python -m hf_constrained.recipes.shapes_clip_example            # one seed (2027), about a minute of CPU
    hf-constrained shapes-example --seeds 100,101,102,103,104 --penalties hinge,none

Every option of the demo is an option here (``--help``); only the defaults below differ. See
docs/generated_images.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional

from hf_constrained.recipe_args import run_plain_command
from hf_constrained.recipes import demo_clip_digits as demo

FOLDER = "shapes_clip_example"
MODULE_COMMAND = "python -m hf_constrained.recipes.shapes_clip_example"
WIDER_FLAGS = "--penalties hinge,none --seeds 100,101,102,103,104 --workers 2"

SHAPES_DEFAULTS: dict[str, Any] = {
    "data": "shapes",
    "target": 1,  # ring
    "pulled": 0,  # circle: the noisy captions call some circles rings
    # the claim (stated before any data): every old shape loses at most 3 points
    "forget_tolerance": 0.03,
    # sized from the claim (module docstring): 3,000 held-out images per class, all of them certification images
    "held_out_images": 3000,
    "certify_fraction": 1.0,
    # the target data in the digits demo's balance of positives and negatives (about 200 positives, noisy ones
    # included, against 160 negatives there): 800 rings and 400 circles captioned ring against 200 negatives of
    # each other old shape. With the demo's 20 per class (1,200 positives against 120 negatives) every class
    # collapsed toward "ring" within 10 steps, even under the constraints (docs/generated_images.md)
    "negatives_per_class": 200,
    # chosen on seeds 0-4 by the rule of docs/generated_images.md (candidate C): a checkpoint is feasible when at
    # most 2% of each old shape's selection images are forgotten (the demo's 5% is above the 3-point claim)
    "select_forget_rate": 0.02,
    # generated images need no augmented copies: the generator draws independent images instead
    "constraint_copies": 1,
    "eval_copies": 1,
    # MSVR's look-ahead, which the example's results were measured with (the digits demo dropped it in the
    # twenty-first tuning round, docs/benchmarks.md; this example was not tuned on it)
    "msvr_gamma_prime": 0.1,
    # and as many indicator images per step as constraint images (the demo reads 8 since its twenty-second round)
    "indicator_batch_size": 0,
}
"""The example's defaults: every other setting is the demo's (``DemoConfig``), unless tuned (docs)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options with the example's defaults (:data:`SHAPES_DEFAULTS`) and its own output folder."""
    demo.add_demo_arguments(parser)
    parser.set_defaults(**SHAPES_DEFAULTS, cache_dir=os.path.join("outputs", FOLDER))


def run(ns: argparse.Namespace, echo: Any = None, command: Optional[str] = None) -> dict[str, Any]:
    """Run the example with the options in ``ns`` (:func:`demo_clip_digits.run_demo`)."""
    if ns.data != "shapes":
        raise ValueError(f"--data: this example runs on generated shapes, got {ns.data!r} "
                         "(the digits are the demo's: python -m hf_constrained.recipes.demo_clip_digits)")
    return demo.run_demo(ns, echo=echo, command=command, wider=f"{MODULE_COMMAND} {WIDER_FLAGS}")


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m hf_constrained.recipes.shapes_clip_example``, the same as ``hf-constrained shapes-example``."""
    # named as it was called: `hf-constrained shapes-example` (the CLI sets argv[0]) or `python -m ...`
    prog = sys.argv[0] if os.path.basename(sys.argv[0]).startswith("hf-constrained") else MODULE_COMMAND
    return run_plain_command(argv, prog, __doc__.split("\n")[0], add_arguments, run, MODULE_COMMAND, demo.print_line)


if __name__ == "__main__":
    sys.exit(main())
