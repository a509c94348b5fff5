"""The ledger of looks: every certificate computed on a certification split spends its error budget.

A certificate holds with probability at least ``1 - delta`` over its certification sample. A
second certificate on the same rows (a retrained model, another beta, the gate re-certifying
changed weights, a demo certifying three models) is a second test on the same sample: "retrain
until CERTIFIED" on one split fails with probability well above ``delta``. So each split (known
by its fingerprint, :func:`~hf_constrained.certification.splits.split_fingerprint`) keeps a ledger of
the certificates computed on it, and look ``j`` is tested at ``delta_j`` of a spending schedule
with ``sum_j delta_j <= delta`` (alpha spending; Bonferroni over looks): with probability at
least ``1 - delta``, every claim ever certified on the split is true, however the later models
were chosen. A schedule may also refuse a look once its budget is spent (:class:`LookRefused`):
then only fresh certification rows can certify.

- :class:`GeometricSpending` (the default): ``delta_j = delta * 0.9 * 0.1^(j-1)`` (0.9 of the
  budget at the first look, where almost every release is certified; a retrained model pays ten
  times more at each further look), refused after ``max_looks`` looks. ``ratio=0.5`` spreads it
  as ``delta * 2^-j``.
- :class:`SingleLook`: the whole ``delta`` at the first look, every later look refused. For
  users who certify once and want the full budget there.

**Where the ledger lives.** Two JSON files, read together (a look recorded in either counts)
and both updated: the user-level ledger (``$HF_CONSTRAINED_LEDGER``, default
``~/.cache/hf_constrained/certification_ledger.json``), which counts looks across runs and
output directories on this machine, and ``certification_ledger.json`` in the run's output
directory, which travels with the run. They hold split fingerprints, look numbers, the deltas
spent, the row-order seeds and hashes of the values a look read: no path, no data.

**A repeated identical look is free.** A look is keyed by a hash of everything that decides its
outcome (the split, the constraints' names, tolerances, ranges and bounds, the procedure, the
budget, every candidate's per-row values and, where the caller gives it, every candidate's identity: the
trainer gives its weights' fingerprint): computing the same certificate again (the same weights, a
report written twice) reuses the recorded look, its delta and its row-order seed, so it gives the
same answer and spends nothing; another model is another look, even with the same per-row values.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Optional, Protocol, Union

from ..atomic_files import atomic_write_json

logger = logging.getLogger(__name__)

LEDGER_ENV = "HF_CONSTRAINED_LEDGER"
"""Environment variable: the path of the user-level ledger."""

LEDGER_FILE = "certification_ledger.json"
"""The ledger's file name in a run's output directory."""

_FORMAT = 1


def user_ledger_path() -> str:
    """The user-level ledger: ``$HF_CONSTRAINED_LEDGER``, else
    ``$XDG_CACHE_HOME/hf_constrained/certification_ledger.json`` (``~/.cache`` by default)."""
    env = os.environ.get(LEDGER_ENV)
    if env:
        return env
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "hf_constrained", LEDGER_FILE)


@contextlib.contextmanager
def user_ledger_at(path: str) -> Iterator[None]:
    """Inside the block, count looks in the ledger file ``path`` instead of the user-level one (a study whose
    every run is one simulated release, certified as its first look); the setting before is restored after."""
    before = os.environ.get(LEDGER_ENV)
    os.environ[LEDGER_ENV] = path
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(LEDGER_ENV, None)
        else:
            os.environ[LEDGER_ENV] = before


class LookRefused(ValueError):
    """A certification split's error budget is spent: no further certificate on it."""


class Spending(Protocol):
    """How a split's budget ``delta`` is spent over its looks (``look`` = 1, 2, ...)."""

    name: str

    def level(self, delta: float, look: int) -> Optional[float]:
        """``delta_j`` of look ``look``, or ``None`` when the look is refused."""


@dataclass(frozen=True)
class GeometricSpending:
    """``delta_j = delta * (1 - ratio) * ratio^(j - 1)``; the sum over all looks is ``delta``.

    The default ``ratio = 0.1`` keeps 0.9 of the budget for the first look, since a release is
    normally certified once; each further look (a retrained model, another candidate run) gets a
    tenth of the one before. Looks after ``max_looks`` are refused (their levels say nothing any
    more: ``delta * 1e-5`` at the sixth look)."""

    ratio: float = 0.1
    max_looks: int = 6

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio < 1.0:
            raise ValueError(f"GeometricSpending: ratio must be in (0, 1), got {self.ratio}")
        if self.max_looks < 1:
            raise ValueError(f"GeometricSpending: max_looks must be >= 1, got {self.max_looks}")

    @property
    def name(self) -> str:
        return f"geometric alpha spending, delta_j = delta * {1 - self.ratio:g} * {self.ratio:g}^(j-1)"

    def level(self, delta: float, look: int) -> Optional[float]:
        if look > self.max_looks:
            return None
        return delta * (1.0 - self.ratio) * self.ratio ** (look - 1)


@dataclass(frozen=True)
class SingleLook:
    """The whole budget at the first look; every later look is refused."""

    name: str = "single look (the whole delta at the first look, later looks refused)"

    def level(self, delta: float, look: int) -> Optional[float]:
        return delta if look == 1 else None


@dataclass(frozen=True)
class Look:
    """One certificate's use of one split, as recorded."""

    fingerprint: str
    look: int
    budget: float
    delta_spent: float
    spending: str
    key: str
    order_seed: Optional[int]
    constraints: tuple[str, ...]
    time: str

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["constraints"] = list(self.constraints)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Look":
        seed = data.get("order_seed")
        return cls(fingerprint=str(data["fingerprint"]), look=int(data["look"]), budget=float(data["budget"]),
                   delta_spent=float(data["delta_spent"]), spending=str(data.get("spending", "")),
                   key=str(data["key"]), order_seed=None if seed is None else int(seed),
                   constraints=tuple(data.get("constraints") or ()), time=str(data.get("time", "")))


