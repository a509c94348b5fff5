"""``hf-constrained report RUN_DIR --check``: does the report in RUN_DIR still vouch for its weights?

:func:`check_run_dir` is the one place that turns a folder into an exit status:

- ``0`` (:data:`EXIT_CERTIFIED`): the report is intact, describes the weight files next to it
  (or there are none: it describes weights that were evaluated in memory), and every
  constraint holds under the rule;
- ``1`` (:data:`EXIT_NOT_CERTIFIED`): the report is intact and current, and a constraint fails;
- ``2`` (:data:`EXIT_STALE_OR_UNREADABLE`): the verdict cannot be trusted: no report, a
  report that cannot be read, that was edited after it was written (its ``content_digest``
  does not match its content), that holds no constraints, or whose weights are not the
  files in the folder (replaced, missing, or never recorded by the report).

The verdict is recomputed from the stored numbers (values, bounds, tolerances, rule), never
read from a stored boolean. This module reads files only: no torch, no transformers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

from ..certification.certify import certified_candidates
from ..certification.fingerprint import weights_files_fingerprint
from .report import CONTENT_DIGEST_KEY, SAFETY_REPORT_NAME, SafetyReport, report_content_digest

EXIT_CERTIFIED = 0
EXIT_NOT_CERTIFIED = 1
EXIT_STALE_OR_UNREADABLE = 2


@dataclass
class CheckResult:
    """What :func:`check_run_dir` found: the exit status, a one-line message and the report
    (``None`` when it could not be read)."""

    exit_code: int
    message: str
    report: Optional[SafetyReport] = None


def _stale(message: str, report: Optional[SafetyReport] = None) -> CheckResult:
    return CheckResult(EXIT_STALE_OR_UNREADABLE, message, report)


def check_run_dir(run_dir: str, rule: Optional[str] = None) -> CheckResult:
    """Check the safety report of ``run_dir`` (an output or ``checkpoint-N`` folder) against the
    files there; ``rule`` (``"point"`` / ``"upper_bound"``) overrides the report's own rule.

    See the module docstring for the exit statuses. Never raises for a bad folder or file:
    every problem is an exit status 2 with a message naming the file.
    """
    path = os.path.join(run_dir, SAFETY_REPORT_NAME) if os.path.isdir(run_dir) else run_dir
    folder = os.path.dirname(path) or "."
    if not os.path.isfile(path):
        return _stale(f"no safety report at {path}: finish_run(trainer, ...) writes one into the output directory, "
                      "and every checkpoint evaluated during training gets its own")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        return _stale(f"{path} cannot be read as JSON ({exc})")
    if not isinstance(data, dict):
        return _stale(f"{path} is not a safety report (a JSON {type(data).__name__})")
    stored_digest = data.get(CONTENT_DIGEST_KEY)
    if stored_digest is None:
        return _stale(f"{path} has no {CONTENT_DIGEST_KEY}: it was not written by this version of hf_constrained "
                      "(or was written by hand), so it cannot be verified; evaluate again (finish_run or "
                      "trainer.safety.build_report) to write a verifiable report")
    if stored_digest != report_content_digest(data):
        return _stale(f"{path} was edited after it was written (its {CONTENT_DIGEST_KEY} does not match its "
                      "content): its verdict cannot be trusted; evaluate again to write a new report")
    try:
        report = SafetyReport.from_dict(data)
        if rule is not None:
            report = report.with_rule(rule)
    except ValueError as exc:
        return _stale(f"{path}: {exc}")
    if not report.checked:
        return _stale(f"{path} holds no constraints: there is nothing to check, so it cannot pass --check "
                      "(was the trainer given its constraints?)", report)
    # the verdict is the stored numbers' under the stored rule; a stored boolean that disagrees is an edit
    stored_verdict = data.get("all_satisfied")
    if rule is None and stored_verdict is not None and bool(stored_verdict) != report.all_satisfied:
        return _stale(f"{path} says all_satisfied={stored_verdict}, but its values and tolerances say "
                      f"{report.all_satisfied}: the file was edited; evaluate again", report)
    cert = data.get("certificate")
    if isinstance(cert, dict) and sorted(cert.get("certified", [])) != certified_candidates(cert):
        return _stale(f"{path} lists certified candidates {cert.get('certified')}, but its bounds and tolerances "
                      f"certify {certified_candidates(cert)}: the file was edited; evaluate again", report)
    if report.weights_folder is not None:  # the weights are in another folder the report names
        if weights_files_fingerprint(folder) is not None:
            return _stale(f"{folder} holds weight files, but {path} describes the weights in "
                          f"{report.weights_folder}: certify the folder that holds them", report)
        folder = weights_folder(report, os.path.dirname(path) or ".")
        if not os.path.isdir(folder):
            return _stale(f"{path} describes the weights in {folder}, which is not there (moved or deleted)", report)
    try:
        files_now = weights_files_fingerprint(folder)
    except (OSError, ValueError) as exc:
        return _stale(f"the weight files in {folder} cannot be read ({exc})", report)
    recorded = report.weights_files_fingerprint
    if recorded is None and files_now is not None:
        return _stale(f"{path} does not record the weight files in {folder}: it may describe other weights "
                      "(saved elsewhere, or replaced since); evaluate these files again "
                      "(trainer.safety.build_report(checkpoint=DIR))", report)
    if recorded is not None and files_now is None:
        return _stale(f"the weights that {path} describes are missing from {folder}", report)
    if recorded != files_now:
        return _stale(f"the weight files in {folder} changed after {path} was written (recorded {recorded}, "
                      f"now {files_now}): the report no longer describes them; evaluate them again "
                      "(trainer.safety.build_report(checkpoint=DIR))", report)
    where = ("the report is intact; no weight files here: it describes weights evaluated in memory"
             if files_now is None else "the report is intact and describes the weight files next to it"
             if report.weights_folder is None else f"the report is intact and describes the weight files in {folder}")
    # the message is the report's own verdict line, nothing prefixed that could contradict it
    if report.all_satisfied:
        return CheckResult(EXIT_CERTIFIED, f"{report.summary()} ({where})", report)
    return CheckResult(EXIT_NOT_CERTIFIED, report.summary(), report)


def weights_folder(report: SafetyReport, report_dir: str) -> str:
    """The folder of the weights a report describes: its ``weights_folder`` (relative to ``report_dir``, the
    report's folder, unless absolute), else ``report_dir`` itself."""
    if report.weights_folder is None:
        return report_dir
    return os.path.normpath(os.path.join(report_dir, report.weights_folder))


__all__ = ["EXIT_CERTIFIED", "EXIT_NOT_CERTIFIED", "EXIT_STALE_OR_UNREADABLE", "CheckResult", "check_run_dir",
           "weights_folder"]
