"""What-if replay: run a recorded snapshot's alloc/free sequence through the simulator.

The replay answers "what would this run have reserved with other allocator settings (or on a
smaller GPU)?". It is only worth trusting if replaying a snapshot with its own settings gives
back what the real allocator did, so the replay takes care to start from the same state:

* A window that begins mid-run (no ``segment_alloc`` for segments that exist at the end, frees
  of addresses never allocated in the window) is seeded with the segments and live blocks that
  existed when recording began: the final segments, minus those created in the window, plus
  those freed in it; live blocks are the final live blocks the window never touched plus every
  address whose first event is a free.
* Memory becomes reusable at ``free_completed``; an address with only ``free_requested`` is
  freed there. Frees of addresses the replay never saw allocated are ignored.
* New segments are placed at the addresses the recorded run's cudaMalloc returned (when the
  sizes agree), so best-fit ties between equal-sized free blocks go the same way.
* A run of recorded ``segment_free`` / ``segment_unmap`` entries (``empty_cache()``, or the
  allocator's free-and-retry before an OOM) is replayed as ``empty_cache()``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from memlens.allocator.settings import AllocatorSettings
from memlens.allocator.simulator import (
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    CachingAllocatorSimulator,
    SimulatedOOM,
)
from memlens.errors import MemlensUsageError
from memlens.units import format_bytes

if TYPE_CHECKING:
    from memlens.snapshot.model import DeviceTrace, Segment, Snapshot

# Action codes of memlens.snapshot.model.Action (kept as ints: the replay loop runs per event).
_ALLOC, _FREE_REQUESTED, _FREE_COMPLETED = 0, 1, 2
_SEGMENT_ALLOC, _SEGMENT_FREE, _SEGMENT_MAP, _SEGMENT_UNMAP, _OOM = 3, 4, 5, 6, 7
_RELEASES = (_SEGMENT_FREE, _SEGMENT_UNMAP)
# How far ahead in the recorded segment_alloc list a simulated cudaMalloc may look for a
# segment of its size: a small window keeps the hint in step with the recorded order.
_ADDRESS_HINT_LOOKAHEAD = 8

# Called with (row, simulator) just before the replay handles a recorded segment_alloc or oom
# row: the simulator's state is then what the allocator held when it called cudaMalloc (or gave up).
Observer = Callable[[int, CachingAllocatorSimulator], None]


@dataclass
class WhatIfResult:
    """The recorded run next to its simulated replay (both dicts share their keys)."""

    source: str
    device: int
    settings: AllocatorSettings
    recorded_settings: AllocatorSettings
    capacity: int | None
    recorded: dict[str, Any]
    simulated: dict[str, Any]
    seeded: bool = False
    notes: list[str] = field(default_factory=list)
    start_time_us: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "device": self.device,
            "start_time_us": self.start_time_us,
            "capacity_bytes": self.capacity,
            "recorded_settings": self.recorded_settings.to_snapshot_dict(),
            "simulated_settings": self.settings.to_snapshot_dict(),
            "seeded_from_final_state": self.seeded,
            "notes": list(self.notes),
            "recorded": dict(self.recorded),
            "simulated": dict(self.simulated),
        }


def recorded_capacity(snapshot: Snapshot, trace: DeviceTrace) -> tuple[int | None, str | None]:
    """The device memory the recorded run had, when the files tell: the recorder's sidecar, or
    else a recorded OOM (what was reserved then plus what CUDA still reported free). Without it a
    replay cannot run out of memory, and "would it fit?" has no answer."""
    device = snapshot.sidecar.get("device") if isinstance(snapshot.sidecar, dict) else None
    total = device.get("total_memory_bytes") if isinstance(device, dict) else None
    if isinstance(total, int) and total > 0:
        return total, f"capacity {format_bytes(total)} from the recorder's sidecar"
    oom_rows = np.flatnonzero(trace.action == _OOM) if len(trace) else np.zeros(0, dtype=np.int64)
    if oom_rows.size:
        row = int(oom_rows[0])
        # At the OOM the allocator had already released its cached blocks and retried.
        total = int(trace.reserved[row]) + int(trace.device_free[row])
        return total, (f"capacity {format_bytes(total)} inferred from the recorded OOM "
                       "(reserved then + what the device still had free)")
    return None, None


def whatif(
    snapshot_or_path: Snapshot | str | Path,
    settings: AllocatorSettings | None = None,
    capacity: int | None = None,
    device: int | None = None,
    use_recorded_addresses: bool = True,
    observer: Observer | None = None,
) -> WhatIfResult:
    """Replay one device's recorded history with ``settings`` (default: the recorded ones).

    ``use_recorded_addresses=False`` places new segments at fresh addresses instead of where
    the recorded cudaMalloc put them (the fidelity tests use it to show the figures do not
    depend on copying addresses). ``observer`` sees the simulator at every recorded
    ``segment_alloc`` and ``oom`` row (see ``Observer``).
    """
    if isinstance(snapshot_or_path, str | Path):
        from memlens.snapshot.reader import load

        snapshot = load(snapshot_or_path)
    else:
        snapshot = snapshot_or_path
    trace = snapshot.device(device)
    recorded_settings = AllocatorSettings.from_snapshot_dict(snapshot.allocator_settings)
    settings = settings or recorded_settings
    capacity_note = None
    if capacity is None:
        capacity, capacity_note = recorded_capacity(snapshot, trace)
    if settings.garbage_collection_threshold > 0 and capacity is None:
        raise MemlensUsageError(
            "garbage_collection_threshold acts relative to the device capacity: give a capacity too"
        )
    segments = snapshot.segments_on(trace.device)
    recorded = recorded_figures(trace, segments)
    replay = _Replay(trace, segments, recorded_settings, settings, capacity, use_recorded_addresses, observer)
    simulated = replay.run()
    if capacity_note:
        replay.notes.insert(0, capacity_note)
    return WhatIfResult(
        source=snapshot.source,
        device=trace.device,
        settings=settings,
        recorded_settings=recorded_settings,
        capacity=capacity,
        recorded=recorded,
        simulated=simulated,
        seeded=replay.seeded,
        notes=replay.notes,
        start_time_us=_time_at(trace, 0) if len(trace) else None,
    )


def recorded_figures(trace: DeviceTrace, segments: list[Segment]) -> dict[str, Any]:
    """Peak reserved, fragmentation at the peak, cudaMalloc count and OOMs of the recorded run."""
    action = np.asarray(trace.action)
    n = len(action)
    final_reserved = sum(s.total_size for s in segments)
    if n:
        reserved = np.asarray(trace.reserved, dtype=np.int64)
        allocated = np.asarray(trace.allocated, dtype=np.int64)
        peak_reserved = int(reserved.max())
        # Reserved stays at its peak for a while; measure the waste when the most is in use.
        at_peak = np.flatnonzero(reserved == peak_reserved)
        waste = reserved[at_peak] - allocated[at_peak]
        peak_event = int(at_peak[int(np.argmin(waste))])
        fragmentation = int(waste.min())
        peak_allocated = int(allocated.max())
        baseline = int(trace.baseline_reserved)
        if baseline > peak_reserved:
            peak_reserved, peak_event, fragmentation = baseline, -1, baseline - int(trace.baseline_allocated)
    else:
        peak_event = -1
        peak_reserved = final_reserved
        active = sum(b.requested_size for s in segments for b in s.blocks if b.state != "inactive")
        fragmentation = final_reserved - active
        peak_allocated = active
    oom_rows = np.flatnonzero(action == _OOM)
    oom_event = int(oom_rows[0]) if len(oom_rows) else None
    return {
        "events": n,
        "peak_reserved_bytes": peak_reserved,
        "peak_allocated_bytes": peak_allocated,
        "fragmentation_at_peak_bytes": fragmentation,
        "peak_event": peak_event,
        "final_reserved_bytes": int(trace.final_reserved) if n else final_reserved,
        "segment_allocs": int(np.count_nonzero(action == _SEGMENT_ALLOC)),
        "segment_frees": int(np.count_nonzero(action == _SEGMENT_FREE)),
        "segment_maps": int(np.count_nonzero(action == _SEGMENT_MAP)),
        "segment_unmaps": int(np.count_nonzero(action == _SEGMENT_UNMAP)),
        "oom": oom_event is not None,
        "oom_event": oom_event,
        "oom_time_us": _time_at(trace, oom_event),
        "oom_size_bytes": int(trace.size[oom_event]) if oom_event is not None else None,
    }


def _time_at(trace: DeviceTrace, index: int | None) -> int | None:
    if index is None or index < 0 or not trace.has_time:
        return None
    return int(trace.time_us[index])


@dataclass
class _InitialSegment:
    address: int
    size: int
    stream: int
    is_small: bool
    live: list[tuple[int, int, int]] = field(default_factory=list)


class _Replay:
    """One replay: seeds the simulator, feeds it the events, collects the figures."""

    def __init__(
        self,
        trace: DeviceTrace,
        segments: list[Segment],
        recorded_settings: AllocatorSettings,
        settings: AllocatorSettings,
        capacity: int | None,
        use_recorded_addresses: bool = True,
        observer: Observer | None = None,
    ) -> None:
        self.trace = trace
        self.observer = observer
        self.use_recorded_addresses = use_recorded_addresses
        self.segments = segments
        self.recorded_settings = recorded_settings
        self.settings = settings
        self.capacity = capacity
        self.notes: list[str] = []
        self.seeded = False
        self.actions: list[int] = np.asarray(trace.action).tolist()
        self.addresses: list[int] = np.asarray(trace.address).tolist()
        self.sizes: list[int] = np.asarray(trace.size).tolist()
        self.streams: list[int] = np.asarray(trace.stream).tolist()
        self._hints: list[tuple[int, int]] = [
            (a, s) for act, a, s in zip(self.actions, self.addresses, self.sizes, strict=True) if act == _SEGMENT_ALLOC
        ]

    # ------------------------------------------------------------------ address hints
    def _segment_address(self, size: int) -> int | None:
        for i, (address, hinted_size) in enumerate(self._hints[:_ADDRESS_HINT_LOOKAHEAD]):
            if hinted_size == size:
                del self._hints[i]
                return address
        return None

    # ------------------------------------------------------------------ initial state
    def _initial_segments(self) -> list[_InitialSegment]:
        """Segments (with their live blocks) that existed when the recording began."""
        created: set[int] = set()
        freed_initial: dict[int, _InitialSegment] = {}
        has_map_events = False
        events = zip(self.actions, self.addresses, self.sizes, self.streams, strict=True)
        for act, address, size, stream in events:
            if act == _SEGMENT_ALLOC:
                created.add(address)
            elif act == _SEGMENT_FREE:
                if address in created:
                    created.discard(address)
                elif address not in freed_initial:
                    freed_initial[address] = _InitialSegment(address, size, stream, size <= K_SMALL_BUFFER)
            elif act in (_SEGMENT_MAP, _SEGMENT_UNMAP):
                has_map_events = True
        initial: dict[int, _InitialSegment] = dict(freed_initial)
        final_live: list[tuple[int, int, int]] = []
        for segment in self.segments:
            if segment.address in created:
                continue
            if segment.is_expandable and has_map_events:
                # Its mapped extent at the start cannot be told from the end state; the
                # replay's own segment_map calls rebuild it.
                continue
            initial[segment.address] = _InitialSegment(
                segment.address, segment.total_size, segment.stream, segment.segment_type == "small"
            )
            final_live.extend((b.address, b.size, b.requested_size) for b in segment.blocks if b.state != "inactive")
        if has_map_events and any(s.is_expandable for s in self.segments):
            self.notes.append("expandable segments mapped during the window are rebuilt by the replay")
        if not initial:
            return []

        # Addresses the window touches: their first event says whether they were live at start.
        first_event: dict[int, int] = {}
        for i, (act, address) in enumerate(zip(self.actions, self.addresses, strict=True)):
            if act <= _FREE_COMPLETED and address not in first_event:
                first_event[address] = i
        live: dict[int, tuple[int, int]] = {}  # address -> (size or 0 = unknown, requested)
        for address, size, requested in final_live:
            if address not in first_event:
                live[address] = (size, requested)
        for address, i in first_event.items():
            if self.actions[i] != _ALLOC:
                live[address] = (0, self.sizes[i])

        starts = sorted(initial)
        ordered = [initial[a] for a in starts]
        ignored = 0
        for address in sorted(live):
            index = bisect_right(starts, address) - 1
            if index < 0 or address >= ordered[index].address + ordered[index].size:
                ignored += 1
                continue
            size, requested = live[address]
            ordered[index].live.append((address, size, requested))
        if ignored:
            self.notes.append(f"{ignored} free(s) of addresses outside every known segment were ignored")
        rounder = CachingAllocatorSimulator(self.recorded_settings, record_history=False)
        for initial_segment in ordered:
            initial_segment.live = self._block_sizes(initial_segment, rounder)
        return ordered

    def _block_sizes(self, segment: _InitialSegment, rounder: CachingAllocatorSimulator) -> list[tuple[int, int, int]]:
        """Give blocks known only by their requested size a block size, in address order.

        A large-pool block keeps the tail it was carved from when the remainder would have
        been 1 MiB or less (``should_split``), and every cached large-pool block is over
        1 MiB, so a gap of at most 1 MiB after a live block belongs to that block.
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

    # ------------------------------------------------------------------ replay
    def run(self) -> dict[str, Any]:
        sim = CachingAllocatorSimulator(
            self.settings,
            capacity=self.capacity,
            device=self.trace.device,
            record_history=False,
            segment_addresses=self._segment_address if self.use_recorded_addresses else None,
        )
        mapping: dict[int, int] = {}
        for segment in self._initial_segments():
            try:
                sim.restore_segment(segment.address, segment.size, segment.stream, segment.is_small, segment.live)
            except MemlensUsageError as exc:
                self.notes.append(f"initial segment {segment.address:#x} skipped: {exc}")
                continue
            self.seeded = True
            for address, _, _ in segment.live:
                mapping[address] = address
        over_capacity = False
        if self.capacity is not None and sim.reserved_bytes > self.capacity:
            sim.empty_cache()
            if sim.reserved_bytes > self.capacity:
                over_capacity = True
                self.notes.append(
                    "memory in use when the recording began already exceeds the capacity: "
                    "out of memory before the first event"
                )

        completes = self._completed_requests()
        peak_reserved = sim.reserved_bytes
        peak_event = -1
        fragmentation = sim.reserved_bytes - sim.requested_bytes
        peak_allocated = sim.requested_bytes
        oom_event: int | None = 0 if over_capacity else None
        oom_size: int | None = None
        matches = allocs = 0
        previous = -1
        actions, addresses, sizes, streams = self.actions, self.addresses, self.sizes, self.streams
        for i in range(0 if over_capacity else len(actions)):
            act = actions[i]
            if act == _ALLOC:
                address = addresses[i]
                try:
                    sim_address = sim.malloc(sizes[i], streams[i])
                except SimulatedOOM:
                    oom_event, oom_size = i, sizes[i]
                    break
                mapping[address] = sim_address
                allocs += 1
                matches += sim_address == address
                if sim.requested_bytes > peak_allocated:
                    peak_allocated = sim.requested_bytes
                reserved = sim.reserved_bytes
                if reserved >= peak_reserved:
                    waste = reserved - sim.requested_bytes
                    if reserved > peak_reserved or waste < fragmentation:
                        peak_reserved, peak_event, fragmentation = reserved, i, waste
            elif act == _FREE_REQUESTED:
                sim_address = mapping.get(addresses[i], -1)
                if sim_address >= 0 and sim.is_allocated(sim_address):
                    if i in completes:
                        sim.request_free(sim_address)
                    else:
                        sim.free(sim_address)
                        del mapping[addresses[i]]
            elif act == _FREE_COMPLETED:
                sim_address = mapping.pop(addresses[i], -1)
                if sim_address >= 0 and sim.is_allocated(sim_address):
                    sim.complete_free(sim_address)
            elif act == _SEGMENT_ALLOC and self.observer is not None:
                self.observer(i, sim)
            elif act == _OOM:
                if self.observer is not None:
                    self.observer(i, sim)
                # The request that failed in the recorded run is not an alloc row: try it here,
                # so "would it fit with these settings?" is answered by the simulation itself.
                try:
                    trial = sim.malloc(sizes[i], streams[i])
                except SimulatedOOM:
                    oom_event, oom_size = i, sizes[i]
                    break
                self.notes.append(
                    f"the request that failed at event {i} ({format_bytes(int(sizes[i]))}) fits in the simulation"
                )
                sim.free(trial)  # the recorded program never got it: keep the rest of the replay aligned
            elif act in _RELEASES and previous not in _RELEASES:
                sim.empty_cache()
            previous = act
        return {
            "events": oom_event if oom_event is not None else len(actions),
            "peak_reserved_bytes": peak_reserved,
            "peak_allocated_bytes": peak_allocated,
            "fragmentation_at_peak_bytes": fragmentation,
            "peak_event": peak_event,
            "final_reserved_bytes": sim.reserved_bytes,
            "segment_allocs": sim.segment_alloc_count,
            "segment_frees": sim.segment_free_count,
            "segment_maps": sim.segment_map_count,
            "segment_unmaps": sim.segment_unmap_count,
            "oom": oom_event is not None,
            "oom_event": oom_event,
            "oom_time_us": _time_at(self.trace, oom_event),
            "oom_size_bytes": oom_size,
            "alloc_address_match": (matches / allocs) if allocs else None,
        }

    def _completed_requests(self) -> set[int]:
        """Indices of free_requested entries that a later free_completed finishes."""
        last_request: dict[int, int] = {}
        completes: set[int] = set()
        for i, (act, address) in enumerate(zip(self.actions, self.addresses, strict=True)):
            if act == _FREE_REQUESTED:
                last_request[address] = i
            elif act == _FREE_COMPLETED:
                j = last_request.pop(address, None)
                if j is not None:
                    completes.add(j)
            elif act == _ALLOC:
                last_request.pop(address, None)
        return completes


__all__ = ["WhatIfResult", "recorded_figures", "whatif"]