def look_key(parts: Sequence[Any]) -> str:
    """``sha256:<hex>`` of a look's identity (strings, numbers and numpy arrays, in order)."""
    digest = hashlib.sha256()
    for part in parts:
        tobytes = getattr(part, "tobytes", None)
        if callable(tobytes):
            digest.update(f"a{getattr(part, 'dtype', '')}{getattr(part, 'shape', '')}".encode())
            digest.update(tobytes())
        else:
            digest.update(f"v{part!r}".encode())
        digest.update(b"|")
    return "sha256:" + digest.hexdigest()


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive lock beside ``path`` for a read-modify-write (POSIX; elsewhere none)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(path + ".lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read(path: str) -> dict[str, list[dict[str, Any]]]:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as err:
        raise ValueError(f"the certification ledger {os.path.basename(path)} cannot be read ({err}); it counts the "
                         "certificates computed on each certification split, so it is never overwritten: repair or "
                         f"move it (set {LEDGER_ENV} for the user-level one)") from err
    return {fp: list(looks) for fp, looks in (data.get("splits") or {}).items()}


def _write(path: str, splits: Mapping[str, list[dict[str, Any]]]) -> None:
    """Atomic: a reader sees the old ledger or the new one, never a partial file."""
    atomic_write_json(path, {"format": _FORMAT, "splits": splits}, indent=1, sort_keys=True)


class CertificationLedger:
    """The looks recorded on each certification split, in one or more JSON files read together.

    Args:
        paths: the ledger files (a look in any of them counts; new looks go into all).
        spending: the schedule (default :class:`GeometricSpending`).
    """

    def __init__(self, paths: Sequence[Union[str, os.PathLike]], spending: Optional[Spending] = None) -> None:
        if not paths:
            raise ValueError("a certification ledger needs at least one file")
        self.paths = [os.fspath(p) for p in paths]
        self.spending: Spending = spending if spending is not None else GeometricSpending()

    @classmethod
    def for_run(cls, output_dir: Optional[str] = None, spending: Optional[Spending] = None,
                user_level: bool = True) -> "CertificationLedger":
        """The user-level ledger (:func:`user_ledger_path`) and, with ``output_dir``, the run's own."""
        paths = [user_ledger_path()] if user_level else []
        if output_dir:
            paths.append(os.path.join(output_dir, LEDGER_FILE))
        return cls(paths, spending)

    def looks(self, fingerprint: str) -> list[Look]:
        """The looks recorded on a split, in look order (one per key, over all files)."""
        seen: dict[str, Look] = {}
        for path in self.paths:
            for record in _read(path).get(fingerprint, []):
                look = Look.from_dict(record)
                seen.setdefault(look.key, look)
        return sorted(seen.values(), key=lambda x: x.look)

    def spend(self, fingerprints: Mapping[str, Sequence[str]], key: str, delta: float,
              order_seed: Optional[int]) -> dict[str, Look]:
        """Record one look on each split (fingerprint -> the constraints certified on it) and return
        each split's :class:`Look`: its number, the budget and the delta it may spend. A look with
        a recorded ``key`` is the same look again (nothing more is spent). Raises
        :class:`LookRefused` (recording nothing) when the schedule refuses a look."""
        with contextlib.ExitStack() as stack:
            for path in self.paths:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                stack.enter_context(_locked(path))
            files = {path: _read(path) for path in self.paths}
            out: dict[str, Look] = {}
            for fp, names in fingerprints.items():
                previous: dict[str, Look] = {}
                for splits in files.values():
                    for record in splits.get(fp, []):
                        look = Look.from_dict(record)
                        previous.setdefault(look.key, look)
                if key in previous:
                    out[fp] = previous[key]
                    continue
                number = 1 + max((look.look for look in previous.values()), default=0)
                # the budget is fixed at the split's first look: a later, larger delta cannot add to it
                first = min(previous.values(), key=lambda x: x.look) if previous else None
                budget = first.budget if first is not None else float(delta)
                if first is not None and budget != float(delta):
                    logger.warning("certification split %s: its error budget was set to delta=%g at its first look; "
                                   "this look spends from that budget, not from delta=%g", fp[:23], budget, delta)
                level = self.spending.level(budget, number)
                if level is None:
                    raise LookRefused(
                        f"certification split {fp[:23]}... of constraint(s) {list(names)} has been certified on "
                        f"{number - 1} time(s) already and its error budget (delta={budget:g}, "
                        f"{self.spending.name}) is spent: a further certificate on the same rows would void the "
                        "guarantee of every certificate computed on them. Certify on fresh certification rows "
                        "(a new Certification(dataset=...) that no training, selection or earlier certificate has "
                        "read)")
                out[fp] = Look(fingerprint=fp, look=number, budget=budget, delta_spent=float(level),
                               spending=self.spending.name, key=key, order_seed=order_seed,
                               constraints=tuple(names),
                               time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
            for path, splits in files.items():
                changed = False
                for fp, look in out.items():
                    records = splits.setdefault(fp, [])
                    if not any(r.get("key") == look.key for r in records):
                        records.append(look.to_dict())
                        changed = True
                if changed:
                    _write(path, splits)
        return out


__all__ = [
    "LEDGER_ENV",
    "LEDGER_FILE",
    "CertificationLedger",
    "GeometricSpending",
    "Look",
    "LookRefused",
    "SingleLook",
    "Spending",
    "look_key",
    "user_ledger_at",
    "user_ledger_path",
]
