"""Training-curve figures from the Trainer's ``log_history`` (the paper's Figures 1-2 style).

- ``constraints.png`` (Figure 1 style): each constraint's training estimate (the MSVR
  estimate u_k of Algorithm 1, line 6, logged as ``constraint/<name>``; solid) and its
  exact held-out value (``eval_constraint/<name>``; markers), with the tolerances dashed.
- ``objective.png`` (Figure 2 style): the largest constraint violation (solid, left axis:
  training estimate ``constraint/max_estimate`` and held-out
  ``eval_constraint_max_violation``) and the objective (dashed, right axis: training
  ``loss`` and the held-out metric).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

from ..certification.selection import after_training_flags
from ..extras import has_module, require_extra
from .report import SafetyReport

SUMMARY_KEYS = ("max_estimate", "active_fraction", "penalty", "penalty_loss", "sampled_active_fraction")


def require_figures() -> None:
    """matplotlib, or :class:`~hf_constrained.extras.MissingExtraError` naming the ``figures`` extra."""
    require_extra("matplotlib", "figures", "training-curve figures")


def figures_available() -> bool:
    """Whether matplotlib (the ``figures`` extra) is installed."""
    return has_module("matplotlib")


def _series(log_history: Iterable[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for entry in log_history:
        if key in entry and "step" in entry and isinstance(entry[key], (int, float)):
            steps.append(int(entry["step"]))
            values.append(float(entry[key]))
    return steps, values


def split_at_train_end(log_history: Sequence[Mapping[str, Any]]) -> tuple[list, list]:
    """(entries logged during training, entries logged after it): evaluations after
    training (e.g. the safety report's) are of the selected weights, not of the weights
    at their logged step (:func:`~hf_constrained.selection.after_training_flags`)."""
    flags = after_training_flags(log_history)
    during = [e for e, after in zip(log_history, flags) if not after or "train_runtime" in e]
    return during, [e for e, after in zip(log_history, flags) if after and "train_runtime" not in e]


def constraint_names_in(log_history: Sequence[Mapping[str, Any]]) -> list[str]:
    """Constraint names that appear in a log history, in first-seen order."""
    names: dict[str, None] = {}
    for entry in log_history:
        for key in entry:
            if key.startswith("eval_constraint/"):
                names.setdefault(key[len("eval_constraint/"):], None)
            elif key.startswith("constraint/") and key[len("constraint/"):] not in SUMMARY_KEYS:
                names.setdefault(key[len("constraint/"):], None)
    return list(names)


# 20 distinct colours (tab20), then the next 20 constraints get another marker, and so on:
# no two constraints share a (colour, marker) pair below 20 * len(MARKERS)
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def constraint_styles(n: int) -> list[tuple[tuple[float, float, float, float], str]]:
    """(colour, marker) of each of ``n`` constraints: tab20's 20 colours, cycling the marker
    every 20 constraints, so 14 (or 160) constraints never share a style."""
    require_figures()
    from matplotlib import colormaps  # drawing only: the report and the CLI start without matplotlib

    palette = colormaps["tab20"].colors
    return [(tuple(palette[i % len(palette)]) + (1.0,), MARKERS[(i // len(palette)) % len(MARKERS)])
            for i in range(n)]


def default_objective_metric(log_history: Sequence[Mapping[str, Any]],
                             report: Optional[SafetyReport] = None) -> Optional[str]:
    """The held-out objective to plot: ``eval_loss`` when logged, else the metric the
    feasible-checkpoint selection used; never another evaluation key (e.g. one class's
    accuracy is not the objective)."""
    logged = {k for e in log_history for k in e}
    if "eval_loss" in logged:
        return "eval_loss"
    metric = (report.selection or {}).get("metric") if report is not None else None
    return metric if metric in logged else None


def constraints_figure(log_history: Sequence[Mapping[str, Any]], names: Sequence[str], *,
                       report: Optional[SafetyReport] = None, tolerances: Optional[Mapping[str, float]] = None,
                       title: Optional[str] = None) -> Any:
    """Figure 1 style: every constraint over training (colour and marker = constraint,
    line style = kind of value); returns a ``matplotlib.figure.Figure``."""
    require_figures()
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    final_step = report.global_step if report is not None else None
    tolerances = dict(tolerances or {})
    fig = Figure(figsize=(9.5, 4.8))
    ax = fig.subplots()
    style_of = dict(zip(names, constraint_styles(len(names))))
    color_handles = []
    has = {"estimate": False, "heldout": False, "report": False}
    for name in names:
        color, marker = style_of[name]
        color_handles.append(Line2D([], [], color=color, marker=marker, ms=5, lw=2, label=name))
        steps, values = _series(log_history, f"constraint/{name}")
        if steps:
            ax.plot(steps, values, "-", color=color, lw=1.3, alpha=0.85, marker=marker, ms=3,
                    markevery=max(1, len(steps) // 8), gid=f"estimate:{name}")
            has["estimate"] = True
        steps, values = _series(log_history, f"eval_constraint/{name}")
        if steps:
            ax.plot(steps, values, ":", color=color, marker=marker, ms=4, lw=1, gid=f"heldout:{name}")
            has["heldout"] = True
        if report is not None and final_step is not None:
            value = next((c.value for c in report.constraints if c.name == name), None)
            if value is not None:
                ax.plot([final_step], [value], "*", color=color, ms=13, mec="black", mew=0.6, gid=f"report:{name}")
                has["report"] = True
        if name in tolerances and len(set(tolerances.values())) > 1:
            ax.axhline(tolerances[name], color=color, ls="--", lw=0.8)
    style_handles = []
    if has["estimate"]:
        style_handles.append(Line2D([], [], color="gray", ls="-", label="training estimate (MSVR)"))
    if has["heldout"]:
        style_handles.append(Line2D([], [], color="gray", ls=":", marker="o", ms=4, label="held-out, exact"))
    if has["report"]:
        style_handles.append(Line2D([], [], color="gray", ls="", marker="*", ms=12, mec="black",
                                    label="selected model (report)"))
    if tolerances:
        style_handles.append(Line2D([], [], color="black", ls="--", label="tolerance"))
    if tolerances and len(set(tolerances.values())) == 1:
        ax.axhline(next(iter(tolerances.values())), color="black", ls="--", lw=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("constraint value h_k")
    ax.set_title((title + ": " if title else "") + "constraints over training")
    ax.grid(alpha=0.3)
    style_legend = ax.legend(handles=style_handles, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.add_artist(style_legend)
    shown = 40
    ax.legend(handles=color_handles[:shown], fontsize="x-small" if len(names) > 20 else "small",
              loc="lower left", bbox_to_anchor=(1.01, 0.0), ncol=2 if len(names) > 20 else 1,
              title="constraint" if len(names) <= shown else f"constraint (first {shown} of {len(names)})")
    return fig


def objective_figure(log_history: Sequence[Mapping[str, Any]], *, report: Optional[SafetyReport] = None,
                     objective_metric: Optional[str] = None, title: Optional[str] = None) -> Any:
    """Figure 2 style: the largest violation (solid, left axis) and the objective (dashed,
    right axis: the training loss and the held-out objective, ``objective_metric`` or
    :func:`default_objective_metric`); returns a ``matplotlib.figure.Figure``."""
    require_figures()
    from matplotlib.figure import Figure

    final_step = report.global_step if report is not None else None
    fig = Figure(figsize=(9.5, 4.8))
    ax = fig.subplots()
    steps, values = _series(log_history, "constraint/max_estimate")
    if steps:
        ax.plot(steps, values, "-", color="tab:red", label="max violation (estimate)")
    steps, values = _series(log_history, "eval_constraint_max_violation")
    if steps:
        ax.plot(steps, values, "o-", color="tab:purple", ms=4, label="max violation (held-out)")
    if report is not None and final_step is not None and report.max_violation is not None:
        ax.plot([final_step], [report.max_violation], "*", color="tab:purple", ms=13, mec="black", mew=0.6,
                label="selected model (safety report)")
    ax.axhline(0.0, color="black", lw=0.8, ls=":")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("largest violation max_k (h_k - tol_k)")
    ax2 = ax.twinx()
    steps, values = _series(log_history, "loss")
    if steps:
        ax2.plot(steps, values, "--", color="tab:blue", label="training objective (loss)", gid="objective:loss")
    metric = objective_metric or default_objective_metric(log_history, report)
    if metric is not None:
        steps, values = _series(log_history, metric)
        if steps:
            ax2.plot(steps, values, "s--", color="tab:green", ms=4, label=f"{metric} (held-out)",
                     gid=f"objective:{metric}")
    ax2.set_ylabel("objective" + (f" (loss; held-out: {metric})" if metric else " (training loss)"))
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize="small", loc="upper left",
              bbox_to_anchor=(1.08, 1.0))
    ax.set_title((title + ": " if title else "") + "violation (solid) and objective (dashed)")
    ax.grid(alpha=0.3)
    return fig


def plot_log_history(log_history: Sequence[Mapping[str, Any]], out_dir: str, *,
                     report: Optional[SafetyReport] = None, tolerances: Optional[Mapping[str, float]] = None,
                     objective_metric: Optional[str] = None, title: Optional[str] = None) -> list[str]:
    """Write ``constraints.png`` and ``objective.png`` into ``out_dir``; returns their paths.

    Args:
        log_history: ``trainer.state.log_history`` (or ``trainer_state.json``'s).
        out_dir: where to write (created).
        report / tolerances: where the tolerances come from (a report's, or name -> tol).
        objective_metric: held-out objective key to plot (default: ``eval_loss``, else the
            feasible-checkpoint selection's metric; see :func:`default_objective_metric`).
        title: a figure title prefix.

    Needs matplotlib (the ``figures`` extra): without it, :class:`~hf_constrained.extras.MissingExtraError`.
    """
    require_figures()
    names = constraint_names_in(log_history)
    if not names:
        raise ValueError("the log history holds no constraint values (constraint/<name> or eval_constraint/<name>)")
    during, _ = split_at_train_end(log_history)
    if report is not None:
        tolerances = {c.name: c.tolerance for c in report.constraints}
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, fig in (
        ("constraints.png", constraints_figure(during, names, report=report, tolerances=tolerances, title=title)),
        ("objective.png", objective_figure(during, report=report, objective_metric=objective_metric, title=title)),
    ):
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        # legends outside the axes are part of the picture
        legends = [child for ax in fig.axes for child in ax.get_children() if type(child).__name__ == "Legend"]
        fig.savefig(path, dpi=110, bbox_inches="tight", bbox_extra_artists=legends)
        paths.append(path)
    return paths


__all__ = ["MARKERS", "constraint_names_in", "constraint_styles", "constraints_figure", "default_objective_metric",
           "objective_figure", "plot_log_history"]
