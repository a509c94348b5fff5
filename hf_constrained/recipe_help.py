"""A recipe's ``--help`` that fits a screen, and ``--help-all`` for every flag.

``TrainingArguments`` has about a hundred fields; a recipe's ``--help`` listed all of them (700-900
lines). Like TRL's scripts, whose help groups flags by dataclass, ``--help`` here shows

- the recipe's own flags (every field of its dataclasses that are not ``TrainingArguments``);
- the settings to choose first (``USER_SETTINGS``, e.g. ``--penalty_beta``);
- the few ``TrainingArguments`` flags a run of a recipe is usually shaped by
  (:data:`COMMON_TRAINER_FLAGS`), ``--constraint_penalty``, and those the recipe sets defaults for
  (the other fields of ``TrainingArguments`` and its subclasses, ``ConstrainedTrainingArguments``'
  advanced method settings included, are behind ``--help-all``);

each with the first sentence of its help, and a last line saying how many more ``--help-all`` lists.
``--help-all`` prints the parser's full help (every field, with its whole help text).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Iterable, Sequence

HELP_ALL = "--help-all"

COMMON_TRAINER_FLAGS = ("output_dir", "max_steps", "num_train_epochs", "learning_rate", "per_device_train_batch_size",
                        "seed", "use_cpu", "bf16", "push_to_hub", "hub_model_id", "report_to", "resume_from_checkpoint")
"""``TrainingArguments`` flags shown in the short ``--help`` of every recipe that has them."""

def wants_short_help(argv: Sequence[str]) -> bool:
    """``-h`` / ``--help`` without ``--help-all``."""
    return HELP_ALL not in argv and any(a in ("-h", "--help") for a in argv)


def _first_sentence(text: str, width: int = 84) -> str:
    """The help's first sentence (a period outside parentheses, not of "e.g."), cut to ``width`` characters
    at a word: one line beside the flag."""
    text = " ".join(str(text).split())
    for match in re.finditer(r"\.(\s|$)", text):
        head = text[:match.start() + 1]
        if head.count("(") == head.count(")") and not head.lower().endswith(("e.g.", "i.e.", "etc.", "vs.")):
            text = head
            break
    if len(text) <= width:
        return text
    return text[:width - 3].rsplit(" ", 1)[0].rstrip(",;:") + "..."


def _trainer_fields(dataclass_types: Iterable[type]) -> set[str]:
    """The fields of the ``TrainingArguments`` classes among ``dataclass_types`` (the constraint method's
    ``ConstrainedTrainingArguments`` and TRL's configs included): the Trainer's, behind ``--help-all``."""
    from transformers import TrainingArguments

    return {f.name for t in dataclass_types if isinstance(t, type) and issubclass(t, TrainingArguments)
            for f in dataclasses.fields(t)}


def shorten_help(parser: argparse.ArgumentParser, dataclass_types: Sequence[type], *,
                 shown: Iterable[str] = ()) -> None:
    """Hide from ``parser``'s help the inherited ``TrainingArguments`` flags that are not in ``shown``,
    the settings to choose first or :data:`COMMON_TRAINER_FLAGS`; keep the first sentence of each
    shown flag's help; say in the epilog how many ``--help-all`` adds. Parsing is unchanged."""
    keep = (set(shown) | set(COMMON_TRAINER_FLAGS) | {"constraint_penalty"}
            | {n for t in dataclass_types for n in getattr(t, "USER_SETTINGS", ())})
    inherited = _trainer_fields(dataclass_types)
    hidden = 0
    seen: set[str] = set()
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or not action.option_strings:
            continue
        if action.dest in inherited and action.dest not in keep:
            action.help = argparse.SUPPRESS
            hidden += action.dest not in seen
        elif action.dest in seen:  # the --no_<flag> twin of a boolean flag: one line is enough
            action.help = argparse.SUPPRESS
        elif action.help:
            action.help = _first_sentence(action.help)
        seen.add(action.dest)
    for group in parser._action_groups:  # the recipe's own flags before the Trainer's that stay shown
        group._group_actions.sort(key=lambda a: a.dest in inherited)  # a stable sort: order kept within each
    if parser.description:  # the first paragraph; the rest is the recipe's documentation
        parser.description = parser.description.strip().split("\n\n")[0]
    # a recipe without Trainer flags (llm-example) hides none: no "0 more flags"
    parser.epilog = (f"{hidden} more flags (the Trainer's and the method's advanced settings) and every flag's "
                     f"full help: {parser.prog} {HELP_ALL}" if hidden else
                     f"every flag's full help: {parser.prog} {HELP_ALL}")
    parser.formatter_class = _CompactFormatter


class _CompactFormatter(argparse.RawDescriptionHelpFormatter):
    """One name per flag (not its dash and underscore spellings), help beside it, no defaults."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34, width=118)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        name = action.option_strings[-1] if action.option_strings[0] in ("-h",) else action.option_strings[0]
        if action.nargs == 0:
            return name
        return f"{name} {self._format_args(action, self._get_default_metavar_for_optional(action))}"


def add_help_all(parser: argparse.ArgumentParser) -> None:
    """``--help-all``: print the full help (every flag) and exit."""

    class _HelpAll(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001 (argparse's signature)
            parser.print_help()
            parser.exit()

    parser.add_argument(HELP_ALL, action=_HelpAll, nargs=0, help="list every flag, the Trainer's included, and exit")


__all__ = ["COMMON_TRAINER_FLAGS", "HELP_ALL", "add_help_all", "shorten_help", "wants_short_help"]
