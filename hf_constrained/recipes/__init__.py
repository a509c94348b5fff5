"""The runnable recipes, importable as ``hf_constrained.recipes.<module>`` after ``pip install``.

The recipes have one source, ``recipes/`` at the repository root, where they run as scripts
(``python recipes/x.py``, ``accelerate launch recipes/x.py``). A wheel (non-editable
install) gets a copy of them, their YAML configs and the accelerate configs in this folder
(``setup.py`` copies them at build time); in a git checkout or an editable install this
package's search path is extended to ``recipes/`` instead, so both layouts import the same
modules under the same names. Either way:

    hf-constrained quickstart --help                               # the command line
    python -m hf_constrained.recipes.quickstart_digits --help      # the module
    accelerate launch -m hf_constrained.recipes.clip_non_forgetting ...   # one or several GPUs

The table of recipes (names, modules, summaries) is :mod:`hf_constrained.recipe_registry`, plain data that
the command line and the model card read without importing a recipe. This module imports nothing heavy:
``hf-constrained --help`` lists the recipes without loading torch.
"""

from __future__ import annotations

import os

from ..recipe_registry import RECIPES

_HERE = os.path.dirname(os.path.abspath(__file__))
_CHECKOUT_RECIPES = os.path.join(os.path.dirname(os.path.dirname(_HERE)), "recipes")

# a checkout or an editable install: the modules live in <repo>/recipes, not next to this file
if not os.path.isfile(os.path.join(_HERE, RECIPES[0].module + ".py")) and os.path.isfile(
        os.path.join(_CHECKOUT_RECIPES, RECIPES[0].module + ".py")):
    __path__.append(_CHECKOUT_RECIPES)  # noqa: F821 (a package's __path__)


def recipe_file(relative: str) -> str:
    """The path of a file shipped with the recipes, e.g. ``configs/llm_non_forgetting_lora.yaml``
    or ``accelerate_configs/multi_gpu.yaml``, in a wheel as in a checkout."""
    for folder in __path__:  # noqa: F821 (a package's __path__)
        path = os.path.join(folder, relative)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"no recipe file {relative!r} in {list(__path__)}")  # noqa: F821


def shipped_recipe_files() -> list[str]:
    """The YAML files shipped with the recipes (``configs/`` and ``accelerate_configs/``), sorted."""
    found = []
    for folder in __path__:  # noqa: F821 (a package's __path__)
        for sub in ("configs", "accelerate_configs"):
            directory = os.path.join(folder, sub)
            if os.path.isdir(directory):
                found += [os.path.join(directory, f) for f in sorted(os.listdir(directory)) if f.endswith(".yaml")]
    return found
