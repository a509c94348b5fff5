"""Forgetting frontier: the hinge against what users do instead, in the PEFT method-comparison style.

The offline LLM example (``recipes/llm_tiny_example.py``: a tiny GPT-2 that knows ``reverse``, ``copy`` and
``add`` learns ``first``), the same old model, data, steps and seeds for every method; each method has one
knob swept over a few values:

* ``none``: unconstrained fine-tuning;
* ``replay``: old-task rows mixed into the batches at share ``ratio``
  (:class:`hf_constrained.method.regularisers.Replay`);
* ``kl``: ``lam * KL(p_old || p_new)`` on 32 old-task rows per step
  (:class:`~hf_constrained.method.regularisers.KLToOld`);
* ``l2``: ``lam / 2 * ||w - w_old||^2`` (:class:`~hf_constrained.method.regularisers.L2ToOld`);
* ``agem``: A-GEM, the step's gradient projected when it conflicts with the gradient of a balanced reference batch
  of old rows, knob the reference rows per step (a multiple of the 3 old tasks)
  (:class:`~hf_constrained.method.projection.AGEM`);
* ``replay_agem``: replay at share ``ratio`` whose old rows are also A-GEM's reference batch
  (:class:`~hf_constrained.method.projection.ReplayAGEM`);
* ``hinge`` / ``squared_hinge`` (ours): the example's constrained run without its anchor (``--replay_old``),
  knob the forgetting tolerance of its proxy indicator (``forget_tolerance``); ``hinge_beta``: the hinge, knob
  beta;
* ``replay_rows``: replay of the rows the constraints would draw, |B_k| per old task and step, at share ``ratio``
  of the loss (:class:`~hf_constrained.method.regularisers.ConstraintRowReplay` without a penalty): replay at the
  constrained run's rows per step;
* ``hinge+replay`` / ``hinge+kl``: the hinge (at ``--combo_tolerance``, default the example's
  ``--forget_tolerance``) with replay of the constraints' own rows at share ``ratio`` (one draw of old rows per
  step; ratio 0.5 at the example's beta 0.25 is the example's default constrained run) / with the KL anchor at
  weight ``lam``; ``hinge+replay_own``: the hinge with replay drawing rows of its own (two draws per step).

Every baseline reads the same old rows as the constraints (the example's ``--constraint_rows``, 4096 per task);
none reads the held-out or the certification rows. Per run: the new task's held-out exact match (the target
metric); every old task's held-out exact-match change against the old model on the same 512 rows (paired by row);
the certificate's largest Clopper-Pearson bound on the share of an old task's certification rows forgotten (a bound
on the forgotten share also bounds the accuracy lost; each run is certified once, as the first look at the rows, at
0.9 delta: ``certificate_level``) and whether it certifies ``--claim``; the training time per step; the
regulariser's and the constraints' settings. The summary gives median and worst over seeds per setting, and the
frontier: per method, the settings no other setting of it beats on both median new-task accuracy and median worst
drop; over all methods, each setting's dominators at equal cost (at most 10% more rows forwarded per step) and at
any cost.

    python benchmarks/forgetting_frontier.py --seeds 0 1 2 --methods hinge hinge+kl --values hinge=0.03 \\
        hinge+kl=1 --penalty_beta 2 --json outputs/forgetting_frontier/tuning.json
    python benchmarks/forgetting_frontier.py --seeds 100 101 102 103 104 --methods hinge replay kl \\
        --values hinge=0.03 replay=0.5 kl=3 --example_result benchmarks/results/llm_example.json \\
        --json benchmarks/results/forgetting_frontier_llm_100-104.json

``--example many_tasks`` runs the same comparison on the many-task example
(``recipes/llm_many_tasks_example.py``: 24 old tasks, 4 constraints sampled per step); its rows also give the mean
change of the old tasks and the share of them that lost more than ``--claim``:

    python benchmarks/forgetting_frontier.py --example many_tasks --seeds 0 --old_model outputs/old_llm_many_tasks \
        --json outputs/forgetting_frontier/many_tasks.json

Flags this script does not know go to the example (``--max_steps 3``, ``--old_model DIR``, ...), so every
method runs with the same example settings; ``--seeds``, ``--json`` and ``--workers`` are this script's.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib
import json
import logging
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

from tqdm.auto import tqdm

from hf_constrained.atomic_files import atomic_write_json
from hf_constrained.publishable import publishable_command, publishable_values
from hf_constrained.recipes import llm_tiny_example as ex

logger = logging.getLogger("forgetting_frontier")

EXAMPLES = {"tiny": "llm_tiny_example", "many_tasks": "llm_many_tasks_example"}
"""``--example``: the offline LLM example the methods run on (three old tasks, or 24 with sampled constraints)."""
TITLES = {"tiny": "offline LLM example", "many_tasks": "24-task LLM example"}
"""The figure's title per example."""
EXAMPLE_VALUES: dict[str, dict[str, tuple[float, ...]]] = {"many_tasks": {"agem": (24.0, 48.0)}}
"""Knob values an example needs instead of :data:`METHODS`'s (A-GEM's reference rows: a multiple of its old
tasks); ``--values`` still overrides them."""


