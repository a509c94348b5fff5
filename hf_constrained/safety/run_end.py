"""The end of a run: the certificate, the safety report, the card, the trainer state and the figures.

:class:`RunEnd` is the part of :class:`~hf_constrained.safety.loop.SafetyLoop` (``trainer.safety``) that ends a
run (mixed into it): :meth:`RunEnd.finish` under the loop's
:class:`~hf_constrained.safety.settings.CertificateSettings`, and the certificate over every checkpoint
(:meth:`RunEnd.certify_checkpoints`: fixed-sequence testing in training order, Learn-Then-Test of
Angelopoulos et al. 2021). ``finish_run(trainer, ...)`` (:mod:`hf_constrained.safety.finish`) calls it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any, Optional

from ..certification.certify import Certificate, best_certified
from ..certification.selection import evaluation_records, metric_key
from ..checkpointing import checkpoint_folders, is_complete_checkpoint
from ..extras import install_hint
from ..publishing.figures import figures_available, plot_log_history, require_figures
from ..publishing.report import SafetyReport
from .evaluation import certified_statistics, checkpoint_step, old_model_constraint_values
from .model_fingerprint import weights_fingerprint
from .settings import CertificateSettings

logger = logging.getLogger(__name__)


class RunEnd:
    """Ending a run, for the weights in the model (a part of :class:`~hf_constrained.safety.loop.SafetyLoop`:
    it reads the loop's view, host and settings and calls its evaluations)."""

    settings: CertificateSettings

    def finish(self, settings: Optional[CertificateSettings] = None, *, old_model: Optional[Any] = None,
               old_model_values: Optional[Mapping[str, float]] = None,
               objective_metrics: Optional[Mapping[str, float]] = None,
               extra_columns: Optional[Mapping[str, Mapping[str, Any]]] = None, show: bool = True) -> SafetyReport:
        """End the run: certify, evaluate and write ``safety_report.json``, the card (``README.md``),
        ``trainer_state.json`` and, with ``settings.plots``, the figures into the output directory.

        ``settings`` (default: the loop's own) become the loop's settings, so the pushes after it are judged by
        the same rule. ``old_model`` / ``old_model_values``: the old model (or its constraint values) for the
        "old model" column; ``objective_metrics``: held-out objective metrics, when ``trainer.evaluate()`` is
        not the right way to get them; ``extra_columns``: per-constraint columns, ``{column: {name: value}}``;
        ``show``: log the verdict once (``False`` when the caller shows ``report.render()`` itself).
        """
        if settings is not None:
            self.settings = settings
        settings = self.settings
        view, host = self.view, self.host
        plots = settings.plots
        if plots:
            require_figures()  # asked for: fail before anything is written
        elif plots is None:
            plots = figures_available()
            if not plots:
                logger.warning("no training-curve figures: matplotlib is not installed (%s); the report and the card "
                               "are written without them", install_hint("figures"))
        old = old_model_constraint_values(view, host, old_model, old_model_values)
        if old is not None:
            self.reference_values = old
        certificate, candidate, released, fingerprint = None, 0, None, None
        if settings.candidates == "checkpoints":
            fingerprint = weights_fingerprint(host.model)  # the final weights, hashed once for the ledger and report
            certificate, candidate, released = self.certify_checkpoints(settings.delta, fingerprint)
            if released is not None:
                fingerprint = None  # a checkpoint's weights replaced them: the report hashes those
        report = self.new_report(objective_metrics=objective_metrics, extra_columns=extra_columns,
                                 certificate=certificate, certificate_candidate=candidate, checkpoint=released,
                                 statistics=certified_statistics(view, host, old_model), fingerprint=fingerprint)
        if released is not None:
            report.global_step = checkpoint_step(released)
        report.settings = settings.to_dict()  # saved with the run: what the certificate was asked to claim
        self.set_report(report)
        if host.is_world_process_zero():
            self._write_run_files(report, plots, show)
        return report

    def _write_run_files(self, report: SafetyReport, plots: bool, show: bool) -> None:
        out = self.view.output_dir
        os.makedirs(out, exist_ok=True)
        self.save_report(report, out)  # names the weight files in ``out`` when saved from these weights
        self.write_model_card(out, report=report)
        self.host.save_state()
        if plots:
            try:
                plot_log_history(self.host.state.log_history, os.path.join(out, "figures"), report=report,
                                 title=report.model_name)
            except ValueError as exc:  # nothing to plot must not lose the report written above
                logger.warning("no training-curve figures: %s", exc)
        if show:  # the verdict, shown once: its line, the verdict table and the diagnostics
            (logger.info if report.all_satisfied else logger.warning)("%s", report.render())

    def certify_checkpoints(self, delta: float, current: Optional[str] = None
                            ) -> tuple[Optional[Certificate], int, Optional[str]]:
        """Certify every complete checkpoint of the output directory in training order (then the final weights
        when they are none of them) and load the released one into the trainer: the certified candidate with
        the best selection-split objective, else the final weights. ``current``: the weights fingerprint of the
        trainer's weights, where the caller has it. Returns the certificate, the released candidate's index and,
        when the trainer's weights were replaced, the checkpoint they now come from."""
        args, state, model = self.view.args, self.host.state, self.host.model
        # training order (checkpoint_folders lists the newest first)
        folders = [f for f in reversed(checkpoint_folders(args.output_dir)) if is_complete_checkpoint(f)]
        current = current if current is not None else weights_fingerprint(model)
        fingerprints: list[Optional[str]] = []

        def models() -> Iterator[Any]:
            for folder in folders:  # one copy of the model at a time
                candidate = self.checkpoint_model(folder)
                fingerprints.append(weights_fingerprint(candidate))
                yield candidate
            if current not in fingerprints:
                fingerprints.append(current)
                yield None  # the model in the trainer

        # the generator fills ``fingerprints`` before it yields each model: the ledger's identities are not hashed
        certificate = self.certify(models(), delta=delta, procedure="fixed_sequence", fingerprints=fingerprints)
        if certificate is None:
            return None, 0, None
        steps = [checkpoint_step(f) for f in folders] + ([state.global_step] if len(fingerprints) > len(folders)
                                                         else [])
        final = fingerprints.index(current)
        key = args.metric_for_best_model
        objective: list[Optional[float]] = [None] * len(steps)
        if key is not None:
            by_step = {r.step: r.metric for r in evaluation_records(state.log_history, metric_key(key))}
            objective = [by_step.get(s) for s in steps]
        release = best_certified(certificate, objective, bool(args.greater_is_better))
        if release is None or release == final:
            return certificate, final, None
        logger.info("releasing %s: the certified checkpoint with the best selection objective", folders[release])
        model.load_state_dict(self.checkpoint_model(folders[release]).state_dict())
        return certificate, release, folders[release]


__all__ = ["RunEnd"]
