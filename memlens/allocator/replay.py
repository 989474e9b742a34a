"""What-if replay: run a recorded snapshot's alloc/free sequence through the simulator.

The replay answers "what would this run have reserved with other allocator settings (or on a
smaller GPU)?". It is only worth trusting if replaying a snapshot with its own settings gives
back what the real allocator did, so the replay takes care to start from the same state:

* A window that begins mid-run (no ``segment_alloc`` for segments that exist at the end, frees
  of addresses never allocated in the window) is seeded with the segments and live blocks that
  existed when recording began (``memlens.allocator.initial_state`` infers them and says how).
  A complete history seeds nothing.
* Memory becomes reusable at ``free_completed``; an address with only ``free_requested`` is
  freed there. Frees of addresses the replay never saw allocated are ignored.
* New segments are placed at the addresses the recorded run's cudaMalloc returned (when the
  sizes agree), so best-fit ties between equal-sized free blocks go the same way. Each
  simulated segment is paired with the recorded one it stands for (same size, among the next
  few recorded ``segment_alloc``s), and where a tensor lands is compared as (segment, offset):
  ``alloc_segment_offset_match``, which holds whether the bases were copied or fresh.
  ``alloc_address_match`` (raw address equality) is 1.0 with copied bases only because the
  bases are copied.
* A run of recorded ``segment_free`` / ``segment_unmap`` entries is replayed by its cause
  (``memlens.allocator.releases``): the program's ``empty_cache()`` is replayed as
  ``empty_cache()`` under any settings; the allocator's own free-and-retry or garbage
  collection is not replayed: the simulator, which runs the same rules against the capacity,
  releases memory where the simulated settings make it run short. Without a capacity the
  simulation can never run short, so such a run, and one whose cause cannot be told, is
  replayed as ``empty_cache()`` (the recorded allocator's choice, carried into the what-if),
  and the result's notes say so.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from memlens.allocator.constants import ADDRESS_HINT_LOOKAHEAD
from memlens.allocator.engine import native_module, simulator_class
from memlens.allocator.initial_state import InitialState, infer_initial_state
from memlens.allocator.releases import ALLOCATOR, EMPTY_CACHE, Release, classify_releases
from memlens.allocator.settings import AllocatorSettings, SnapshotAllocatorSettings
from memlens.allocator.simulator import CachingAllocatorSimulator, SimulatedOOM
from memlens.errors import MemlensUsageError
from memlens.snapshot.model import Action
from memlens.snapshot.validate import PLAUSIBLE_BYTES
from memlens.units import format_bytes

if TYPE_CHECKING:
    from memlens.snapshot.model import DeviceTrace, Segment, Snapshot, StackTable

# Plain ints of the one Action definition: the replay loop compares them once per event, and
# an int compare is cheaper than an IntEnum member lookup there.
_ALLOC = int(Action.ALLOC)
_FREE_REQUESTED = int(Action.FREE_REQUESTED)
_FREE_COMPLETED = int(Action.FREE_COMPLETED)
_SEGMENT_ALLOC = int(Action.SEGMENT_ALLOC)
_SEGMENT_FREE = int(Action.SEGMENT_FREE)
_SEGMENT_MAP = int(Action.SEGMENT_MAP)
_SEGMENT_UNMAP = int(Action.SEGMENT_UNMAP)
_OOM = int(Action.OOM)

# Called with (row, simulator) just before the replay handles a recorded segment_alloc or oom
# row: the simulator's state is then what the allocator held when it called cudaMalloc (or gave up).
# One exception: where the row follows a release run the replay leaves to the simulator
# (``left_to_simulator``), the recorded allocator released those segments *before* the row, but
# the simulator releases only inside the malloc it replays next. At that row the observer sees
# the state before the free-and-retry: the recorded ``reserved`` before the run, not the row's.
Observer = Callable[[int, CachingAllocatorSimulator], None]


@dataclass(eq=False)
class Watch:
    """What a replay notes as it goes, instead of calling an observer: at every ``segment_alloc``
    and ``oom`` row it replays (where an ``Observer`` would be called, and seeing what it would
    see), the simulator's reserved bytes; at each of ``rows`` (ascending, such rows), the summary
    of the cached blocks of one pool on one stream (``cached_summary(small, stream,
    pieces_only)``). It stops once it has noted a row at or after ``stop_after`` (-1: never).
    The native loop notes all of it without a Python call (and so without the GIL); the replay
    fills the ``noted_*`` fields, ``summaries`` (``None`` for a row it never reached) and ``stopped``."""

    rows: np.ndarray  # int64
    small: np.ndarray  # uint8
    streams: np.ndarray  # int64
    pieces_only: np.ndarray  # uint8
    stop_after: int = -1
    noted_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    noted_reserved: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    summaries: list[tuple[int, int, int, int] | None] = field(default_factory=list)
    stopped: bool = False

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """The request as the native loop takes it."""
        return (np.ascontiguousarray(self.rows, dtype=np.int64), np.ascontiguousarray(self.small, dtype=np.uint8),
                np.ascontiguousarray(self.streams, dtype=np.int64),
                np.ascontiguousarray(self.pieces_only, dtype=np.uint8), self.stop_after)


class _WatchNotes:
    """The Python loop's notes for a ``Watch``, as the native loop takes them."""

    def __init__(self, watch: Watch) -> None:
        self.watch = watch
        self.rows: list[int] = []
        self.reserved: list[int] = []
        self.summaries: list[tuple[int, int, int, int] | None] = [None] * len(watch.rows)
        self._watched = {int(row): k for k, row in enumerate(np.asarray(watch.rows).tolist())}
        self.stopped = False

    def note(self, row: int, sim: CachingAllocatorSimulator) -> bool:
        """Notes ``row``; whether the replay stops there."""
        self.rows.append(row)
        self.reserved.append(sim.reserved_bytes)
        k = self._watched.get(row)
        if k is not None:
            w = self.watch
            self.summaries[k] = sim.cached_summary(bool(w.small[k]), int(w.streams[k]),
                                                   pieces_only=bool(w.pieces_only[k]))
        self.stopped = 0 <= self.watch.stop_after <= row
        return self.stopped

    def fill(self) -> None:
        self.watch.noted_rows = np.array(self.rows, dtype=np.int64)
        self.watch.noted_reserved = np.array(self.reserved, dtype=np.int64)
        self.watch.summaries = self.summaries
        self.watch.stopped = self.stopped


