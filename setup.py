"""Build hook only (metadata lives in pyproject.toml).

The model-card templates have one source, ``model_cards/`` at the repository root. A wheel
(non-editable install) gets a copy as ``hf_constrained/model_cards/``, where
:func:`hf_constrained.safety.card.template_path` finds it; an editable install reads
``model_cards/`` directly.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithModelCards(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            return
        target = Path(self.build_lib) / "hf_constrained" / "model_cards"
        target.mkdir(parents=True, exist_ok=True)
        for template in sorted((ROOT / "model_cards").glob("*.md")):
            shutil.copy2(template, target / template.name)


setup(cmdclass={"build_py": BuildPyWithModelCards})
