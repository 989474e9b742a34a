"""The caching-allocator simulator and what-if replay of recorded snapshots.

``CachingAllocatorSimulator`` is the engine this process runs on (``memlens.allocator.engine``):
the native core when it is built, else the Python reference model, with one API.
"""

from typing import TYPE_CHECKING

from memlens.allocator.engine import simulator_class
from memlens.allocator.replay import WhatIfResult, recorded_figures, whatif
from memlens.allocator.settings import AllocatorSettings
from memlens.allocator.simulator import SimulatedOOM, get_allocation_size

if TYPE_CHECKING:
    from memlens.allocator.simulator import CachingAllocatorSimulator
else:
    CachingAllocatorSimulator = simulator_class()

__all__ = [
    "AllocatorSettings",
    "CachingAllocatorSimulator",
    "SimulatedOOM",
    "WhatIfResult",
    "get_allocation_size",
    "recorded_figures",
    "whatif",
]