def use_example(name: str) -> Any:
    """Make ``name`` (a key of :data:`EXAMPLES`) the example this module's functions read (``ex``)."""
    global ex
    if name not in EXAMPLES:
        raise SystemExit(f"--example {name!r}: one of {sorted(EXAMPLES)}")
    ex = importlib.import_module(f"hf_constrained.recipes.{EXAMPLES[name]}")
    return ex
T = TypeVar("T")  # what a worker returns (run_jobs)


@dataclass(frozen=True)
class Method:
    """A method of the comparison: its penalty, the knob it sweeps, and how a knob value sets up a run."""

    penalty: str
    knob: Optional[str]
    values: tuple[float, ...]
    regulariser: Optional[str] = None  # the baseline the knob feeds (replay, kl, l2, agem, replay_agem)
    example_field: Optional[str] = None  # the example's flag the knob sets (forget_tolerance, penalty_beta)


METHODS: dict[str, Method] = {
    "none": Method("none", None, (float("nan"),)),
    "replay": Method("none", "ratio", (0.25, 0.5, 0.75), regulariser="replay"),
    "kl": Method("none", "lam", (1.0, 5.0), regulariser="kl"),
    "l2": Method("none", "lam", (0.1, 1.0, 10.0), regulariser="l2"),
    "agem": Method("none", "rows_per_step", (12.0, 24.0, 48.0), regulariser="agem"),
    "replay_agem": Method("none", "ratio", (0.25, 0.5), regulariser="replay_agem"),
    "hinge": Method("hinge", "forget_tolerance", (0.03, 0.1), example_field="forget_tolerance"),
    "squared_hinge": Method("squared_hinge", "forget_tolerance", (0.03,), example_field="forget_tolerance"),
    "hinge_beta": Method("hinge", "penalty_beta", (5.0,), example_field="penalty_beta"),
    "hinge+replay": Method("hinge", "ratio", (0.25, 0.5), regulariser="replay_rows"),
    "hinge+replay_own": Method("hinge", "ratio", (0.5,), regulariser="replay"),
    "hinge+kl": Method("hinge", "lam", (1.0, 2.0), regulariser="kl"),
    "replay_rows": Method("none", "ratio", (0.5,), regulariser="replay_rows"),
}
COMBINATIONS = ("hinge+replay", "hinge+replay_own", "hinge+kl")  # the hinge at --combo_tolerance plus a baseline


def run_spec(method: str, value: float, cfg: ex.ExampleArguments,
             combo_tolerance: float) -> tuple[str, ex.ExampleArguments, Optional[tuple[str, float]]]:
    """(penalty, the example's settings, baseline) of one run."""
    m = METHODS[method]
    # each method's own terms only (a combination sets its baseline)
    run_cfg = dataclasses.replace(cfg, kl_to_old=0.0, replay_old=0.0)
    if m.example_field is not None:
        run_cfg = dataclasses.replace(run_cfg, **{m.example_field: value})
    if method in COMBINATIONS:
        run_cfg = dataclasses.replace(run_cfg, forget_tolerance=combo_tolerance)
    return m.penalty, run_cfg, (None if m.regulariser is None else (m.regulariser, value))


