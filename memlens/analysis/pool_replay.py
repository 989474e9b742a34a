"""The caching allocator's pools as a replay of the trace held them: what the fragmentation and
OOM finders judge a cudaMalloc and an out-of-memory by.

One replay serves both finders of one device: ``DeviceContext.allocator_evidence`` computes it
the first time a finder asks and holds it for the other (see ``memlens.analysis.context``).
This module imports nothing from the finders or the context, so the context can hold its result.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memlens.allocator import AllocatorSettings, CachingAllocatorSimulator, whatif
from memlens.allocator.replay import Watch, left_to_simulator, recorded_capacity, trace_releases
from memlens.allocator.simulator import K_LARGE_BUFFER, K_SMALL_BUFFER, K_SMALL_SIZE, get_allocation_size
from memlens.errors import MemlensError
from memlens.snapshot.model import Action, DeviceTrace, Snapshot

# The alloc row that a segment_alloc row was made for follows it; on a busy multi-stream trace
# another stream's rows may come between, so look this many alloc rows ahead for the same stream.
_REQUEST_LOOKAHEAD = 8


# ------------------------------------------------------------------ the allocator's state
@dataclass(frozen=True)
class PoolState:
    """The cached free blocks of one pool on one stream at one trace row, as the replay held them,
    next to the request the allocator was serving there (rounded, as the allocator sizes it)."""

    event: int
    small_pool: bool
    stream: int
    request_bytes: int
    free_bytes: int
    free_in_pieces_bytes: int  # inside partly used segments: fragmentation
    free_in_whole_segments_bytes: int  # entire unused segments: idle cache
    largest_free_block_bytes: int
    free_blocks: int
    # What the allocator had to get from the device for the request when no cached block held
    # it: the cudaMalloc ``get_allocation_size`` makes (a 1-10 MiB request opens a 20 MiB
    # segment), or with expandable segments the pages to map.
    new_segment_bytes: int = 0

    def fits_if_whole(self, device_free: int) -> bool:
        """Had the pool's free bytes been one block (or given back to the device), the request
        would have fit: in them alone, or as the new segment in them plus what the device had."""
        if self.free_bytes <= 0 or self.largest_free_block_bytes >= self.request_bytes:
            return False
        return self.free_bytes >= self.request_bytes or self.new_segment_bytes <= self.free_bytes + device_free

    @property
    def blocked(self) -> bool:
        """Enough was free in the pool, but in no block large enough."""
        return self.free_bytes >= self.request_bytes > self.largest_free_block_bytes

    @property
    def pool(self) -> str:
        return "small" if self.small_pool else "large"


@dataclass(frozen=True)
class CudaMalloc:
    event: int
    segment_bytes: int
    pool: PoolState


@dataclass(frozen=True)
class AllocatorEvidence:
    """What the replay with the recorded settings saw at cudaMallocs and at the OOM."""

    segment_allocs: int  # every recorded segment_alloc row
    cudamallocs: tuple[CudaMalloc, ...]  # those that could have been blocked, with their pool state
    at_oom: PoolState | None
    oom_device_free_bytes: int
    replayed: bool
    # The first observed row where the replay's reserved bytes differ from the recorded ones (a
    # trace that is not the caching allocator's, or state the seeding could not rebuild); None
    # when the replay reproduced every cudaMalloc it was asked about.
    diverged_at: int | None = None
    notes: tuple[str, ...] = ()

    def trusted(self, row: int) -> bool:
        """The replay still matched the recorded run at ``row``: its pool state there is evidence."""
        return self.diverged_at is None or row < self.diverged_at

    @property
    def blocked(self) -> list[CudaMalloc]:
        return [c for c in self.cudamallocs if c.pool.blocked and self.trusted(c.event)]


def _pool_state(
    event: int, request: int, stream: int, summary: tuple[int, int, int, int], expandable_segments: bool,
) -> PoolState:
    """The pool the rounded ``request`` is served from, from the replay's ``cached_summary`` of it
    at ``event`` (at the OOM, as the pool is once the allocator has freed its whole cached
    segments where the simulator had yet to: its pieces only; see ``replay_pool_states``)."""
    total, whole, largest, count = summary
    return PoolState(
        event=event,
        small_pool=request <= K_SMALL_SIZE,
        stream=stream,
        request_bytes=request,
        free_bytes=total,
        free_in_pieces_bytes=total - whole,
        free_in_whole_segments_bytes=whole,
        largest_free_block_bytes=largest,
        free_blocks=count,
        new_segment_bytes=new_segment_bytes(request, expandable_segments),
    )


def new_segment_bytes(request: int, expandable_segments: bool) -> int:
    """The device memory a rounded ``request`` that no cached block holds needs: the segment
    ``get_allocation_size`` opens, or with expandable segments the request in whole pages."""
    if expandable_segments:
        page = K_SMALL_BUFFER if request <= K_SMALL_SIZE else K_LARGE_BUFFER
        return -(-request // page) * page
    return get_allocation_size(request)


def _segment_alloc_requests(trace: DeviceTrace, rounder: CachingAllocatorSimulator) -> list[tuple[int, int, int]]:
    """``(row, segment bytes, rounded request)`` of every segment_alloc row whose request is known."""
    rows = np.flatnonzero(trace.action == Action.SEGMENT_ALLOC)
    alloc_rows = np.flatnonzero(trace.action == Action.ALLOC)
    following = np.searchsorted(alloc_rows, rows)
    result = []
    for row, first in zip(rows.tolist(), following.tolist(), strict=True):
        stream = int(trace.stream[row])
        for k in range(first, min(first + _REQUEST_LOOKAHEAD, len(alloc_rows))):
            alloc_row = int(alloc_rows[k])
            if int(trace.stream[alloc_row]) == stream:
                result.append((row, int(trace.size[row]), rounder.round_size(int(trace.size[alloc_row]))))
                break
    return result


def replay_pool_states(snapshot: Snapshot, trace: DeviceTrace, capacity: int | None) -> AllocatorEvidence:
    settings = AllocatorSettings.from_snapshot_dict(snapshot.allocator_settings)
    rounder = CachingAllocatorSimulator(settings, record_history=False)
    requests = _segment_alloc_requests(trace, rounder)
    # reserved - allocated before the cudaMalloc bounds the free bytes of every pool from above
    # (allocated counts the allocated blocks, so the rest is free or pending): below the request, the
    # pool cannot have held it, and the cudaMalloc was not blocked.
    candidates = {
        row: (segment, request)
        for row, segment, request in requests
        if int(trace.reserved[row]) - segment - int(trace.allocated[row]) >= request
    }
    oom_rows = np.flatnonzero(trace.action == Action.OOM)
    oom_row = int(oom_rows[-1]) if oom_rows.size else None
    if not candidates and oom_row is None:
        return AllocatorEvidence(len(requests), (), None, 0, False, None)

    # The allocator's own free-and-retry runs (segment_free rows just before a segment_alloc or
    # the oom) are left to the simulator when the capacity is known: it releases inside the malloc
    # it replays after the row, so at the row it still holds what the recorded run held before the
    # release (see ``memlens.allocator.replay.Observer``). First row after such a run -> its first row.
    # The capacity is the one the replay runs with (``whatif`` infers it when none is given).
    replay_capacity = capacity if capacity is not None else recorded_capacity(snapshot, trace)[0]
    pending_release = {
        r.end: r.start for r in trace_releases(trace, snapshot.stacks, settings, replay_capacity)
        if left_to_simulator(r, replay_capacity)
    }

    # The pool each watched row asks about: a cudaMalloc's request as it stands, or at the OOM the
    # failed request rounded. The recorded allocator gave up only after its free-and-retry released
    # every unsplit cached segment; where the simulator has yet to make that release, the pool it
    # held when it gave up is the simulator's pieces (the released bytes are in the recorded
    # device_free already).
    watched = sorted([*candidates, *([] if oom_row is None else [oom_row])])
    requests_at = {row: request for row, (_, request) in candidates.items()}
    if oom_row is not None:
        requests_at[oom_row] = rounder.round_size(int(trace.size[oom_row]))
    streams = [int(trace.stream[row]) for row in watched]
    watch = Watch(
        rows=np.array(watched, dtype=np.int64),
        small=np.array([requests_at[row] <= K_SMALL_SIZE for row in watched], dtype=np.uint8),
        streams=np.array(streams, dtype=np.int64),
        pieces_only=np.array([row == oom_row and row not in candidates and row in pending_release
                              for row in watched], dtype=np.uint8),
        # cudaMallocs come early (the cache warms up in the first steps): the replay stops after
        # the last row it is asked about instead of running the whole trace.
        stop_after=watched[-1],
    )
    notes: tuple[str, ...] = ()
    try:
        result = whatif(snapshot, capacity=capacity, device=trace.device, watch=watch)
    except MemlensError as exc:
        # e.g. garbage_collection_threshold set and no capacity known: the replay cannot run, and
        # without it there is no pool state to judge a cudaMalloc by.
        return AllocatorEvidence(len(requests), (), None, 0, False, notes=(f"no allocator replay: {exc}",))
    if not watch.stopped:
        notes = tuple(result.notes)

    diverged = None
    for row, reserved in zip(watch.noted_rows.tolist(), watch.noted_reserved.tolist(), strict=True):
        run_start = pending_release.get(row)
        if run_start is not None:
            recorded_before = int(trace.reserved[run_start - 1]) if run_start else int(trace.baseline_reserved)
        else:
            recorded_before = int(trace.reserved[row]) - (int(trace.size[row]) if row != oom_row else 0)
        if reserved != recorded_before:
            diverged = row
            break
    states = {
        row: _pool_state(row, requests_at[row], stream, summary, settings.expandable_segments)
        for row, stream, summary in zip(watched, streams, watch.summaries, strict=True) if summary is not None
    }
    cudamallocs = tuple(CudaMalloc(row, candidates[row][0], states[row]) for row in sorted(candidates) if row in states)
    return AllocatorEvidence(
        segment_allocs=len(requests),
        cudamallocs=cudamallocs,
        at_oom=states.get(oom_row) if oom_row is not None else None,
        oom_device_free_bytes=int(trace.device_free[oom_row]) if oom_row is not None else 0,
        replayed=True,
        diverged_at=diverged,
        notes=notes,
    )


