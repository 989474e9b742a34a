"""The caching-allocator simulator and what-if replay of recorded snapshots.

``CachingAllocatorSimulator`` is the engine this process runs on (``memlens.allocator.engine``):
the native core when it is built, else the Python reference model, with one API.

The names are imported on first use (PEP 562), so importing one small module of this package
(``engine``, ``settings``) does not import the replay, the snapshot model and numpy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memlens._lazy import lazy_names

if TYPE_CHECKING:
    from memlens.allocator.replay import WhatIfResult as WhatIfResult
    from memlens.allocator.replay import recorded_figures as recorded_figures
    from memlens.allocator.replay import whatif as whatif
    from memlens.allocator.settings import AllocatorSettings as AllocatorSettings
    from memlens.allocator.simulator import CachingAllocatorSimulator as CachingAllocatorSimulator
    from memlens.allocator.simulator import SimulatedOOM as SimulatedOOM
    from memlens.allocator.simulator import get_allocation_size as get_allocation_size

_HOMES = {
    **dict.fromkeys(("WhatIfResult", "recorded_figures", "whatif"), "memlens.allocator.replay"),
    "AllocatorSettings": "memlens.allocator.settings",
    **dict.fromkeys(("SimulatedOOM", "get_allocation_size"), "memlens.allocator.simulator"),
}


_lazy_getattr, _lazy_dir = lazy_names(__name__, _HOMES)


def __getattr__(name: str) -> Any:
    if name != "CachingAllocatorSimulator":
        return _lazy_getattr(name)
    from memlens.allocator.engine import simulator_class

    value = globals()[name] = simulator_class()  # the engine this process runs on
    return value


def __dir__() -> list[str]:
    return sorted({*_lazy_dir(), "CachingAllocatorSimulator"})


__all__ = [
    "AllocatorSettings",
    "CachingAllocatorSimulator",
    "SimulatedOOM",
    "WhatIfResult",
    "get_allocation_size",
    "recorded_figures",
    "whatif",
]