def saved_run_name(method: str, value: float, seed: int) -> str:
    """The folder name of one run's saved model under ``--save_models`` (``replay-0.5-seed100``)."""
    return f"{method}-{'none' if math.isnan(value) else format(value, 'g')}-seed{seed}"


def one_run(job: tuple[str, str, float, int, ex.ExampleArguments, float, Optional[str]]) -> dict[str, Any]:
    """Fine-tune once (a worker process) and return the example's run record plus the method's name and knob."""
    old_path, method, value, seed, cfg, combo_tolerance, save_models = job
    ex.torch.set_num_threads(cfg.threads)
    penalty, run_cfg, baseline = run_spec(method, value, cfg, combo_tolerance)
    save_to = None if save_models is None else os.path.join(save_models, "runs", saved_run_name(method, value, seed))
    record = ex.finetune(old_path, penalty, seed, run_cfg, regulariser=baseline, save_to=save_to)
    return {"method": method, "knob": METHODS[method].knob, "value": None if math.isnan(value) else value,
            "steps": run_cfg.max_steps, "constraint_settings": constraint_settings(penalty, run_cfg), **record}


def constraint_settings(penalty: str, cfg: ex.ExampleArguments) -> Optional[dict[str, Any]]:
    """The constrained run's own settings (recorded per run; None for a run without constraints)."""
    if penalty == "none":
        return None
    return {"penalty": penalty, "penalty_beta": cfg.penalty_beta, "forget_tolerance": cfg.forget_tolerance,
            "constraint_margin": cfg.constraint_margin, "constraint_batch_size": cfg.constraint_batch_size,
            "constraint_indicator_fraction": cfg.constraint_indicator_fraction,
            "constraint_indicator_batch_size": cfg.constraint_indicator_batch_size,
            "constraint_proxy_indicator": cfg.constraint_proxy_indicator, "msvr_gamma": cfg.msvr_gamma,
            "msvr_gamma_prime": cfg.msvr_gamma_prime,
            "learning_rate": cfg.learning_rate, "max_steps": cfg.max_steps}


def run_row(run: dict[str, Any], old: dict[str, dict], claim: float) -> dict[str, Any]:
    """The numbers of one run: target metric, each old task's paired change, certificate, time per step."""
    changes = {t: run["held_out"][t]["accuracy"] - old[t]["accuracy"] for t in ex.OLD_TASKS}
    cert = run.get("certificate")
    return {"method": run["method"], "knob": run["knob"], "value": run["value"], "seed": run["seed"],
            "steps": run["steps"], "new_task_accuracy": run["held_out"][ex.NEW_TASK]["accuracy"],
            "old_task_change": changes, "worst_old_change": min(changes.values()),
            **ex.forgetting_summary(changes, claim),  # the mean change, the share of tasks that lost more than claim
            "largest_bound": None if cert is None else cert["largest_bound"],
            "upper_bounds": None if cert is None else cert["upper_bounds"],
            "forgotten": None if cert is None else cert["forgotten"],
            "certification_rows": None if cert is None else cert["num_rows"],
            "certified_claim": None if cert is None else cert["largest_bound"] <= claim,
            "certificate_level": None if cert is None else cert.get("level"),
            "seconds_per_step": run["seconds_per_step"], "rows_per_step": run.get("rows_per_step"),
            "regulariser": run["regulariser"],
            "gradient_projection": run.get("gradient_projection"),
            "constraint_settings": run.get("constraint_settings")}


def _med_worst(values: list[float], worst: Any) -> dict[str, float]:
    return {"median": statistics.median(values), "worst": worst(values)}


