"""A recipe's ``--config`` YAML file: where a name finds it, what it holds, and the name of its copy in a run's output
folder. Read by the recipes' parsing (:mod:`hf_constrained.recipe_args`) and by the reproduce command a run publishes
(:mod:`hf_constrained.publishable`)."""

from __future__ import annotations

import os
from typing import Any

import yaml

from .errors import RecipeConfigError

SAVED_CONFIG_NAME = "recipe_config.yaml"
"""The copy of a run's ``--config`` file in its output folder, cited by the reproduce command."""


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
        raise RecipeConfigError(f"--config {path}: expected a mapping of flag names to values, "
                                f"got {type(data).__name__}")
    return data


__all__ = ["SAVED_CONFIG_NAME", "load_config_file", "resolve_config_path"]
