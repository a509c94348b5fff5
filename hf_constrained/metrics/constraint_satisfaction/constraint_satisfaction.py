"""Constraint satisfaction: are the constraints h_k(w) <= tolerance_k met on held-out data?

An ``evaluate`` module, loadable from a local path without the Hub::

    import evaluate
    from hf_constrained.metrics import CONSTRAINT_SATISFACTION_PATH
    metric = evaluate.load(CONSTRAINT_SATISFACTION_PATH)

The exact value of a per-sample-mean constraint is h_k = mean_{i in D_k} values_i
(minus mean_{i in D_k} reference_values_i for a non-forgetting constraint,
h_k(w) = L_k(w, D_k) - L_k(w_old, D_k), the non-forgetting constraints of section 5.2); it is satisfied when
h_k <= tolerance_k (the feasibility condition of problem (1) of Yang et al., TMLR 2026).
For a constraint that is not a per-sample mean (e.g. the ROC-fairness rate gaps), pass
its exact value as one row.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Mapping, Union

import datasets
import evaluate

_CITATION = """\
@article{yang2026singleloop,
  title   = {Single-loop Algorithms for Stochastic Non-Convex Optimization with Weakly-Convex Constraints},
  author  = {Yang, Ming and Li, Gang and Hu, Quanqi and Lin, Qihang and Yang, Tianbao},
  journal = {Transactions on Machine Learning Research},
  year    = {2026},
  url     = {https://openreview.net/forum?id=aCgOR2KvAI}
}
"""

_DESCRIPTION = """\
Constraint satisfaction scores a model against inequality constraints h_k <= tolerance_k.
Each row is one sample's contribution to one named constraint; a constraint's value is the
mean of its rows' `predictions` (the new model's values) minus the mean of its rows'
`references` (the old model's values on the same rows; pass 0.0 for a constraint without a
reference). Returns each constraint's value, its violation
(value - tolerance), whether it holds, the largest violation and whether all hold.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[float]`): per-row value of the new model (e.g. a per-sample loss,
        or a constraint's exact value as one row).
    references (`list[float]`): per-row value of the old model on the same rows (0.0 when
        the constraint has no reference); the constraint is
        mean(predictions) - mean(references) <= tolerance.
    constraints (`list[str]`): the constraint each row belongs to.
    tolerance (`float` or `dict[str, float]`, optional, default 0.0): one tolerance
        for all constraints or one per constraint name.
Returns:
    constraint_values (`dict[str, float]`), violations (`dict[str, float]`),
    satisfied (`dict[str, bool]`), max_violation (`float`), all_satisfied (`bool`),
    num_constraints (`int`).
Examples:
    >>> metric = evaluate.load(CONSTRAINT_SATISFACTION_PATH)
    >>> metric.compute(predictions=[0.2, 0.4, 1.0], references=[0.0, 0.0, 0.0],
    ...                constraints=["a", "a", "b"], tolerance={"a": 0.5, "b": 0.5})["satisfied"]
    {'a': True, 'b': False}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class ConstraintSatisfaction(evaluate.Metric):
    """Per-constraint value, violation and satisfaction; see the module docstring."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("float64"), "references": datasets.Value("float64"),
                 "constraints": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions: list[float], references: list[float], constraints: list[str],
                 tolerance: Union[float, Mapping[str, float]] = 0.0) -> dict:
        if len(predictions) == 0:
            raise ValueError("constraint_satisfaction needs at least one row (got no predictions)")
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        for i, (value, ref, name) in enumerate(zip(predictions, references, constraints)):
            value, ref = float(value), float(ref)
            if not (math.isfinite(float(value)) and math.isfinite(ref)):
                raise ValueError(f"row {i} of constraint {name!r} is not finite (prediction={value}, reference={ref})")
            sums[name] += value - ref
            counts[name] += 1
        names = sorted(sums)
        if isinstance(tolerance, Mapping):
            missing = [n for n in names if n not in tolerance]
            if missing:
                raise ValueError(f"no tolerance given for constraints {missing} (tolerances for {sorted(tolerance)})")
            tol = {n: float(tolerance[n]) for n in names}
        else:
            tol = {n: float(tolerance) for n in names}
        value_of = {n: sums[n] / counts[n] for n in names}
        violation = {n: value_of[n] - tol[n] for n in names}
        satisfied = {n: violation[n] <= 0.0 for n in names}
        return {
            "constraint_values": value_of,
            "violations": violation,
            "satisfied": satisfied,
            "max_violation": max(violation.values()),
            "all_satisfied": all(satisfied.values()),
            "num_constraints": len(names),
        }