def summarize(rows: list[dict[str, Any]], target: str = "new_task_accuracy") -> list[dict[str, Any]]:
    """Median and worst over the seeds of every (method, value); ``target``: the rows' target metric."""
    settings: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for r in rows:
        settings.setdefault((r["method"], r["value"]), []).append(r)
    out = []
    for (method, value), rs in settings.items():
        bounds = [r["largest_bound"] for r in rs if r["largest_bound"] is not None]
        out.append({"method": method, "knob": rs[0]["knob"], "value": value, "seeds": [r["seed"] for r in rs],
                    target: _med_worst([r[target] for r in rs], min),
                    "worst_old_change": _med_worst([r["worst_old_change"] for r in rs], min),
                    **({"mean_old_change": _med_worst([r["mean_old_change"] for r in rs], min),
                        "share_over_tolerance": _med_worst([r["share_over_tolerance"] for r in rs], max)}
                       if all("mean_old_change" in r for r in rs) else {}),
                    "old_task_change": {t: _med_worst([r["old_task_change"][t] for r in rs], min)
                                        for t in rs[0]["old_task_change"]},
                    "largest_bound": _med_worst(bounds, max) if bounds else None,
                    "seeds_certified_claim": sum(bool(r["certified_claim"]) for r in rs),
                    "seconds_per_step": statistics.median(r["seconds_per_step"] for r in rs),
                    "rows_forwarded_per_step": _rows_forwarded(rs)})
    return out


def _rows_forwarded(rs: list[dict[str, Any]]) -> Optional[int]:
    """The rows a step of these runs forwards (the same for every seed of a setting); None for runs stored
    before rows were recorded."""
    rows = [r["rows_per_step"]["forward"] for r in rs if r.get("rows_per_step")]
    return max(rows) if rows else None


EQUAL_COST = 1.10  # a setting is compared with those that cost at most 10% more rows per step


def dominates(a: dict[str, Any], b: dict[str, Any], target: str = "new_task_accuracy",
              equal_cost: bool = True) -> bool:
    """``a`` reaches at least ``b``'s median new-task accuracy at the same or a smaller median worst drop, and is
    strictly better in one of the two; with ``equal_cost`` (where both record their rows per step) ``a`` must also
    cost at most :data:`EQUAL_COST` times ``b``'s rows forwarded per step: a method is beaten only by one at about
    its own cost, not by one that reads more rows."""
    acc_a, acc_b = a[target]["median"], b[target]["median"]
    drop_a, drop_b = a["worst_old_change"]["median"], b["worst_old_change"]["median"]  # changes: higher is better
    cost_a, cost_b = a.get("rows_forwarded_per_step"), b.get("rows_forwarded_per_step")
    if equal_cost and cost_a is not None and cost_b is not None and cost_a > EQUAL_COST * cost_b:
        return False
    return acc_a >= acc_b and drop_a >= drop_b and (acc_a > acc_b or drop_a > drop_b)


def frontier(settings: list[dict[str, Any]], target: str = "new_task_accuracy") -> dict[str, Any]:
    """Per method, its settings on its own frontier; over all methods, each setting's dominators."""
    per_method = {}
    for method in dict.fromkeys(s["method"] for s in settings):
        mine = [s for s in settings if s["method"] == method]
        per_method[method] = [s["value"] for s in mine if not any(dominates(o, s, target) for o in mine)]
    dominated_by = {f"{s['method']}={s['value']}": [f"{o['method']}={o['value']}" for o in settings
                                                   if dominates(o, s, target)]
                    for s in settings}
    at_any_cost = {f"{s['method']}={s['value']}": [f"{o['method']}={o['value']}" for o in settings
                                                  if dominates(o, s, target, equal_cost=False)]
                   for s in settings}
    return {"per_method": per_method, "dominated_by": dominated_by, "dominated_by_at_any_cost": at_any_cost}


OFF_SCALE_GOALS = 5  # the figure's axis spans drops up to this many times the goal