class RunFigures(msgspec.Struct, frozen=True):
    """What a run (recorded, or a replay of it) reserved, allocated and asked the device for."""

    events: int  # trace rows the figures cover
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    fragmentation_at_peak_bytes: int  # reserved - allocated where reserved peaked (the least of it)
    peak_event: int  # -1: the peak is the state before the first row
    final_reserved_bytes: int
    segment_allocs: int  # cudaMalloc calls
    segment_frees: int  # cudaFree calls
    segment_maps: int  # pages mapped (expandable segments)
    segment_unmaps: int
    oom: bool
    oom_event: int | None
    oom_time_us: int | None
    oom_size_bytes: int | None


class SimulatedFigures(RunFigures, frozen=True):
    """A replay's figures, and how closely it placed the recorded run's tensors."""

    alloc_address_match: float | None  # share of allocs at the recorded address (None: no allocs)
    alloc_segment_offset_match: float | None  # share at the recorded (segment, offset)
    allocs_in_known_segment: int  # allocs whose segment pairs with a recorded one


@dataclass
class WhatIfResult:
    """The recorded run next to its simulated replay (the simulated figures are the recorded
    ones plus the placement match)."""

    source: str
    device: int
    settings: AllocatorSettings
    recorded_settings: AllocatorSettings
    capacity: int | None
    recorded: RunFigures
    simulated: SimulatedFigures
    seeded: bool = False
    # What the replay was seeded with (empty for a complete history) and each recorded release
    # run with its inferred cause.
    initial_state: InitialState = field(default_factory=InitialState)
    releases: list[Release] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    start_time_us: int | None = None
    # When the simulated run ran out of memory before the trace's end, its figures stop there:
    # the recorded run's figures over the same events (``recorded_figures(..., until=)``), the
    # only ones its figures can be compared with.
    recorded_until_simulated_oom: RunFigures | None = None

    @property
    def comparable(self) -> bool:
        """Whether change figures mean anything: the simulated run finished, or stopped at the
        recorded run's own OOM. One cut off earlier by its OOM saves nothing, whatever its peak."""
        simulated, recorded = self.simulated, self.recorded
        return not simulated.oom or bool(recorded.oom and recorded.oom_event == simulated.oom_event)

    def stopped_note(self) -> str | None:
        """Where a simulated run cut off by its OOM stopped and what its figures cover (every face
        shows it: it is the first of ``notes``); None when the figures compare."""
        if self.comparable:
            return None
        stop = int(self.simulated.oom_event or 0)
        covered = self.compared_events
        if covered is None:
            return (f"the simulated run ran out of memory at event {stop:,}, before it replayed anything: "
                    "no change to show")
        return (f"the simulated run ran out of memory at event {stop:,} of {self.recorded.events:,} and stopped "
                f"there: its figures cover only the {covered:,} event{'s' if covered != 1 else ''} before that "
                "request; a run that does not finish saves nothing, so no change is shown")

    def recorded_compared(self) -> RunFigures:
        """The recorded run's figures over the events the simulated figures cover: all of them,
        or those before the simulated run's OOM (its own OOM flag kept)."""
        if self.recorded_until_simulated_oom is None:
            return self.recorded
        return msgspec.structs.replace(self.recorded_until_simulated_oom, oom=self.recorded.oom)

    @property
    def compared_events(self) -> int | None:
        """The events both sides' figures cover when the simulated run stopped early, else None."""
        if self.recorded_until_simulated_oom is None:
            return None
        return self.recorded_until_simulated_oom.events

    def report(self) -> WhatIfReport:
        """The result as its JSON form's struct (what ``memlens whatif --json`` writes)."""
        return WhatIfReport(
            source=self.source,
            device=self.device,
            start_time_us=self.start_time_us,
            capacity_bytes=self.capacity,
            recorded_settings=self.recorded_settings.snapshot_record(),
            simulated_settings=self.settings.snapshot_record(),
            seeded_from_final_state=self.seeded,
            seeded_segments=len(self.initial_state.segments),
            seeded_live_blocks=self.initial_state.live_blocks,
            releases=[ReleaseRun(r.start, r.end - r.start, r.cause, r.reason) for r in self.releases],
            notes=list(self.notes),
            recorded=self.recorded,
            simulated=self.simulated,
            recorded_until_simulated_oom=self.recorded_until_simulated_oom,
        )

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.report())


