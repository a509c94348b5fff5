"""The certification package stands alone: arrays of per-row values in, a certificate out, with no torch,
no transformers and no trainer loaded (MAPIE's risk control knows nothing of the model either)."""

from __future__ import annotations

import os
import subprocess
import sys

from test_safety_layout import REPO, import_graph

# what the certification package may import of the library: itself and these plain-numpy helpers
ALLOWED = {"hf_constrained", "hf_constrained.statistics", "hf_constrained.atomic_files"}

SCRIPT = """
import sys, tempfile
import numpy as np

import hf_constrained.certification as cert
from hf_constrained.certification import (CertificationLedger, carve_certification, certify, row_hash,
                                          split_fingerprint, weights_files_fingerprint)
from hf_constrained.certification import bounds, certify as certify_module, fingerprint, ledger, selection, splits

rows = np.arange(1000)
left, held = carve_certification(rows, 0.4, seed=0)
assert len(held) == 400 and not set(left) & set(held)
forgotten = np.zeros(len(held))
fp = split_fingerprint(row_hash(r) for r in held)
with tempfile.TemporaryDirectory() as run_dir:
    c = certify([{"forgetting": forgotten}, {"forgetting": np.ones(len(held))}], {"forgetting": 0.02},
                {"forgetting": (0.0, 1.0)}, 0.05, bound="clopper_pearson", split_fingerprints={"forgetting": fp},
                ledger=CertificationLedger.for_run(run_dir))
    assert weights_files_fingerprint(run_dir) is None
assert c.certified == [0], c.certified
assert c.looks == {"forgetting": 1}, c.looks
assert "0.95" in c.statement()
loaded = sorted(m for m in ("torch", "transformers", "hf_constrained.trainer", "hf_constrained.safety",
                            "hf_constrained.publishing", "hf_constrained.method", "hf_constrained.constraint")
                if m in sys.modules)
print("LOADED", loaded)
"""


def test_certification_runs_on_arrays_without_torch_or_transformers():
    env = {**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=REPO,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1] == "LOADED []", result.stdout


def test_certification_imports_nothing_of_the_run():
    """Read from the source, type-only and function-local imports included: the package imports only itself
    and the plain-numpy helpers, so nothing it imports can ever pull the trainer in."""
    graph = import_graph()
    modules = [m for m in graph if m == "hf_constrained.certification" or m.startswith("hf_constrained.certification.")]
    assert len(modules) >= 7, modules
    for module in modules:
        outside = {d for d in graph[module] if not d.startswith("hf_constrained.certification")} - ALLOWED
        assert not outside, f"{module} imports {sorted(outside)}"
    for helper in ALLOWED - {"hf_constrained"}:
        assert graph[helper] == set(), helper
