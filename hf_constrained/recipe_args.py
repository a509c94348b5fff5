"""Command-line parsing shared by the recipes: dataclass flags plus ``--config x.yaml``.

As in TRL's scripts (``trl sft --config x.yaml``), a YAML file gives values for any field of
the recipe's dataclasses (e.g. :class:`~hf_constrained.ConstrainedTrainingArguments` and the
recipe's own arguments) and flags on the command line override it. A key of the file that no
dataclass has is an error naming the file and the key, and a flag that no dataclass has is a
usage error (exit status 2): neither is silently ignored. A usage error prints the short usage
line and the error, not the list of every flag (``--help`` lists them).

The certificate's flags are declared once, in :class:`CertificateArguments` (``--delta``, its help and its
check), which every recipe's own argument dataclass inherits; ``--help`` lists them after the recipe's own flags.

Without an accelerator, ``--dataloader_pin_memory`` defaults to false (torch warns at every
dataloader that pinning needs one; :class:`~hf_constrained.ConstrainedTrainingArguments`); a multi-process
launch that cannot form one run is refused (:mod:`hf_constrained.launch`).

``--bf16`` follows what a user asks for: given on the command line or in the file on a machine
without bf16 support, it is a usage error naming the flag before any model loads; a default of
``bf16`` on (TRL's ``SFTConfig``) is turned off there, with a log line saying so.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import sys
from collections.abc import Sequence
from typing import Any, Callable, Optional

from transformers import HfArgumentParser, TrainingArguments

from .config_files import SAVED_CONFIG_NAME, load_config_file, resolve_config_path  # noqa: F401 (re-exported)
from .errors import RecipeConfigError
from .launch import check_multi_process_launch
from .publishing.push import check_hub_before_training
from .recipe_help import add_help_all, shorten_help, wants_short_help
from .safety.settings import CertificateArguments  # the certificate's flags, which every recipe's arguments inherit

logger = logging.getLogger(__name__)

SHORT_USAGE = "%(prog)s [--config FILE.yaml] [--FLAG VALUE ...]  (--help: the main flags; --help-all: every flag)"
"""The usage line of every recipe: a usage error prints it and the error, not a page of flags."""


def _user_settings_first(parser: argparse.ArgumentParser, dataclass_types: Sequence[type]) -> None:
    """``--help`` lists the settings a user sets first (a dataclass's ``USER_SETTINGS``, e.g. the
    three of :class:`~hf_constrained.ConstrainedTrainingArguments`) in a group of their own,
    before the hundred fields inherited from ``TrainingArguments``."""
    names = [n for t in dataclass_types for n in getattr(t, "USER_SETTINGS", ())]
    if not names:
        return
    group = parser.add_argument_group("the settings to choose first")
    for action in [a for a in parser._actions if a.dest in names]:
        for other in parser._action_groups:
            if action in other._group_actions:
                other._group_actions.remove(action)
        group._group_actions.append(action)
    parser._action_groups.remove(group)
    parser._action_groups.insert(1, group)  # after the positionals


def _certificate_flags_last(parser: argparse.ArgumentParser) -> None:
    """The certificate's flags (:class:`CertificateArguments`, inherited by a recipe's dataclass, so declared first)
    listed after the recipe's own flags in ``--help``: the recipe's data and claim first, then its error level."""
    names = {f.name for f in dataclasses.fields(CertificateArguments)}
    for group in parser._action_groups:
        group._group_actions.sort(key=lambda a: a.dest in names)  # a stable sort: the order kept within each


def parse_with_config(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)`` honouring ``--config FILE.yaml`` (a plain ``argparse`` parser with a
    ``--config`` option, e.g. the demo's): the file's values become defaults, so the command line wins; a
    key that is no option of ``parser`` is an error naming the file and the key (exit status 2)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(list(argv))
    if known.config is not None:
        try:
            values = load_config_file(known.config)
        except RecipeConfigError as err:
            parser.error(str(err))
        # a key is an option's name without dashes (`penalty_beta` for `--penalty_beta`, which the demo stores
        # as `beta`) or its destination: the help shows the option names, so those must work in a file too
        dest_of = {a.dest: a.dest for a in parser._actions if a.dest != argparse.SUPPRESS}
        dest_of.update({o[2:].replace("-", "_"): a.dest for a in parser._actions for o in a.option_strings
                        if o.startswith("--") and a.dest != argparse.SUPPRESS})
        keys = {str(k): str(k).replace("-", "_") for k in values}
        unknown = sorted(k for k in keys.values() if k not in dest_of)
        if unknown:
            parser.error(f"--config {known.config}: unknown keys {unknown} (not an option of this command)")
        spellings: dict[str, list[str]] = {}
        for key, name in keys.items():
            spellings.setdefault(dest_of[name], []).append(key)
        twice = [names for names in spellings.values() if len(names) > 1]
        if twice:  # e.g. `beta:` and `penalty_beta:`: one would silently win
            parser.error(f"--config {known.config}: keys {twice[0]} set the same option; keep one")
        parser.set_defaults(**{dest_of[keys[str(k)]]: v for k, v in values.items()})
    return parser.parse_args(list(argv))


PLAIN_USAGE = "%(prog)s [--config FILE.yaml] [--OPTION VALUE ...]  (--help: every option)"
"""The usage line of a command built on a plain ``argparse`` parser (the demo and the examples on its pipeline): a
mistyped option prints it and the error, not every option."""


def flag_bool(text: str) -> bool:
    """``true``/``false`` (also 1/0, yes/no) for a boolean option of a plain parser; anything else is an error, not
    ``True`` (``bool("false")`` is)."""
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(str(text).lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


def parse_seeds(text: Optional[str], default: int, flag: str = "--seeds") -> list[int]:
    """The seeds of ``--seeds 100,101,102`` (comma-separated distinct integers), or ``[default]`` (the single
    ``--seed``) when not given; anything else is a ``ValueError`` naming ``flag``."""
    if text is None:
        return [default]
    try:
        seeds = [int(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"{flag} must list distinct integers, got {text!r}")
    return seeds


def run_plain_command(argv: Optional[Sequence[str]], prog: str, description: str,
                      add_arguments: Callable[[argparse.ArgumentParser], None], run: Callable[..., Any],
                      module_command: str, echo: Callable[[str], None]) -> int:
    """A command on a plain ``argparse`` parser (the demo and the examples on its pipeline): ``--config`` and the
    options of ``add_arguments`` (:func:`parse_with_config`), then ``run(namespace, echo=echo, command=...)`` with
    the command as typed (``module_command`` and ``argv``, default ``sys.argv[1:]``); a ``ValueError`` is a
    usage error naming the option (exit status 2). Returns 0."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=prog, description=description, usage=PLAIN_USAGE,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    parser.add_argument("--config", default=None, help="YAML file of option values (names as the options, without "
                        "dashes); options on the command line override it")
    add_arguments(parser)
    ns = parse_with_config(parser, args)
    logging.basicConfig(level=logging.WARNING)
    try:
        run(ns, echo=echo, command=shlex.join([*module_command.split(), *args]))
    except ValueError as exc:
        parser.error(str(exc))
    return 0


