"""Figures: readable with many constraints (no repeated style), and objective.png plots the
objective, never an arbitrary evaluation key such as one class's accuracy."""

from __future__ import annotations

import matplotlib.colors as mcolors
import pytest

from hf_constrained.publishing.figures import (
    constraint_styles,
    constraints_figure,
    default_objective_metric,
    objective_figure,
    plot_log_history,
)
from hf_constrained.publishing.report import ConstraintResult, SafetyReport


def history(names, steps=5, extra=None):
    out = []
    for step in range(1, steps + 1):
        out.append({"step": step, "loss": 1.0 / step,
                    **{f"constraint/{n}": 0.1 * i + step for i, n in enumerate(names)},
                    "constraint/max_estimate": 0.1})
        out.append({"step": step, **{f"eval_constraint/{n}": 0.1 * i - step for i, n in enumerate(names)},
                    "eval_constraint_max_violation": -0.1, **(extra or {})})
    return out


@pytest.mark.parametrize("n", [14, 20, 37, 160])
def test_no_two_constraints_share_a_style(n):
    styles = constraint_styles(n)
    assert len(set(styles)) == n
    if n <= 20:  # colour alone tells them apart
        assert len({c for c, _ in styles}) == n


def test_fourteen_constraints_get_fourteen_colours():
    names = [f"tpr_gap@{t}" for t in range(7)] + [f"fpr_gap@{t}" for t in range(7)]
    fig = constraints_figure(history(names), names, tolerances={n: 0.05 for n in names})
    lines = {line.get_gid(): line for line in fig.axes[0].get_lines() if line.get_gid()}
    heldout = [mcolors.to_hex(lines[f"heldout:{n}"].get_color()) for n in names]
    estimate = [mcolors.to_hex(lines[f"estimate:{n}"].get_color()) for n in names]
    assert len(set(heldout)) == 14 and heldout == estimate  # one colour per constraint, for both series


def test_objective_figure_does_not_plot_a_class_accuracy_as_the_objective():
    """The CLIP recipe logs eval_accuracy/<class> and no eval_loss: the objective is the training loss."""
    log = history(["protected=zero"], extra={"eval_accuracy/zero": 0.9, "eval_accuracy/nine": 0.5})
    assert default_objective_metric(log) is None
    gids = {line.get_gid() for ax in objective_figure(log).axes for line in ax.get_lines()}
    assert "objective:loss" in gids and not any("accuracy" in str(g) for g in gids)
    # with eval_loss, that is the held-out objective
    log = history(["a"], extra={"eval_loss": 0.7, "eval_accuracy/zero": 0.9})
    gids = {line.get_gid() for ax in objective_figure(log).axes for line in ax.get_lines()}
    assert "objective:eval_loss" in gids and not any("accuracy" in str(g) for g in gids)
    # the metric the checkpoint selection used, when there is no eval_loss
    log = history(["a"], extra={"eval_auc": 0.8, "eval_accuracy/zero": 0.9})
    report = SafetyReport([ConstraintResult("a", 0.0, 0.1)], selection={"metric": "eval_auc"})
    assert default_objective_metric(log, report) == "eval_auc"
    # asked for by name
    gids = {line.get_gid() for ax in objective_figure(log, objective_metric="eval_accuracy/zero").axes
            for line in ax.get_lines()}
    assert "objective:eval_accuracy/zero" in gids


def test_plot_log_history_writes_both_figures(tmp_path):
    names = [f"c{i}" for i in range(25)]
    paths = plot_log_history(history(names), str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in paths] == ["constraints.png", "objective.png"]
    assert all(open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n" for p in paths)
