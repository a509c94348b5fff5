"""Forgetting frontier on the CLIP digits demo: the hinge against replay, KL to the old model and plain fine-tuning.

The sibling of ``benchmarks/forgetting_frontier.py`` (the offline LLM example) for the demo ``make demo`` runs
(``recipes/demo_clip_digits.py``): per seed the same stage-1 old model, the same noisy target data, splits, steps,
learning rate and checkpoint rule for every method; each method has one knob swept over a few values:

* ``none``: unconstrained contrastive fine-tuning (the demo's ``--penalties none``: its kept checkpoint has the
  best target loss on the selection split);
* ``replay``: protected-digit images mixed into every step at share ``ratio`` of the rows
  (:class:`hf_constrained.method.regularisers.Replay`), scored by their zero-shot cross-entropy, the loss whose
  increase the demo's non-forgetting constraints bound;
* ``kl``: ``lam * KL(p_old || p_new)`` of the zero-shot class distribution on 64 protected images per step
  (:class:`~hf_constrained.method.regularisers.KLToOld`);
* ``hinge`` and ``squared_hinge`` (ours): the demo's constrained run at its defaults with that penalty, knob ``beta``.

Every baseline reads only the constraint images D_k (the rows the constraints read, with their augmented copies):
never the selection, held-out or certification images. Replay, KL and the hinge keep the checkpoint of the demo's
rule for constrained runs (the best target loss among checkpoints forgetting at most ``--select_forget_rate`` of
each protected digit's selection images). Per run: the target digit's held-out accuracy gain; every protected
digit's held-out accuracy change against the old model on the same images; the worst of them; the certificate's
largest Clopper-Pearson bound on a digit's share of certification images forgotten and whether it certifies the
demo's claim (every protected digit loses at most ``--forget_tolerance``; each run certified as the first look at
its images, level 0.9 delta, as if it were the only release: a fresh ledger per run); the seconds per training step
(the selection's evaluations left out). The summary, frontier and figure are ``forgetting_frontier.py``'s.

Choosing a setting (fixed before any run): per method, the highest median target gain among the settings whose
median worst protected change is at most ``--within`` points down (3: the demo's goal); where none is, the
smallest median drop. Tune on seeds 0-4, report the chosen settings once on seeds 100-104:

    python benchmarks/forgetting_frontier_demo.py --seeds 0 1 2 3 4 --json tuning.json
    python benchmarks/forgetting_frontier_demo.py --seeds 100 101 102 103 104 --values replay=0.75 kl=3 hinge=10 \\
        --chosen_from tuning.json --json results.json --figure results.png

Seeds below 100 tune, seeds from 100 on report; one run does one or the other. Only a tuning run applies the rule:
its JSON's ``chosen`` holds the chosen values and the seeds they were chosen on (``chosen_on``). A report run never
chooses on its own seeds: its ``chosen`` is the tuning file's (``--chosen_from``, named under ``from``), or absent.

Flags this script does not know go to the demo (``--max_steps 3``, ``--stage1_epochs 2``, ...), so every method runs
with the same demo settings.

``--example`` takes the demo's settings from an example on its pipeline instead of the digits demo's defaults (flags
still override them): ``shapes`` (``recipes/shapes_clip_example.py``, eight generated shapes) or ``many_classes``
(``recipes/shapes_many_classes_example.py``: 31 protected classes, 6 constraints sampled per step; one value per
knob by default, so that one seed of every method runs in minutes). Each row also gives the mean change of the
protected classes, the share of them that lost more than ``--forget_tolerance`` and the rows per step:

    python benchmarks/forgetting_frontier_demo.py --example many_classes --seeds 0 --json outputs/many_classes.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Iterator, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import forgetting_frontier as ff  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from hf_constrained.atomic_files import atomic_write_json  # noqa: E402
from hf_constrained.certification.ledger import LEDGER_FILE, user_ledger_at  # noqa: E402
from hf_constrained.clip import experiment as pipeline  # noqa: E402  (the demo's pipeline)
from hf_constrained.publishable import publishable_command, publishable_values  # noqa: E402
from hf_constrained.recipes import demo_clip_digits as demo  # noqa: E402
from hf_constrained.run_cost import StepClock  # noqa: E402

logger = logging.getLogger("forgetting_frontier_demo")

METHODS: dict[str, ff.Method] = {
    "none": ff.Method("none", None, (float("nan"),)),
    "replay": ff.Method("none", "ratio", (0.5, 0.75), regulariser="replay"),
    "kl": ff.Method("none", "lam", (1.0, 3.0, 10.0), regulariser="kl"),
    "hinge": ff.Method("hinge", "beta", (10.0, 5.0), example_field="beta"),
    "squared_hinge": ff.Method("squared_hinge", "beta", (10.0, 50.0), example_field="beta"),
}
EXAMPLES = {"demo": "demo_clip_digits", "shapes": "shapes_clip_example", "many_classes": "shapes_many_classes_example"}
"""``--example``: whose defaults the demo's settings start from (each module's ``add_arguments``; the digits demo's
``add_demo_arguments``)."""
EXAMPLE_VALUES: dict[str, dict[str, tuple[float, ...]]] = {
    "many_classes": {"replay": (0.75,), "kl": (3.0,), "hinge": (10.0,), "squared_hinge": (10.0,)}}
"""Knob values an example runs by default instead of :data:`METHODS`'s (``--values`` overrides them): the many-class
example's, one per method (the values the eight-shape example chose, docs/generated_images.md)."""
TARGET = "target_gain"  # the target metric of the summary, the frontier and the figure
REPORT_SEEDS_FROM = 100  # the project's rule: settings are chosen on seeds 0-4 and reported on seeds 100-104


