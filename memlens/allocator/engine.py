"""Which engine runs the caching-allocator model: the native core or the Python reference.

The native core (``memlens._native``, C++17, built by ``pip install``) is used whenever it
imports; ``MEMLENS_PURE_PYTHON=1`` forces the Python model (``memlens.allocator.simulator``),
which stays the reference the differential tests hold the native one to. An extension that
cannot be imported (a checkout run without building it, a wheel for another platform) is not an
error: memlens runs on Python and says so once per process, on stderr.
"""

from __future__ import annotations

import os
import sys
from functools import cache
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memlens.allocator.simulator import CachingAllocatorSimulator

PURE_PYTHON_ENV = "MEMLENS_PURE_PYTHON"
NATIVE = "native"
PYTHON = "python"


def pure_python_requested() -> bool:
    return os.environ.get(PURE_PYTHON_ENV, "").strip().lower() not in ("", "0", "false", "no")


@cache
def native_module() -> ModuleType | None:
    """``memlens._native``, or None when the Python engine runs (asked for, or no extension)."""
    if pure_python_requested():
        return None
    try:
        from memlens import _native
    except ImportError as exc:
        sys.stderr.write(
            f"memlens: the native core is not available ({exc}); running on the Python engine "
            "(slower, same answers). Reinstall with a C++17 compiler to build it: pip install -e .\n"
        )
        return None
    return _native


def engine_name() -> str:
    """``native`` or ``python``: the engine this process runs the allocator model on."""
    return NATIVE if native_module() is not None else PYTHON


def simulator_class() -> type[CachingAllocatorSimulator]:
    """The class ``memlens.allocator.CachingAllocatorSimulator`` names: the native model when it
    imports, else the Python reference (same constructor, same calls, same answers)."""
    if native_module() is not None:
        from memlens.allocator.native import NativeCachingAllocatorSimulator

        # The native class answers every call of the Python one (the differential tests hold it to
        # that); it is not its subclass, so the type is asserted here.
        return NativeCachingAllocatorSimulator  # type: ignore[return-value]
    from memlens.allocator.simulator import CachingAllocatorSimulator

    return CachingAllocatorSimulator
