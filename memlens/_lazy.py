"""Names a package imports on first use (PEP 562), so that importing one small module of it never
imports the rest: a cached ``memlens triage`` needs neither numpy nor the analysis.

``__getattr__, __dir__ = lazy_names(__name__, {"Report": "memlens.analysis.report", ...})`` in a
package's ``__init__``: each name is taken from the module it maps to on first use (a name that
maps to ``<package>.<name>`` is that submodule itself), then bound in the package, so later
lookups never come back here. The package keeps its ``TYPE_CHECKING`` imports for mypy and IDEs.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, homes: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose names ``homes`` maps to their modules."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(home)
        value = module if home == f"{package}.{name}" else getattr(module, name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(homes))

    return __getattr__, __dir__