def plot(settings: list[dict[str, Any]], path: str, claim: float, target: str = "new_task_accuracy",
         title: str = "Forgetting frontier, offline LLM example",
         xlabel: str = "worst old-task exact-match change (points, median over seeds)",
         ylabel: str = "new-task exact match (%, median)") -> None:
    """Median new-task exact match (``target``) against the median worst old-task change, one line per method, each
    point labelled with its cost (rows forwarded per step, where the runs record it).

    The horizontal axis spans the methods whose median worst drop is within five times the goal (15 points for a
    3-point goal); a method that forgets more (plain fine-tuning) is drawn at the left edge with its value written
    beside it, so that it does not squeeze the methods near the goal into one point."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = [100 * s[target]["median"] for s in settings]
    if max(targets) - min(targets) < 1.0 and all(s.get("rows_forwarded_per_step") for s in settings):
        plot_against_cost(settings, path, claim, title)  # every method learns the new task alike: cost tells them apart
        return
    goal = -100 * claim
    medians = [100 * s["worst_old_change"]["median"] for s in settings]
    left = min([goal, *[x for x in medians if x >= OFF_SCALE_GOALS * goal]]) - 1.0
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, method in enumerate(dict.fromkeys(s["method"] for s in settings)):
        mine = sorted((s for s in settings if s["method"] == method), key=lambda s: s["worst_old_change"]["median"])
        xs = [100 * s["worst_old_change"]["median"] for s in mine]
        ys = [100 * s[target]["median"] for s in mine]
        shown = [max(x, left) for x in xs]
        line, = ax.plot(shown, ys, marker="o", label=method)
        for s, x, x_shown, y in zip(mine, xs, shown, ys):
            label = method if s["value"] is None else f"{method} {s['value']:g}"
            if s.get("rows_forwarded_per_step"):  # the cost: rows forwarded per step
                label += f", {s['rows_forwarded_per_step']} rows/step"
            if x < left:  # off the axis: at the edge, with its value
                ax.plot([x_shown], [y], marker="<", markersize=10, color=line.get_color())
                label = f"{label} ({x:+.1f} pts, off scale)"
            # methods at one point (several reach the same accuracy) get their labels on separate lines
            ax.annotate(label, (x_shown, y), fontsize=7, xytext=(3, 3 + 9 * (k % 4)), textcoords="offset points")
    ax.axvline(goal, color="grey", linestyle=":", linewidth=1, label=f"goal: {goal:g} points")
    ax.set_xlim(left - 0.5, max(1.0, max(medians) + 0.5))
    targets = [100 * s[target]["median"] for s in settings]
    pad = max(1.0, 0.08 * (max(targets) - min(targets)))  # room for the labels above the highest point
    ax.set_ylim(min(targets) - pad, max(targets) + 3 * pad)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_against_cost(settings: list[dict[str, Any]], path: str, claim: float, title: str) -> None:
    """The median worst old-task change (points; the worst seed as an error bar down) against the rows forwarded per
    step, one marker per method and knob value: the equal-cost frontier when every method learns the new task
    alike (then the new-task axis of :func:`plot` would put every point on one line)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in dict.fromkeys(s["method"] for s in settings):
        mine = sorted((s for s in settings if s["method"] == method), key=lambda s: s["rows_forwarded_per_step"])
        xs = [s["rows_forwarded_per_step"] for s in mine]
        ys = [100 * s["worst_old_change"]["median"] for s in mine]
        low = [100 * (s["worst_old_change"]["median"] - s["worst_old_change"]["worst"]) for s in mine]
        line = ax.errorbar(xs, ys, yerr=[low, [0] * len(low)], marker="o", capsize=3, label=method)
        for s, x, y in zip(mine, xs, ys):
            if s["value"] is not None:
                ax.annotate(f"{s['value']:g}", (x, y), fontsize=7, xytext=(4, 2), textcoords="offset points",
                            color=line[0].get_color())
    ax.axhline(-100 * claim, color="grey", linestyle=":", linewidth=1, label=f"goal: {-100 * claim:g} points")
    ax.set_xlabel("rows forwarded per optimizer step (the cost)")
    ax.set_ylabel("worst old-task change (points)\nmedian; bar: the worst seed")
    ax.set_title(title + " (every method learns the new task alike)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(settings: list[dict[str, Any]], claim: float, many_tasks: bool = False) -> str:
    """The settings' table (markdown); ``many_tasks``: with the mean change and the share of old tasks over the
    claim, median (worst)."""
    header = ("| method | knob | new-task exact match, median (worst) | worst old-task change, median (worst) | "
              f"largest bound, median (worst) | certified at most {claim:g} | s/step |")
    lines = [header, "|---|---|---|---|---|---|---|"]
    if many_tasks:
        lines = [header + " mean old-task change | old tasks over the claim |", "|---|---|---|---|---|---|---|---|---|"]
    for s in settings:
        knob = "-" if s["value"] is None else f"{s['knob']} {s['value']:g}"
        bound = "-" if s["largest_bound"] is None else \
            f"{s['largest_bound']['median']:.3f} ({s['largest_bound']['worst']:.3f})"
        lines.append(f"| {s['method']} | {knob} | {100 * s['new_task_accuracy']['median']:.1f}% "
                     f"({100 * s['new_task_accuracy']['worst']:.1f}%) | {100 * s['worst_old_change']['median']:+.1f} "
                     f"({100 * s['worst_old_change']['worst']:+.1f}) pts | {bound} | "
                     f"{s['seeds_certified_claim']}/{len(s['seeds'])} | {s['seconds_per_step']:.3f} |")
        if many_tasks:
            lines[-1] += (f" {100 * s['mean_old_change']['median']:+.1f} ({100 * s['mean_old_change']['worst']:+.1f})"
                          f" pts | {100 * s['share_over_tolerance']['median']:.0f}% "
                          f"({100 * s['share_over_tolerance']['worst']:.0f}%) |")
    return "\n".join(lines)


def parse_values(specs: list[str], methods: Optional[dict[str, Method]] = None) -> dict[str, tuple[float, ...]]:
    """``method=v1,v2`` overrides of the knob values (of ``methods``, default :data:`METHODS`)."""
    methods = METHODS if methods is None else methods
    out = {}
    for spec in specs:
        method, _, values = spec.partition("=")
        if method not in methods or methods[method].knob is None or not values:
            raise SystemExit(f"--values {spec!r}: give method=v1,v2 for a method with a knob "
                             f"({[m for m, d in methods.items() if d.knob]})")
        out[method] = tuple(float(v) for v in values.split(","))
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--example", default="tiny", choices=list(EXAMPLES),
                   help="the offline LLM example: tiny (three old tasks) or many_tasks (24, constraints sampled)")
    p.add_argument("--methods", nargs="*", default=list(METHODS), choices=list(METHODS),
                   help="the methods to run (none: only --include and --example_result)")
    p.add_argument("--include", nargs="*", default=[],
                   help="add the runs of earlier result files of this benchmark (same old model and settings)")
    p.add_argument("--values", nargs="*", default=[], help="method=v1,v2: the knob values of a method")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4],
                   help="fine-tuning seeds (0-4 choose the settings; 100-104 report them)")
    p.add_argument("--combo_tolerance", type=float, default=None,
                   help="the hinge's forget_tolerance in hinge+replay and hinge+kl (default: the example's "
                        "--forget_tolerance)")
    p.add_argument("--claim", type=float, default=0.03,
                   help="the certified claim reported: at most this share of each old task's rows forgotten")
    p.add_argument("--json", default="outputs/forgetting_frontier/results.json")
    p.add_argument("--figure", default=None, help="write the frontier figure (PNG) here")
    p.add_argument("--workers", type=int, default=2, help="runs in parallel (processes)")
    p.add_argument("--save_models", default=None, metavar="DIR",
                   help="save each run's fine-tuned model in DIR/runs/<method>-<value>-seed<seed> and the old tasks' "
                        "certification rows in DIR/certification_rows/<task>.jsonl, for hf-constrained certify "
                        "(benchmarks/certify_saved_runs.py)")
    p.add_argument("--example_result", default=None,
                   help="take the unconstrained and the constrained runs from this LLM-example result file (same "
                        "old model and settings, checked) instead of running them again")
    return p


IGNORED_SETTINGS = ("seeds", "json", "workers", "old_model")  # where and how fast, not what is measured


def same_settings(saved_example: dict[str, Any], cfg: ex.ExampleArguments, path: str, flag: str) -> None:
    """Refuse a result file whose example settings differ from this run's (apart from IGNORED_SETTINGS)."""
    mine = {k: v for k, v in publishable_values(dataclasses.asdict(cfg)).items() if k not in IGNORED_SETTINGS}
    theirs = {k: v for k, v in ex.stored_settings(saved_example).items() if k not in IGNORED_SETTINGS}
    if mine != theirs:
        differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        raise SystemExit(f"{flag} {path}: its example settings differ from this run's in {differ}")


def included_rows(path: str, cfg: ex.ExampleArguments, old_sha256: str, combo_tolerance: float) -> list[dict]:
    """The runs of an earlier result file of this benchmark (same old model and example settings, checked)."""
    with open(path) as f:
        saved = json.load(f)
    same_settings(saved["config"]["example"], cfg, path, "--include")
    if saved["old_model_sha256"] != old_sha256:
        raise SystemExit(f"--include {path}: another old model (sha256 {saved['old_model_sha256'][:12]})")
    rows = saved["runs"]
    if any(r["method"] in COMBINATIONS for r in rows) and saved["config"]["benchmark"]["combo_tolerance"] != \
            combo_tolerance:
        raise SystemExit(f"--include {path}: its hinge combinations use --combo_tolerance "
                         f"{saved['config']['benchmark']['combo_tolerance']}, this run {combo_tolerance}")
    return rows