@contextlib.contextmanager
def fresh_ledger() -> Iterator[None]:
    """A ledger of looks of its own for one run: its certificate is the first look at its certification images
    (level 0.9 delta), whatever ran before on them, as for a user who releases only this method's model."""
    with tempfile.TemporaryDirectory() as tmp, user_ledger_at(os.path.join(tmp, LEDGER_FILE)):
        yield


def _quiet() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)  # tiny models: one thread per run, the runs in processes


def run_config(method: str, value: float, seed: int, base: dict[str, Any]) -> pipeline.DemoConfig:
    """The demo's settings of one run: ``base`` at ``seed``, with the method's knob where it is a demo setting."""
    m = METHODS[method]
    fields = {**base, "seed": seed}
    if m.example_field is not None:
        fields[m.example_field] = value
    return pipeline.DemoConfig(**fields)


def stage1(job: tuple[int, dict[str, Any], str]) -> str:
    """The old model of a seed (trained once, cached under the cache folder), before the runs share it."""
    seed, base, cache_dir = job
    _quiet()
    return pipeline.pretrain_old_model(pipeline.DemoConfig(**{**base, "seed": seed}), cache_dir, log=logger.debug)


def one_run(job: tuple[str, float, int, dict[str, Any], str]) -> dict[str, Any]:
    """Fine-tune once (in a worker process) and return the run's row: target gain, every protected digit's paired
    held-out change, certificate, time per step."""
    method, value, seed, base, cache_dir = job
    _quiet()
    m = METHODS[method]
    cfg = run_config(method, value, seed, base)
    clock = StepClock()
    with fresh_ledger():
        old_path = pipeline.pretrain_old_model(cfg, cache_dir, log=logger.debug)
        old_model = pipeline.load_old_model(old_path)  # once for the pools, the old accuracy and the run's copy
        pools = pipeline.old_pools(cfg, old_path, old_model)
        old = pipeline.old_accuracy(cfg, old_path, pools, old_model)
        run = pipeline.finetune(cfg, old_path, m.penalty, pools=pools, log=logger.debug, callbacks=[clock],
                            regulariser=None if m.regulariser is None else (m.regulariser, value), old_model=old_model)
    return run_row(method, value, cfg, old, run, clock)


