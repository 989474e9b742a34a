"""A pure-Python model of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``).

The simulator follows ``DeviceCachingAllocator`` rule for rule: ``round_size``,
``get_allocation_size``, best-fit ``get_free_block`` per (pool, stream) with the
``max_split_size`` oversize rules, ``should_split``, ``alloc_found_block``, ``free_block`` with
``try_merge_blocks``, the ``release_available_cached_blocks`` / ``release_cached_blocks`` retry
path, ``garbage_collect_cached_blocks`` and expandable segments mapped in 2 MiB / 20 MiB pages.
It leaves out what a single-threaded replay cannot see: CUDA graph private pools and
cross-stream ``record_stream`` events (a pending free is modelled by ``request_free`` /
``complete_free``).

Free blocks are kept per (pool, stream) in a sorted list of integer keys ``size << 64 | address``,
so a best-fit lookup is one ``bisect`` and ties go to the lower address, like PyTorch's
``BlockComparatorSize``.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Iterator
from typing import Any

from memlens.allocator.constants import (
    DEFAULT_BASE_ADDRESS,
    DEFAULT_DEVICE_MEMORY,
    DEFAULT_START_TIME_US,
    SEGMENT_ALIGNMENT,
)
from memlens.allocator.settings import AllocatorSettings
from memlens.errors import MemlensOutOfMemory, MemlensUsageError
from memlens.snapshot.block_rules import (
    K_LARGE_BUFFER,
    K_MIN_BLOCK_SIZE,
    K_MIN_LARGE_ALLOC,
    K_ROUND_LARGE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    MAX_MODELLED_ADDRESS,
    MAX_MODELLED_REQUEST,
    round_size,
)
from memlens.units import capacity_bytes, format_bytes

# CUDACachingAllocator.cpp's constants and what the model covers (MAX_MODELLED_*) are declared
# once, with the C++ model and the snapshot's block sizes, in memlens.snapshot.block_rules; the
# model's own defaults (base address, segment alignment, device memory, start time) in
# memlens.allocator.constants.
_KEY_SHIFT = 64
_ADDRESS_MASK = (1 << _KEY_SHIFT) - 1
# A free block's key is its size, then its address as a signed 64-bit pointer (the order of the
# native model's int64 addresses): shifted by 2**63 into the key's low 64 bits, so an address
# at or past 2**63 (read as negative) keeps its place and maps back to itself.
_ADDRESS_OFFSET = 1 << 63

Frames = list[dict[str, Any]]


def _key_address(key: int) -> int:
    """The address of the free block whose key is ``key`` (``_Block.key``)."""
    return (key & _ADDRESS_MASK) - _ADDRESS_OFFSET


class SimulatedOOM(MemlensOutOfMemory):
    """``malloc`` could not be satisfied within the capacity, after freeing cached blocks."""

    def __init__(self, requested: int, rounded: int, device_free: int, allocated: int, reserved: int) -> None:
        self.requested = requested
        self.rounded = rounded
        self.device_free = device_free
        self.allocated = allocated
        self.reserved = reserved
        super().__init__(
            f"simulated CUDA out of memory: tried to allocate {format_bytes(rounded)} with "
            f"{format_bytes(device_free)} free; {format_bytes(allocated)} allocated, "
            f"{format_bytes(reserved)} reserved"
        )


class _ExpandableSegment:
    """A reserved virtual address range whose pages are mapped on demand."""

    __slots__ = ("base", "page_size", "size", "stream")

    def __init__(self, base: int, page_size: int, size: int, stream: int) -> None:
        self.base = base
        self.page_size = page_size
        self.size = size
        self.stream = stream


class _Block:
    """One ``Block``: a piece of a segment, allocated, pending free, cached, or (expandable) unmapped."""

    __slots__ = (
        "address",
        "allocated",
        "expandable",
        "frames",
        "gc_base",
        "is_small",
        "mapped",
        "next",
        "pending",
        "prev",
        "requested_size",
        "segment_frames",
        "size",
        "stream",
    )

    def __init__(self, address: int, size: int, stream: int, is_small: bool) -> None:
        self.address = address
        self.size = size
        self.stream = stream
        self.is_small = is_small
        self.requested_size = 0
        self.allocated = False
        self.pending = False  # freed by the caller, not yet reusable (free_requested only)
        self.mapped = True
        self.expandable: _ExpandableSegment | None = None
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.frames: Frames | None = None
        self.segment_frames: Frames | None = None
        self.gc_base = 0

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    @property
    def key(self) -> int:
        return (self.size << _KEY_SHIFT) | (self.address + _ADDRESS_OFFSET)

    @property
    def end(self) -> int:
        return self.address + self.size


class _Pool:
    """``BlockPool``: cached (free, mapped) blocks by (stream, size, address); unmapped ranges."""

    __slots__ = ("free_calls", "is_small", "keys", "unmapped")

    def __init__(self, is_small: bool) -> None:
        self.is_small = is_small
        self.keys: dict[int, list[int]] = {}  # stream -> sorted size<<64|address
        self.unmapped: dict[int, list[int]] = {}  # stream -> sorted addresses of unmapped blocks
        self.free_calls = 0  # get_free_blocks_call_count, the clock of garbage collection

    def stream_keys(self, stream: int) -> list[int]:
        keys = self.keys.get(stream)
        if keys is None:
            keys = self.keys[stream] = []
        return keys


class CachingAllocatorSimulator:
    """Replays malloc/free through PyTorch's caching-allocator rules for one device.

    ``capacity`` is the memory cudaMalloc may hand out (None = unlimited); ``clock`` returns
    ``time_us`` for trace entries (default: a deterministic counter); ``segment_addresses``,
    if given, is asked ``(size) -> address | None`` where a new segment should live (replays
    use it to put segments where the recorded run's cudaMalloc did, which keeps best-fit ties
    identical); otherwise addresses grow from ``DEFAULT_BASE_ADDRESS``.
    """

    def __init__(
        self,
        settings: AllocatorSettings | None = None,
        capacity: int | None = None,
        device: int = 0,
        record_history: bool = True,
        clock: Callable[[], int] | None = None,
        segment_addresses: Callable[[int], int | None] | None = None,
    ) -> None:
        self.settings = settings or AllocatorSettings()
        if capacity is not None:
            capacity_bytes(capacity)  # the one check of a device's size (memlens.units)
        self.capacity = capacity
        self.device = device
        self.record_history = record_history
        if clock is None:
            counter = itertools.count(DEFAULT_START_TIME_US)
            self._clock: Callable[[], int] = counter.__next__
        else:
            self._clock = clock
        self._segment_addresses = segment_addresses

        self._max_split = self.settings.max_split_size_or_max
        self._divisions = self.settings.divisions
        self._expandable = self.settings.expandable_segments
        self._allowed = self.settings.allowed_bytes(capacity)
        self._gc_enabled = self._allowed is not None and self.settings.garbage_collection_threshold > 0

        self._small = _Pool(is_small=True)
        self._large = _Pool(is_small=False)
        self._free: dict[int, _Block] = {}  # cached mapped blocks by address
        self._unmapped: dict[int, _Block] = {}  # unmapped expandable blocks by address
        self._active: dict[int, _Block] = {}  # allocated or pending-free blocks by address
        self._expandable_segments: list[_ExpandableSegment] = []
        self._next_address = DEFAULT_BASE_ADDRESS
        self._segment_spans: dict[int, int] = {}  # live cudaMalloc ranges and VA reservations
        self._span_starts: list[int] = []  # their starts, sorted: overlap tests are a bisect
        self.trace: list[dict[str, Any]] = []

        self.reserved_bytes = 0
        self.allocated_bytes = 0  # rounded sizes of active blocks (pending frees included)
        self.requested_bytes = 0  # requested sizes of active blocks (pending frees included)
        self.peak_reserved_bytes = 0
        self.peak_allocated_bytes = 0
        self.segment_alloc_count = 0
        self.segment_free_count = 0
        self.segment_map_count = 0
        self.segment_unmap_count = 0
        self.alloc_retries = 0
        self.oom_count = 0

    # ================================================================== public API
    def round_size(self, size: int) -> int:
        """``round_size``: 512-byte multiples, or power-of-2 divisions where configured."""
        return round_size(size, self._divisions)

    def malloc(self, size: int, stream: int = 0, frames: Frames | None = None) -> int:
        """Allocate ``size`` bytes on ``stream``; returns the block address or raises SimulatedOOM."""
        if size < 0:
            raise MemlensUsageError(f"cannot allocate a negative size ({size})")
        if size > MAX_MODELLED_REQUEST:
            raise MemlensUsageError(f"cannot allocate {size} bytes: more than the allocator model covers (2**60)")
        rounded = self.round_size(size)
        pool = self._small if rounded <= K_SMALL_SIZE else self._large
        alloc_size = get_allocation_size(rounded)

        block = self._get_free_block(pool, rounded, stream)
        if block is None:
            if self._gc_enabled:
                self._garbage_collect_cached_blocks(frames)
            block = self._alloc_block(pool, rounded, alloc_size, stream, frames)
            if block is None and self._release_available_cached_blocks(pool, rounded, stream, frames):
                block = self._alloc_block(pool, rounded, alloc_size, stream, frames)
            if block is None:
                self._release_cached_blocks(frames)
                self.alloc_retries += 1
                block = self._alloc_block(pool, rounded, alloc_size, stream, frames)
            if block is None:
                device_free = self._device_free()
                self.oom_count += 1
                self._record("oom", None, rounded, stream, frames, device_free=device_free)
                raise SimulatedOOM(size, rounded, device_free, self.allocated_bytes, self.reserved_bytes)
        split = self._should_split(block, rounded)
        return self._alloc_found_block(pool, block, rounded, size, stream, split, frames)

    def free(self, address: int, frames: Frames | None = None) -> None:
        """Free a block at once: records ``free_requested`` then ``free_completed``."""
        block = self._take_active(address)
        if not block.pending:
            self._mark_freed(block, frames)
        self._free_block(block, frames)

    def request_free(self, address: int, frames: Frames | None = None) -> None:
        """The caller freed it, but another stream may still use it: not reusable yet."""
        block = self._active.get(address)
        if block is None or not block.allocated:
            raise MemlensUsageError(f"free of an address that is not allocated: {address:#x}")
        self._mark_freed(block, frames)
        block.pending = True

    def complete_free(self, address: int, frames: Frames | None = None) -> None:
        """The pending free is done (``free_completed``): the block returns to the cache."""
        block = self._take_active(address)
        if not block.pending:
            self._mark_freed(block, frames)
        self._free_block(block, frames)

    def empty_cache(self, frames: Frames | None = None) -> None:
        """``torch.cuda.empty_cache()``: release every unsplit cached block (unmap free pages)."""
        self._release_cached_blocks(frames)

    def is_allocated(self, address: int) -> bool:
        return address in self._active

    def cached_blocks(self, small: bool, stream: int) -> list[tuple[int, bool]]:
        """``(size, whole_segment)`` of the cached free blocks of one pool on one stream, smallest
        first; ``whole_segment`` when the block is an entire unsplit cudaMalloc'd segment (what
        ``empty_cache()`` would release) rather than a piece of a partly used one. Read only: the
        fragmentation analysis asks it at each cudaMalloc of a replay."""
        pool = self._small if small else self._large
        blocks = (self._free[_key_address(key)] for key in pool.keys.get(stream, ()))
        return [(b.size, not b.is_split and b.expandable is None) for b in blocks]

    def cached_summary(self, small: bool, stream: int, pieces_only: bool = False) -> tuple[int, int, int, int]:
        """``(free bytes, bytes in whole segments, largest block, blocks)`` of ``cached_blocks``
        (``pieces_only``: without the whole segments, as after ``release_cached_blocks``): what
        the fragmentation analysis sums at each cudaMalloc, in one call."""
        blocks = self.cached_blocks(small, stream)
        if pieces_only:
            blocks = [(size, whole) for size, whole in blocks if not whole]
        total = sum(size for size, _ in blocks)
        whole_bytes = sum(size for size, whole in blocks if whole)
        return total, whole_bytes, max((size for size, _ in blocks), default=0), len(blocks)

    def segment_base(self, address: int) -> int | None:
        """Start of the segment (cudaMalloc'd range or expandable reservation) holding ``address``:
        the replay compares where tensors land as (segment, offset), which does not depend on
        where the segments themselves were placed."""
        index = bisect_right(self._span_starts, address) - 1
        if index < 0:
            return None
        start = self._span_starts[index]
        return start if address < start + self._segment_spans[start] else None

    @property
    def device_free_bytes(self) -> int:
        return self._device_free()

    def restore_segment(
        self,
        address: int,
        total_size: int,
        stream: int = 0,
        is_small: bool | None = None,
        live_blocks: list[tuple[int, int, int]] | None = None,
    ) -> None:
        """Recreate a segment that existed before the simulation began (no trace entry).

        ``live_blocks`` holds ``(address, size, requested_size)`` of blocks allocated at that
        moment; the gaps between them become cached free blocks (free neighbours always merge,
        so a gap is one block).
        """
        if is_small is None:
            is_small = total_size <= K_SMALL_BUFFER
        if total_size <= 0 or total_size % K_MIN_BLOCK_SIZE:
            raise MemlensUsageError(f"segment size {total_size} is not a positive multiple of 512")
        if address < 0 or total_size > MAX_MODELLED_REQUEST or address > MAX_MODELLED_ADDRESS:
            raise MemlensUsageError(f"segment {address:#x}+{total_size} lies outside the address space the allocator "
                                    "model covers (0 to 2**62)")
        self._claim_span(address, total_size)
        pool = self._small if is_small else self._large
        pieces: list[_Block] = []
        cursor = address
        end = address + total_size
        for block_address, size, requested in sorted(live_blocks or []):
            if block_address < cursor or block_address + size > end or size <= 0:
                raise MemlensUsageError(f"block {block_address:#x}+{size} does not fit segment {address:#x}")
            if block_address > cursor:
                pieces.append(_Block(cursor, block_address - cursor, stream, is_small))
            live = _Block(block_address, size, stream, is_small)
            live.allocated = True
            live.requested_size = requested
            pieces.append(live)
            cursor = block_address + size
        if cursor < end:
            pieces.append(_Block(cursor, end - cursor, stream, is_small))
        for before, after in itertools.pairwise(pieces):
            before.next = after
            after.prev = before
        for piece in pieces:
            if piece.allocated:
                self._active[piece.address] = piece
                self.allocated_bytes += piece.size
                self.requested_bytes += piece.requested_size
            else:
                self._insert_free(pool, piece)
        self.reserved_bytes += total_size
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)

    # ------------------------------------------------------------------ snapshot
    def snapshot(self) -> dict[str, Any]:
        """The state and history in PyTorch's ``torch.cuda.memory._snapshot()`` schema."""
        segments = [self._segment_dict(head) for head in self._segment_heads()]
        segments.sort(key=lambda s: s["address"])
        traces: list[list[dict[str, Any]]] = [[] for _ in range(self.device + 1)]
        traces[self.device] = list(self.trace)
        return {
            "segments": segments,
            "device_traces": traces,
            "allocator_settings": self.settings.to_snapshot_dict(),
        }

    def iter_blocks(self) -> Iterator[tuple[int, int, str]]:
        """(address, size, state) of every mapped block, segment by segment."""
        for head in self._segment_heads():
            block: _Block | None = head
            while block is not None and block.mapped:
                yield block.address, block.size, _state(block)
                block = block.next

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (used by the property tests)."""
        reserved = 0
        allocated = 0
        seen: set[int] = set()
        for head in self._segment_heads():
            block: _Block | None = head
            cursor = head.address
            while block is not None and block.mapped:
                assert block.address == cursor, f"gap or overlap at {cursor:#x}"
                assert block.address not in seen
                seen.add(block.address)
                if block.allocated or block.pending:
                    assert self._active.get(block.address) is block
                    allocated += block.size
                else:
                    assert self._free.get(block.address) is block
                    nxt = block.next
                    if nxt is not None and nxt.mapped and not self._expandable_block_boundary(block, nxt):
                        assert nxt.allocated or nxt.pending, f"two free neighbours at {block.address:#x}"
                reserved += block.size
                cursor += block.size
                block = block.next
        assert reserved == self.reserved_bytes, (reserved, self.reserved_bytes)
        assert allocated == self.allocated_bytes, (allocated, self.allocated_bytes)
        assert allocated <= reserved
        assert len(seen) == len(self._active) + len(self._free)

    # ================================================================== allocator internals
    def _device_free(self) -> int:
        if self.capacity is None:
            return 1 << 62
        return max(self.capacity - self.reserved_bytes, 0)

    def _take_active(self, address: int) -> _Block:
        block = self._active.pop(address, None)
        if block is None:
            raise MemlensUsageError(f"free of an address that is not allocated: {address:#x}")
        return block

    def _mark_freed(self, block: _Block, frames: Frames | None) -> None:
        block.allocated = False
        frames = frames or block.frames
        self._record("free_requested", block.address, block.requested_size, block.stream, frames)

    def _record(
        self,
        action: str,
        address: int | None,
        size: int,
        stream: int,
        frames: Frames | None,
        device_free: int | None = None,
    ) -> None:
        if not self.record_history:
            return
        entry: dict[str, Any] = {"action": action}
        if address is None:
            entry["device_free"] = device_free
        else:
            entry["addr"] = address
        entry["size"] = size
        entry["stream"] = stream
        entry["time_us"] = self._clock()
        entry["frames"] = list(frames) if frames else []
        self.trace.append(entry)

    # ------------------------------------------------------------------ free index
    def _insert_free(self, pool: _Pool, block: _Block) -> None:
        block.gc_base = pool.free_calls
        self._free[block.address] = block
        insort(pool.stream_keys(block.stream), block.key)

    def _remove_free(self, pool: _Pool, block: _Block) -> None:
        keys = pool.keys[block.stream]
        key = block.key
        index = bisect_left(keys, key)
        assert keys[index] == key
        del keys[index]
        del self._free[block.address]

    def _insert_unmapped(self, pool: _Pool, block: _Block) -> None:
        self._unmapped[block.address] = block
        insort(pool.unmapped.setdefault(block.stream, []), block.address)

    def _remove_unmapped(self, pool: _Pool, block: _Block) -> None:
        addresses = pool.unmapped[block.stream]
        index = bisect_left(addresses, block.address)
        assert addresses[index] == block.address
        del addresses[index]
        del self._unmapped[block.address]

    # ------------------------------------------------------------------ get_free_block
    def _get_free_block(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        if self._gc_enabled:
            pool.free_calls += 1
        keys = pool.keys.get(stream)
        if not keys:
            return None
        index = bisect_left(keys, size << _KEY_SHIFT)
        if index == len(keys):
            return None
        block = self._free[_key_address(keys[index])]
        if block.expandable is not None:
            if self._expandable:
                # Best fit counts the unmapped space after a block as room it can grow into.
                best = _expandable_size(block)
                while block.expandable is not None and index + 1 < len(keys):
                    candidate = self._free[_key_address(keys[index + 1])]
                    candidate_size = _expandable_size(candidate)
                    if candidate_size >= best:
                        break
                    index += 1
                    block, best = candidate, candidate_size
            else:
                # Expandable segments were switched off: only plain blocks qualify.
                index += 1
                while index < len(keys) and self._free[_key_address(keys[index])].expandable is not None:
                    index += 1
                if index == len(keys):
                    return None
                block = self._free[_key_address(keys[index])]
        max_split = self._max_split
        # Do not return an oversized block for a request below max_split_size ...
        if size < max_split and block.size >= max_split:
            return None
        # ... and let an oversize request round up by at most kLargeBuffer.
        if size >= max_split and block.size >= size + K_LARGE_BUFFER:
            return None
        del keys[index]
        del self._free[block.address]
        return block

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.is_small or self._expandable:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self._max_split and remaining > K_SMALL_SIZE

    def _alloc_found_block(
        self,
        pool: _Pool,
        block: _Block,
        size: int,
        requested: int,
        stream: int,
        split: bool,
        frames: Frames | None,
    ) -> int:
        if split:
            # The old Block object becomes the cached remainder, as in PyTorch.
            remaining = block
            block = _Block(remaining.address, size, stream, remaining.is_small)
            block.expandable = remaining.expandable
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = remaining
            block.segment_frames = remaining.segment_frames
            remaining.segment_frames = None
            remaining.prev = block
            remaining.address += size
            remaining.size -= size
            self._insert_free(pool, remaining)
        block.allocated = True
        block.pending = False
        block.requested_size = requested
        block.frames = frames
        self._active[block.address] = block
        self.allocated_bytes += block.size
        self.requested_bytes += requested
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes
        self._record("alloc", block.address, requested, block.stream, frames)
        return block.address

    # ------------------------------------------------------------------ free_block
    def _free_block(self, block: _Block, frames: Frames | None) -> None:
        block.allocated = False
        block.pending = False
        frames = frames or block.frames
        self._record("free_completed", block.address, block.requested_size, block.stream, frames)
        block.frames = None
        self.allocated_bytes -= block.size
        self.requested_bytes -= block.requested_size
        pool = self._small if block.is_small else self._large
        self._try_merge_blocks(pool, block, block.prev)
        self._try_merge_blocks(pool, block, block.next)
        self._insert_free(pool, block)

    def _try_merge_blocks(self, pool: _Pool, dst: _Block, src: _Block | None) -> int:
        if src is None or src.allocated or src.pending or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            self._remove_free(pool, src)
        else:
            self._remove_unmapped(pool, src)
        if dst.prev is src:  # [src dst]
            dst.address = src.address
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
            dst.segment_frames = src.segment_frames
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # ------------------------------------------------------------------ cudaMalloc / cudaFree
    def _alloc_block(
        self, pool: _Pool, size: int, alloc_size: int, stream: int, frames: Frames | None
    ) -> _Block | None:
        if self._allowed is not None and self.reserved_bytes + alloc_size > self._allowed:
            return None
        if self._expandable:
            return self._try_allocate_expandable_block(pool, size, stream, frames)
        if self.capacity is not None and self.reserved_bytes + alloc_size > self.capacity:
            return None
        address = self._new_segment_address(alloc_size)
        block = _Block(address, alloc_size, stream, pool.is_small)
        block.segment_frames = frames
        self._add_span(address, alloc_size)
        self.reserved_bytes += alloc_size
        if self.reserved_bytes > self.peak_reserved_bytes:
            self.peak_reserved_bytes = self.reserved_bytes
        self.segment_alloc_count += 1
        self._record("segment_alloc", address, alloc_size, stream, frames)
        return block

    def _new_segment_address(self, size: int) -> int:
        if self._segment_addresses is not None:
            hinted = self._segment_addresses(size)
            if hinted is not None and not self._overlaps(hinted, size):
                self._next_address = max(self._next_address, _align_up(hinted + size, SEGMENT_ALIGNMENT))
                return hinted
        address = self._next_address
        while self._overlaps(address, size):
            address = _align_up(address + size, SEGMENT_ALIGNMENT)
        self._next_address = _align_up(address + size, SEGMENT_ALIGNMENT)
        return address

    def _overlaps(self, address: int, size: int) -> bool:
        # Spans never overlap each other, so of those starting before ``end`` the last one ends
        # last: one bisect instead of a scan (a scan per new segment made 150,000 segments,
        # e.g. one per stream, take hours).
        before_end = bisect_left(self._span_starts, address + size)
        if before_end == 0:
            return False
        start = self._span_starts[before_end - 1]
        return address < start + self._segment_spans[start]

    def _add_span(self, address: int, size: int) -> None:
        if address not in self._segment_spans:
            insort(self._span_starts, address)
        self._segment_spans[address] = size

    def _drop_span(self, address: int) -> None:
        if self._segment_spans.pop(address, None) is not None:
            del self._span_starts[bisect_left(self._span_starts, address)]

    def _claim_span(self, address: int, size: int) -> None:
        if self._overlaps(address, size):
            raise MemlensUsageError(f"segment {address:#x}+{size} overlaps an existing segment")
        self._add_span(address, size)
        self._next_address = max(self._next_address, _align_up(address + size, SEGMENT_ALIGNMENT))

    def _release_block(self, pool: _Pool, block: _Block, frames: Frames | None) -> None:
        """cudaFree of a whole, unsplit, cached segment."""
        self._remove_free(pool, block)
        self._drop_span(block.address)
        self.reserved_bytes -= block.size
        self.segment_free_count += 1
        self._record("segment_free", block.address, block.size, block.stream, frames or block.segment_frames)

    def _release_available_cached_blocks(self, pool: _Pool, size: int, stream: int, frames: Frames | None) -> bool:
        """Free oversize cached blocks, only as many as the request needs (max_split_size set)."""
        if self.settings.max_split_size is None:
            return False
        keys = pool.keys.get(stream) or []
        target = max(size, self._max_split)
        index = bisect_left(keys, target << _KEY_SHIFT)
        if index < len(keys):
            block = self._free[_key_address(keys[index])]
            if block.expandable is not None or block.is_split:
                return False
            self._release_block(pool, block, frames)
            return True
        released = 0
        # No single block is big enough: free the largest oversize ones until enough is freed.
        for key in reversed(list(keys)):
            if released >= target:
                break
            block = self._free[_key_address(key)]
            if block.size < self._max_split:
                break
            if block.expandable is not None or block.is_split:
                continue
            released += block.size
            self._release_block(pool, block, frames)
        return released >= target

    def _release_cached_blocks(self, frames: Frames | None) -> None:
        for pool in (self._large, self._small):
            to_unmap: list[_Block] = []
            for stream in sorted(pool.keys):
                for key in list(pool.keys[stream]):
                    block = self._free[_key_address(key)]
                    if block.expandable is not None:
                        to_unmap.append(block)
                    elif not block.is_split:
                        self._release_block(pool, block, frames)
            for block in to_unmap:
                self._unmap_block(pool, block, frames)
                if block.prev is None and block.next is None:
                    self._release_expandable_segment(pool, block)

    def _garbage_collect_cached_blocks(self, frames: Frames | None) -> None:
        """Free old unsplit large cached blocks until reserved drops below the threshold."""
        assert self._allowed is not None
        gc_threshold = int(self.settings.garbage_collection_threshold * self._allowed)
        if self.reserved_bytes <= gc_threshold:
            return
        target = self.reserved_bytes - gc_threshold
        pool = self._large
        candidates = [self._free[_key_address(key)] for stream in sorted(pool.keys) for key in pool.keys[stream]]
        freeable = [b for b in candidates if not b.is_split]
        if not freeable:
            return
        total_age = sum(pool.free_calls - b.gc_base for b in freeable)
        count = len(freeable)
        reclaimed = 0
        block_freed = True
        while reclaimed < target and block_freed and count > 0:
            age_threshold = total_age / count
            block_freed = False
            for stream in sorted(pool.keys):
                for key in list(pool.keys[stream]):
                    block = self._free[_key_address(key)]
                    age = pool.free_calls - block.gc_base
                    if not block.is_split and block.expandable is None and age >= age_threshold:
                        block_freed = True
                        reclaimed += block.size
                        total_age -= age
                        count -= 1
                        self._release_block(pool, block, frames)

    # ------------------------------------------------------------------ expandable segments
    def _try_allocate_expandable_block(
        self, pool: _Pool, size: int, stream: int, frames: Frames | None
    ) -> _Block | None:
        candidate = self._find_expandable_block(pool, size, stream)
        if not candidate.mapped and not self._map_block(pool, candidate, min(candidate.size, size), frames):
            return None
        while candidate.size < size:
            nxt = candidate.next
            assert nxt is not None and not nxt.mapped
            if not self._map_block(pool, nxt, min(size - candidate.size, nxt.size), frames):
                return None
            candidate = nxt
        self._remove_free(pool, candidate)
        return candidate

    def _find_expandable_block(self, pool: _Pool, size: int, stream: int) -> _Block:
        for address in pool.unmapped.get(stream, []):
            candidate = self._unmapped[address]
            if _allocatable(candidate.prev):
                assert candidate.prev is not None
                candidate = candidate.prev
            room = 0
            probe: _Block | None = candidate
            while room < size and _allocatable(probe):
                assert probe is not None
                room += probe.size
                probe = probe.next
            if room >= size:
                return candidate
        page = K_SMALL_BUFFER if pool.is_small else K_LARGE_BUFFER
        device_memory = self.capacity or max(DEFAULT_DEVICE_MEMORY, size)
        handles = -(-(device_memory + device_memory // 8) // page)
        va_size = handles * page
        base = self._new_segment_address(va_size)
        self._add_span(base, va_size)
        segment = _ExpandableSegment(base, page, va_size, stream)
        self._expandable_segments.append(segment)
        block = _Block(base, va_size, stream, pool.is_small)
        block.mapped = False
        block.expandable = segment
        self._insert_unmapped(pool, block)
        return block

    def _map_block(self, pool: _Pool, block: _Block, size: int, frames: Frames | None) -> bool:
        segment = block.expandable
        assert segment is not None and not block.mapped and size <= block.size
        offset = block.address - segment.base
        assert offset % segment.page_size == 0
        end = -(-(offset + size) // segment.page_size) * segment.page_size
        mapped = end - offset
        if self.capacity is not None and self.reserved_bytes + mapped > self.capacity:
            return False
        self._remove_unmapped(pool, block)
        block.mapped = True
        if mapped < block.size:
            remaining = _Block(block.address + mapped, block.size - mapped, block.stream, block.is_small)
            remaining.mapped = False
            remaining.expandable = segment
            remaining.prev = block
            remaining.next = block.next
            if block.next is not None:
                block.next.prev = remaining
            block.next = remaining
            self._insert_unmapped(pool, remaining)
            block.size = mapped
        mapped_address = block.address
        self._try_merge_blocks(pool, block, block.prev)
        self._try_merge_blocks(pool, block, block.next)
        self._insert_free(pool, block)
        self.reserved_bytes += mapped
        if self.reserved_bytes > self.peak_reserved_bytes:
            self.peak_reserved_bytes = self.reserved_bytes
        self.segment_map_count += 1
        self._record("segment_map", mapped_address, mapped, block.stream, frames)
        if block.prev is None and block.segment_frames is None:
            block.segment_frames = frames
        return True

    def _unmap_block(self, pool: _Pool, block: _Block, frames: Frames | None) -> None:
        segment = block.expandable
        assert segment is not None
        page = segment.page_size
        offset = block.address - segment.base
        begin = -(-offset // page) * page
        end = ((offset + block.size) // page) * page
        if begin >= end:
            return
        self._remove_free(pool, block)
        unmapped_address = segment.base + begin
        unmapped_size = end - begin
        before = unmapped_address - block.address
        if before > 0:
            before_free = _Block(block.address, before, block.stream, block.is_small)
            before_free.expandable = segment
            before_free.prev = block.prev
            if block.prev is not None:
                block.prev.next = before_free
            before_free.next = block
            block.prev = before_free
            self._insert_free(pool, before_free)
        after = block.size - before - unmapped_size
        if after > 0:
            after_free = _Block(unmapped_address + unmapped_size, after, block.stream, block.is_small)
            after_free.expandable = segment
            after_free.next = block.next
            if block.next is not None:
                block.next.prev = after_free
            after_free.prev = block
            block.next = after_free
            self._insert_free(pool, after_free)
        block.address = unmapped_address
        block.size = unmapped_size
        block.mapped = False
        self._try_merge_blocks(pool, block, block.prev)
        self._try_merge_blocks(pool, block, block.next)
        self._insert_unmapped(pool, block)
        self.reserved_bytes -= unmapped_size
        self.segment_unmap_count += 1
        frames = frames or block.segment_frames
        self._record("segment_unmap", unmapped_address, unmapped_size, block.stream, frames)

    def _release_expandable_segment(self, pool: _Pool, block: _Block) -> None:
        segment = block.expandable
        assert segment is not None and block.size == segment.size and not block.mapped
        self._remove_unmapped(pool, block)
        self._expandable_segments.remove(segment)
        self._drop_span(segment.base)

    @staticmethod
    def _expandable_block_boundary(block: _Block, nxt: _Block) -> bool:
        return block.mapped != nxt.mapped

    # ------------------------------------------------------------------ snapshot helpers
    def _segment_heads(self) -> list[_Block]:
        heads = [
            b
            for b in itertools.chain(self._free.values(), self._active.values())
            if b.prev is None or not b.prev.mapped
        ]
        heads.sort(key=lambda b: b.address)
        return heads

    def _segment_dict(self, head: _Block) -> dict[str, Any]:
        blocks = []
        total = allocated = active = requested = 0
        block: _Block | None = head
        while block is not None and block.mapped:
            state = _state(block)
            blocks.append(
                {
                    "address": block.address,
                    "size": block.size,
                    "requested_size": block.requested_size,
                    "state": state,
                    "frames": list(block.frames or []),
                }
            )
            total += block.size
            if state == "active_allocated":
                allocated += block.size
            if state != "inactive":
                active += block.size
                requested += block.requested_size
            block = block.next
        return {
            "device": self.device,
            "address": head.address,
            "total_size": total,
            "allocated_size": allocated,
            "active_size": active,
            "requested_size": requested,
            "stream": head.stream,
            "segment_type": "small" if head.is_small else "large",
            "segment_pool_id": (0, 0),
            "is_expandable": head.expandable is not None,
            "frames": list(head.segment_frames or []),
            "blocks": blocks,
        }


def get_allocation_size(size: int) -> int:
    """``get_allocation_size``: the cudaMalloc size for a rounded request with no cached fit."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


def _expandable_size(block: _Block) -> int:
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


def _allocatable(block: _Block | None) -> bool:
    return block is not None and not block.allocated and not block.pending


def _state(block: _Block) -> str:
    if block.allocated:
        return "active_allocated"
    if block.pending:
        return "active_pending_free"
    return "inactive"


def _align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment
