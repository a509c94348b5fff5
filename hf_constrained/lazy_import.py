"""Names of a package imported on first access (PEP 562), so that importing the package
(and starting the ``hf-constrained`` command line) does not load torch or transformers."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any


def lazy_attributes(package: str, modules: Mapping[str, str],
                    namespace: MutableMapping[str, Any]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``package``: ``name`` is read from the module
    ``modules[name]`` (relative to ``package``) on first access and stored in ``namespace``
    (the package's ``globals()``), so later lookups skip the hook."""

    def __getattr__(name: str) -> Any:
        if name in modules:
            value = getattr(importlib.import_module(modules[name], package), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