def given_flags(argv: Optional[Sequence[str]] = None) -> set[str]:
    """The fields set on the command line ``argv`` (default: ``sys.argv[1:]``) or in its
    ``--config`` file, by field name (``--constraint-penalty`` and ``--constraint_penalty`` are
    both ``constraint_penalty``): what a user chose, as opposed to a default."""
    argv = list(sys.argv[1:] if argv is None else argv)
    names = {a[2:].split("=", 1)[0].replace("-", "_") for a in argv if a.startswith("--") and len(a) > 2}
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    config = pre.parse_known_args(argv)[0].config
    if config is not None:
        names |= {str(k) for k in load_config_file(config)}
    names.discard("config")
    return names


def bf16_supported() -> bool:
    """Whether this machine trains in bf16 without ``--use_cpu`` (a GPU with bf16, or an XLA device):
    the condition under which ``TrainingArguments`` accepts ``bf16=True``."""
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    return bool(is_torch_bf16_gpu_available() or is_torch_xla_available())


def _check_bf16(parser: argparse.ArgumentParser, namespace: argparse.Namespace, rest: Sequence[str],
                given: set[str], config: Optional[str]) -> None:
    """``--bf16`` where no GPU supports it: a usage error naming the flag when the user asked for it
    (command line or ``--config`` file; with ``--use_cpu true`` it is honoured: bf16 on the CPU); a
    default ``bf16`` (TRL's ``SFTConfig``: on unless ``--fp16``) is turned off on such a machine and with
    ``--use_cpu``, with a log line saying so."""
    if not any(getattr(a, "dest", None) == "bf16" for a in parser._actions):
        return
    if getattr(namespace, "bf16", None) is False or getattr(namespace, "fp16", False):
        return
    use_cpu = bool(getattr(namespace, "use_cpu", False))
    if not use_cpu and bf16_supported():
        return
    if "bf16" in given:
        if use_cpu:
            return  # bf16 on the CPU, as asked
        where = "on the command line" if _on_command_line("bf16", rest) else f"by --config {config}"
        parser.error(f"--bf16 true (set {where}): this machine has no GPU with bf16 support; pass --bf16 false to "
                     "train in float32 (or --use_cpu true to train in bf16 on the CPU)")
    logger.warning("bf16 is on by default, but %s: training in float32 (--bf16 false); pass --bf16 true for bf16",
                   "--use_cpu is set" if use_cpu else "this machine has no GPU with bf16 support")
    parser.set_defaults(bf16=False)