class ReleaseRun(msgspec.Struct, frozen=True):
    """A recorded run of segment frees/unmaps and its inferred cause (``memlens.allocator.releases``)."""

    first_event: int
    events: int
    cause: str
    reason: str


class WhatIfReport(msgspec.Struct, frozen=True):
    """The JSON form of a ``WhatIfResult`` (``memlens whatif --json``, the MCP ``whatif`` tool)."""

    source: str
    device: int
    start_time_us: int | None
    capacity_bytes: int | None
    recorded_settings: SnapshotAllocatorSettings
    simulated_settings: SnapshotAllocatorSettings
    seeded_from_final_state: bool
    seeded_segments: int
    seeded_live_blocks: int
    releases: list[ReleaseRun]
    notes: list[str]
    recorded: RunFigures
    simulated: SimulatedFigures
    recorded_until_simulated_oom: RunFigures | None


def recorded_reserved_peak(trace: DeviceTrace) -> int:
    """The most the recorded run had reserved at once (the history's curve, its baseline, the dump)."""
    return max(int(trace.reserved.max()) if len(trace) else 0, trace.baseline_reserved, trace.final_reserved)


def sidecar_capacity(snapshot: Snapshot, trace: DeviceTrace) -> tuple[int | None, str | None]:
    """The device memory the recorder's sidecar states, or None with a note when it cannot be
    true: a device never has less memory than the run had reserved on it."""
    total = snapshot.sidecar.capacity_bytes if snapshot.sidecar is not None else None
    if total is None:
        return None, None
    reserved = recorded_reserved_peak(trace)
    if total < reserved:
        return None, (f"the sidecar's capacity ({format_bytes(total)}) is below the recorded reserved "
                      f"({format_bytes(reserved)}): ignored")
    if total > PLAUSIBLE_BYTES:
        return None, f"the sidecar's capacity ({format_bytes(total)}) is more than any GPU holds: ignored"
    return total, None