def run_row(method: str, value: float, cfg: pipeline.DemoConfig, old: dict[str, float], run: dict[str, Any],
            clock: StepClock) -> dict[str, Any]:
    """One run's numbers, as fractions (accuracy changes in [-1, 1]), in the LLM benchmark's keys where they mean
    the same (``old_task_change``: each protected digit; ``worst_old_change``: the worst of them)."""
    names = pipeline.demo_data(cfg).names  # the digits, or the shapes with --data shapes
    target = names[cfg.target]
    changes = {n: run["accuracy"][n] - old[n] for n in names if n != target}
    worst = min(changes, key=changes.get)
    cert = run["certificate"]
    protected = len(changes)
    over = [n for n, c in changes.items() if c < -cfg.forget_tolerance - 1e-12]
    return {"method": method, "knob": METHODS[method].knob, "value": None if math.isnan(value) else value,
            "penalty": run["penalty"], "seed": cfg.seed, "steps": cfg.steps, "target": target,
            "target_gain": run["accuracy"][target] - old[target], "target_accuracy": run["accuracy"][target],
            "old_target_accuracy": old[target],
            "old_task_change": changes, "worst_old_change": changes[worst], "worst_old_class": worst,
            "mean_old_change": statistics.fmean(changes.values()), "share_over_tolerance": len(over) / protected,
            "tasks_over_tolerance": over, "rows_per_step": run.get("rows_per_step"),
            "largest_bound": cert["largest_bound"], "upper_bounds": cert["bounds"], "forgotten": cert["forgotten"],
            "certification_rows": cert["rows"], "certified_claim": cert["certified"], "level": cert.get("level"),
            "look": cert.get("look"), "kept_step": run["kept_step"],
            "seconds_per_step": statistics.fmean(clock.wall), "cpu_seconds_per_step": statistics.fmean(clock.cpu),
            "regulariser": run.get("regulariser")}


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``forgetting_frontier.summarize`` on the target gain, plus the median CPU seconds per step."""
    settings = ff.summarize(rows, target=TARGET)
    for s in settings:
        mine = [r for r in rows if (r["method"], r["value"]) == (s["method"], s["value"])]
        s["cpu_seconds_per_step"] = statistics.median(r["cpu_seconds_per_step"] for r in mine)
    return settings


def choose(settings: list[dict[str, Any]], within: float) -> dict[str, Any]:
    """Per method, the chosen setting (the rule fixed before any run): the highest median target gain among the
    settings whose median worst protected change is >= ``-within``; where none is, the smallest median drop."""
    chosen = {}
    for method in dict.fromkeys(s["method"] for s in settings):
        mine = [s for s in settings if s["method"] == method]
        ok = [s for s in mine if s["worst_old_change"]["median"] >= -within]
        best = (max(ok, key=lambda s: s[TARGET]["median"]) if ok
                else max(mine, key=lambda s: s["worst_old_change"]["median"]))
        chosen[method] = best["value"]
    return chosen


def is_report_run(seeds: list[int]) -> bool:
    """Whether ``seeds`` report (all from ``REPORT_SEEDS_FROM`` on) or tune (all below); a mix is refused."""
    report = [s >= REPORT_SEEDS_FROM for s in seeds]
    if any(report) and not all(report):
        raise SystemExit(f"--seeds {' '.join(map(str, seeds))}: a run either tunes (seeds below {REPORT_SEEDS_FROM}) "
                         f"or reports (seeds {REPORT_SEEDS_FROM} and up), not both: run them apart")
    return all(report)


def tuning_choice(path: str) -> dict[str, Any]:
    """The ``chosen`` of a tuning run's JSON, for a report run (``--chosen_from``); read before any run."""
    try:
        with open(path, encoding="utf-8") as f:
            chosen = json.load(f).get("chosen")
    except (OSError, ValueError, AttributeError) as e:
        raise SystemExit(f"--chosen_from {path}: cannot read a result JSON ({e})") from None
    if not isinstance(chosen, dict) or "values" not in chosen or "chosen_on" not in chosen:
        raise SystemExit(f"--chosen_from {path}: no choice of a tuning run in it (its 'chosen' needs 'values' and "
                         "'chosen_on'): give the JSON of a run on tuning seeds")
    if is_report_run(chosen["chosen_on"]):
        raise SystemExit(f"--chosen_from {path}: chosen on report seeds {chosen['chosen_on']}")
    return {**chosen, "from": publishable_values(path)}


