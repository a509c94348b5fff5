"""How much gradient clipping interferes with the exact penalty.

Algorithm 1 (line 10) steps along G_1 + G_2, the objective's gradient plus the penalty's
beta-weighted constraint gradients. The hinge penalty is exact for a constant beta above a
threshold (Section 4): clipping the summed gradient to ``max_grad_norm`` (the Trainer's
default 1.0) rescales G_2 by the same factor whenever the step is clipped, so the effective
beta shrinks exactly when constraints are violated and the penalty is large. The method
expects no clipping (``max_grad_norm=0``) or a bound that rarely binds, and a constant or
step-decay learning rate.

:class:`ClipMonitor` reads the pre-clip gradient norm the Trainer logs (``grad_norm``) and
adds to each training log

* ``clip/clipped_fraction``: the fraction of logged steps whose gradient was clipped;
* ``clip/scale``: ``min(1, max_grad_norm / grad_norm)`` of the logged step;
* ``clip/penalty_share``: ``||G_2|| / ||G_1 + G_2||`` when the opt-in
  :class:`~hf_constrained.callbacks.PenaltyGradientNormCallback` measured ``||G_2||``
  (an extra backward through the constraints, so off by default);

and warns once when clipping dominates (at least half of at least 5 logged steps clipped).
No extra computation: the counts cover the logged steps (every step with ``logging_steps=1``).

The metrics are about the penalty, so they are logged only when a penalty is trained, or
when asked for: ``trainer.clip_monitor.report = True``, or a measurement of the penalty's
gradient (:class:`~hf_constrained.callbacks.PenaltyGradientNormCallback`) in the entry.
Without constraints (or with penalty ``none``) the logs are the Trainer's, key for key.
"""

from __future__ import annotations

import logging
from typing import Optional

logger = logging.getLogger(__name__)

PENALTY_GRAD_NORM_KEY = "clip/penalty_grad_norm"


class ClipMonitor:
    """Counts clipped steps from the logged pre-clip gradient norms; warns once when they dominate.

    Args:
        max_grad_norm: the Trainer's clipping bound (``<= 0``: no clipping, nothing to report).
        active: whether a penalty is trained (the warning is about the penalty).
        warn_fraction, min_observations: warn when at least ``warn_fraction`` of at least
            ``min_observations`` logged steps were clipped.
        report: log the metrics; ``None`` (default): when ``active``, or when the entry holds
            a measurement of the penalty's gradient. Settable later (``clip_monitor.report = True``).
    """

    def __init__(self, max_grad_norm: Optional[float], active: bool, warn_fraction: float = 0.5,
                 min_observations: int = 5, report: Optional[bool] = None) -> None:
        self.max_grad_norm = float(max_grad_norm or 0.0)
        self.active = active
        self.report = report
        self.warn_fraction = warn_fraction
        self.min_observations = min_observations
        self.observed = 0
        self.clipped = 0
        self.warned = False

    @property
    def clipped_fraction(self) -> float:
        return self.clipped / self.observed if self.observed else 0.0

    def observe(self, grad_norm: Optional[float], step: int,
                penalty_grad_norm: Optional[float] = None) -> dict[str, float]:
        """The clipping metrics of one training log (empty without clipping or a norm, and
        when not reporting: see ``report``)."""
        report = self.report if self.report is not None else (self.active or penalty_grad_norm is not None)
        if self.max_grad_norm <= 0 or grad_norm is None or not report:
            return {}
        grad_norm = float(grad_norm)
        self.observed += 1
        self.clipped += grad_norm > self.max_grad_norm
        out = {"clip/clipped_fraction": self.clipped_fraction,
               "clip/scale": min(1.0, self.max_grad_norm / grad_norm) if grad_norm > 0 else 1.0}
        if penalty_grad_norm is not None and grad_norm > 0:
            out["clip/penalty_share"] = float(penalty_grad_norm) / grad_norm
        if (self.active and not self.warned and self.observed >= self.min_observations
                and self.clipped_fraction >= self.warn_fraction):
            self.warned = True
            share = (f"; the penalty's gradient was {out['clip/penalty_share']:.0%} of the norm at step {step}"
                     if "clip/penalty_share" in out else "")
            logger.warning(
                "gradient clipping (max_grad_norm=%g) shrank %d of %d logged steps (%.0f%%)%s. Clipping rescales the "
                "penalty's gradient with the objective's, so the exact penalty's beta is effectively smaller whenever "
                "constraints are violated. The method expects max_grad_norm=0 (no clipping) or a bound that rarely "
                "binds, and a constant or step-decay learning rate.", self.max_grad_norm, self.clipped,
                self.observed, 100 * self.clipped_fraction, share)
        return out


__all__ = ["ClipMonitor", "PENALTY_GRAD_NORM_KEY"]
