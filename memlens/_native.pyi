# Types of the native core (src/native/bindings.cpp), for mypy; its Python face is
# memlens.allocator.native.NativeCachingAllocatorSimulator.
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

class Simulator:
    def __init__(
        self,
        max_split_size: int | None,
        divisions: list[int],
        expandable_segments: bool,
        capacity: int | None,
        allowed: int | None,
        gc_threshold_bytes: int,
        gc_enabled: bool,
        record_history: bool,
        clock: Callable[[], int] | None,
        segment_addresses: Callable[[int], int | None] | None,
        trace: list[dict[str, Any]],
        device: int,
    ) -> None: ...
    def round_size(self, size: int) -> int: ...
    def malloc(self, size: int, stream: int = 0, frames: list[dict[str, Any]] | None = None) -> int: ...
    def free(self, address: int, frames: list[dict[str, Any]] | None = None) -> None: ...
    def request_free(self, address: int, frames: list[dict[str, Any]] | None = None) -> None: ...
    def complete_free(self, address: int, frames: list[dict[str, Any]] | None = None) -> None: ...
    def empty_cache(self, frames: list[dict[str, Any]] | None = None) -> None: ...
    def is_allocated(self, address: int) -> bool: ...
    def cached_blocks(self, small: bool, stream: int) -> list[tuple[int, bool]]: ...
    def cached_summary(self, small: bool, stream: int, pieces_only: bool = False) -> tuple[int, int, int, int]: ...
    def segment_base(self, address: int) -> int | None: ...
    def _restore_segment(
        self, address: int, total_size: int, stream: int, is_small: bool | None, live: list[tuple[int, int, int]]
    ) -> None: ...
    def _segments(self) -> list[dict[str, Any]]: ...
    def _blocks(self) -> list[tuple[int, int, str]]: ...
    def _check_invariants(self) -> str: ...
    @property
    def device_free_bytes(self) -> int: ...
    record_history: bool
    reserved_bytes: int
    allocated_bytes: int
    requested_bytes: int
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    segment_alloc_count: int
    segment_free_count: int
    segment_map_count: int
    segment_unmap_count: int
    alloc_retries: int
    oom_count: int

def replay(
    simulator: Simulator,
    actions: npt.NDArray[np.int8],
    addresses: npt.NDArray[np.int64],
    sizes: npt.NDArray[np.int64],
    streams: npt.NDArray[np.int64],
    completes: npt.NDArray[np.uint8],
    empty_cache_at: npt.NDArray[np.uint8],
    hint_addresses: npt.NDArray[np.int64],
    hint_sizes: npt.NDArray[np.int64],
    use_recorded_addresses: bool,
    seeded_live: list[int],
    recorded_initial: list[tuple[int, int]],
    over_capacity: bool,
    observer: Callable[[int, Any], None] | None,
) -> dict[str, Any]: ...
def completed_requests(actions: npt.NDArray[np.int8], addresses: npt.NDArray[np.int64]) -> npt.NDArray[np.uint8]: ...
def first_block_events(
    actions: npt.NDArray[np.int8], addresses: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...
def get_allocation_size(size: int) -> int: ...

# The constants this extension was built with, by their Python names (the one declaration:
# memlens.snapshot.block_rules, memlens.allocator.constants, memlens.snapshot.model.Action).
DECLARED: dict[str, int]