def format_table(settings: list[dict[str, Any]], runs: list[dict[str, Any]], within: float, noun: str = "digit"
                 ) -> str:
    """The settings' table (markdown): target gain, worst and mean protected change, the share of protected classes
    that lost more than the claim (median, worst), seeds within ``within``, bounds, seeds certified, cost per step."""
    lines = ["| method | setting | target gain, median (worst) | worst protected change, median (worst) | "
             f"seeds every {noun} within {100 * within:g} pts | largest bound, median (worst) | seeds certified | "
             "s/step (CPU s/step) | mean protected change | share over the claim | rows/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in settings:
        mine = [r for r in runs if (r["method"], r["value"]) == (s["method"], s["value"])]
        knob = "-" if s["value"] is None else f"{s['knob']} {s['value']:g}"
        bound = "-" if s["largest_bound"] is None else \
            f"{s['largest_bound']['median']:.3f} ({s['largest_bound']['worst']:.3f})"
        kept = sum(r["worst_old_change"] >= -within - 1e-12 for r in mine)
        lines.append(f"| {s['method']} | {knob} | {100 * s[TARGET]['median']:+.1f} ({100 * s[TARGET]['worst']:+.1f}) "
                     f"| {100 * s['worst_old_change']['median']:+.1f} ({100 * s['worst_old_change']['worst']:+.1f}) | "
                     f"{kept}/{len(mine)} | {bound} | {s['seeds_certified_claim']}/{len(s['seeds'])} | "
                     f"{s['seconds_per_step']:.3f} ({s['cpu_seconds_per_step']:.3f}) | "
                     f"{100 * s['mean_old_change']['median']:+.1f} ({100 * s['mean_old_change']['worst']:+.1f}) | "
                     f"{100 * s['share_over_tolerance']['median']:.0f}% "
                     f"({100 * s['share_over_tolerance']['worst']:.0f}%) | {s.get('rows_forwarded_per_step') or '-'} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--example", default="demo", choices=list(EXAMPLES),
                   help="start from the defaults of the digits demo, the shapes example or the many-class example")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS), help="the methods to run")
    p.add_argument("--values", nargs="*", default=[], help="method=v1,v2: the knob values of a method")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4],
                   help="demo seeds, each with its own split and old model (0-4 choose the settings; 100-104 report)")
    p.add_argument("--chosen_from", default=None,
                   help="a report run (seeds 100 and up): the tuning run's JSON whose choice this run records")
    p.add_argument("--within", type=float, default=demo.WITHIN_POINTS,
                   help="points: the worst protected drop a chosen setting may have at the median")
    p.add_argument("--json", default="outputs/forgetting_frontier_demo/results.json")
    p.add_argument("--figure", default=None, help="write the frontier figure (PNG) here")
    p.add_argument("--workers", type=int, default=2, help="runs in parallel (processes, one torch thread each)")
    p.add_argument("--cache_dir", default=os.path.join("outputs", "forgetting_frontier_demo"),
                   help="where the stage-1 old models are kept (reused by later runs with the same settings)")
    return p


