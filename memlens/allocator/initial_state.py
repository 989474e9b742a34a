"""What the allocator held when a recorded window opened: the seed of a mid-run replay.

A snapshot's history is a window (``record_memory_history`` may start after the process has
been running, and the ring buffer drops the oldest entries), but its segments are the state at
the end. A replay that started from an empty allocator would have to open segments the real one
already had, and frees of tensors allocated before the window would have nothing to free. So a
window that opened mid-run is seeded with the state at its first event, inferred backwards:

* **Segments**: the final segments, minus those the window opened (a ``segment_alloc`` for
  that address not undone by a later ``segment_free``), plus those the window closed without
  opening them first (a ``segment_free`` of an address never ``segment_alloc``-ed in the
  window: it existed before the window). An expandable segment is left out when the window
  maps pages (its extent at the start cannot be told from the end state; the replay's own
  ``segment_map`` calls rebuild it).
* **Live blocks** in those segments: the final live blocks that the window never touched (they
  were live all along), plus every address whose first event in the window is a free (it was
  allocated before the window). A block known only from its free has no recorded block size:
  it gets the rounded request size, extended over the gap to the next known block when that gap
  could only be the tail ``should_split`` keeps (see ``_block_sizes``).

A complete history (every segment opened inside the window, every freed address allocated in
it) infers nothing: the seed is empty and the replay starts from an empty allocator, exactly
as the process did. The inference is fair to the recorded settings only: it assumes the
allocator that produced the window's first state is the one that recorded it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from memlens.allocator.settings import AllocatorSettings
from memlens.allocator.simulator import K_SMALL_BUFFER, K_SMALL_SIZE, CachingAllocatorSimulator
from memlens.snapshot.model import Action, Segment

_ALLOC = int(Action.ALLOC)
_FREE_COMPLETED = int(Action.FREE_COMPLETED)
_SEGMENT_ALLOC = int(Action.SEGMENT_ALLOC)
_SEGMENT_FREE = int(Action.SEGMENT_FREE)
_SEGMENT_MAPS = (int(Action.SEGMENT_MAP), int(Action.SEGMENT_UNMAP))


@dataclass
class InitialSegment:
    """One segment that existed when the window opened, with the blocks live in it then.

    ``live`` holds ``(address, block size, requested size)`` in address order; ``source`` says
    why the segment is believed to predate the window: ``"final state"`` (still there at the
    end, not opened in the window) or ``"freed in window"`` (closed by the window, never opened
    in it)."""

    address: int
    size: int
    stream: int
    is_small: bool
    source: str
    live: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class InitialState:
    """The inferred state at the window's first event: empty for a complete history."""

    segments: list[InitialSegment] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Frees whose address lies in no inferred segment (dropped from the seed).
    unplaced_frees: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.segments

    @property
    def live_blocks(self) -> int:
        return sum(len(s.live) for s in self.segments)

    @property
    def reserved_bytes(self) -> int:
        return sum(s.size for s in self.segments)


