"""Runs of an experiment in worker processes (one seed each, say), and the CPU time they took.

:func:`map_in_processes` calls a top-level function on every job in spawned processes and yields the results in
the jobs' order as they come, so a caller can print each seed's lines as soon as that seed and those before it
are done; :func:`cpu_seconds` is this process's CPU time plus that of its ended worker processes.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import resource
import time
from collections.abc import Iterator, Sequence
from typing import Any, Callable

__all__ = ["cpu_seconds", "map_in_processes"]


def map_in_processes(fn: Callable[..., Any], jobs: Sequence[tuple[Any, ...]], workers: int) -> Iterator[Any]:
    """``fn(*job)`` for every job of ``jobs``, in ``min(workers, len(jobs))`` spawned processes (a fresh
    interpreter each: nothing of the caller's state but the job's arguments; ``fn`` must be importable,
    i.e. top-level), yielded in the jobs' order. The processes end when the last result is read."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(workers, len(jobs)), mp_context=context) as pool:
        yield from pool.map(fn, *zip(*jobs))


def cpu_seconds() -> float:
    """CPU seconds of this process and of its ended child processes (user and system time)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime
