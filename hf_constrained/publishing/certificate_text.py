"""A non-forgetting certificate for a results file and in words a newcomer reads.

:func:`certificate_record` turns a :class:`~hf_constrained.certification.certify.Certificate` of one model (the
kept one) into the plain record a results file stores: certified or not, the largest bound, the constraints not
certified, and per constraint its exact bound, the share of its certification rows forgotten and their number,
with the level of the look it spent (the ledger of looks, :mod:`hf_constrained.certification.ledger`).
:func:`certificate_paragraph` says that record in words: the verdict against the requirement stated before the
run, the tightest claim the data allow ("no protected class loses more than X points", valid at 1 - delta:
the class that loses most is one fixed class, and its bound is at most X), why the claim is not tighter (a
fixed data set) or why its split has the size it has (a generator), and why a later look at the same rows is
tested at a smaller level.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from ..certification.bounds import most_forgotten_that_certify
from ..certification.certify import Certificate, rows_needed

__all__ = ["certificate_paragraph", "certificate_record"]


def certificate_record(certificate: Optional[Certificate], names: Sequence[str]) -> dict[str, Any]:
    """The certificate of candidate 0 (one model) as a results file stores it: ``certified``,
    ``largest_bound``, ``failing`` (the constraints not certified, those of ``names`` without certification rows
    included), per constraint ``bounds``, ``forgotten`` (the statistic's value: the share of certification rows
    forgotten) and ``rows``, then ``tolerance``, ``delta``, ``level`` (the error level this look at the split
    was tested at) and ``look``. Without a certificate: not certified, every constraint of ``names`` failing."""
    if certificate is None:
        return {"certified": False, "largest_bound": None, "failing": list(names), "bounds": {}, "forgotten": {},
                "rows": {}, "delta": None}
    bounds = certificate.upper_bounds[0]
    failing = certificate.failing(0) + [n for n in names if n not in bounds]  # no certification split: not certified
    return {"certified": certificate.is_certified(0) and not failing,
            "largest_bound": max(bounds.values()), "failing": failing, "bounds": bounds,
            "forgotten": certificate.values[0], "rows": certificate.num_rows, "tolerance": certificate.tolerance,
            "delta": certificate.delta, "level": certificate.level,  # the level this look at the split was tested at
            "look": max(certificate.looks.values(), default=1)}


def _wrapped(text: str) -> list[str]:
    return textwrap.wrap(text, 100, initial_indent="  ", subsequent_indent="  ")


def _why_not_tighter(n: int, level: float, noun: str, tolerance: float, supply: Optional[str],
                     supply_flag: str) -> str:
    """Why the claim on ``n`` rows per class tested at ``level`` is no tighter (a fixed data set: ``supply`` says
    why it has no more rows) or why the split has its size (a generator, whose ``supply_flag`` sets how many rows
    it draws)."""
    if supply is not None:  # a fixed data set: what it cannot support, and why
        floor = 100 * (1 - level ** (1 / n))
        # the fewest images with none forgotten whose Clopper-Pearson bound reaches 3 points
        n_three = rows_needed("clopper_pearson", (0.0, 1.0), 0.03, level)
        return (f"Why not tighter: with {n} images and none forgotten the bound is still {floor:.1f} "
                f"points; a 3-point claim needs at least {n_three} images per {noun} with none forgotten, and "
                f"{supply}.")
    most = most_forgotten_that_certify(n, tolerance, level)
    needed = rows_needed("clopper_pearson", (0.0, 1.0), tolerance, level)
    return (f"Why {n} images per {noun}: a {100 * tolerance:g}-point claim needs at least "
            f"{needed} with none forgotten; {n} certify it with "
            f"up to {most} forgotten ({100 * most / n:.1f}%), and the generator draws as many as the "
            f"claim needs ({supply_flag}; docs/generated_images.md).")


def certificate_paragraph(cert: Mapping[str, Any], *, noun: str, tolerance: float, delta: float,
                          supply: Optional[str] = None, supply_flag: str = "") -> list[str]:
    """The lines that say a :func:`certificate_record` of a non-forgetting claim in words: "every protected
    ``noun`` loses at most 100 x ``tolerance`` points of accuracy" (the share of its certification images
    forgotten bounds its accuracy drop from above), tested per protected class with an exact Clopper-Pearson
    bound at the look's level within the budget ``delta``; a model is certified when every class passes
    (intersection-union, no correction across classes). ``supply``: for a fixed data set, why it has no more
    rows (the paragraph then says why the claim is not tighter); ``None`` for a generator, whose ``supply_flag``
    sets how many rows it draws (the paragraph then says why the split has its size)."""
    rows = cert.get("rows") or {}
    if not rows:
        return ["Certificate: none (--certify_fraction 0: no certification images)."]
    sizes = sorted(rows.values())
    n_text = f"{sizes[0]}" if sizes[0] == sizes[-1] else f"{sizes[0]}-{sizes[-1]}"
    worst = max(cert["bounds"], key=cert["bounds"].get)
    requirement = f"every protected {noun} loses at most {100 * tolerance:g} points of accuracy"
    level = cert.get("level", delta)
    look = f"look {cert.get('look', 1)} at these images, tested at {level:.3g} of the budget delta {delta:g}"
    lines = textwrap.wrap(f"Certificate (exact Clopper-Pearson bound, {look}, on {n_text} held-out images per "
                          f"protected {noun}; a model is certified when every {noun} passes, each tested at that "
                          "level):", 100)
    if cert["certified"]:
        verdict = f"CERTIFIED: {requirement} (the requirement, stated before the run)."
    else:
        failing = ", ".join(k.split("/", 1)[-1] for k in cert["failing"])
        verdict = f"NOT CERTIFIED: the requirement ({requirement}) is not shown for {failing}."
    lines += _wrapped(verdict)
    lines += _wrapped(f"With probability >= {1 - delta:g}: no protected {noun} loses more than "
                      f"{100 * cert['largest_bound']:.1f} points (the largest bound: {worst.split('/', 1)[-1]}, "
                      f"{round(cert['forgotten'][worst] * rows[worst])} of {rows[worst]} images forgotten).")
    lines += _wrapped(_why_not_tighter(sizes[0], level, noun, tolerance, supply, supply_flag))
    looks = int(cert.get("look", 1))
    if looks > 1:  # a newcomer who tried a flag sees a smaller level and should know why, and the way out
        earlier = f"{looks - 1} time{'s' if looks > 2 else ''}"
        lines += _wrapped(
            f"Why look {looks}: these certification images were certified on {earlier} before (other settings or "
            f"penalties on the same split, counted by the certification ledger), and all looks share the one "
            f"budget delta {delta:g} so that retrying until a run certifies cannot void the guarantee; "
            "another --seed draws a fresh split that starts at look 1.")
    return lines