def example_runs(path: str, cfg: ex.ExampleArguments, seeds: list[int], old_sha256: str,
                 combo_tolerance: float) -> list[dict[str, Any]]:
    """The unconstrained and constrained runs of an LLM-example result file (``recipes/llm_tiny_example.py
    --json``), as this benchmark's runs: the same function (``finetune``) with the same settings, so the same
    numbers, without running them twice. The file must come from the same old model and the same example
    settings (apart from its seeds, output and workers) and hold every seed asked for."""
    with open(path) as f:
        saved = json.load(f)
    same_settings(saved["config"], cfg, path, "--example_result")
    if saved["old_model_sha256"] != old_sha256:
        raise SystemExit(f"--example_result {path}: another old model (sha256 {saved['old_model_sha256'][:12]})")
    runs = []
    for r in saved["runs"]:
        if r["seed"] not in seeds:
            continue
        if r["penalty"] == "none":
            method, value = "none", None
        elif r.get("regulariser"):  # the example's constrained run with its anchor (--replay_old / --kl_to_old)
            if cfg.forget_tolerance != combo_tolerance:
                raise SystemExit(f"--example_result {path}: its hinge combination uses forget_tolerance "
                                 f"{cfg.forget_tolerance}, --combo_tolerance is {combo_tolerance}")
            own_rows = r["regulariser"]["name"] == "replay" and r["regulariser"].get("rows") != "constraint_rows"
            method = f"hinge+{r['regulariser']['name']}" + ("_own" if own_rows else "")
            value = r["regulariser"][METHODS[method].knob]
        else:
            method, value = r["penalty"], cfg.forget_tolerance
        runs.append({"method": method, "knob": METHODS[method].knob, "value": value, "steps": cfg.max_steps,
                     "constraint_settings": constraint_settings(r["penalty"], cfg), **r})
    for method in dict.fromkeys(r["method"] for r in runs):
        got = sorted(r["seed"] for r in runs if r["method"] == method)
        if got != sorted(seeds):
            raise SystemExit(f"--example_result {path}: {method} has seeds {got}, not {sorted(seeds)}")
    return runs


