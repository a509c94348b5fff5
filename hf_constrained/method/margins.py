"""The running spread of per-row values: the noise of an estimate and the margins in force.

For row-wise constraints every step yields the per-row values of B_k^t, hence their sample
variance. :class:`RowSpread` keeps a running variance s_k^2 (per group of a ``group_key``
constraint) and the rows per batch, and from them

* the standard error of the mini-batch value h_k(w; B_k) as an estimate of h_k(w; D_k)
  (``constraint_std/<name>``), noise to compare with the tolerance, with ONE warning per run
  when the estimate keeps more noise than the constraint's scale while it sits within that noise
  of its threshold (where the noise decides the hinge's indicator). B_k is drawn without
  replacement from the N rows the estimate reads (one shuffled pass after another), so the
  finite-population correction applies (:func:`without_replacement_factor`): ``s_k^2 / n``
  times ``1 - n/N`` for a batch inside one pass, more for one that runs into the next, 0 when n
  is a multiple of N (every batch IS D_k);
* the margin in force per constraint: each constraint's rule
  (:class:`~hf_constrained.margin.Margin`: a fixed margin, a calibrated one
  ``z_c * s_k / sqrt(n_k)``, or the empirical-Bernstein width the certificate's bound will need),
  decided once by :func:`~hf_constrained.method.strategies.margin_rules`; each rule class computes the
  margins of all its constraints at once from the running spread. The hinge then acts on
  ``u_k + margin > tol_k``.

Its state (:meth:`RowSpread.state_dict`) goes into every checkpoint: a resumed run has the
same margins as an uninterrupted one.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..margin import Margin, SpreadAt
from ..row_sums import batch_variances

if TYPE_CHECKING:  # pragma: no cover
    from ..constraint import Constraint

logger = logging.getLogger(__name__)

SPREAD_DECAY = 0.1
"""Weight of the newest batch in the running per-row variance of a row-wise constraint
(a running mean over the first 10 visits, then an exponential average over about 10)."""


def without_replacement_factor(n: torch.Tensor, population: torch.Tensor) -> torch.Tensor:
    """``Var(mean of B) / (s^2 / n)`` for a batch of n rows cut from consecutive shuffled passes
    over N rows (:class:`~hf_constrained.method.sampling.ConstraintBatchStream`); 1 where N is
    unknown (0). Both are rounded to whole rows.

    A batch is a piece of one pass or pieces of several; a piece of L rows drawn without
    replacement adds ``phi(L) = L (N - L) / N`` to ``n^2 Var / s^2`` (a whole pass adds 0) and
    pieces of different passes are independent. Batches start at the offsets 0, g, 2g, ...
    (g = gcd(n, N)) in turn, so the factor is the mean of that sum over the K = N / g offsets:
    with a the rows left in the pass where a batch starts, ``phi(n)`` or ``phi(a) + phi(n - a)``
    for n < N, ``phi(a) + phi(|r - a|)`` for n >= N (r = n mod N). Sums of ``phi`` over
    multiples of g have the closed form ``P(m) = sum_{i<=m} phi(i g)``."""
    n_rows = n.round().clamp(min=1).long()
    big = population.round().clamp(min=1).long()
    g = torch.gcd(n_rows, big)
    nf, bf, gf = n_rows.to(n.dtype), big.to(n.dtype), g.to(n.dtype)
    k_off, k, j = bf / gf, nf / gf, torch.remainder(n_rows, big).to(n.dtype) / gf

    def partial(m: torch.Tensor) -> torch.Tensor:  # sum of phi(i g) for i = 0..m
        return gf * m * (m + 1) / 2 - gf * gf * m * (m + 1) * (2 * m + 1) / (6 * bf)

    below = 2 * partial(k) + (k_off - 1 - k) * nf * (bf - nf) / bf
    above = partial(k_off - 1) + partial(j) + partial(k_off - 1 - j)
    factor = torch.where(n_rows < big, below, above) / (k_off * nf)
    return torch.where(population > 0, factor.clamp(min=0.0), torch.ones_like(factor))


class RowSpread:
    """Running per-row spread of the row-wise constraints, and the margins it gives.

    Args:
        constraints: all m constraints.
        rules: each constraint's margin rule (``None``: no margin), as decided by
            :func:`~hf_constrained.method.strategies.margin_rules`; each rule class computes the margins of
            all its constraints at once (:meth:`~hf_constrained.margin.Margin.margins`).
        device, dtype: where and in which precision the running sums live.
        sampled: the constraints over the rows the estimates' batches are drawn from (the indicator parts
            under two-split estimation; default: the constraints). Only the noise (``constraint_std``)
            counts those rows: margins are about unseen data, not about the sampling.
        batch_setting: the flag that sizes those batches, named by the noise warning.
    """

    def __init__(self, constraints: Sequence["Constraint"], rules: Optional[Sequence[Optional[Margin]]] = None, *,
                 device: Any = None, dtype: torch.dtype = torch.float64,
                 sampled: Optional[Sequence["Constraint"]] = None,
                 batch_setting: str = "constraint_batch_size") -> None:
        self.constraints = list(constraints)
        m = len(self.constraints)
        rules = [None] * m if rules is None else list(rules)
        sampled = self.constraints if sampled is None else list(sampled)
        # rows each estimate's batches are drawn from; 0: none (no correction)
        population = torch.tensor([0.0 if c.data_free else float(len(c.dataset)) for c in sampled],
                                  dtype=torch.float64)
        # what a margin reads of a constraint: n_k (independent rows, not correlated copies), the certification
        # split's rows and the width of its values' range
        rows, cert_rows, cert_range = (torch.zeros(m, dtype=torch.float64) for _ in range(3))
        for k, c in enumerate(self.constraints):
            rows[k] = 1.0 if not c.rowwise else c.independent_rows if c.independent_rows is not None \
                else len(c.dataset)
            if c.certifiable and c.certify.value_range is not None:
                cert_rows[k] = len(c.certify.dataset)
                cert_range[k] = float(c.certify.value_range[1]) - float(c.certify.value_range[0])
        # one coefficient vector per rule class in force (0 off its members), and its members
        self.rule_classes: list[tuple[type[Margin], torch.Tensor, torch.Tensor]] = []
        configured = torch.zeros(m, dtype=torch.bool)
        for cls in dict.fromkeys(type(r) for r in rules if r is not None):
            member = torch.tensor([type(r) is cls for r in rules], dtype=torch.bool)
            coefficient = torch.tensor([r.coefficient(c) if type(r) is cls else 0.0
                                        for r, c in zip(rules, self.constraints)], dtype=torch.float64)
            configured |= member & (coefficient > 0)
            self.rule_classes.append((cls, coefficient.to(device, dtype), member.to(device)))
        self.data_rows, self.population = rows.to(device, dtype), population.to(device, dtype)
        self.cert_rows, self.cert_range = cert_rows.to(device, dtype), cert_range.to(device, dtype)
        self.configured = configured
        self.has_margins = bool(configured.any())
        self.var = torch.zeros(2 * m, dtype=dtype, device=device)
        self.rows = torch.zeros(2 * m, dtype=dtype, device=device)
        self.visits = torch.zeros(m, dtype=dtype, device=device)
        self.noise_warned = False
        self.batch_setting = batch_setting

    @torch.no_grad()
    def observe(self, ids: torch.Tensor, stats: torch.Tensor) -> None:
        """Fold this step's global row statistics (at w_t) into the running spread:
        ``V <- (1 - rho) V + rho s^2_batch`` with ``rho = max(1 / visits, SPREAD_DECAY)``, so the
        first visits average equally and later ones forget old parameters."""
        n = ids.numel()
        var, rows = batch_variances(stats), stats[2]
        has_rows = rows.view(n, 2).sum(dim=1) > 0  # the row-wise positions of B_c
        visits = self.visits[ids] + has_rows.to(self.visits.dtype)
        rho = torch.where(has_rows, (1.0 / visits.clamp(min=1)).clamp(min=SPREAD_DECAY), torch.zeros_like(visits))
        rho2 = rho.repeat_interleave(2)
        owner = torch.stack([2 * ids, 2 * ids + 1], dim=1).reshape(-1)
        self.var[owner] = (1 - rho2) * self.var[owner] + rho2 * var.to(self.var)
        self.rows[owner] = (1 - rho2) * self.rows[owner] + rho2 * rows.to(self.rows)
        self.visits[ids] = visits

    def _at(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        owner = torch.stack([2 * ids, 2 * ids + 1], dim=1).reshape(-1)
        return self.var[owner].view(-1, 2), self.rows[owner].view(-1, 2)

    def batch_std_error(self, ids: torch.Tensor) -> torch.Tensor:
        """Standard error of h_k(w; B_k) around h_k(w; D_k): ``s_k / sqrt(|B_k|)`` times the
        finite-population factor (module docstring), or ``sqrt(v_0 + v_1)`` for a group
        difference, each group's v_g with its running share of the batch and of the N rows."""
        var, rows = self._at(ids)
        share = rows / rows.sum(dim=1, keepdim=True).clamp(min=1e-12)
        fpc = without_replacement_factor(rows, self.population[ids].unsqueeze(1) * share)
        return torch.where(rows > 0, var / rows.clamp(min=1e-12) * fpc, torch.zeros_like(var)).sum(dim=1).sqrt()

    def margin_values(self, ids: torch.Tensor) -> torch.Tensor:
        """The margin in force per constraint, each computed by its rule's class
        (:meth:`~hf_constrained.margin.Margin.margins`); 0 for constraints without one."""
        var, rows = self._at(ids)
        share = rows / rows.sum(dim=1, keepdim=True).clamp(min=1e-12)
        at = SpreadAt(var=var, rows=rows, share=share, data_rows=self.data_rows[ids],
                      certify_rows=self.cert_rows[ids], certify_range=self.cert_range[ids])
        out = torch.zeros(ids.numel(), dtype=var.dtype, device=var.device)
        for cls, coefficient, member in self.rule_classes:
            out = torch.where(member[ids], cls.margins(coefficient[ids], at), out)
        return out

    def margins(self) -> dict[str, float]:
        """The margin of each constraint that has one (empty when none is configured)."""
        if not self.has_margins:
            return {}
        values = self.margin_values(torch.arange(len(self.constraints), device=self.var.device)).cpu().tolist()
        return {c.name: float(v) for c, v, on in zip(self.constraints, values, self.configured.tolist()) if on}

    def noise(self) -> dict[str, float]:
        """Standard error of each visited row-wise constraint's mini-batch value, as an estimate
        of its value on the rows it is drawn from (:meth:`batch_std_error`)."""
        if not self.constraints:
            return {}
        se = self.batch_std_error(torch.arange(len(self.constraints), device=self.var.device)).cpu().tolist()
        visited = (self.visits > 0).cpu().tolist()
        return {c.name: float(v) for c, v, seen in zip(self.constraints, se, visited) if seen}

    def log_metrics(self, per_constraint: bool, msvr_gamma: float,
                    distances: Callable[[], Mapping[str, float]]) -> dict[str, float]:
        """``constraint_std/<name>`` and ``constraint_margin/<name>`` (with ``per_constraint``) and
        their maxima; warns once when the noise an estimate keeps dwarfs a constraint's scale
        while the estimate is within that noise of its threshold (``distances()``, by name, asked
        only when some constraint's noise exceeds its scale)."""
        logs: dict[str, float] = {}
        noise = self.noise()
        if noise:
            if per_constraint:
                logs.update({f"constraint_std/{n}": v for n, v in noise.items()})
            logs["constraint_std/max"] = max(noise.values())
            self._maybe_warn_noise(noise, msvr_gamma, distances)
        margins = self.margins()
        if margins:
            if per_constraint:
                logs.update({f"constraint_margin/{n}": v for n, v in margins.items()})
            logs["constraint_margin/max"] = max(margins.values())
        return logs

    @staticmethod
    def _noise_scale(c: "Constraint") -> Optional[float]:
        """``metadata["noise_scale"]`` (e.g. the ROC constraints' kappa), else ``|tolerance|`` when
        nonzero, else none (no warning)."""
        scale = c.metadata.get("noise_scale") if isinstance(c.metadata, Mapping) else None
        if scale is None and c.tolerance != 0:
            scale = abs(float(c.tolerance))
        return None if scale is None or not scale > 0 else float(scale)

    def _maybe_warn_noise(self, noise: dict[str, float], gamma: float,
                          distances: Callable[[], Mapping[str, float]]) -> None:
        """With independent batch noise of standard error se (finite-population corrected), an
        exponential average with weight gamma keeps ``se * sqrt(gamma / (2 - gamma))``. When that
        exceeds the constraint's scale AND the estimate is within it of the threshold
        (``distances()``: ``|u_k + margin - tol_k|``), the indicator 1[u_k > 0] is close to a coin flip;
        an estimate further away than its noise switches the same way whatever the noise (a
        constraint clearly violated or clearly met), so it is not counted."""
        if self.noise_warned:
            return
        keep = math.sqrt(gamma / (2.0 - gamma))
        noisy = []
        for c in self.constraints:
            scale = self._noise_scale(c)
            if scale is not None and c.name in noise and noise[c.name] * keep > scale:
                noisy.append((noise[c.name] * keep / scale, c.name, noise[c.name], scale))
        if not noisy:
            return
        distance = distances()
        bad = [b for b in noisy if distance.get(b[1], math.inf) < b[2] * keep]
        if not bad:
            return
        self.noise_warned = True
        bad.sort(reverse=True)
        ratio, name, se, scale = bad[0]
        logger.warning(
            "constraint noise: the mini-batch value of %r has standard error %.3g; with msvr_gamma=%g its estimate "
            "keeps about %.3g of it, %.1fx the constraint's scale %.3g (metadata['noise_scale'] or |tolerance|), "
            "and the estimate is within that noise of its threshold, so the hinge acts on noise. %d of %d "
            "constraints are in this state (worst: %s). Raise %s (the noise falls "
            "as 1/sqrt(|B_k|), faster as a batch nears all of the constraint's rows) or lower msvr_gamma (e.g. 0.1; "
            "the estimate then averages about 2/gamma batches).", name, se, gamma, se * keep, ratio, scale, len(bad),
            len(self.constraints), [b[1] for b in bad[:5]], self.batch_setting)

    def state_dict(self) -> dict[str, Any]:
        return {"var": self.var.cpu(), "rows": self.rows.cpu(), "visits": self.visits.cpu(),
                "noise_warned": self.noise_warned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.var.copy_(state["var"].to(self.var))
        self.rows.copy_(state["rows"].to(self.rows))
        self.visits.copy_(state["visits"].to(self.visits))
        self.noise_warned = bool(state["noise_warned"])


__all__ = ["RowSpread", "SPREAD_DECAY", "without_replacement_factor"]