def infer_initial_state(
    actions: Sequence[int] | np.ndarray,
    addresses: Sequence[int] | np.ndarray,
    sizes: Sequence[int] | np.ndarray,
    streams: Sequence[int] | np.ndarray,
    final_segments: Sequence[Segment],
    recorded_settings: AllocatorSettings,
) -> InitialState:
    """The segments and live blocks that existed before the window's first event.

    ``actions`` .. ``streams`` are the window's columns (``Action`` codes; lists or int64
    arrays); ``final_segments``
    the device's segments at the end; ``recorded_settings`` round the sizes of blocks known only
    from their free.
    """
    state = InitialState()
    opened: set[int] = set()
    closed_before_opened: dict[int, InitialSegment] = {}
    maps_pages = False
    # Only segment rows decide this pass: numpy picks them out of the window (a Python scan of
    # every row was a second's work on a 1M-row trace), and the loop reads those alone.
    # The codes in their own type, a byte a row: an int64 copy held 32 MB for a 4M-row trace.
    codes = actions if isinstance(actions, np.ndarray) else np.asarray(actions, dtype=np.int64)
    rows = np.flatnonzero(np.isin(codes, (_SEGMENT_ALLOC, _SEGMENT_FREE, *_SEGMENT_MAPS)))

    def picked(column: Sequence[int] | np.ndarray) -> list[int]:  # the rows first, then as ints
        return np.asarray(column)[rows].astype(np.int64).tolist() if len(rows) else []

    segment_rows = zip(picked(codes), picked(addresses), picked(sizes), picked(streams), strict=True)
    for act, address, size, stream in segment_rows:
        if act == _SEGMENT_ALLOC:
            opened.add(address)
        elif act == _SEGMENT_FREE:
            if address in opened:
                opened.discard(address)
            elif address not in closed_before_opened:
                closed_before_opened[address] = InitialSegment(
                    address, size, stream, size <= K_SMALL_BUFFER, "freed in window"
                )
        elif act in _SEGMENT_MAPS:
            maps_pages = True

    initial: dict[int, InitialSegment] = dict(closed_before_opened)
    final_live: list[tuple[int, int, int]] = []
    for segment in final_segments:
        if segment.address in opened:
            continue
        if segment.is_expandable and maps_pages:
            continue
        initial[segment.address] = InitialSegment(
            segment.address, segment.total_size, segment.stream, segment.segment_type == "small", "final state"
        )
        final_live.extend((b.address, b.size, b.requested_size) for b in segment.blocks if b.is_active)
    if maps_pages and any(s.is_expandable for s in final_segments):
        state.notes.append("expandable segments mapped during the window are rebuilt by the replay")
    if not initial:
        return state
    # The first event of each address the window touches says whether it was live at the start:
    # an alloc means it was not (or was freed and reused before: then the final state decides
    # nothing either), a free means it was allocated before the window opened.
    codes = np.asarray(codes)
    touched, first_rows = first_block_events(codes, np.asarray(addresses))
    touched_addresses = set(touched.tolist())
    live: dict[int, tuple[int, int]] = {}  # address -> (block size, 0 = unknown; requested)
    for address, size, requested in final_live:
        if address not in touched_addresses:
            live[address] = (size, requested)
    freed_first = first_rows[codes[first_rows] != _ALLOC]
    freed_addresses = np.asarray(addresses)[freed_first].astype(np.int64).tolist()
    freed_sizes = np.asarray(sizes)[freed_first].astype(np.int64).tolist()
    for address, requested in zip(freed_addresses, freed_sizes, strict=True):
        live[address] = (0, requested)

    starts = sorted(initial)
    ordered = [initial[a] for a in starts]
    for address in sorted(live):
        index = bisect_right(starts, address) - 1
        if index < 0 or address >= ordered[index].address + ordered[index].size:
            state.unplaced_frees += 1
            continue
        size, requested = live[address]
        ordered[index].live.append((address, size, requested))
    if state.unplaced_frees:
        state.notes.append(f"{state.unplaced_frees} free(s) of addresses outside every known segment were ignored")
    rounder = CachingAllocatorSimulator(recorded_settings, record_history=False)
    for seeded in ordered:
        seeded.live = _block_sizes(seeded, rounder)
    state.segments = ordered
    return state


def first_block_events(codes: np.ndarray, addresses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each address's first block event (alloc, free_requested or free_completed): the addresses
    and their rows, both int64. The native engine's one pass over a hash map; else numpy's stable
    unique (which keeps each address's earliest row), the reference it is tested against. A Python
    pass over every row was a fifth of a 1M-row triage, the unique 1 s of a 4M-row one."""
    from memlens.allocator.engine import native_module

    native = native_module()
    if native is not None:
        return native.first_block_events(np.ascontiguousarray(codes, dtype=np.int8),
                                         np.ascontiguousarray(addresses, dtype=np.int64))
    block_rows = np.flatnonzero(codes <= _FREE_COMPLETED)
    touched, first = np.unique(np.asarray(addresses, dtype=np.int64)[block_rows], return_index=True)
    return touched, block_rows[first].astype(np.int64)


def _block_sizes(segment: InitialSegment, rounder: CachingAllocatorSimulator) -> list[tuple[int, int, int]]:
    """Give blocks known only by their requested size a block size, in address order.

    A large-pool block keeps the tail it was carved from when the remainder would have been
    1 MiB or less (``should_split``), and every cached large-pool block is over 1 MiB, so a gap
    of at most 1 MiB after a live block belongs to that block. A block that would overlap the
    next one is cut at it (the final state, which knows the real sizes, wins).
    """
    result: list[tuple[int, int, int]] = []
    end = segment.address + segment.size
    blocks = segment.live
    for i, (address, size, requested) in enumerate(blocks):
        boundary = blocks[i + 1][0] if i + 1 < len(blocks) else end
        if size == 0:
            size = rounder.round_size(requested)
            gap = boundary - (address + size)
            if not segment.is_small and 0 < gap <= K_SMALL_SIZE:
                size += gap
        if address + size > boundary:
            if result or boundary > address:
                size = boundary - address
            if size <= 0:
                continue
        result.append((address, size, requested))
    return result


__all__ = ["InitialSegment", "InitialState", "infer_initial_state"]