def _on_command_line(name: str, argv: Sequence[str]) -> bool:
    return any(a[2:].split("=", 1)[0].replace("-", "_") == name for a in argv if a.startswith("--"))


def parse_recipe_args(dataclass_types: Sequence[type], argv: Optional[Sequence[str]] = None,
                      description: Optional[str] = None,
                      defaults: Optional[dict[str, Any]] = None,
                      parser_class: type = HfArgumentParser,
                      replaced_flags: Optional[dict[str, str]] = None) -> tuple[Any, ...]:
    """Parse ``argv`` into instances of ``dataclass_types``, honouring ``--config FILE.yaml``.

    ``defaults`` are the recipe's own defaults (e.g. its learning rate); the file's values
    override them and every flag given on the command line wins over both. The usual
    validation of each dataclass (``__post_init__``) runs on the merged values.

    ``parser_class``: ``HfArgumentParser`` or a subclass (``trl.TrlParser`` for a recipe that
    follows TRL's scripts). ``replaced_flags``: old flag name -> what replaces it; such a flag on
    the command line or in the file is a usage error that names the replacement, not an
    unknown flag. A usage error prints :data:`SHORT_USAGE` and the error (exit status 2).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(argv)
    # no abbreviations: a mistyped or old flag name (--seed for --seeds) is an error, not another flag
    parser = parser_class(list(dataclass_types), description=description, allow_abbrev=False, usage=SHORT_USAGE)
    parser.add_argument("--config", default=None, help="YAML file of flag values; command-line flags override it.")
    add_help_all(parser)
    _user_settings_first(parser, dataclass_types)
    _certificate_flags_last(parser)
    if wants_short_help(argv):  # the recipe's own flags and a few of the Trainer's; --help-all: every flag
        shorten_help(parser, dataclass_types, shown=defaults or ())
    if defaults:
        parser.set_defaults(**defaults)
    file_keys: set[str] = set()
    if known.config is not None:
        values = load_config_file(known.config)
        file_keys = {str(k) for k in values}
        for old, new in (replaced_flags or {}).items():
            if old in values:
                raise RecipeConfigError(f"--config {known.config}: key {old!r} was replaced: {new}")
        fields = {action.dest for action in parser._actions}  # the flags every dataclass declares
        unknown = sorted(set(values) - fields)
        if unknown:
            raise RecipeConfigError(f"--config {known.config}: unknown keys {unknown} (not a flag of this recipe)")
        parser.set_defaults(**values)
        # a field the file sets no longer needs the command line (required fields included)
        for action in parser._actions:
            if action.dest in values:
                action.required = False
    for old, new in (replaced_flags or {}).items():
        if _on_command_line(old, rest):
            parser.error(f"--{old} was replaced: {new}")
    given = file_keys | {a[2:].split("=", 1)[0].replace("-", "_") for a in rest if a.startswith("--")}
    namespace, unknown_flags = parser.parse_known_args(list(rest))  # argparse values only: no dataclass built yet
    if unknown_flags:  # argparse's own message and exit status 2, not a traceback
        parser.error(f"unrecognized arguments: {' '.join(unknown_flags)} "
                     "(not a flag of this recipe; --help-all lists them)")
    _check_bf16(parser, namespace, rest, given, known.config)
    try:
        outputs = parser.parse_args_into_dataclasses(args=list(rest))
    except RecipeConfigError:
        raise
    except ValueError as err:
        # a dataclass's own check of the merged values (``__post_init__``: the recipe's, or the Trainer's, e.g.
        # --load_best_model_at_end with unequal strategies) is the user's setting, found before anything loads:
        # ``hf-constrained <recipe>`` shows it in one line, not under a traceback
        raise RecipeConfigError(str(err)) from err
    for parsed in outputs[: len(dataclass_types)]:
        if isinstance(parsed, TrainingArguments):  # before any model or data loads
            check_multi_process_launch(parsed, parser.error)
            check_hub_before_training(parsed, parser.error)
    return tuple(outputs[: len(dataclass_types)])  # the last entry is the namespace holding --config
