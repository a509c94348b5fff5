"""The embedded demo (``make demo``): CLIP fine-tuning under non-forgetting constraints, offline.

The second application of Yang et al. (TMLR 2026, section 5) in miniature, on scikit-learn's digits: a small CLIP,
pre-trained here as a zero-shot digit classifier that has seen almost no nines, is fine-tuned toward "nine" on noisy
captions (some fives are captioned "nine") with one non-forgetting constraint per other digit, its checkpoint kept
on selection images, and certified once on held-out images nothing else read: "each protected digit loses at most
15 points of accuracy" (``forget_tolerance`` 0.15, stated before any run read these images; with 44 images per
digit no claim below 6.6 points can be certified). The pipeline is the library's
(:mod:`hf_constrained.clip.experiment`: stage 1, the pools, the constraints, the selection, the certificate, the
safety report, card and figures); this recipe is its command line, its runs over seeds and penalties, its results
file and what it says about them (docs/demo.md: what it does, and why its numbers hold on unseen images).

``make demo`` runs the hinge on one seed (2027, the library's ``DEFAULT_SEED``) and writes the kept model with its
safety report, model card and figures into ``<cache_dir>/seed-<seed>-<penalty>/``, printing what ran, each digit's
held-out accuracy and the certified claim in words. ``python -m hf_constrained.recipes.demo_clip_digits --penalties
hinge,squared_hinge,none --seeds 100,101,102,103,104 --workers 5`` compares the three penalties and repeats
everything for several seeds, each with its own split and stage-1 old model (``--workers``: seeds in parallel
processes, single-threaded each; the numbers do not change), and states each goal as met or not over the seeds.
``--data shapes`` runs the same pipeline on generated shapes (``recipes/shapes_clip_example.py``). ``--help`` lists
the knobs.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shlex
import statistics
import sys
import textwrap
import time
from dataclasses import fields
from typing import Any, Callable, Optional

import torch

from hf_constrained.atomic_files import atomic_write_json
from hf_constrained.clip.experiment import (
    DATA_NAMES,
    FORGETTING,
    LATER_FIELDS,
    SELECT_ON,
    SHAPE_FIELDS,
    DemoConfig,
    RunOutput,
    check_settings,
    demo_data,
    finetune,
    load_old_model,
    old_accuracy,
    old_pools,
    pretrain_old_model,
    run_folder,
)
from hf_constrained.processes import cpu_seconds, map_in_processes
from hf_constrained.publishable import publishable_values
from hf_constrained.publishing.certificate_text import certificate_paragraph
from hf_constrained.recipe_args import CertificateArguments, flag_bool, parse_seeds, run_plain_command
from hf_constrained.redact import redact_command

logger = logging.getLogger(__name__)

PENALTIES = ("hinge", "squared_hinge", "none")


# ---------------------------------------------------------------------------------- report


def seed_summary(cfg: DemoConfig, old: dict[str, float], run: dict[str, Any]) -> dict[str, Any]:
    """One run's headline numbers (accuracies in points, on the test split): the target's gain, the worst and the
    mean protected change, the protected classes that lost more than ``forget_tolerance`` (their share), the
    certificate, and the cost per step (seconds and rows, where the run records them)."""
    names = demo_data(cfg).names
    target = names[cfg.target]
    protected = [n for n in names if n != target]
    drops = {n: 100 * (old[n] - run["accuracy"][n]) for n in protected}
    worst = max(drops, key=drops.get)
    over = [n for n in protected if drops[n] > 100 * cfg.forget_tolerance + 1e-9]
    return {
        "target_class": target,
        "target_gain": 100 * (run["accuracy"][target] - old[target]),
        "worst_protected_drop": drops[worst],
        "worst_protected_class": worst,
        "mean_protected_change": -sum(drops.values()) / len(drops),
        "share_over_tolerance": len(over) / len(protected),
        "classes_over_tolerance": over,
        "violated_train": sum(v > cfg.tolerance - cfg.margin for v in run["h_train"].values()),
        "violated_test": sum(v > cfg.tolerance for v in run["h_test"].values()),
        "max_h_train": max(run["h_train"].values()),
        "max_h_test": max(run["h_test"].values()),
        "kept_step": run["kept_step"],
        "max_margin": max(run.get("margins", {}).values(), default=0.0),
        "certified": run["certificate"]["certified"],
        "largest_certified_bound": run["certificate"]["largest_bound"],
        "not_certified": run["certificate"]["failing"],
        "seconds_per_step": run.get("seconds_per_step"),
        "rows_per_step": run.get("rows_per_step"),
    }


def _failing_cell(names: list[str], total: int) -> str:
    short = [n.split("/", 1)[-1] for n in names]
    if not short:
        return "none"
    return f"all {total}" if len(short) == total else ", ".join(short)


def seed_table(cfg: DemoConfig, old: dict[str, float], runs: list[dict[str, Any]]) -> str:
    """Per class: old vs new test accuracy and h_k on the test split, per method; then the headline rows."""
    source = demo_data(cfg)
    target = source.names[cfg.target]
    names = [r["penalty"] for r in runs]
    value = "mean CE(new) - CE(old)" if cfg.forgetting == "mean" else "mean [CE(new) - CE(old)]_+"
    lines = [f"seed {cfg.seed}: test accuracy % (old, new) and h_k = {value} on the test split",
             "| class | old | " + " | ".join(f"{n} acc | {n} h_k" for n in names) + " |",
             "|---|---|" + "---|---|" * len(names)]
    for name in source.names:
        tag = " (target)" if name == target else (" (pulled)" if name == source.names[cfg.pulled] else "")
        cells = []
        for r in runs:
            h = r["h_test"].get(f"non_forgetting/{name}")
            cells.append(f"{100 * r['accuracy'][name]:.1f} | " + ("" if h is None else f"{h:+.3f}"))
        lines.append(f"| {name}{tag} | {100 * old[name]:.1f} | " + " | ".join(cells) + " |")
    s = [seed_summary(cfg, old, r) for r in runs]
    m = len(source.names) - 1
    lines += ["", "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names),
              "| target gain (points) | " + " | ".join(f"{x['target_gain']:+.1f}" for x in s) + " |",
              "| worst protected drop (points) | " + " | ".join(
                  f"{x['worst_protected_drop']:.1f} ({x['worst_protected_class']})" for x in s) + " |",
              f"| constraints violated on D_k (h_k > {cfg.tolerance - cfg.margin:g}) | " + " | ".join(
                  f"{x['violated_train']}/{m}" for x in s) + " |",
              f"| constraints violated, test (h_k > {cfg.tolerance:g}) | " + " | ".join(
                  f"{x['violated_test']}/{m}" for x in s) + " |",
              "| largest calibrated margin on D_k | " + " | ".join(f"{x['max_margin']:.3f}" for x in s) + " |",
              "| kept step | " + " | ".join(str(x["kept_step"]) for x in s) + " |",
              f"| certified: every protected {source.noun} loses at most {100 * cfg.forget_tolerance:g} points (share "
              f"forgotten <= {cfg.forget_tolerance:g}, delta {cfg.delta:g}) | "
              + " | ".join("yes" if x["certified"] else "no" for x in s) + " |",
              "| largest certified bound (share forgotten) | " + " | ".join(
                  "-" if x["largest_certified_bound"] is None else f"{x['largest_certified_bound']:.3f}" for x in s)
              + " |",
              "| not certified | " + " | ".join(_failing_cell(x["not_certified"], m) for x in s) + " |"]
    return "\n".join(lines)


WITHIN_POINTS = 3.0  # "kept": a protected class within this many points (about one test image) of the old model
WORST_POINTS = 5.0  # never more than this many points down


def goals(per_method: dict[str, list[dict[str, Any]]]) -> list[tuple[str, bool, str]]:
    """The demo's claims over the seeds, each (claim, met, evidence).

    With n seeds: the hinge's kept model is certified in at least ceil(0.8 n) seeds; it gains at
    least 10 points on the target in every certified seed and at least 20 at the median seed; it
    keeps every protected class within ``WITHIN_POINTS`` of the old model's test accuracy in at
    least ceil(0.8 n) seeds and never loses more than ``WORST_POINTS``. The squared hinge at the
    same beta and unconstrained fine-tuning each fail to certify in at least ceil(0.6 n) seeds.
    """
    out = []
    if "hinge" in per_method:
        s = per_method["hinge"]
        n, need = len(s), math.ceil(0.8 * len(s))
        certified = [x for x in s if x.get("certified")]
        out.append((f"hinge certified in >= {need} of {n} seeds", len(certified) >= need,
                    f"certified in {len(certified)}/{n}"))
        gains = [x["target_gain"] for x in s]
        low = min((x["target_gain"] for x in certified), default=None)
        out.append(("hinge: target +10 points or more in every certified seed, +20 or more at the median seed",
                    (low is None or low >= 10.0) and statistics.median(gains) >= 20.0,
                    f"smallest gain of a certified seed {'-' if low is None else f'{low:+.1f}'}; "
                    f"median {statistics.median(gains):+.1f}"))
        within = sum(x["worst_protected_drop"] <= WITHIN_POINTS for x in s)
        worst = max(x["worst_protected_drop"] for x in s)
        out.append((f"hinge: every protected class within {WITHIN_POINTS:g} points in >= {need} of {n} seeds, "
                    f"never more than {WORST_POINTS:g} points down",
                    within >= need and worst <= WORST_POINTS,
                    f"within {WITHIN_POINTS:g} points in {within}/{n}; worst drop {worst:.1f}"))
    for method, label in (("squared_hinge", "squared hinge at the same beta"), ("none", "unconstrained fine-tuning")):
        if method in per_method:
            s = per_method[method]
            n, need = len(s), math.ceil(0.6 * len(s))
            failed = sum(not x.get("certified") for x in s)
            out.append((f"{label} not certified in >= {need} of {n} seeds", failed >= need,
                        f"not certified in {failed}/{n}"))
    return out


def seeds_table(per_method: dict[str, list[dict[str, Any]]]) -> str:
    """Median and worst over the seeds, per method."""
    names = list(per_method)
    lines = ["| over seeds (median / worst) | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    rows = (("target gain (points)", "target_gain", min, "{:+.1f}"),
            ("worst protected drop (points)", "worst_protected_drop", max, "{:.1f}"),
            ("constraints violated on D_k", "violated_train", max, "{:.0f}"),
            ("constraints violated, test", "violated_test", max, "{:.0f}"),
            ("max h_k on the test split", "max_h_test", max, "{:+.3f}"))
    for label, key, worst, fmt in rows:
        cells = []
        for n in names:
            v = [x[key] for x in per_method[n]]
            cells.append(f"{fmt.format(statistics.median(v))} / {fmt.format(worst(v))}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    within = [f"{sum(x['worst_protected_drop'] <= WITHIN_POINTS for x in per_method[n])}/{len(per_method[n])}"
              for n in names]
    lines.append(f"| seeds with every protected class within {WITHIN_POINTS:g} points | " + " | ".join(within) + " |")
    cells = []
    for n in names:
        v = [x["largest_certified_bound"] for x in per_method[n] if x.get("largest_certified_bound") is not None]
        cells.append(f"{statistics.median(v):.3f} / {max(v):.3f}" if v else "-")
    lines.append("| largest certified bound (share forgotten) | " + " | ".join(cells) + " |")
    certified = [f"{sum(bool(x.get('certified')) for x in per_method[n])}/{len(per_method[n])}" for n in names]
    lines.append("| seeds certified | " + " | ".join(certified) + " |")
    return "\n".join(lines)


def newcomer_summary(cfg: DemoConfig, old: dict[str, float], run: dict[str, Any], cache_dir: str) -> str:
    """One run in words a newcomer reads: what was fine-tuned, the target's gain, each protected class's
    old and new held-out accuracy with its images forgotten, the certified claim in words
    (:func:`~hf_constrained.publishing.certificate_text.certificate_paragraph`: bound, delta, n) and
    the paths of the safety report, card and figures."""
    source = demo_data(cfg)
    target, noun = source.names[cfg.target], source.noun
    width = max(6, *map(len, source.names))  # the class column (6: the digits' summary as it always was)
    cert, rows = run["certificate"], run["certificate"].get("rows") or {}
    penalty = {"hinge": "the hinge penalty", "squared_hinge": "the squared hinge penalty",
               "none": "no penalty (plain fine-tuning)"}[run["penalty"]]
    what = (f"What ran (seed {cfg.seed}): a small CLIP, pre-trained here as a zero-shot {noun} classifier that has "
            f"seen almost no {target!r}, was fine-tuned for {cfg.steps} steps to recognise {target!r} from noisy "
            f"captions (some {source.names[cfg.pulled]!r} images are captioned {target!r}), with {penalty} and one "
            f"non-forgetting constraint per other {noun}; the checkpoint of step {run['kept_step']} was kept.")
    lines = [*textwrap.wrap(what, 100), "",
             "Held-out accuracy, old model -> fine-tuned model (on images that no training step and no checkpoint",
             "selection read; 'forgotten': right before, wrong now):"]
    for name in sorted(source.names, key=lambda n: n != target):  # the target first, then in class order
        key, change = f"non_forgetting/{name}", 100 * (run["accuracy"][name] - old[name])
        n = rows.get(key)
        lost = "" if n is None else f"   forgotten {round(cert['forgotten'][key] * n)} of {n}"
        tag = "(target)" if name == target else "(noisy)" if name == source.names[cfg.pulled] else ""
        lines.append(f"  {name:>{width}} {tag:<9} {100 * old[name]:5.1f}% -> {100 * run['accuracy'][name]:5.1f}%   "
                     f"{change:+5.1f} points{lost}")
    lines += ["", *certificate_paragraph(cert, noun=noun, tolerance=cfg.forget_tolerance, delta=cfg.delta,
                                         supply=source.supply, supply_flag=source.supply_flag)]
    files = run.get("files") or {}
    if files:
        folder = os.path.join(cache_dir, run_folder(cfg.seed, run["penalty"]))
        lines += ["", f"Written to {folder}: the fine-tuned model and"]
        labels = {"report": "safety report", "card": "model card", "figures": "figures"}
        lines += [f"  {labels[key]:<14} {os.path.join(folder, name)}" for key, name in files.items()]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- entry points


# flags named as in the recipes and the Trainer; the DemoConfig field names stay the keys of the results
FLAG_NAMES = {"beta": "penalty_beta", "lr": "learning_rate", "steps": "max_steps", "schedule": "lr_scheduler_type"}
DEMO_FOLDER = "demo_clip_digits"
"""The demo writes into ``outputs/demo_clip_digits`` by default, as every recipe writes into ``outputs/<module>``."""
OPTION_HELP = {f.name: f.metadata["help"] for f in fields(DemoConfig)}
"""One line of ``--help`` per :class:`DemoConfig` field (``--delta``'s is the one every recipe shows)."""
MODULE_COMMAND = "python -m hf_constrained.recipes.demo_clip_digits"
WIDER_FLAGS = "--penalties hinge,squared_hinge,none --seeds 100,101,102,103,104 --workers 5"
"""The flags of the demo's wider evaluation (docs/demo.md): both penalties and none, on the five reporting seeds."""


def option_fields() -> list[Any]:
    """:class:`DemoConfig`'s fields in the order of ``--help`` and of a results file's ``config``: the demo's own,
    then the certificate's (``--delta``, inherited from :class:`~hf_constrained.recipe_args.CertificateArguments`)."""
    certificate = {f.name for f in fields(CertificateArguments)}
    return sorted(fields(DemoConfig), key=lambda f: f.name in certificate)


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (every :class:`DemoConfig` field, seeds, penalties, cache and output),
    spelt as the recipes spell them (``--penalty_beta``, ``--learning_rate``, ``--msvr_gamma``);
    the earlier hyphenated spellings (``--beta``, ``--msvr-gamma``) are accepted too."""
    for f in option_fields():
        value = getattr(DemoConfig(), f.name)
        choices = {"forgetting": list(FORGETTING), "select_on": list(SELECT_ON), "data": list(DATA_NAMES)}.get(f.name)
        flags = [f"--{FLAG_NAMES.get(f.name, f.name)}"]
        legacy = f"--{f.name.replace('_', '-')}"
        if legacy not in flags:
            flags.append(legacy)
        kind = flag_bool if isinstance(value, bool) else type(value)
        parser.add_argument(*flags, dest=f.name, type=kind, default=value, choices=choices,
                            help=OPTION_HELP.get(f.name))
    parser.add_argument("--seeds", default=None,
                        help="comma-separated seeds (e.g. 100,101,102,103,104), each with its own split and old "
                        "model; overrides --seed")
    parser.add_argument("--penalties", "--constraint_penalty", dest="penalties", default="hinge",
                        help="the penalties to run and compare, comma-separated, from " + ",".join(PENALTIES))
    parser.add_argument("--cache_dir", "--cache-dir", dest="cache_dir", default=os.path.join("outputs", DEMO_FOLDER),
                        help="the demo's folder: the old models (reused by later runs with the same stage-1 settings) "
                             "and, without --output, demo_results.json")
    parser.add_argument("--output", default=None,
                        help="write the results JSON here (default: <cache_dir>/demo_results.json)")
    parser.add_argument("--workers", type=int, default=1,
                        help="seeds run at once, one single-threaded process each (the numbers do not change)")


def parsed_config(ns: argparse.Namespace) -> dict[str, Any]:
    """The complete parsed settings a results file records as ``config``: every :class:`DemoConfig`
    field, the seeds, the penalties and the output path (not the stage-1 cache folder, which changes
    where the old models are kept, not what they are). On the digits the generated images' settings
    (:data:`SHAPE_FIELDS`), which change nothing there, are left out: the digits' results read as before; so are
    the settings added later (:data:`LATER_FIELDS`) at their default, which every earlier run had."""
    skip = (SHAPE_FIELDS if ns.data == "digits" else ()) + tuple(k for k in LATER_FIELDS if not getattr(ns, k))
    return {**{f.name: getattr(ns, f.name) for f in option_fields() if f.name not in skip},
            "seeds": parse_seeds(ns.seeds, ns.seed), "penalties": _penalties(ns), "output": ns.output,
            "workers": ns.workers}


def run_seed(base: dict[str, Any], seed: int, penalties: list[str], cache_dir: str,
             log: Optional[Callable[[str], None]] = None, command: Optional[str] = None
             ) -> tuple[dict[str, float], list[dict[str, Any]], list[str]]:
    """Both stages for one seed: (the old model's test accuracy, one run per penalty, the progress
    lines not yet passed to ``log``). Top-level, so that ``--workers`` can run seeds in processes.
    Each run's kept model, safety report, card and figures go to ``cache_dir/``:func:`run_folder`
    (``command``: the command its card shows)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    lines: list[str] = []
    log = log or lines.append
    cfg = DemoConfig(**{**base, "seed": seed})
    old_path = pretrain_old_model(cfg, cache_dir, log=log)
    old_model = load_old_model(old_path)  # once: each run below trains a copy
    pools = old_pools(cfg, old_path, old_model)
    old = old_accuracy(cfg, old_path, pools, old_model)
    log(f"seed {seed}: stage 2, fine-tuning ({', '.join(penalties)})")
    runs = [finetune(cfg, old_path, p, pools=pools, log=log, old_model=old_model,
                     output=RunOutput(os.path.join(cache_dir, run_folder(seed, p)), old, command)) for p in penalties]
    return old, runs, lines


def _penalties(ns: argparse.Namespace) -> list[str]:
    return [p.strip() for p in ns.penalties.split(",") if p.strip()]


def _over_seeds(echo: Callable[[str], None], results: dict[str, Any], per_method: dict[str, list[dict[str, Any]]],
                target: str, cache_dir: str) -> None:
    """Several seeds: the table over them and each goal, met or not, with its evidence (into ``results``)."""
    echo(f"over {len(results['seeds'])} seed(s), target {target}:")
    echo(seeds_table(per_method))
    echo("")
    for g in results["goals"]:
        echo(f"- {g['goal']}: {'MET' if g['met'] else 'NOT MET'} ({g['evidence']})")
    echo("each run's model, safety report, card and figures: " + os.path.join(cache_dir, run_folder("<seed>",
                                                                                                    "<penalty>")))


def run_demo(ns: argparse.Namespace, echo: Optional[Callable[[str], None]] = None,
             command: Optional[str] = None, wider: Optional[str] = None) -> dict[str, Any]:
    """Run both stages for every seed with the options in ``ns``; ``echo`` (default: the
    module logger) receives the progress lines, the per-seed tables and the summary.

    Writes the results JSON (atomically: never half a file) with ``command`` (the command line that produced it;
    default: this process's own) and ``config`` (:func:`parsed_config`), and returns it. ``wider``: the
    command of the wider evaluation printed after a single-seed run (default: the digits demo's).
    """
    from transformers.utils import logging as hf_logging

    echo = echo or logger.info
    seeds, penalties = parse_seeds(ns.seeds, ns.seed), _penalties(ns)
    unknown = [p for p in penalties if p not in PENALTIES]
    if unknown:
        raise ValueError(f"--penalties: unknown {unknown}; choose from {list(PENALTIES)}")
    base = {f.name: getattr(ns, f.name) for f in fields(DemoConfig)}
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)  # tiny models: one thread is fastest and immune to a busy machine
    os.makedirs(ns.cache_dir, exist_ok=True)
    t0 = time.time()
    out = ns.output or os.path.join(ns.cache_dir, "demo_results.json")
    cfg0 = DemoConfig(**base)
    target = demo_data(cfg0).names[cfg0.target]
    echo(f"hf_constrained demo: CLIP non-forgetting fine-tuning on {cfg0.data} (target: {target}, seeds {seeds})")
    check_settings(cfg0, certify=cfg0.certify_fraction > 0)  # before any model is trained
    # no secret and no local path in a results file: an absolute --output or cache folder becomes <local>/name
    command = redact_command(command or shlex.join([os.path.basename(sys.argv[0]), *sys.argv[1:]]))
    results: dict[str, Any] = {"command": command, "config": publishable_values(parsed_config(ns)), "seeds": seeds,
                               "per_seed": []}
    per_method: dict[str, list[dict[str, Any]]] = {p: [] for p in penalties}
    if ns.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {ns.workers}")
    jobs = [(base, seed, penalties, ns.cache_dir, None, command) for seed in seeds]
    if ns.workers == 1 or len(seeds) == 1:
        done = (run_seed(*job[:4], log=echo, command=command) for job in jobs)
    else:  # one process per seed (each single-threaded); the same numbers as one after the other
        done = map_in_processes(run_seed, jobs, ns.workers)
    for seed, (old, runs, lines) in zip(seeds, done):
        cfg = DemoConfig(**{**base, "seed": seed})
        for line in lines:  # a worker's progress lines, in seed order
            echo(line)
        for r in runs:
            per_method[r["penalty"]].append(seed_summary(cfg, old, r))
        echo("")
        if len(seeds) == 1:  # the demo a newcomer runs: what happened, in words; the full table is in the JSON
            for r in runs:
                echo(newcomer_summary(cfg, old, r, ns.cache_dir))
                echo("")
        else:
            echo(seed_table(cfg, old, runs))
            echo("")
        results["per_seed"].append({"seed": seed, "old_accuracy": old, "runs": runs})
        atomic_write_json(out, results)  # after every seed: a long run can be read while it goes on
    results["summary"] = per_method
    results["goals"] = [{"goal": g, "met": met, "evidence": ev} for g, met, ev in goals(per_method)]
    if len(seeds) > 1:
        _over_seeds(echo, results, per_method, target, ns.cache_dir)
    results["seconds"] = time.time() - t0
    results["cpu_seconds"] = cpu_seconds()  # --workers: with the seeds' processes, once ended
    echo(f"\ntotal {results['seconds']:.0f}s ({results['cpu_seconds']:.0f}s of CPU) on {os.cpu_count()} CPU core(s), "
         f"torch {torch.__version__}")
    atomic_write_json(out, results)
    echo(f"results: {out}")
    if len(seeds) == 1 and penalties == ["hinge"]:
        echo(f"the wider evaluation: {wider or f'{MODULE_COMMAND} {WIDER_FLAGS}'}")
    return results


def print_line(line: str) -> None:
    """Print one line of the demo's output now (the demo and the examples on its pipeline print as they go)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m hf_constrained.recipes.demo_clip_digits``: the same options as ``hf-constrained demo``."""
    return run_plain_command(argv, MODULE_COMMAND, __doc__.split("\n")[0], add_demo_arguments, run_demo,
                             MODULE_COMMAND, print_line)


if __name__ == "__main__":
    sys.exit(main())
