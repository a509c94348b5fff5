"""A safety report in words: its verdict table, its diagnostics and its one-line summary.

:class:`ReportText` is the text side of :class:`~hf_constrained.publishing.report.SafetyReport` (mixed into it:
``report.render()``, ``report.format_table(markdown=True)``, ``report.summary()``): the same tables in the
terminal, the log and the model card, with the verdict words of :meth:`SafetyReport.verdicts
<hf_constrained.publishing.report.SafetyReport.verdicts>` and the certificate's guarantee in words
(:func:`~hf_constrained.certification.certify.guarantee_sentence`).
"""

from __future__ import annotations

from typing import Any, Optional

from ..certification.certify import CONSTRAINT_ITSELF, guarantee_sentence

# the per-constraint verdict words (one set, from SafetyReport.verdicts)
CERTIFIED = "certified"
NOT_CERTIFIED = "not certified"
NOT_TESTED = "not tested"
NO_CERTIFICATION_SPLIT = "no certification split"
EXACT_HOLDS = "holds (exact, data-free)"
EXACT_FAILS = "fails (exact, data-free)"
HOLDS = "holds"
FAILS = "fails"


def format_number(value: Optional[float]) -> str:
    """How reports, tables and cards print a number (6 significant digits)."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:.6g}"


DIAGNOSTICS_CAPTION = ("Diagnostics (no verdict): the trained constraint h_k (the training surrogate), in its own "
                       "unit, on the rows named under 'data'; the upper bound is an asymptotic CLT bound, not a "
                       "certificate.")


def format_rows(rows: list[list[str]], markdown: bool) -> str:
    """A header and rows as an aligned plain-text table or a Markdown table."""
    if markdown:
        align = ["---"] + ["---:" if h != "verdict" else ":---" for h in rows[0][1:]]
        lines = ["| " + " | ".join(rows[0]) + " |", "|" + "|".join(align) + "|"]
        lines += ["| " + " | ".join(_escape_md(x) for x in r) + " |" for r in rows[1:]]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    numeric = [all(_is_number(r[i]) for r in rows[1:]) for i in range(len(rows[0]))]  # numbers align right
    fmt = "  ".join(("{:>%d}" if numeric[i] and i else "{:<%d}") % w for i, w in enumerate(widths))
    lines = [fmt.format(*rows[0]), "  ".join("-" * w for w in widths)]
    lines += [fmt.format(*r) for r in rows[1:]]
    return "\n".join(lines)


def _is_number(text: str) -> bool:
    head = text.split(" ", 1)[0]
    try:
        float(head)
    except ValueError:
        return head == "n/a"
    return True


def _cell(value: Any) -> str:
    return format_number(value) if value is None or isinstance(value, (int, float)) else str(value)


def _escape_md(text: str) -> str:
    return text.replace("|", "\\|")


class ReportText:
    """The text of a :class:`~hf_constrained.publishing.report.SafetyReport` (a mixin: every method reads the
    report's fields and its :meth:`verdicts`)."""

    def statistic_description(self, name: str) -> str:
        """What the certificate measures for constraint ``name`` (its unit)."""
        return (self.statistics.get(name) or {}).get("description") or CONSTRAINT_ITSELF

    @property
    def proxies(self) -> list[str]:
        """Certifiable constraints whose certified statistic is not the trained constraint itself."""
        return [k for k, v in self.statistics.items() if v.get("proxy")]

    def bound_header(self) -> str:
        """``upper bound (95% CLT)`` when every bound shares its level and method."""
        levels = {(c.confidence, c.bound_method) for c in self.constraints
                  if c.upper_bound is not None and c.bound_method != "exact"}
        if len(levels) == 1:
            confidence, method = next(iter(levels))
            if confidence is not None:
                return f"upper bound ({100 * confidence:.4g}%{' ' + method if method else ''})"
        return "upper bound"

    def table_rows(self) -> list[list[str]]:
        """Header + one row per constraint of the table that carries the verdict.

        Under ``"certified"``: the certified statistic (its unit), the old model's and the new
        model's value of it, the certified bound and the tolerance (all in that unit), the
        certification rows and the verdict. Under the uncertified rules: the held-out value of
        the constraint (old and new model), its CLT bound when any, the tolerance, the margin and
        the verdict, then the caller's extra columns.
        """
        verdicts = {v.name: v for v in self.verdicts()}
        if self.safety_rule == "certified":
            cert = self.certificate or {}
            delta = cert.get("delta")
            header = ["constraint", "certified statistic (unit of the next four columns)", "old model", "new model",
                      "certified bound" + (f" (delta {delta:g})" if delta is not None else ""), "tolerance",
                      "certification rows", "verdict"]
            rows = [header]
            bounds, values = self.certified_bounds(), self.certified_values()
            for c in self.constraints:
                word = verdicts[c.name].word
                if c.data == "data-free":
                    rows.append([c.name, "exact value (data-free: no sampling error)", format_number(c.old_value),
                                 format_number(c.value), format_number(c.value) + " (exact)",
                                 format_number(c.tolerance), "n/a", word])
                elif word == NO_CERTIFICATION_SPLIT:
                    rows.append([c.name, "none", "n/a", "n/a", "n/a", "n/a", "n/a", word])
                else:
                    stat = self.statistics.get(c.name) or {}
                    bound = bounds.get(c.name)
                    rows.append([c.name, self.statistic_description(c.name), format_number(stat.get("old_value")),
                                 format_number(values.get(c.name)),
                                 format_number(bound) + (f" ({cert['bound'][c.name]})" if bound is not None else ""),
                                 format_number(cert.get("tolerance", {}).get(c.name)),
                                 format_number(cert.get("num_rows", {}).get(c.name)), word])
            return rows
        show_bound = any(c.upper_bound is not None for c in self.constraints)
        show_margin = any(c.margin is not None for c in self.constraints)
        header = ["constraint", "old model", "new model (held-out value)"]
        header += ([self.bound_header()] if show_bound else []) + ["tolerance"]
        header += (["margin"] if show_margin else []) + ["verdict"] + list(self.extra_columns)
        rows = [header]
        for c in self.constraints:
            row = [c.name + (" (training data)" if c.data == "training" else ""), format_number(c.old_value),
                   format_number(c.value)]
            row += ([format_number(c.upper_bound)] if show_bound else []) + [format_number(c.tolerance)]
            row += ([format_number(c.margin)] if show_margin else []) + [verdicts[c.name].word]
            row += [_cell(c.extra.get(col)) for col in self.extra_columns]
            rows.append(row)
        return rows

    def diagnostic_rows(self) -> list[list[str]]:
        """Under ``"certified"``: header + one row per constraint of the diagnostics, which carry
        no verdict: the trained constraint h_k (the training surrogate) on its held-out rows, old
        and new model, its asymptotic CLT bound, the tolerance it was trained to, the margin and
        the caller's extra columns. Empty under the uncertified rules (their table shows these)."""
        if self.safety_rule != "certified" or all(c.data == "certification" for c in self.constraints):
            return []  # (a certification of a model trained elsewhere has no trained constraint to show)
        show_bound = any(c.upper_bound is not None and c.bound_method != "exact" for c in self.constraints)
        show_margin = any(c.margin is not None for c in self.constraints)
        header = ["constraint", "data", "old model", "new model"]
        header += ([self.bound_header()] if show_bound else []) + ["trained tolerance"]
        header += (["margin"] if show_margin else []) + list(self.extra_columns)
        rows = [header]
        for c in self.constraints:
            row = [c.name, c.data, format_number(c.old_value), format_number(c.value)]
            row += ([format_number(c.upper_bound if c.bound_method != "exact" else None)] if show_bound else [])
            row += [format_number(c.tolerance)] + ([format_number(c.margin)] if show_margin else [])
            row += [_cell(c.extra.get(col)) for col in self.extra_columns]
            rows.append(row)
        return rows

    def format_table(self, markdown: bool = False) -> str:
        """The verdict table (:meth:`table_rows`) as aligned plain text, or as a Markdown table."""
        return format_rows(self.table_rows(), markdown)

    def format_diagnostics(self, markdown: bool = False) -> str:
        """The diagnostics table (:meth:`diagnostic_rows`), with its caption; empty when there is none."""
        rows = self.diagnostic_rows()
        if not rows:
            return ""
        return f"{DIAGNOSTICS_CAPTION}\n\n{format_rows(rows, markdown)}" if markdown else \
            f"{DIAGNOSTICS_CAPTION}\n{format_rows(rows, markdown)}"

    def settings_line(self) -> str:
        """One line on the certificate's settings the run ended with (:attr:`settings`: the error level ``delta``,
        the safety rule, the candidates tested and the confidence of the CLT bounds shown); empty for a report that
        records none (one not made by the end of a run)."""
        settings = self.settings or {}
        parts = []
        if settings.get("delta") is not None:
            parts.append(f"delta {settings['delta']:g}")
        rule = settings.get("safety_rule")
        if rule:  # a report read under another rule (`hf-constrained report --rule`) says so
            parts.append(f"safety rule {rule}" + (f" (shown here by {self.safety_rule})" if self.safety_rule != rule
                                                  else ""))
        if settings.get("candidates"):
            parts.append("candidates: " + {"final": "the final model",
                                           "checkpoints": "every checkpoint, then the final model"}.get(
                settings["candidates"], str(settings["candidates"])))
        if settings.get("confidence") is not None:
            parts.append(f"CLT bounds at {100 * settings['confidence']:.4g}%")
        return ("Certificate settings: " + ", ".join(parts)) if parts else ""

    def render(self, markdown: bool = False) -> str:
        """The whole verdict as shown once: the one-line summary, the verdict table, the diagnostics and the
        certificate's settings."""
        parts = [self.summary(), self.format_table(markdown)]
        diagnostics = self.format_diagnostics(markdown)
        if diagnostics:
            parts.append(diagnostics)
        settings = self.settings_line()
        if settings:
            parts.append(settings)
        return "\n\n".join(parts)

    def certificate_summary(self) -> str:
        """One line on the certificate: CERTIFIED at delta (the guarantee: which statistic, which
        bound, delta, n, the population) or NOT CERTIFIED (why)."""
        cert = self.certificate
        if cert is None and self.statistics:
            return ("NOT CERTIFIED: these weights were evaluated, not certified (an evaluation during training); "
                    "finish_run or trainer.safety.build_report() certifies them on the certification rows")
        if cert is None:
            return ("NOT CERTIFIED: no constraint has a certification split (Constraint.certify), so nothing was "
                    "tested on data that training and selection never touched")
        names = list(cert.get("tolerance", {}))
        sentence = guarantee_sentence(cert["delta"], {k: self.statistic_description(k) for k in names},
                                      cert.get("bound", {}), cert.get("num_rows", {}), cert["num_candidates"],
                                      cert["procedure"])
        if self.certified:
            proxy = ("; the trained constraints themselves (the training surrogate) are not what is certified: "
                     "they are diagnostics" if self.proxies else "")
            return f"CERTIFIED at delta = {cert['delta']:g}: {sentence}{proxy}"
        reasons = []
        verdicts = self.with_rule("certified").verdicts()
        no_split = [v.name for v in verdicts if v.word == NO_CERTIFICATION_SPLIT]
        if no_split:
            reasons.append(f"no certification split for {', '.join(no_split)}")
        bounds, tolerance = self.certified_bounds(), cert.get("tolerance", {})
        above = [f"{v.name} ({format_number(bounds.get(v.name))} > {format_number(tolerance.get(v.name))})"
                 for v in verdicts if v.word == NOT_CERTIFIED]
        if above:
            reasons.append(f"certified bound above tolerance for {', '.join(above)}")
        exact = [v.name for v in verdicts if v.word == EXACT_FAILS]
        if exact:
            reasons.append(f"data-free constraint(s) above tolerance: {', '.join(exact)}")
        if not reasons:
            reasons.append("these weights were not tested (an earlier candidate failed in the fixed sequence)")
        return f"NOT CERTIFIED at delta = {cert['delta']:g}: {'; '.join(reasons)}"

    def headline(self) -> str:
        """The verdict in one short line, the first line of the card: e.g. "Certified: each protected set loses
        at most 3 points of exact match, delta 0.05, 2,000 rows each". The claim in words is the report's
        ``settings["claim"]`` where the run stated one (``hf-constrained certify`` does), else "every constraint
        within its tolerance"; :meth:`summary` is the long sentence (the guarantee, the bound, the population)."""
        n = len(self.constraints)
        if not n:
            return "Not checked: the report has no constraints"
        if self.safety_rule != "certified":
            if self.all_satisfied:
                return (f"Passes, not certified: all {n} constraint(s) hold on held-out data by the uncertified "
                        f"'{self.safety_rule}' rule")
            return f"Unsafe: {len(self.failed)} of {n} constraint(s) fail on held-out data"
        cert = self.certificate
        if cert is None:
            return "Not certified: no certification split, so nothing was tested on rows nothing else read"
        claim = (self.settings or {}).get("claim") or (
            f"each of the {n} constraints within its tolerance" if n > 1 else
            f"{self.constraints[0].name} within its tolerance")
        rows = sorted({int(r) for r in (cert.get("num_rows") or {}).values()})
        size = ("" if not rows else f", {rows[0]:,} rows" + (" each" if n > 1 else "") if len(rows) == 1
                else f", {rows[0]:,}-{rows[-1]:,} rows per constraint")
        if self.certified:
            return f"Certified: {claim}, delta {cert['delta']:g}{size}"
        failing = [v.name for v in self.with_rule("certified").verdicts() if not v.passes]
        return f"Not certified: not shown that {claim} ({', '.join(failing)} failed), delta {cert['delta']:g}{size}"

    def summary(self) -> str:
        """One line: the verdict under :attr:`safety_rule` (CERTIFIED / NOT CERTIFIED, or, by an
        uncertified rule, PASSES (NOT CERTIFIED) / UNSAFE), with the reasons."""
        n = len(self.constraints)
        if not n:
            return "NOT CHECKED: the report has no constraints, so it shows nothing about the model's safety"
        if self.safety_rule == "certified":
            return self.certificate_summary()
        caveat = ""
        if self.not_held_out:
            caveat = (f"; {len(self.not_held_out)} constraint(s) have no held-out data and were checked on their "
                      f"training data: {', '.join(self.not_held_out)}")
        if self.safety_rule == "upper_bound":
            judged = "their CLT upper confidence bounds (asymptotic)"
            if self.without_bound:
                caveat += (f"; {len(self.without_bound)} constraint(s) have no confidence bound and were judged on "
                           f"their value: {', '.join(self.without_bound)}")
        else:
            judged = "the point estimate"
        if self.all_satisfied:
            return (f"PASSES, NOT CERTIFIED (uncertified '{self.safety_rule}' rule): all {n} constraints hold on "
                    f"held-out data, judged by {judged} (max violation {format_number(self.max_violation)}){caveat}")
        return (f"UNSAFE: {len(self.failed)} of {n} constraints fail on held-out data by the uncertified "
                f"'{self.safety_rule}' rule, judged by {judged} (max violation {format_number(self.max_violation)}): "
                f"{', '.join(self.failed)}{caveat}")


__all__ = ["CERTIFIED", "DIAGNOSTICS_CAPTION", "EXACT_FAILS", "EXACT_HOLDS", "FAILS", "HOLDS", "NOT_CERTIFIED",
           "NOT_TESTED", "NO_CERTIFICATION_SPLIT", "ReportText", "format_number", "format_rows"]