def demo_settings(rest: list[str], example: str = "demo") -> dict[str, Any]:
    """The demo's settings (every :class:`DemoConfig` field but the seed) from the flags this script does not know,
    on the defaults of ``example`` (a key of :data:`EXAMPLES`)."""
    import importlib

    p = argparse.ArgumentParser(prog="demo settings", allow_abbrev=False)
    if example == "demo":
        demo.add_demo_arguments(p)
    else:
        importlib.import_module(f"hf_constrained.recipes.{EXAMPLES[example]}").add_arguments(p)
    ns = p.parse_args(rest)
    for flag in ("--penalties", "--constraint_penalty", "--output", "--seed"):
        if any(a == flag or a.startswith(flag + "=") for a in rest):
            raise SystemExit(f"{flag}: the benchmark sets it (--methods, --json, --seeds)")
    return {f.name: getattr(ns, f.name) for f in dataclasses.fields(pipeline.DemoConfig) if f.name != "seed"}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, rest = parser().parse_known_args(argv)
    overrides = {**EXAMPLE_VALUES.get(args.example, {}), **ff.parse_values(args.values, methods=METHODS)}
    base = demo_settings(rest, args.example)
    if args.workers < 1:
        raise SystemExit(f"--workers must be >= 1, got {args.workers}")
    report_run = is_report_run(args.seeds)
    if args.chosen_from is not None and not report_run:
        raise SystemExit(f"--chosen_from: a tuning run (--seeds {' '.join(map(str, args.seeds))}) makes its own choice")
    chosen = tuning_choice(args.chosen_from) if args.chosen_from is not None else None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    _quiet()
    t0 = time.time()
    os.makedirs(args.cache_dir, exist_ok=True)
    jobs = [(method, value, seed, base, args.cache_dir) for method in args.methods
            for value in overrides.get(method, METHODS[method].values) for seed in args.seeds]
    logger.info("%d runs: %s on seeds %s", len(jobs), args.methods, args.seeds)
    partial = args.json + ".partial.jsonl" if args.json else None
    if partial:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        if os.path.exists(partial):
            os.remove(partial)  # an interrupted earlier run's rows

    bar = tqdm(total=len(jobs), desc=f"runs ({args.example})", unit="run", dynamic_ncols=True)

    def finished(row: dict[str, Any], i: int) -> None:
        bar.update()
        logger.info("%d/%d %s %s seed %d: target %+.1f pts, worst protected %+.1f pts (%s), bound %.3f, %.3f s/step",
                    i + 1, len(jobs), row["method"], row["value"], row["seed"], 100 * row[TARGET],
                    100 * row["worst_old_change"], row["worst_old_class"], row["largest_bound"],
                    row["seconds_per_step"])
        if partial:
            with open(partial, "a") as f:
                f.write(json.dumps(row) + "\n")

    # each old model once, before the runs share it (in the worker processes: only where they run in parallel)
    first = (stage1, [(s, base, args.cache_dir) for s in args.seeds]) if args.workers > 1 else None
    rows = ff.run_jobs(one_run, jobs, args.workers, finished, first=first)
    bar.close()
    settings = summarize(rows)
    if not report_run:  # the rule applies on tuning seeds only
        chosen = {"rule": f"highest median target gain with median worst protected change >= -{args.within:g} "
                          "points; else the smallest median drop",
                  "values": choose(settings, args.within / 100), "chosen_on": list(args.seeds)}
    noun = pipeline.demo_data(pipeline.DemoConfig(**base)).noun  # "digit", or "shape" with --data shapes
    result = {"command": publishable_command("python benchmarks/forgetting_frontier_demo.py", argv),
              "config": {"benchmark": publishable_values(vars(args)), "demo": publishable_values(base)},
              "claim": f"every protected {noun} loses at most {100 * base['forget_tolerance']:g} points (share of its "
                       f"certification images forgotten <= {base['forget_tolerance']:g}), delta {base['delta']:g}",
              "bound": f"Clopper-Pearson on the share of each protected {noun}'s certification images forgotten, "
                       "each run the first look at its images (level 0.9 delta)",
              "units": "fractions: target_gain and old_task_change are held-out accuracy changes against the old "
                       "model on the same images (x100: points)",
              "settings": settings, "frontier": ff.frontier(settings, target=TARGET),
              **({} if chosen is None else {"chosen": chosen}), "runs": rows, "seconds": round(time.time() - t0, 1)}
    print(format_table(settings, rows, args.within / 100, noun))
    if args.json:
        atomic_write_json(args.json, result)
        if partial and os.path.exists(partial):
            os.remove(partial)  # the result holds every run
    if args.figure:
        ff.plot(settings, args.figure, args.within / 100, target=TARGET,
                title=f"Forgetting frontier, CLIP {base['data']} {'demo' if base['data'] == 'digits' else 'example'}",
                xlabel=f"worst protected {noun}'s held-out accuracy change (points, median over seeds)",
                ylabel=f"target {noun}'s held-out accuracy gain (points, median)")
    return result


if __name__ == "__main__":
    main()