def finished(run: dict[str, Any], i: int, total: int, old: dict[str, dict], args: argparse.Namespace) -> None:
    """Log a finished run and append its row to ``<json>.partial.jsonl`` (what a long sweep has so far)."""
    row = run_row(run, old, args.claim)
    logger.info("%d/%d %s %s seed %d: new task %.3f, worst old-task change %+.1f pts, bound %s, %.3f s/step",
                i + 1, total, row["method"], row["value"], row["seed"], row["new_task_accuracy"],
                100 * row["worst_old_change"], row["largest_bound"], row["seconds_per_step"])
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json + ".partial.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def run_jobs(worker: Callable[[Any], T], jobs: list[Any], workers: int, finished: Callable[[T, int], None],
             first: Optional[tuple[Callable[[Any], Any], list[Any]]] = None) -> list[T]:
    """``worker`` on every job, in ``workers`` spawned processes when more than one; ``finished(result, i)`` as each
    ends (the i-th to end), results in the jobs' order. ``first``: (function, its jobs), mapped in the same pool
    before (the demo's stage-1 old models, each trained once before the runs share it)."""
    if workers <= 1:
        if first is not None:
            list(map(*first))
        results = []
        for i, j in enumerate(jobs):
            results.append(worker(j))
            finished(results[-1], i)
        return results
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        if first is not None:
            list(pool.map(*first))
        futures = [pool.submit(worker, j) for j in jobs]
        for i, done in enumerate(concurrent.futures.as_completed(futures)):
            finished(done.result(), i)
        return [f.result() for f in futures]


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, rest = parser().parse_known_args(argv)
    use_example(args.example)
    overrides = {**EXAMPLE_VALUES.get(args.example, {}), **parse_values(args.values)}
    cfg = ex.parse(rest + ["--seeds", *map(str, args.seeds)])  # unknown flags are the example's error
    if args.combo_tolerance is None:
        args.combo_tolerance = cfg.forget_tolerance
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    ex._quiet()
    ex.torch.set_num_threads(cfg.threads)
    t0 = time.time()
    tmp = tempfile.TemporaryDirectory()
    old_path = cfg.old_model or tmp.name
    if not os.path.exists(os.path.join(old_path, "config.json")):
        ex.train_old_model(old_path, cfg)
    tokenizer = ex.AutoTokenizer.from_pretrained(old_path)
    held_out, _ = ex.data_splits(tokenizer, cfg)
    old_model = ex.AutoModelForCausalLM.from_pretrained(old_path)
    old = ex.evaluate(old_model, held_out, ex.PaddingCollator(tokenizer))
    if args.save_models:  # the certification rows once, as files, for hf-constrained certify
        ex.write_certification_rows(cfg, os.path.join(args.save_models, "certification_rows"))
    jobs = [(old_path, method, value, seed, cfg, args.combo_tolerance, args.save_models)
            for method in args.methods for value in overrides.get(method, METHODS[method].values)
            for seed in args.seeds]
    logger.info("%d runs: %s", len(jobs), sorted({j[1] for j in jobs}))
    if args.json and os.path.exists(args.json + ".partial.jsonl"):
        os.remove(args.json + ".partial.jsonl")  # an interrupted earlier run's rows
    bar = tqdm(total=len(jobs), desc=f"runs ({args.example} example)", unit="run", dynamic_ncols=True)
    runs = run_jobs(one_run, jobs, args.workers, lambda run, i: (finished(run, i, len(jobs), old, args),
                                                                 bar.update()))
    bar.close()
    old_sha256 = ex.model_fingerprint(old_model)
    if args.example_result:
        runs = example_runs(args.example_result, cfg, args.seeds, old_sha256, args.combo_tolerance) + runs
    rows = [run_row(r, old, args.claim) for r in runs]
    for path in args.include:
        rows += included_rows(path, cfg, old_sha256, args.combo_tolerance)
    keys = [(r["method"], r["value"], r["seed"]) for r in rows]
    twice = sorted({k for k in keys if keys.count(k) > 1}, key=str)
    if twice:
        raise SystemExit(f"runs {twice} come twice (ran here, from --example_result or --include): leave them out")
    settings = summarize(rows)
    result = {"command": publishable_command("python benchmarks/forgetting_frontier.py", argv),
              "config": {"benchmark": publishable_values(vars(args)),
                         "example": publishable_values(dataclasses.asdict(cfg))},
              "old_model_sha256": old_sha256, "old_model": old,
              "environment": ex.environment(cfg), "claim": args.claim, "delta": cfg.delta,
              "bound": "Clopper-Pearson on the share of each old task's certification rows forgotten",
              "settings": settings, "frontier": frontier(settings), "runs": rows,
              "seconds": round(time.time() - t0, 1)}
    print(format_table(settings, args.claim, many_tasks=args.example == "many_tasks"))
    if args.json:
        atomic_write_json(args.json, result)
        if os.path.exists(args.json + ".partial.jsonl"):
            os.remove(args.json + ".partial.jsonl")  # the result holds every run
    if args.figure:
        plot(settings, args.figure, args.claim, title=f"Forgetting frontier, {TITLES[args.example]}")
    tmp.cleanup()
    return result


if __name__ == "__main__":
    main()
