"""Algorithm 1 (and the estimators of Algorithm 2) of the paper, with no Trainer in it.

* :mod:`~hf_constrained.method.sampling`: which constraints a step visits (B_c) and their rows (B_k);
* :mod:`~hf_constrained.method.estimators`: the MSVR estimators (line 6);
* :mod:`~hf_constrained.method.penalties`: how violations become gradient weights (line 9);
* :mod:`~hf_constrained.method.rows`: row-wise constraints, one planner and one reduction;
* :mod:`~hf_constrained.method.draw_values`: h_k(w; B_k) of a draw;
* :mod:`~hf_constrained.method.margins`: the running row spread, noise and calibrated margins;
* :mod:`~hf_constrained.method.engine`: the constraint part of a step, lines 3-9 in order.

The modules are imported on use (``from hf_constrained.method.engine import ConstraintEngine``):
the bottom modules stay importable without the ones above them.
"""
