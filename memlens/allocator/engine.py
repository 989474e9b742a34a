"""Which engine runs the caching-allocator model: the native core or the Python reference.

The native core (``memlens._native``, C++17, built by ``pip install``) is used whenever it
imports; ``MEMLENS_PURE_PYTHON=1`` forces the Python model (``memlens.allocator.simulator``),
which stays the reference the differential tests hold the native one to. The switch, and the one
note on stderr when an extension cannot be imported, are the process's
(``memlens.snapshot.engine``, which chooses for the snapshot's own passes the same way).
"""

from __future__ import annotations

from functools import cache
from types import ModuleType
from typing import TYPE_CHECKING

from memlens.snapshot.engine import NATIVE, PYTHON, native_extension

if TYPE_CHECKING:
    from memlens.allocator.simulator import CachingAllocatorSimulator


@cache
def native_module() -> ModuleType | None:
    """``memlens._native``, or None when the Python engine runs (asked for, or no extension)."""
    return native_extension("memlens._native")


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
