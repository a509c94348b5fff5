"""``hf-constrained``: the command line.

    hf-constrained report RUN_DIR [--json] [--check]   print the safety table of a run or checkpoint
                                                       (--check: exit 0 certified, 1 not, 2 stale/unreadable)
    hf-constrained certify --model DIR --base_model B   certify a fine-tune made with any tool against its base
        --protected_datasets NAME=FILE --claim C          (exit 0 certified, 1 not); report and card in --output_dir
    hf-constrained plot RUN_DIR [--out DIR]            write constraints.png and objective.png
    hf-constrained demo [...]                          the CLIP non-forgetting demo on digits
    hf-constrained recipes                             list the recipes, their modules and shipped configs
    hf-constrained RECIPE [flags | --config x.yaml]    run a recipe: quickstart, llm, llm-example,
                                                       llm-many-tasks, shapes-example,
                                                       shapes-many-classes, clip, fairness, safe-release
                                                       (``RECIPE --help``: its flags)

The command line depends on the library, never the reverse. ``report`` and ``plot`` read
files only (no torch, no transformers), so they start in well under a second; a recipe's
module (and with it torch) is imported only when that recipe runs. On several GPUs, launch a
recipe's module: ``accelerate launch -m hf_constrained.recipes.<module> ...``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import shlex
import sys
from typing import Any, Optional, Sequence

from .atomic_files import atomic_write_json
from .certification.selection import FeasibleSelection
from .checkpointing import checkpoint_folders, checkpoint_problem
from .errors import RecipeConfigError
from .extras import MissingExtraError, extra_for_module, install_hint
from .help_cache import SHIPPED, cached_help, render_help, versions
from .publishing.figures import plot_log_history
from .publishing.report import SAFETY_REPORT_NAME, SAFETY_RULES, SafetyReport
from .publishing.tables import format_number
from .publishing.verify import EXIT_STALE_OR_UNREADABLE, check_run_dir
from .recipe_registry import DEMO_MODULE, RECIPES, Recipe
from .recipes import shipped_recipe_files


def find_trainer_state(run_dir: str) -> str:
    """``RUN_DIR/trainer_state.json``, else the one of the newest COMPLETE checkpoint in RUN_DIR
    (a checkpoint a kill interrupted is skipped, with a warning)."""
    path = os.path.join(run_dir, "trainer_state.json")
    if os.path.isfile(path):
        return path
    for folder in checkpoint_folders(run_dir):
        problem = checkpoint_problem(folder)
        if problem is None and os.path.isfile(os.path.join(folder, "trainer_state.json")):
            return os.path.join(folder, "trainer_state.json")
        logging.getLogger(__name__).warning("skipping %s: %s", folder, problem or "no trainer_state.json")
    raise FileNotFoundError(
        f"no trainer_state.json in {run_dir} or its checkpoints: pass a Trainer output directory "
        "(finish_run / trainer.save_state() write it) or a checkpoint-N directory"
    )


def _report(args: argparse.Namespace) -> int:
    check = None
    if args.check:  # the exit status is check_run_dir's, and only its
        check = check_run_dir(args.run_dir, rule=args.rule)
        if check.exit_code == EXIT_STALE_OR_UNREADABLE:
            print(f"hf-constrained report: error: {check.message}", file=sys.stderr)
            return check.exit_code
        assert check.report is not None
        report = check.report
    else:
        report = SafetyReport.load(args.run_dir)
        if args.rule is not None:
            report = report.with_rule(args.rule)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        where = f"step {report.global_step}" if report.global_step is not None else "unknown step"
        if report.checkpoint:
            where += f", weights from {report.checkpoint}"
        print(f"Safety report: {os.path.join(args.run_dir, SAFETY_REPORT_NAME)} ({report.split} data, {where})")
        print()
        print(report.render())  # the verdict line, its table and the diagnostics, once
        print()
        if report.objective_metrics:
            print("Objective metrics (held-out): " + ", ".join(
                f"{k} = {format_number(v)}" for k, v in report.objective_metrics.items()))
        if report.selection:
            known = {k: v for k, v in report.selection.items() if k in FeasibleSelection.__dataclass_fields__}
            print("Checkpoint selection (diagnostic, validation data): " + FeasibleSelection(**known).message())
    if check is not None:
        print(f"--check: {check.message}", file=sys.stderr if args.json else sys.stdout)
        return check.exit_code
    return 0


def _push(args: argparse.Namespace) -> int:
    from .publishing.push import push_run

    try:
        result = push_run(args.run_dir, args.repo_id, private=args.private or None,
                          commit_message=args.commit_message)
    except Exception as exc:  # noqa: BLE001 - the Hub's errors (network, permissions): one line unless --debug
        if args.debug:
            raise
        print(f"hf-constrained push: error: the upload failed ({type(exc).__name__}: "
              f"{' '.join(str(exc).split())[:300]}); --debug shows the traceback", file=sys.stderr)
        return 2
    print(result.message, file=sys.stdout if result.exit_code == 0 else sys.stderr)
    return result.exit_code


def _certify(args: argparse.Namespace) -> int:
    # imported here, not at the top: certifying loads torch and transformers, which would make every other
    # command (and --help) take seconds to start
    from .safety.certify_claims import CertifySettings

    settings = CertifySettings(
        model=args.model, base_model=args.base_model, protected_datasets=tuple(args.protected_datasets),
        claims=tuple(args.claim), output_dir=args.output_dir, delta=args.delta, train_files=tuple(args.train_files),
        batch_size=args.batch_size, max_length=args.max_length, device=args.device, dtype=args.dtype,
        split=args.split, hub_datasets=tuple(args.hub_datasets),
        command=" ".join(["hf-constrained", *map(shlex.quote, sys.argv[1:] if args.argv is None else args.argv)]),
        task=args.task, per_class=args.per_class, class_names=tuple(args.class_names),
        prompt_template=args.prompt_template, text_column=args.text_column, image_column=args.image_column,
        label_column=args.label_column, loss_clip=args.loss_clip)
    if not settings.per_class:  # with --per_class the sets are the classes, known once the rows are read
        settings.claims_per_set()  # every claim parsed and matched to a set before anything is read
    from .safety.certify_model import certify_model

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    result = certify_model(settings, echo=lambda line: print(line, flush=True))
    print(f"wrote {result.report_path} and {result.card_path}; check: hf-constrained report {args.output_dir} "
          "--check; publish: hf-constrained push " + args.output_dir + " --repo_id owner/name")
    return result.exit_code


def _plot(args: argparse.Namespace) -> int:
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


def _demo_parser() -> tuple[Any, argparse.ArgumentParser]:
    """The demo's module and its option parser (``hf-constrained demo``)."""
    # imported here, not at the top: the demo imports torch and transformers, which would
    # make every other command (and --help) take seconds to start
    from .recipe_args import PLAIN_USAGE
    from .recipes import __name__ as recipes_package

    demo = import_recipe(f"{recipes_package}.{DEMO_MODULE}")
    parser = argparse.ArgumentParser(prog="hf-constrained demo", description=DEMO_DESCRIPTION, usage=PLAIN_USAGE,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    parser.add_argument("--config", default=None, help="YAML file of option values (names as the options, "
                        "without dashes); options on the command line override it")
    demo.add_demo_arguments(parser)
    return demo, parser


def _render_demo_help() -> int:
    """Print the demo's ``--help``: argparse prints it and exits (status 0, which :func:`render_help` reads)."""
    _demo_parser()[1].parse_args(["--help"])
    return 0  # not reached


def _demo(args: argparse.Namespace) -> int:
    if {"-h", "--help"} & set(args.demo_args):
        # printed from the shipped or cached text, as a recipe's: importing the demo (torch) takes seconds
        code, text = cached_help("demo", "help", _source_file(DEMO_MODULE), _render_demo_help)
        print(text, end="")
        return code
    from .recipe_args import parse_with_config  # imports transformers: not for --help

    demo, parser = _demo_parser()
    options = parse_with_config(parser, args.demo_args)
    logging.basicConfig(level=logging.WARNING)
    demo.run_demo(options, echo=lambda line: print(line, flush=True))
    return 0


def _recipes(args: argparse.Namespace) -> int:
    print("Recipes (hf-constrained RECIPE --help lists a recipe's flags; every recipe takes --config x.yaml):")
    width = max(len(r.command) for r in RECIPES)  # every summary in one column, the longest command included
    for recipe in RECIPES:
        print(f"  {recipe.command:<{width}} {recipe.summary}")
        print(f"  {'':<{width}} module {recipe.module_name}")
    print()
    print("Shipped configs:")
    for path in shipped_recipe_files():
        print(f"  {path}")
    print()
    print("Several GPUs: accelerate launch --config_file MULTI_GPU_YAML -m MODULE [flags]")
    return 0


def _source_file(module: str) -> Optional[str]:
    """The source file of the recipe (or demo) ``module`` (its help depends on it), or ``None``."""
    from .recipes import recipe_file

    try:
        return recipe_file(f"{module}.py")
    except FileNotFoundError:
        return None


def import_recipe(module_name: str) -> Any:
    """Import a recipe's module; a missing optional package (scikit-learn for the digits examples,
    pillow for CLIP, ...) propagates as :class:`ModuleNotFoundError`, which :func:`main` turns
    into one line naming the extra to install."""
    return importlib.import_module(module_name)


def run_recipe(recipe: Recipe, argv: Sequence[str]) -> int:
    """Run ``recipe``'s ``main(argv)``, as ``python recipes/<module>.py argv`` would; its usage
    and errors name the command (``hf-constrained <recipe>``)."""
    # imported here, not at the top: a recipe imports torch and transformers, which would make
    # every other command (and --help) take seconds to start
    module = import_recipe(recipe.module_name)
    saved, sys.argv = sys.argv, [f"hf-constrained {recipe.command}", *argv]  # argparse's prog
    try:
        result = module.main(list(argv))
    finally:
        sys.argv = saved
    if isinstance(result, dict) and isinstance(result.get("exit_status"), int):
        return result["exit_status"]  # e.g. 1 when the recipe's push gate refused
    return result if isinstance(result, int) else 0


DEMO_HELP = "the embedded CLIP non-forgetting demo on digits (what `make demo` runs); `demo --help` lists its options"
DEMO_DESCRIPTION = ("The CLIP non-forgetting demo on digits (what `make demo` runs): one seed, certified, with its "
                    "report, card and figures. The wider evaluation: --penalties hinge,squared_hinge,none --seeds "
                    "100,101,102,103,104 --workers 5 (docs/demo.md).")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-constrained",
                                     description="Run the recipes and inspect constrained fine-tuning runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("report", help="print the safety table (safety_report.json) of a run or checkpoint")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run's output folder or one of its checkpoint-N folders")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--check", action="store_true",
                   help="verify the report and turn it into the exit status: 0 certified (the report is intact, "
                        "describes the weight files in RUN_DIR, and every constraint holds), 1 not certified (a "
                        "constraint fails), 2 stale or unreadable (no report, a report edited after it was "
                        "written or without constraints, weight files replaced or missing)")
    p.add_argument("--rule", choices=SAFETY_RULES, default=None,
                   help="what decides pass/fail: 'certified' (the finite-sample certificate on the certification "
                        "split), or the uncertified 'point' (each held-out value within its tolerance) and "
                        "'upper_bound' (each CLT upper bound within its tolerance). Default: the report's own rule "
                        "(certified unless finish_run(..., safety_rule=...) said otherwise)")
    p.set_defaults(func=_report)
    p = sub.add_parser("push", help="upload a finished run to the Hub, only if `report RUN_DIR --check` passes "
                       "(certified, intact report naming the weight files in the folder)")
    p.add_argument("run_dir", help="the run's output folder (safety_report.json, README.md and the weights)")
    p.add_argument("--repo_id", required=True, help="the Hub repository, owner/name")
    p.add_argument("--private", action="store_true", help="create the repository as private")
    p.add_argument("--commit_message", default=None, help="default: the run's verdict")
    p.add_argument("--debug", action="store_true", help="show the traceback of a failed upload")
    p.set_defaults(func=_push)
    _add_certify_parser(sub)
    p = sub.add_parser("plot", help="write PNG figures of the constraints and the objective over training")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run's output folder or one of its checkpoint-N folders")
    p.add_argument("--out", default=None, help="output directory (default: RUN_DIR/figures)")
    p.add_argument("--metric", default=None,
                   help="held-out objective key to plot (default: eval_loss, else the selection metric)")
    p.set_defaults(func=_plot)
    # the demo's own options are parsed by _demo (they live with the demo, see recipes/demo_clip_digits.py)
    p = sub.add_parser("demo", help=DEMO_HELP, add_help=False)
    p.set_defaults(func=_demo, demo_args=[])
    p = sub.add_parser("recipes", help="list the recipes, their modules and the shipped configs",
                       description="List the recipes (hf-constrained RECIPE), their modules (python -m MODULE, "
                       "accelerate launch -m MODULE) and the configs shipped with them (--config NAME.yaml).")
    p.set_defaults(func=_recipes)
    # each recipe parses its own flags (and --config) when it runs
    for recipe in RECIPES:
        p = sub.add_parser(recipe.command, help=f"recipe: {recipe.summary} (`{recipe.command} --help`: its flags)",
                           add_help=False)
        p.set_defaults(recipe=recipe)
    return parser


