"""Command-line parsing shared by the recipes: dataclass flags plus ``--config x.yaml``.

As in TRL's scripts (``trl sft --config x.yaml``), a YAML file gives values for any field of
the recipe's dataclasses (e.g. :class:`~hf_constrained.ConstrainedTrainingArguments` and the
recipe's own arguments) and flags on the command line override it. A key of the file that no
dataclass has is an error naming the file and the key, and a flag that no dataclass has is a
usage error (exit status 2): neither is silently ignored.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, Optional

import yaml
from transformers import HfArgumentParser


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


class RecipeConfigError(ValueError):
    """A ``--config`` file that cannot be used."""


def resolve_config_path(path: str) -> str:
    """``path`` if it is a file; else, for a bare file name, the recipes' shipped config of that name
    (``--config llm_non_forgetting_lora.yaml`` works from any folder, after ``pip install`` too)."""
    if os.path.isfile(path) or os.path.dirname(path):
        return path
    from .recipes import recipe_file

    try:
        return recipe_file(os.path.join("configs", path))
    except FileNotFoundError:
        return path


def load_config_file(path: str) -> dict[str, Any]:
    """The mapping in the YAML file ``path`` (or the shipped config of that name, see
    :func:`resolve_config_path`); a clear error when it is missing or not a mapping."""
    path = resolve_config_path(path)
    if not os.path.isfile(path):
        raise RecipeConfigError(f"--config {path}: no such file (the configs shipped with the recipes can be named "
                                "by their file name alone: `hf-constrained recipes` lists them)")
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as err:
            raise RecipeConfigError(f"--config {path}: not valid YAML ({err})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeConfigError(f"--config {path}: expected a mapping of flag names to values, got {type(data).__name__}")
    return data


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


def parse_recipe_args(dataclass_types: Sequence[type], argv: Optional[Sequence[str]] = None,
                      description: Optional[str] = None,
                      defaults: Optional[dict[str, Any]] = None) -> tuple[Any, ...]:
    """Parse ``argv`` into instances of ``dataclass_types``, honouring ``--config FILE.yaml``.

    ``defaults`` are the recipe's own defaults (e.g. its learning rate); the file's values
    override them and every flag given on the command line wins over both. The usual
    validation of each dataclass (``__post_init__``) runs on the merged values.
    """
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(argv)
    # no abbreviations: a mistyped or old flag name (--seed for --seeds) is an error, not another flag
    parser = HfArgumentParser(list(dataclass_types), description=description, allow_abbrev=False)
    parser.add_argument("--config", default=None, help="YAML file of flag values; command-line flags override it.")
    _user_settings_first(parser, dataclass_types)
    if defaults:
        parser.set_defaults(**defaults)
    if known.config is not None:
        values = load_config_file(known.config)
        fields = {action.dest for action in parser._actions}  # the flags every dataclass declares
        unknown = sorted(set(values) - fields)
        if unknown:
            raise RecipeConfigError(f"--config {known.config}: unknown keys {unknown} (not a flag of this recipe)")
        parser.set_defaults(**values)
        # a field the file sets no longer needs the command line (required fields included)
        for action in parser._actions:
            if action.dest in values:
                action.required = False
    *outputs, unknown_flags = parser.parse_args_into_dataclasses(args=list(rest), return_remaining_strings=True)
    if unknown_flags:  # argparse's own message and exit status 2, not a traceback
        parser.error(f"unrecognized arguments: {' '.join(unknown_flags)} "
                     "(not a flag of this recipe; --help lists them)")
    return tuple(outputs[: len(dataclass_types)])  # the last entry is the namespace holding --config
