"""``benchmarks/roc_fairness_step_time.py`` with the look-ahead at a chosen ``lookahead_placement``.

The ROC step-time benchmark builds its trainers with the library's defaults; this runs it
unchanged except that every ``ConstrainedTrainingArguments`` it creates gets
``lookahead_placement=--placement``, so the placements can be compared with the same script.
Its ratios (each placement against the plain step of the same, interleaved run) are read
from the JSON it writes. ``--clock cpu`` (default) times steps in process CPU time instead of
the wall clock, as the other CPU benchmarks do (one torch thread: a step's CPU time barely
moves when other jobs share the cores).

    python benchmarks/roc_step_time_placements.py --placement before_backward -- \
        --widths 1024,1024 --steps 30 --warmup 5 --repeats 2 --out benchmarks/results/roc_step_time_before_fused_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import roc_fairness_step_time as bench  # noqa: E402
from common import write_json  # noqa: E402
from hf_constrained.config import LOOKAHEAD_PLACEMENTS, ConstrainedTrainingArguments  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--placement", choices=LOOKAHEAD_PLACEMENTS, required=True)
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                   help="step times from this process's CPU time (cpu: robust to other jobs on a shared machine "
                   "with one torch thread) or the wall clock (wall: the benchmark's own choice)")
    p.add_argument("rest", nargs=argparse.REMAINDER,
                   help="arguments of roc_fairness_step_time.py (after --; give --out to have the JSON annotated)")
    a = p.parse_args()
    rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    original = ConstrainedTrainingArguments.__post_init__

    def post_init(self: ConstrainedTrainingArguments) -> None:
        self.lookahead_placement = a.placement
        original(self)

    ConstrainedTrainingArguments.__post_init__ = post_init
    if a.clock == "cpu":  # the benchmark's timers read time.perf_counter: give them the process CPU time
        bench.time = SimpleNamespace(perf_counter=time.process_time)
    command = "python benchmarks/roc_step_time_placements.py " + " ".join(sys.argv[1:])
    bench.main(rest)
    out = rest[rest.index("--out") + 1] if "--out" in rest else None
    if out:  # record this command and the placement in the benchmark's JSON
        with open(out) as f:
            result = json.load(f)
        result.update(command=command, lookahead_placement=a.placement, clock=a.clock)
        write_json(out, result, echo=False)


if __name__ == "__main__":
    main()