CERTIFY_TASKS = ("causal_lm", "sequence_classification", "image_classification", "clip")
"""``--task``'s choices (:data:`hf_constrained.safety.certify_claims.TASKS`, written out: that module loads
``datasets``, which ``hf-constrained --help`` should not wait for)."""

CERTIFY_DESCRIPTION = (
    "Certify a fine-tuned model (a full model folder, or a PEFT adapter folder) against its base on your "
    "certification rows, however it was trained: a causal LM (per protected set, teacher-forced exact match of the "
    "answer, or the rise of its per-token loss), a text or image classifier (accuracy) or a CLIP model's zero-shot "
    "head (accuracy over --class_names with --prompt_template), under both models, paired row by row, with a "
    "finite-sample bound at --delta. Writes safety_report.json and the card (README.md) into --output_dir, for "
    "`hf-constrained report DIR --check` and `hf-constrained push DIR --repo_id owner/name`. Exit status: 0 "
    "certified, 1 not certified, 2 an error (docs/certify.md).")


def _add_certify_parser(sub: Any) -> None:
    p = sub.add_parser("certify", help="certify a fine-tune made with any tool against its base (report, card, "
                       "then `push`)", description=CERTIFY_DESCRIPTION)
    p.add_argument("--model", required=True, help="the fine-tuned model's folder (save_pretrained): a full model, "
                   "or a PEFT adapter (adapter_config.json) on top of --base_model")
    p.add_argument("--base_model", required=True, help="the model it was fine-tuned from: a folder or a Hub id")
    p.add_argument("--protected_datasets", nargs="+", required=True, metavar="NAME=FILE",
                   help="each protected set's certification rows, read by nothing else (JSON/JSONL/CSV/parquet or a "
                        "Hub dataset id): prompt/completion or messages rows for a causal LM; text + label rows for "
                        "a text classifier; image (a path) + label rows, or a folder of class subfolders, for an "
                        "image classifier or CLIP")
    p.add_argument("--claim", action="append", required=True, metavar="CLAIM",
                   help="stated before any row is read: 'points_lost <= 3' (each set loses at most 3 points of "
                        "exact match or accuracy), 'percent_forgotten <= 2' (at most 2%% of its rows forgotten) or, "
                        "for a causal LM, 'loss_rise <= 0.05' (its per-token loss rises by at most 0.05 nats); "
                        "'NAME: points_lost <= 1' for one set (or class). Repeatable")
    p.add_argument("--delta", type=float, default=0.05,
                   help="error level: the claim holds with probability at least 1 - delta (over every look at "
                        "these rows: a ledger of looks spends it)")
    p.add_argument("--output_dir", required=True, help="where safety_report.json, README.md, the ledger and the "
                   "cache of per-row values go (may be --model itself)")
    p.add_argument("--train_files", nargs="*", default=[], metavar="FILE",
                   help="the files the model was trained on: a certification row found in them is refused")
    p.add_argument("--batch_size", type=int, default=16, help="rows per forward pass")
    p.add_argument("--max_length", type=int, default=2048,
                   help="the longest row allowed, in tokens (a longer row is an error: rows are never cut)")
    p.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="auto: the dtype the weights were saved in (bf16 where the model is)")
    p.add_argument("--split", default="train", help="the split of a Hub dataset given as a set")
    p.add_argument("--hub_datasets", nargs="*", default=[], metavar="NAME=HUB_ID",
                   help="the Hub dataset a local set was drawn from (the card's model-index names it)")
    p.add_argument("--task", default="auto", choices=("auto", *CERTIFY_TASKS),
                   help="auto: from the model's config.json (*ForCausalLM, *ForSequenceClassification, "
                        "*ForImageClassification, CLIPModel)")
    p.add_argument("--per_class", action="store_true",
                   help="classifiers and CLIP: each class of the rows is its own protected set (a claim per class)")
    p.add_argument("--class_names", nargs="+", default=[], metavar="CLASS",
                   help="CLIP: the zero-shot head's classes, in order (default: the labels in the rows, sorted)")
    p.add_argument("--prompt_template", default="a photo of a {}.",
                   help="CLIP: each class's prompt, with {} for the class name")
    p.add_argument("--text_column", default="text", help="text classifiers: the column of the text")
    p.add_argument("--image_column", default=None,
                   help="image classifiers and CLIP: the column of image paths (default: image, else filepath)")
    p.add_argument("--label_column", default="label", help="classifiers and CLIP: the column of the label (a class "
                   "name or index)")
    p.add_argument("--loss_clip", type=float, default=10.0,
                   help="loss_rise: each row's per-token loss is clipped at this many nats (the bound needs bounded "
                        "values)")
    p.set_defaults(func=_certify, argv=None)


