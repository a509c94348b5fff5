"""``hf-constrained``: the command line.

    hf-constrained report RUN_DIR [--json] [--check]   print the safety table of a run or checkpoint
    hf-constrained plot RUN_DIR [--out DIR]            write constraints.png and objective.png
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Optional, Sequence

from .safety import SAFETY_REPORT_NAME, SafetyReport, format_number


def find_trainer_state(run_dir: str) -> str:
    """``RUN_DIR/trainer_state.json``, else the one of the latest checkpoint in RUN_DIR."""
    path = os.path.join(run_dir, "trainer_state.json")
    if os.path.isfile(path):
        return path
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(run_dir) if os.path.isdir(run_dir) else None
    if last is not None and os.path.isfile(os.path.join(last, "trainer_state.json")):
        return os.path.join(last, "trainer_state.json")
    raise FileNotFoundError(
        f"no trainer_state.json in {run_dir} or its checkpoints: pass a Trainer output directory "
        "(finish_run / trainer.save_state() write it) or a checkpoint-N directory"
    )


def _report(args: argparse.Namespace) -> int:
    report = SafetyReport.load(args.run_dir)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        where = f"step {report.global_step}" if report.global_step is not None else "unknown step"
        if report.checkpoint:
            where += f", weights from {report.checkpoint}"
        print(f"Safety report: {os.path.join(args.run_dir, SAFETY_REPORT_NAME)} ({report.split} data, {where})")
        print()
        print(report.format_table())
        print()
        if report.objective_metrics:
            print("Objective metrics (held-out): " + ", ".join(
                f"{k} = {format_number(v)}" for k, v in report.objective_metrics.items()))
        if report.selection:
            from .selection import FeasibleSelection

            known = {k: v for k, v in report.selection.items() if k in FeasibleSelection.__dataclass_fields__}
            print("Checkpoint selection: " + FeasibleSelection(**known).message())
        print(report.summary())
    return 1 if args.check and not report.all_satisfied else 0


def _plot(args: argparse.Namespace) -> int:
    from .plotting import plot_log_history

    with open(find_trainer_state(args.run_dir), encoding="utf-8") as f:
        log_history = json.load(f).get("log_history", [])
    report: Optional[SafetyReport] = None
    if os.path.isfile(os.path.join(args.run_dir, SAFETY_REPORT_NAME)):
        report = SafetyReport.load(args.run_dir)
    out = args.out or os.path.join(args.run_dir, "figures")
    for path in plot_log_history(log_history, out, report=report, objective_metric=args.metric,
                                 title=os.path.basename(os.path.normpath(args.run_dir))):
        print(path)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    logging.basicConfig(level=logging.WARNING)
    run_demo(args, echo=lambda line: print(line, flush=True))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .demo import add_demo_arguments

    parser = argparse.ArgumentParser(prog="hf-constrained", description="Inspect constrained fine-tuning runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("report", help="print the safety table (safety_report.json) of a run or checkpoint")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--check", action="store_true", help="exit with status 1 when a constraint fails")
    p.set_defaults(func=_report)
    p = sub.add_parser("plot", help="write PNG figures of the constraints and the objective over training")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--out", default=None, help="output directory (default: RUN_DIR/figures)")
    p.add_argument("--metric", default=None, help="held-out objective key to plot (default: eval_loss or the first)")
    p.set_defaults(func=_plot)
    p = sub.add_parser("demo", help="the embedded CLIP non-forgetting demo on digits (what `make demo` runs)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_demo_arguments(p)
    p.set_defaults(func=_demo)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"hf-constrained {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
