"""Certification: which candidate models satisfy every constraint, with a finite-sample guarantee.

A package that knows nothing of the model that produced the numbers: it works on arrays of per-row
values (one value per certification row and constraint, for each candidate) and imports neither torch,
nor transformers, nor the trainer (plain numpy/scipy). The trainer's safety loop
(:mod:`hf_constrained.safety`) computes the per-row values of a run and calls it; a user can call it on
values from anywhere::

    import numpy as np
    from hf_constrained.certification import certify

    forgotten = np.zeros(400)  # 0/1 per certification row: was this row forgotten?
    cert = certify([{"forgetting": forgotten}], tolerance={"forgetting": 0.02},
                   value_range={"forgetting": (0.0, 1.0)}, delta=0.05, bound="clopper_pearson")
    cert.certified  # [0]: with probability >= 0.95, at most 2% of the population is forgotten

Modules, each importing only those above it:

- :mod:`~hf_constrained.certification.bounds`: finite-sample upper confidence bounds of a mean of bounded
  values (Clopper-Pearson, Hoeffding-Bentkus, paired change, betting; CLT for comparison);
- :mod:`~hf_constrained.certification.ledger`: the ledger of looks at a certification split and its
  spending schedule (the error summed over every look stays at most delta);
- :mod:`~hf_constrained.certification.certify`: Learn-Then-Test over candidates (fixed-sequence or
  Bonferroni), the :class:`Certificate` and its guarantee in words, and whether a split can certify at all;
- :mod:`~hf_constrained.certification.splits`: carving a certification split with a seed alone, content
  hashes of rows and the fingerprint of a split;
- :mod:`~hf_constrained.certification.fingerprint`: the fingerprint of saved weight files;
- :mod:`~hf_constrained.certification.selection`: feasible-checkpoint selection (the candidates' order
  and choice on selection data, from a log history of metrics).
"""

from __future__ import annotations

from .bounds import BOUNDS, DEFAULT_BOUND, check_bound, check_delta, smallest_certifiable, upper_bound
from .certify import (
    DEFAULT_DELTA,
    PROCEDURES,
    Certifiability,
    Certificate,
    GroupRows,
    best_certified,
    certifiability,
    certify,
    first_look_delta,
    rows_needed,
)
from .fingerprint import weights_files_fingerprint
from .ledger import CertificationLedger, GeometricSpending, LookRefused, SingleLook, Spending, user_ledger_at
from .selection import FeasibleSelection
from .splits import carve_certification, check_certify_fraction, row_hash, split_fingerprint

__all__ = [
    "BOUNDS",
    "DEFAULT_BOUND",
    "DEFAULT_DELTA",
    "PROCEDURES",
    "Certifiability",
    "Certificate",
    "CertificationLedger",
    "FeasibleSelection",
    "GeometricSpending",
    "GroupRows",
    "LookRefused",
    "SingleLook",
    "Spending",
    "best_certified",
    "carve_certification",
    "certifiability",
    "certify",
    "check_bound",
    "check_certify_fraction",
    "check_delta",
    "first_look_delta",
    "row_hash",
    "rows_needed",
    "smallest_certifiable",
    "split_fingerprint",
    "upper_bound",
    "user_ledger_at",
    "weights_files_fingerprint",
]
