"""Which engine runs: the native extensions or their Python references, for the whole process.

The snapshot's passes over a trace's columns (block sizes, lifetime pairing, curves, the timeline's envelope) run in
``memlens.snapshot._kernels`` when it is built; the allocator model runs in ``memlens._native``
(``memlens.allocator.engine``, which asks here), the scanner in ``memlens._scan``.
``MEMLENS_PURE_PYTHON=1`` runs every one of them on Python, the reference the differential tests
hold the native code to. An extension that cannot be imported (a checkout run without building
it, a wheel for another platform) is not an error: memlens runs that part on Python and says so
once per process, on stderr, however many extensions are missing.
"""

from __future__ import annotations

import importlib
import os
import sys
from functools import cache
from types import ModuleType

PURE_PYTHON_ENV = "MEMLENS_PURE_PYTHON"
NATIVE = "native"
PYTHON = "python"

_said_missing: list[str] = []  # the extensions whose absence this process has reported


def pure_python_requested() -> bool:
    return os.environ.get(PURE_PYTHON_ENV, "").strip().lower() not in ("", "0", "false", "no")


def native_extension(name: str) -> ModuleType | None:
    """The extension module ``name`` (``memlens._native``), or None when the Python engine runs
    it (asked for, or not built)."""
    if pure_python_requested():
        return None
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if not _said_missing:
            sys.stderr.write(
                f"memlens: the native core is not available ({exc}); running on the Python engine "
                "(slower, same answers). Reinstall with a C++17 compiler to build it: pip install -e .\n"
            )
        _said_missing.append(name)
        return None


@cache
def native_kernels() -> ModuleType | None:
    """``memlens.snapshot._kernels``, or None when the snapshot's passes run on Python."""
    return native_extension("memlens.snapshot._kernels")


def kernels_engine_name() -> str:
    """``native`` or ``python``: the engine this process runs the snapshot's passes on."""
    return NATIVE if native_kernels() is not None else PYTHON
