"""Optional dependencies ("extras") and the error that names the one to install.

A plain ``pip install hf_constrained`` trains, certifies and gates (torch, transformers,
accelerate, datasets, huggingface_hub, numpy, scipy). The rest is optional:

===============  ==========================  ============================================
extra            packages                    what needs it
===============  ==========================  ============================================
``figures``      matplotlib                  training-curve figures (``finish_run(plots=True)``,
                                             ``hf-constrained plot``)
``fairness``     scikit-learn, pandas,       :mod:`hf_constrained.fairness` (ROC recipe,
                 pillow                      Adult / COMPAS / CSV / CheXpert data)
``clip``         pillow                      decoding image files (CLIP recipe, CSV images)
``peft``         peft                        LoRA adapters (``--use_peft``, ``--lora_r``)
``tensorboard``  tensorboard                 ``--report_to tensorboard``
``trl``          trl                         :mod:`hf_constrained.integrations.trl`
``recipes``      all of the above but trl    every shipped recipe and example
``all``          every extra
===============  ==========================  ============================================

pandas also comes with ``datasets``; ``fairness`` names it because the fairness loaders use it
directly.
"""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS: dict[str, tuple[str, ...]] = {
    "figures": ("matplotlib",),
    "fairness": ("scikit-learn", "pandas", "pillow"),
    "clip": ("pillow",),
    "peft": ("peft",),
    "tensorboard": ("tensorboard",),
    "trl": ("trl",),
}
"""Each extra's distributions (``pyproject.toml`` holds their versions)."""


IMPORT_NAMES: dict[str, str] = {
    "matplotlib": "figures", "sklearn": "fairness", "pandas": "fairness", "PIL": "clip", "peft": "peft",
    "tensorboard": "tensorboard", "trl": "trl",
}
"""The top-level import name of each optional package -> the extra that installs it."""


def extra_for_module(module: str) -> str | None:
    """The extra that installs the package ``module`` (``"sklearn.datasets"`` -> ``"fairness"``), or
    ``None`` for a package that is no optional dependency."""
    return IMPORT_NAMES.get(module.split(".")[0])


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


def install_hint(extra: str) -> str:
    """``pip install 'hf_constrained[extra]'``."""
    return f"pip install 'hf_constrained[{extra}]'"


def require_extra(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module`` (e.g. ``"matplotlib"``) for ``what`` (e.g. ``"training-curve figures"``),
    or raise :class:`MissingExtraError` naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingExtraError(f"{what} needs the optional package {module!r}, which is not installed: "
                                f"{install_hint(extra)}") from err


def has_module(module: str) -> bool:
    """Whether ``module`` imports (an optional dependency is installed)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


__all__ = ["EXTRAS", "IMPORT_NAMES", "MissingExtraError", "extra_for_module", "has_module", "install_hint",
           "require_extra"]
