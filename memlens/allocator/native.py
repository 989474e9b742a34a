"""The caching-allocator model on the native core, under the Python model's API.

``NativeCachingAllocatorSimulator`` takes the constructor of
``memlens.allocator.simulator.CachingAllocatorSimulator`` and answers the same calls (``malloc``,
``free``, ``request_free``, ``complete_free``, ``empty_cache``, ``round_size``, the counters,
``trace``, ``snapshot()``): predict and the CPU recorder drive it step by step, and the what-if
replay runs whole traces through ``memlens._native.replay`` in one call. Importing this module
needs the extension; ``memlens.allocator.engine`` decides whether to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from memlens import _native
from memlens.allocator.settings import AllocatorSettings
from memlens.units import capacity_bytes

Frames = list[dict[str, Any]]


class NativeCachingAllocatorSimulator(_native.Simulator):
    """``CachingAllocatorSimulator`` with its state and rules in C++ (see src/native/)."""

    def __init__(
        self,
        settings: AllocatorSettings | None = None,
        capacity: int | None = None,
        device: int = 0,
        record_history: bool = True,
        clock: Callable[[], int] | None = None,
        segment_addresses: Callable[[int], int | None] | None = None,
    ) -> None:
        settings = settings or AllocatorSettings()
        if capacity is not None:
            capacity_bytes(capacity)  # the one check of a device's size (memlens.units)
        # The limit both engines compute the same way (AllocatorSettings.allowed_bytes).
        allowed = settings.allowed_bytes(capacity)
        gc_enabled = allowed is not None and settings.garbage_collection_threshold > 0
        gc_threshold = int(settings.garbage_collection_threshold * allowed) if allowed is not None else 0
        self.settings = settings
        self.capacity = capacity
        self.device = device
        self.trace: list[dict[str, Any]] = []
        super().__init__(
            settings.max_split_size,
            list(settings.divisions),
            settings.expandable_segments,
            capacity,
            allowed,
            gc_threshold,
            gc_enabled,
            record_history,
            clock,
            segment_addresses,
            self.trace,
            device,
        )

    def restore_segment(
        self,
        address: int,
        total_size: int,
        stream: int = 0,
        is_small: bool | None = None,
        live_blocks: list[tuple[int, int, int]] | None = None,
    ) -> None:
        """Recreate a segment that existed before the simulation began (no trace entry)."""
        self._restore_segment(address, total_size, stream, is_small, list(live_blocks or []))

    def snapshot(self) -> dict[str, Any]:
        """The state and history in PyTorch's ``torch.cuda.memory._snapshot()`` schema."""
        traces: list[list[dict[str, Any]]] = [[] for _ in range(self.device + 1)]
        traces[self.device] = list(self.trace)
        return {
            "segments": self._segments(),
            "device_traces": traces,
            "allocator_settings": self.settings.to_snapshot_dict(),
        }

    def iter_blocks(self) -> Iterator[tuple[int, int, str]]:
        """(address, size, state) of every mapped block, segment by segment."""
        yield from self._blocks()

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (used by the property tests)."""
        problem = self._check_invariants()
        assert not problem, problem