def device_capacity(snapshot: Snapshot, trace: DeviceTrace, given: int | None) -> tuple[int | None, str | None]:
    """The memory of the device the recorded run had, for the analysis: ``given`` (the user's
    capacity) or the sidecar's, with a note instead when it is below what the run had reserved
    there (no device holds less than was reserved on it; a replay on a smaller device is
    ``whatif``'s question, which takes its capacity as asked)."""
    if given is None:
        return sidecar_capacity(snapshot, trace)
    reserved = recorded_reserved_peak(trace)
    if given < reserved:
        return None, (f"the capacity given ({format_bytes(given)}) is below what the run had reserved "
                      f"({format_bytes(reserved)}) on device {trace.device}: ignored for this device")
    return given, None


def recorded_capacity(snapshot: Snapshot, trace: DeviceTrace) -> tuple[int | None, str | None]:
    """The device memory the recorded run had, when the files tell: the recorder's sidecar, or
    else a recorded OOM (what was reserved then plus what CUDA still reported free). Without it a
    replay cannot run out of memory, and "would it fit?" has no answer. A figure that cannot be
    true (below what the run had reserved) is not used; the note says so."""
    total, note = sidecar_capacity(snapshot, trace)
    if total is not None:
        return total, f"capacity {format_bytes(total)} from the recorder's sidecar"
    oom_rows = np.flatnonzero(trace.action == _OOM) if len(trace) else np.zeros(0, dtype=np.int64)
    if oom_rows.size:
        row = int(oom_rows[0])
        # At the OOM the allocator had already released its cached blocks and retried.
        inferred = int(trace.reserved[row]) + int(trace.device_free[row])
        reserved = recorded_reserved_peak(trace)
        if inferred >= reserved and inferred > 0:
            return inferred, (f"capacity {format_bytes(inferred)} inferred from the recorded OOM "
                              "(reserved then + what the device still had free)")
        why = ("the recorded OOM reports nothing reserved and nothing free: no capacity inferred" if inferred <= 0
               else f"the recorded OOM implies a capacity of {format_bytes(inferred)}, below the recorded "
                    f"reserved ({format_bytes(reserved)}): ignored")
        note = f"{note}; {why}" if note else why
    return None, note


