"""Cost per step of the CLIP demo's methods, timed side by side, with the images each step forwards.

Each method runs the demo's own fine-tuning (:func:`hf_constrained.clip.experiment.finetune`: the same stage-1 old
model, target data, batch, constraints and settings as ``make demo`` and ``benchmarks/forgetting_frontier_demo.py``)
for ``--steps`` steps, of which the first ``--warmup`` are not timed; the methods alternate for ``--rounds`` rounds
in one process, so that the machine's load falls on all of them alike. Checkpoint selection and the certificate are
off (``--select_every 0 --certify_fraction 0``): they are evaluations after steps, not the step.

Per method: the median step time (process CPU time with one torch thread, or wall time), its ratio to
``--reference``, and the images through the vision tower per optimizer step, with gradient (those the backward
reads) and without (the indicator and look-ahead passes), counted by a hook on the tower: a cost that does not
depend on the machine. The issue's reference is "a plain step plus the old images it reads": replay at the share
that mixes as many protected images into each step as the constrained step backpropagates.

    python benchmarks/clip_step_cost.py --methods none replay=0.8 hinge "hinge@msvr_gamma_prime=0.1" \\
        --reference replay=0.8 --json benchmarks/results/clip_step_cost.json

A method is ``none``, ``replay=R`` or ``kl=LAM`` (a baseline of the frontier), or ``hinge`` / ``squared_hinge``
(the demo's constrained run), each optionally with ``@field=value,...``: the demo's settings of that run
(``hinge@indicator_fraction=0``, ``hinge@msvr_gamma_prime=0.1``). Flags this script does not know go to
the demo (``--constraint_batch_size 16``, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import sys
import tempfile
from typing import Any, Optional
from unittest import mock

import torch
from transformers import TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import forgetting_frontier_demo as ffd  # noqa: E402
from common import StepTimer, machine  # noqa: E402

from hf_constrained.atomic_files import atomic_write_json  # noqa: E402
from hf_constrained.clip import experiment as pipeline  # noqa: E402
from hf_constrained.publishable import publishable_command, publishable_values  # noqa: E402

logger = logging.getLogger("clip_step_cost")
PENALTIES = ("none", "hinge", "squared_hinge")
BASELINES = ("replay", "kl")


class ImagesPerStep(TrainerCallback):
    """Counts the images through ``vision_model`` in each optimizer step, with and without gradient."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.grad, self.no_grad, self.steps = 0, 0, 0
        self._handle = model.vision_model.register_forward_hook(self._count, with_kwargs=True)

    def _count(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        pixels = args[0] if args else kwargs.get("pixel_values")
        images = 0 if pixels is None else pixels.shape[0]
        if torch.is_grad_enabled():
            self.grad += images
        else:
            self.no_grad += images

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 1:  # the first step's counts include nothing else; from step 2 on, count every step
            self.grad = self.no_grad = self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1
        if state.global_step >= state.max_steps:
            self._handle.remove()  # the evaluations after the last step are not steps

    def per_step(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {"forward": (self.grad + self.no_grad) / n, "backward": self.grad / n, "no_grad": self.no_grad / n}


def parse_method(text: str) -> tuple[str, Optional[tuple[str, float]], dict[str, Any]]:
    """``name[=value][@field=value,...]`` -> (penalty, baseline, settings of the run)."""
    spec, _, flags = text.partition("@")
    name, _, value = spec.partition("=")
    if name in PENALTIES and not value:
        penalty, baseline = name, None
    elif name in BASELINES and value:
        penalty, baseline = "none", (name, float(value))
    else:
        raise SystemExit(f"--methods {text!r}: one of {', '.join(PENALTIES)} (no value) or "
                         f"{', '.join(b + '=VALUE' for b in BASELINES)}")
    own = {}
    fields = {f.name: f.type for f in dataclasses.fields(pipeline.DemoConfig)}
    for item in filter(None, flags.split(",")):
        key, _, v = item.partition("=")
        if key not in fields:
            raise SystemExit(f"--methods {text!r}: {key!r} is not a demo setting")
        own[key] = v
    return penalty, baseline, own


def _typed(cfg: pipeline.DemoConfig, own: dict[str, str]) -> pipeline.DemoConfig:
    changes = {}
    for key, v in own.items():
        current = getattr(cfg, key)
        changes[key] = (v.lower() in ("1", "true", "yes")) if isinstance(current, bool) else type(current)(v)
    return dataclasses.replace(cfg, **changes)


def time_method(text: str, cfg: pipeline.DemoConfig, old_path: str, pools: Any, old_model: Any, steps: int,
                warmup: int, clock: str) -> tuple[list[float], dict[str, float]]:
    """One method's step times after ``warmup`` steps, and its images per step."""
    penalty, baseline, own = parse_method(text)
    run_cfg = dataclasses.replace(_typed(cfg, own), steps=steps)
    timer = StepTimer(warmup)
    counter: dict[str, ImagesPerStep] = {}
    make_trainer = pipeline._trainer

    def trainer_with_counter(*args: Any, **kwargs: Any) -> Any:
        trainer = make_trainer(*args, **kwargs)
        counter["images"] = ImagesPerStep(trainer.model)
        trainer.add_callback(counter["images"])
        return trainer

    with mock.patch.object(pipeline, "_trainer", trainer_with_counter):
        pipeline.finetune(run_cfg, old_path, penalty, pools=pools, log=lambda *a: None, regulariser=baseline,
                          callbacks=[timer], old_model=old_model)
    return (timer.cpu_times if clock == "cpu" else timer.times), counter["images"].per_step()


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["none", "replay=0.8", "hinge"])
    p.add_argument("--reference", default="replay=0.8", help="the method the ratios are of (one of --methods)")
    p.add_argument("--steps", type=int, default=12, help="steps per method and round (the first --warmup untimed)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    p.add_argument("--cache_dir", default="outputs/clip_step_cost", help="where the stage-1 old model is kept")
    p.add_argument("--json", default=None)
    args, rest = p.parse_known_args(argv)
    if args.reference not in args.methods:
        raise SystemExit(f"--reference {args.reference!r} is not among --methods")
    for text in args.methods:
        parse_method(text)
    cfg = pipeline.DemoConfig(**ffd.demo_settings(rest + ["--select_every", "0", "--certify_fraction", "0"]))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    os.makedirs(args.cache_dir, exist_ok=True)
    old_path = pipeline.pretrain_old_model(cfg, args.cache_dir)
    old_model = pipeline.load_old_model(old_path)
    pools = pipeline.old_pools(cfg, old_path, old_model)
    times: dict[str, list[float]] = {m: [] for m in args.methods}
    images: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory():
        for r in range(args.rounds):
            for m in args.methods:
                t, images[m] = time_method(m, cfg, old_path, pools, old_model, args.steps, args.warmup, args.clock)
                times[m] += t
                logger.info("round %d %s: %.4f s per step, %s images per step", r + 1, m, statistics.median(t),
                            images[m])
    reference = statistics.median(times[args.reference])
    rows = {m: {"seconds_per_step": statistics.median(times[m]), "ratio": statistics.median(times[m]) / reference,
                "images_per_step": images[m], "timed_steps": len(times[m])} for m in args.methods}
    result = {"command": publishable_command("python benchmarks/clip_step_cost.py", argv),
              "config": publishable_values(vars(args)), "demo": publishable_values(dataclasses.asdict(cfg)),
              "clock": args.clock, "reference": args.reference, "machine": machine(), "methods": rows}
    print(f"| method | images forwarded / backpropagated per step | {args.clock} s per step | ratio to "
          f"{args.reference} |\n|---|---|---|---|")
    for m, row in rows.items():
        im = row["images_per_step"]
        print(f"| {m} | {im['forward']:.0f} / {im['backward']:.0f} | {row['seconds_per_step']:.4f} | "
              f"{row['ratio']:.2f}x |")
    if args.json:
        atomic_write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