def _missing_extra(command: str, err: ModuleNotFoundError) -> int:
    """A missing optional package: one line naming the extra (status 2); any other missing module re-raises."""
    extra = extra_for_module(err.name or "")
    if extra is None:
        raise err
    print(f"hf-constrained {command}: error: the optional package {err.name!r} is not installed: "
          f"{install_hint('recipes')} (what every recipe needs) or {install_hint(extra)}", file=sys.stderr)
    return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "recipe", None) is not None:
        # not under the try below: a recipe's errors keep their traceback, as with python recipes/x.py; a
        # missing optional package, a setting refused before anything loads and a missing file are one line
        try:
            kind = "help-all" if "--help-all" in rest else "help" if {"-h", "--help"} & set(rest) else None
            if kind is not None:  # printed from the cache after the first time: no torch import
                code, text = cached_help(args.recipe.command, kind, _source_file(args.recipe.module),
                                         lambda: run_recipe(args.recipe, rest))
                print(text, end="")
                return code
            return run_recipe(args.recipe, rest)
        except (MissingExtraError, RecipeConfigError) as exc:  # settings, found before anything loads
            # one line, also for the Trainer's own multi-line messages (--load_best_model_at_end's)
            print(f"hf-constrained {args.recipe.command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
            return 2
        except FileNotFoundError as exc:
            # a missing data file, model folder or checkpoint is the user's to fix, and the recipes' messages name
            # it with its flag (--csv_path, --model_name_or_path, ...): one line; HF_CONSTRAINED_DEBUG=1 re-raises.
            # One the operating system raised (errno set: an open() of a path the code built) names no flag and
            # is more likely a bug than a mistyped flag: it keeps its traceback
            if exc.errno is not None or os.environ.get("HF_CONSTRAINED_DEBUG", "").strip() not in ("", "0"):
                raise
            print(f"hf-constrained {args.recipe.command}: error: {exc} (HF_CONSTRAINED_DEBUG=1 shows the traceback)",
                  file=sys.stderr)
            return 2
        except ModuleNotFoundError as err:  # an optional package a recipe imports late
            return _missing_extra(args.recipe.command, err)
    if args.command == "demo":
        args.demo_args = rest
    elif args.command == "certify":
        args.argv = list(sys.argv[1:] if argv is None else argv)
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except (FileNotFoundError, ValueError, MissingExtraError) as exc:
        print(f"hf-constrained {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:
        return _missing_extra(args.command, err)
    except BrokenPipeError:
        # the reader went away (`hf-constrained report RUN --json | head -1`): no traceback, and
        # no second error when the interpreter flushes stdout at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a process killed by the signal


def write_shipped_help() -> dict[str, str]:
    """Render every recipe's short ``--help`` (and the demo's) and write the package's shipped texts
    (:data:`~hf_constrained.help_cache.SHIPPED`); run after changing a recipe's flags:
    ``python -m hf_constrained.cli --write-shipped-help``."""
    texts = {}
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: the shipped texts at one fixed width
    renders = {recipe.command: lambda recipe=recipe: run_recipe(recipe, ["--help"]) for recipe in RECIPES}
    renders["demo"] = _render_demo_help
    for command, render in renders.items():
        code, texts[command] = render_help(render)
        if code != 0:
            raise RuntimeError(f"hf-constrained {command} --help exited with {code}")
    atomic_write_json(SHIPPED, {"versions": versions(), "texts": texts}, indent=1, sort_keys=True, newline=True)
    return texts


if __name__ == "__main__":  # pragma: no cover
    sys.exit(write_shipped_help() and 0 if sys.argv[1:] == ["--write-shipped-help"] else main())