def whatif(
    snapshot_or_path: Snapshot | str | Path,
    settings: AllocatorSettings | None = None,
    capacity: int | None = None,
    device: int | None = None,
    use_recorded_addresses: bool = True,
    observer: Observer | None = None,
    watch: Watch | None = None,
) -> WhatIfResult:
    """Replay one device's recorded history with ``settings`` (default: the recorded ones).

    ``use_recorded_addresses=False`` places new segments at fresh addresses instead of where
    the recorded cudaMalloc put them (the fidelity tests use it to show the figures do not
    depend on copying addresses). ``observer`` sees the simulator at every recorded
    ``segment_alloc`` and ``oom`` row (see ``Observer``); ``watch`` notes what it would see there
    without a call (see ``Watch``: a replay it stops gives figures up to that row only).
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
    replay = _Replay(
        trace, segments, recorded_settings, settings, capacity, use_recorded_addresses, observer, snapshot.stacks,
        watch,
    )
    simulated = replay.run()
    if capacity_note:
        replay.notes.insert(0, capacity_note)
    until_oom = None
    if simulated.oom:
        # The recorded rows just before the request that failed (its cudaMalloc, its page maps)
        # are the recorded allocator serving that request: the simulated run never got that far.
        cut = int(simulated.oom_event or 0)
        while cut > 0 and int(trace.action[cut - 1]) in (_SEGMENT_ALLOC, _SEGMENT_MAP):
            cut -= 1
        # Stopped before its first event (the starting state already over the capacity): nothing to compare.
        if 0 < cut < len(trace):
            until_oom = recorded_figures(trace, segments, until=cut)
    result = WhatIfResult(
        source=snapshot.source,
        device=trace.device,
        settings=settings,
        recorded_settings=recorded_settings,
        capacity=capacity,
        recorded=recorded,
        simulated=simulated,
        seeded=replay.seeded,
        initial_state=replay.initial_state,
        releases=replay.releases,
        notes=replay.notes,
        start_time_us=_time_at(trace, 0) if len(trace) else None,
        recorded_until_simulated_oom=until_oom,
    )
    stopped = result.stopped_note()
    if stopped is not None:
        result.notes.insert(0, stopped)
    return result


def recorded_figures(trace: DeviceTrace, segments: list[Segment], until: int | None = None) -> RunFigures:
    """Peak reserved, fragmentation at the peak, cudaMalloc count and OOMs of the recorded run.

    ``until``: of its first ``until`` events only (the events a simulated run that ran out of
    memory there replayed), its "end" being the state after the last of them.
    """
    action = np.asarray(trace.action)
    if until is not None and not 0 < until <= len(action):
        raise ValueError(f"until={until} is outside 1..{len(action)}")
    action = action[:until]
    n = len(action)
    final_reserved = sum(s.total_size for s in segments)
    if n:
        reserved = np.asarray(trace.reserved, dtype=np.int64)[:n]
        allocated = np.asarray(trace.allocated, dtype=np.int64)[:n]
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
        active = sum(b.size for s in segments for b in s.blocks if b.state != "inactive")
        fragmentation = final_reserved - active
        peak_allocated = active
    oom_rows = np.flatnonzero(action == _OOM)
    oom_event = int(oom_rows[0]) if len(oom_rows) else None
    return RunFigures(
        events=n,
        peak_reserved_bytes=peak_reserved,
        peak_allocated_bytes=peak_allocated,
        fragmentation_at_peak_bytes=fragmentation,
        peak_event=peak_event,
        final_reserved_bytes=int(reserved[-1]) if until is not None else (
            int(trace.final_reserved) if n else final_reserved
        ),
        segment_allocs=int(np.count_nonzero(action == _SEGMENT_ALLOC)),
        segment_frees=int(np.count_nonzero(action == _SEGMENT_FREE)),
        segment_maps=int(np.count_nonzero(action == _SEGMENT_MAP)),
        segment_unmaps=int(np.count_nonzero(action == _SEGMENT_UNMAP)),
        oom=oom_event is not None,
        oom_event=oom_event,
        oom_time_us=_time_at(trace, oom_event),
        oom_size_bytes=int(trace.size[oom_event]) if oom_event is not None else None,
    )


def _time_at(trace: DeviceTrace, index: int | None) -> int | None:
    if index is None or index < 0 or not trace.has_time:
        return None
    return int(trace.time_us[index])


def trace_releases(
    trace: DeviceTrace, stacks: StackTable | None, recorded_settings: AllocatorSettings, capacity: int | None
) -> list[Release]:
    """Every recorded release run of ``trace`` with its cause (``memlens.allocator.releases``)."""
    # The columns as they are: the runs are found by numpy and only their rows are read.
    actions = np.asarray(trace.action)
    return classify_releases(
        actions,
        np.asarray(trace.size),
        np.asarray(trace.stack_id) if len(trace.stack_id) else np.full(len(actions), -1, dtype=np.int64),
        np.asarray(trace.reserved) if len(trace.reserved) else np.zeros(len(actions), dtype=np.int64),
        int(trace.baseline_reserved),
        stacks.innermost if stacks is not None else (lambda _stack: []),
        recorded_settings,
        capacity,
    )


def left_to_simulator(release: Release, capacity: int | None) -> bool:
    """Whether a replay with ``capacity`` leaves this recorded release to the simulator (which
    then releases inside the malloc that follows, if its own settings make it run short) rather
    than calling ``empty_cache()`` where the run starts. Without a capacity the simulation can
    never run short, so the recorded choice is carried."""
    return release.cause == ALLOCATOR and capacity is not None


class _RecordedSegments:
    """The recorded run's live segments as the window goes, to name the segment of an address."""

    def __init__(self, initial: InitialState, final_segments: list[Segment]) -> None:
        self._sizes: dict[int, int] = {s.address: s.size for s in initial.segments}
        # Expandable segments grow by page maps the trace cannot place in a reservation: their
        # final extent stands for them throughout.
        for segment in final_segments:
            if segment.is_expandable:
                self._sizes.setdefault(segment.address, segment.total_size)
        self._starts = sorted(self._sizes)

    def opened(self, address: int, size: int) -> None:
        if address not in self._sizes:
            insort(self._starts, address)
        self._sizes[address] = size

    def closed(self, address: int) -> None:
        if self._sizes.pop(address, None) is not None:
            del self._starts[bisect_right(self._starts, address) - 1]

    def items(self) -> list[tuple[int, int]]:
        """(start, size) of the live segments, for the native replay to take over."""
        return list(self._sizes.items())

    def base_of(self, address: int) -> int | None:
        index = bisect_right(self._starts, address) - 1
        if index < 0:
            return None
        start = self._starts[index]
        return start if address < start + self._sizes[start] else None


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
        stacks: StackTable | None = None,
        watch: Watch | None = None,
    ) -> None:
        self.trace = trace
        self.observer = observer
        self.watch = watch
        self.use_recorded_addresses = use_recorded_addresses
        self.segments = segments
        self.recorded_settings = recorded_settings
        self.settings = settings
        self.capacity = capacity
        self.stacks = stacks
        self.notes: list[str] = []
        self.seeded = False
        self.initial_state = InitialState()
        self.releases: list[Release] = []
        # The recorded cudaMallocs (address, size), in order: the Python loop's placement hints
        # (the native loop takes them as columns).
        hint_rows = np.flatnonzero(np.asarray(trace.action) == _SEGMENT_ALLOC)
        self._hints: list[tuple[int, int]] = list(
            zip(np.asarray(trace.address)[hint_rows].tolist(), np.asarray(trace.size)[hint_rows].tolist(), strict=True)
        )
        # The recorded segment a simulated cudaMalloc stands for, until the malloc that asked
        # for it returns and the simulated base is known.
        self._pending_pair: int | None = None
        self._paired: dict[int, int] = {}  # simulated segment base -> recorded segment base

    # The columns as Python lists, for the Python loop (the native one reads the arrays).
    @cached_property
    def actions(self) -> list[int]:
        return np.asarray(self.trace.action).tolist()

    @cached_property
    def addresses(self) -> list[int]:
        return np.asarray(self.trace.address).tolist()

    @cached_property
    def sizes(self) -> list[int]:
        return np.asarray(self.trace.size).tolist()

    @cached_property
    def streams(self) -> list[int]:
        return np.asarray(self.trace.stream).tolist()

    # ------------------------------------------------------------------ address hints
    def _segment_address(self, size: int) -> int | None:
        """Pair the new simulated segment with the recorded one of its size among the next few
        recorded cudaMallocs; place it there if the replay copies the recorded bases."""
        self._pending_pair = None
        for i, (address, hinted_size) in enumerate(self._hints[:ADDRESS_HINT_LOOKAHEAD]):
            if hinted_size == size:
                del self._hints[i]
                self._pending_pair = address
                return address if self.use_recorded_addresses else None
        return None

    def _settle_pair(self, sim: CachingAllocatorSimulator, sim_address: int) -> None:
        if self._pending_pair is None:
            return
        base = sim.segment_base(sim_address)
        if base is not None:
            self._paired[base] = self._pending_pair
        self._pending_pair = None

    # ------------------------------------------------------------------ releases
    def _release_actions(self) -> dict[int, bool]:
        """First row of each recorded release run -> whether the replay calls empty_cache() there."""
        self.releases = trace_releases(self.trace, self.stacks, self.recorded_settings, self.capacity)
        decisions: dict[int, bool] = {}
        carried: list[int] = []
        for release in self.releases:
            decisions[release.start] = not left_to_simulator(release, self.capacity)
            if decisions[release.start] and release.cause != EMPTY_CACHE:
                carried.append(release.start)
        if carried:
            why = "no capacity is known, so the simulation cannot run short" if self.capacity is None else (
                "their cause cannot be told")
            rows = ", ".join(str(r) for r in carried[:5]) + (" ..." if len(carried) > 5 else "")
            self.notes.append(
                f"{len(carried)} recorded release(s) (at event {rows}) replayed as empty_cache(): {why}; "
                "a what-if with other settings inherits the recorded allocator's choice there"
            )
        return decisions

    # ------------------------------------------------------------------ replay
    def run(self) -> SimulatedFigures:
        native = native_module()
        simulator_type = simulator_class()
        sim = simulator_type(
            self.settings,
            capacity=self.capacity,
            device=self.trace.device,
            record_history=False,
            # The native replay places segments itself, from the same hints (``_native.replay``).
            segment_addresses=None if native is not None else self._segment_address,
        )
        trace = self.trace
        self.initial_state = infer_initial_state(
            np.asarray(trace.action), np.asarray(trace.address), np.asarray(trace.size), np.asarray(trace.stream),
            self.segments, self.recorded_settings,
        )
        self.notes.extend(self.initial_state.notes)
        recorded_segments = _RecordedSegments(self.initial_state, self.segments)
        mapping: dict[int, int] = {}
        for segment in self.initial_state.segments:
            try:
                sim.restore_segment(segment.address, segment.size, segment.stream, segment.is_small, segment.live)
            except MemlensUsageError as exc:
                self.notes.append(f"initial segment {segment.address:#x} skipped: {exc}")
                recorded_segments.closed(segment.address)
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

        empty_cache_at = self._release_actions()
        if native is not None:
            return self._run_native(native, sim, recorded_segments, mapping, over_capacity, empty_cache_at)
        completes = self._completed_requests()
        peak_reserved = sim.reserved_bytes
        peak_event = -1
        # Block bytes, as the recorded figures (DeviceTrace.allocated) count them.
        fragmentation = sim.reserved_bytes - sim.allocated_bytes
        peak_allocated = sim.allocated_bytes
        oom_event: int | None = 0 if over_capacity else None
        oom_size: int | None = None
        matches = allocs = 0
        placed = same_place = 0  # allocs whose recorded segment is known; of those, same (segment, offset)
        paired = self._paired
        base_of, segment_base = recorded_segments.base_of, sim.segment_base
        actions, addresses, sizes, streams = self.actions, self.addresses, self.sizes, self.streams
        notes = _WatchNotes(self.watch) if self.watch is not None else None
        for i in range(0 if over_capacity else len(actions)):
            act = actions[i]
            if act == _ALLOC:
                address = addresses[i]
                try:
                    sim_address = sim.malloc(sizes[i], streams[i])
                except SimulatedOOM:
                    oom_event, oom_size = i, sizes[i]
                    break
                self._settle_pair(sim, sim_address)
                mapping[address] = sim_address
                allocs += 1
                recorded_base = base_of(address)
                if recorded_base is not None:
                    placed += 1
                    if sim_address == address:
                        # The same address is the same (segment, offset): the simulated segment
                        # holding it is the recorded one (seeded there, or opened at its base).
                        matches += 1
                        same_place += 1
                    else:
                        sim_base = segment_base(sim_address)
                        if sim_base is not None and paired.get(sim_base, sim_base) == recorded_base:
                            same_place += sim_address - sim_base == address - recorded_base
                else:
                    matches += sim_address == address
                if sim.allocated_bytes > peak_allocated:
                    peak_allocated = sim.allocated_bytes
                reserved = sim.reserved_bytes
                if reserved >= peak_reserved:
                    waste = reserved - sim.allocated_bytes
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
            elif act == _SEGMENT_ALLOC:
                recorded_segments.opened(addresses[i], sizes[i])
                if self.observer is not None:
                    self.observer(i, sim)
                if notes is not None and notes.note(i, sim):
                    break
            elif act == _SEGMENT_FREE:
                recorded_segments.closed(addresses[i])
                if empty_cache_at.get(i):
                    sim.empty_cache()
            elif act == _SEGMENT_UNMAP:
                if empty_cache_at.get(i):
                    sim.empty_cache()
            elif act == _OOM:
                if self.observer is not None:
                    self.observer(i, sim)
                if notes is not None and notes.note(i, sim):
                    break
                # The request that failed in the recorded run is not an alloc row: try it here,
                # so "would it fit with these settings?" is answered by the simulation itself.
                try:
                    trial = sim.malloc(sizes[i], streams[i])
                except SimulatedOOM:
                    oom_event, oom_size = i, sizes[i]
                    break
                self._settle_pair(sim, trial)
                self.notes.append(
                    f"the request that failed at event {i} ({format_bytes(int(sizes[i]))}) fits in the simulation"
                )
                sim.free(trial)  # the recorded program never got it: keep the rest of the replay aligned
        if notes is not None:
            notes.fill()
        return self._figures(
            sim, events=oom_event if oom_event is not None else len(actions), peak_reserved=peak_reserved,
            peak_allocated=peak_allocated, fragmentation=fragmentation, peak_event=peak_event,
            final_reserved=sim.reserved_bytes, oom_event=oom_event,
            oom_size=int(oom_size) if oom_size is not None else None,
            matches=matches, allocs=allocs, same_place=same_place, placed=placed,
        )

    def _figures(self, sim: Any, *, events: int, peak_reserved: int, peak_allocated: int, fragmentation: int,
                 peak_event: int, final_reserved: int, oom_event: int | None, oom_size: int | None,
                 matches: int, allocs: int, same_place: int, placed: int) -> SimulatedFigures:
        """The replay's figures, as both engines' loops end them."""
        return SimulatedFigures(
            events=events,
            peak_reserved_bytes=peak_reserved,
            peak_allocated_bytes=peak_allocated,
            fragmentation_at_peak_bytes=fragmentation,
            peak_event=peak_event,
            final_reserved_bytes=final_reserved,
            segment_allocs=sim.segment_alloc_count,
            segment_frees=sim.segment_free_count,
            segment_maps=sim.segment_map_count,
            segment_unmaps=sim.segment_unmap_count,
            oom=oom_event is not None,
            oom_event=oom_event,
            oom_time_us=_time_at(self.trace, oom_event),
            oom_size_bytes=oom_size,
            alloc_address_match=(matches / allocs) if allocs else None,
            alloc_segment_offset_match=(same_place / placed) if placed else None,
            allocs_in_known_segment=placed,
        )

    def _run_native(
        self,
        native: ModuleType,
        sim: CachingAllocatorSimulator,
        recorded_segments: _RecordedSegments,
        mapping: dict[int, int],
        over_capacity: bool,
        empty_cache_at: dict[int, bool],
    ) -> SimulatedFigures:
        """The loop of ``run`` in one native call over the trace's columns (same rules, same order)."""
        trace = self.trace
        actions = np.ascontiguousarray(trace.action, dtype=np.int8)
        addresses = np.ascontiguousarray(trace.address, dtype=np.int64)
        sizes = np.ascontiguousarray(trace.size, dtype=np.int64)
        # Any stride: one stream throughout is one element (a constant column), read in place.
        streams = trace.stream if trace.stream.dtype == np.int64 else trace.stream.astype(np.int64)
        releases_at = np.zeros(len(actions), dtype=np.uint8)
        for row, decided in empty_cache_at.items():
            releases_at[row] = decided
        hint_rows = actions == _SEGMENT_ALLOC
        raw = native.replay(
            sim,
            actions,
            addresses,
            sizes,
            streams,
            native.completed_requests(actions, addresses),
            releases_at,
            np.ascontiguousarray(addresses[hint_rows]),
            np.ascontiguousarray(sizes[hint_rows]),
            self.use_recorded_addresses,
            list(mapping),
            recorded_segments.items(),
            over_capacity,
            self.observer,
            None if self.watch is None else self.watch.columns(),
        )
        if self.watch is not None:
            summaries = raw["summaries"].reshape(-1, 4).tolist()
            self.watch.noted_rows = raw["noted_rows"]
            self.watch.noted_reserved = raw["noted_reserved"]
            self.watch.summaries = [None if s[0] < 0 else (s[0], s[1], s[2], s[3]) for s in summaries]
            self.watch.stopped = bool(raw["stopped"])
        for row in raw["fits"]:
            self.notes.append(
                f"the request that failed at event {row} ({format_bytes(int(sizes[row]))}) fits in the simulation"
            )
        oom_event = raw["oom_event"]
        allocs, placed = raw["allocs"], raw["placed"]
        return self._figures(
            sim, events=raw["events"], peak_reserved=raw["peak_reserved_bytes"],
            peak_allocated=raw["peak_allocated_bytes"], fragmentation=raw["fragmentation_at_peak_bytes"],
            peak_event=raw["peak_event"], final_reserved=raw["final_reserved_bytes"], oom_event=oom_event,
            oom_size=raw["oom_size_bytes"], matches=raw["matches"], allocs=allocs, same_place=raw["same_place"],
            placed=placed,
        )

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


__all__ = ["ReleaseRun", "RunFigures", "SimulatedFigures", "WhatIfReport", "WhatIfResult", "recorded_figures", "whatif"]
