"""Cost per step of the forgetting benchmark's methods on the offline LLM example, timed side by side.

Each method is set up exactly as ``benchmarks/forgetting_frontier.py`` runs it (``run_spec`` and the example's
``build_trainer``: the same old model, data, batch and constraint settings), then trained for ``--steps`` steps
of which the first ``--warmup`` are not timed. The methods alternate for ``--rounds`` rounds in one process, so
that the machine's load falls on all of them alike; the result is each method's median step time and its ratio to
``--reference``, with the rows each step forwards and backpropagates (``rows_per_step``: a cost that does not
depend on the machine).

    python benchmarks/example_step_cost.py --old_model outputs/old_llm_example \\
        --methods hinge+replay=0.5 replay_rows=0.5 replay=0.5 hinge+replay_own=0.5 none \\
        --reference replay_rows=0.5 --json benchmarks/results/example_step_cost.json

``--example many_tasks`` times the methods on the many-task example (``recipes/llm_many_tasks_example.py``: 24 old
tasks, 4 constraints sampled per step):

    python benchmarks/example_step_cost.py --example many_tasks --old_model outputs/old_llm_many_tasks \
        --methods hinge+replay=0.5 replay=0.5 none --reference replay=0.5

A method is ``name=value`` (the frontier's knob value) or a bare name for one without a knob; flags this script
does not know go to the example (``--msvr_gamma_prime 0``, ``--constraint_indicator_fraction 0``, ...): every
method runs with them. ``variant@flag=value,...`` gives one method its own example flags (e.g.
``hinge+replay=0.5@msvr_gamma_prime=0`` times the default without the look-ahead).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import math
import os
import statistics
import sys
import tempfile
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import forgetting_frontier as ff  # noqa: E402
from common import StepTimer, machine  # noqa: E402

from hf_constrained.atomic_files import atomic_write_json  # noqa: E402
from hf_constrained.publishable import publishable_command, publishable_values  # noqa: E402

logger = logging.getLogger("example_step_cost")


def parse_method(text: str, cfg: Any) -> tuple[str, float, Any]:
    """``name[=value][@flag=value,...]`` -> (frontier method, knob value, the example settings of the run)."""
    spec, _, flags = text.partition("@")
    name, _, value = spec.partition("=")
    if name not in ff.METHODS:
        raise SystemExit(f"--methods {text!r}: {name!r} is none of {sorted(ff.METHODS)}")
    method = ff.METHODS[name]
    if (method.knob is None) != (not value):
        raise SystemExit(f"--methods {text!r}: {name} " + (f"takes {method.knob}=value" if method.knob else
                                                           "takes no value"))
    own = {}
    for item in filter(None, flags.split(",")):
        key, _, raw = item.partition("=")
        if key not in {f.name for f in dataclasses.fields(cfg)}:
            raise SystemExit(f"--methods {text!r}: the example has no flag --{key}")
        own[key] = raw
    run_cfg = cfg if not own else ff.ex.parse(_argv_of(cfg, own))
    return name, float(value) if value else math.nan, run_cfg


def _argv_of(cfg: Any, overrides: dict[str, str]) -> list[str]:
    """The example's command line that gives ``cfg`` with ``overrides``."""
    argv: list[str] = []
    for f in dataclasses.fields(cfg):
        value = overrides.get(f.name, getattr(cfg, f.name))
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            argv += [f"--{f.name}", *map(str, value)]
        else:
            argv += [f"--{f.name}", str(value)]
    return argv


def time_steps(old_path: str, name: str, value: float, cfg: Any, combo_tolerance: float, steps: int,
               warmup: int, seed: int, clock: str = "cpu") -> tuple[list[float], dict[str, int]]:
    """One method's step times (after ``warmup`` steps; ``clock`` "cpu": this process's CPU time, "wall") and rows
    per step."""
    penalty, run_cfg, baseline = ff.run_spec(name, value, dataclasses.replace(cfg, max_steps=steps), combo_tolerance)
    with tempfile.TemporaryDirectory() as tmp:
        trainer, _ = ff.ex.build_trainer(old_path, penalty, seed, run_cfg, tmp, baseline)
        timer = StepTimer(warmup)
        trainer.add_callback(timer)
        trainer.train()
        rows = ff.ex.rows_per_step(trainer)
    del trainer
    gc.collect()
    return (timer.cpu_times if clock == "cpu" else timer.times), rows


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--example", default="tiny", choices=list(ff.EXAMPLES),
                   help="the offline LLM example: tiny (three old tasks) or many_tasks (24, constraints sampled)")
    p.add_argument("--methods", nargs="+", required=True, help="name[=value][@flag=value,...] per method")
    p.add_argument("--reference", required=True, help="the method the ratios divide by (one of --methods)")
    p.add_argument("--steps", type=int, default=40, help="steps per method and round")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per method and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="the runs' fine-tuning seed (the cost does not depend on it)")
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                   help="cpu: the process's CPU time per step (with one torch thread, --threads 1, the step's compute, "
                        "which other processes on the machine barely move); wall: wall-clock time")
    p.add_argument("--json", default=None)
    args, rest = p.parse_known_args(argv)
    if args.reference not in args.methods:
        raise SystemExit(f"--reference {args.reference!r} is not one of --methods")
    ff.use_example(args.example)
    cfg = ff.ex.parse(rest)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    ff.ex._quiet()
    ff.ex.torch.set_num_threads(cfg.threads)
    methods = {text: parse_method(text, cfg) for text in args.methods}
    tmp = tempfile.TemporaryDirectory()
    old_path = cfg.old_model or tmp.name
    if not os.path.exists(os.path.join(old_path, "config.json")):
        ff.ex.train_old_model(old_path, cfg)
    times: dict[str, list[float]] = {m: [] for m in methods}
    rows: dict[str, dict[str, int]] = {}
    for r in range(args.rounds):
        for text, (name, value, run_cfg) in methods.items():
            t, rows[text] = time_steps(old_path, name, value, run_cfg, cfg.forget_tolerance, args.steps,
                                       args.warmup, args.seed, args.clock)
            times[text] += t
            logger.info("round %d %s: %.4f s/step (median of this round)", r, text, statistics.median(t))
    median = {m: statistics.median(t) for m, t in times.items()}
    ref = median[args.reference]
    result = {
        "benchmark": "example_step_cost",
        "command": publishable_command("python benchmarks/example_step_cost.py", argv),
        "example": publishable_values(dataclasses.asdict(cfg)),
        "reference": args.reference, "clock": args.clock, "steps_timed_per_round": args.steps - args.warmup,
        "rounds": args.rounds,
        "seconds_per_step": median,
        "ratio_to_reference": {m: median[m] / ref for m in methods},
        "rows_per_step": rows,
        "rows_ratio_to_reference": {m: rows[m]["forward"] / rows[args.reference]["forward"] for m in methods},
        "machine": machine(),
    }
    lines = ["| method | s/step | ratio | rows forwarded / backpropagated per step |", "|---|---|---|---|"]
    for m in methods:
        lines.append(f"| {m} | {median[m]:.4f} | {median[m] / ref:.2f}x | {rows[m]['forward']} / "
                     f"{rows[m]['backward']} |")
    print("\n".join(lines))
    if args.json:
        atomic_write_json(args.json, result)
    tmp.cleanup()
    return result


if __name__ == "__main__":
    main()
