"""Build hook only (metadata lives in pyproject.toml).

The model-card templates have one source, ``model_cards/`` at the repository root. A wheel
(non-editable install) gets a copy as ``hf_constrained/model_cards/``, where
:func:`hf_constrained.publishing.card.template_path` finds it; an editable install reads
``model_cards/`` directly.

Likewise the recipes (``recipes/*.py``, ``recipes/configs/``, ``recipes/accelerate_configs/``):
a wheel gets a copy in ``hf_constrained/recipes/`` (``hf-constrained clip ...``, ``python -m
hf_constrained.recipes.clip_non_forgetting``); a checkout or an editable install imports them
from ``recipes/`` (see ``hf_constrained/recipes/__init__.py``).
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


# folder of the repository -> (files copied, folder in the wheel)
SHIPPED = {
    "model_cards": ("*.md", "hf_constrained/model_cards"),
    "recipes": ("*.py", "hf_constrained/recipes"),
    "recipes/configs": ("*.yaml", "hf_constrained/recipes/configs"),
    "recipes/accelerate_configs": ("*.yaml", "hf_constrained/recipes/accelerate_configs"),
}


class BuildPyWithModelCards(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            return
        for source, (pattern, destination) in SHIPPED.items():
            target = Path(self.build_lib) / destination
            target.mkdir(parents=True, exist_ok=True)
            for path in sorted((ROOT / source).glob(pattern)):
                shutil.copy2(path, target / path.name)


setup(cmdclass={"build_py": BuildPyWithModelCards})
