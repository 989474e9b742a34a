"""The caching-allocator simulator and what-if replay of recorded snapshots."""

from memlens.allocator.replay import WhatIfResult, recorded_figures, whatif
from memlens.allocator.settings import AllocatorSettings
from memlens.allocator.simulator import CachingAllocatorSimulator, SimulatedOOM, get_allocation_size

__all__ = [
    "AllocatorSettings",
    "CachingAllocatorSimulator",
    "SimulatedOOM",
    "WhatIfResult",
    "get_allocation_size",
    "recorded_figures",
    "whatif",
]
