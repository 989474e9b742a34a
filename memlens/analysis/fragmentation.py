"""Fragmentation from the allocator's own evidence, and idle cache kept apart from it.

Free memory the caching allocator holds comes in two kinds, and only one is fragmentation:

* **pieces** inside partly used segments: free, but only for requests that fit a piece;
* **whole free segments**: idle cache. ``empty_cache()`` returns it, and the allocator itself
  releases it and retries before it raises out-of-memory. It is reported as ``idle_cache``,
  never as fragmentation.

With a history, fragmentation is judged where it costs memory: at each recorded cudaMalloc
(``segment_alloc`` row). A cudaMalloc is *blocked* when, at that moment, the same pool (small
or large, same stream) held at least the rounded request free but no single free block could
hold it. The free blocks at that moment come from replaying the trace through memlens' model
of the caching allocator (``memlens.allocator.whatif``, exact on the real traces), and only
for the cudaMallocs where ``reserved - allocated`` (an upper bound on any pool's free bytes)
could have held the request, so a trace whose cudaMallocs all grew a full pool costs no
replay. At an ``oom`` row the request is set against what its pool held then, plus what the
device still had. The saving is what a replay with ``expandable_segments`` (and with
``max_split_size_mb`` when large blocked requests suggest one) gives: the difference in peak
reserved, and whether the failed request then fits. The finding's bytes are that saving: where
no setting lowers the peak (or a setting's replay runs out of memory itself) there is no finding,
unless the pieces made an OOM, which is reported with no setting offered. A state-only snapshot
has no requests and no replay: it gets the pieces it holds, with no saving claimed.

Evidence keys. ``fragmentation`` with a history: ``cudamallocs``, ``blocked_cudamallocs``,
``blocked_cudamalloc_bytes``; the moments ``first_blocked_*`` and ``worst_blocked_*`` (``_event``,
``_time_us``, ``_step``) with the pool there (``_pool``, ``_stream``, ``_request_bytes``,
``_pool_free_bytes``, ``_free_in_partly_used_segments_bytes``, ``_free_in_whole_segments_bytes``,
``_largest_free_block_bytes``, ``_free_blocks``); at an OOM the same under ``oom_*`` plus
``oom_device_free_bytes`` and ``oom_blocked_by_fragmentation``; per replayed setting
``<setting>_peak_reserved_bytes``, ``<setting>_saving_bytes`` (not for a replay that ran out of memory:
``<setting>_runs_out_of_memory``; at an OOM ``<setting>_avoids_oom``),
``best_setting``, ``recorded_peak_reserved_bytes``, ``replay_reproduces_recorded_reserved``.
``fragmentation`` without a history: ``free_in_partly_used_segments_bytes``,
``partly_used_segments``, ``largest_free_piece_bytes``, ``free_in_whole_segments_bytes``,
``reserved_bytes``, ``moment`` = dump. ``idle_cache``: ``free_in_whole_segments_bytes``,
``whole_free_segments``, ``largest_whole_free_segment_bytes``, ``reserved_bytes``,
``share_of_reserved``, ``moment`` = dump (and ``dump_event``/``_time_us``/``_step``).
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from memlens.allocator import AllocatorSettings, CachingAllocatorSimulator, whatif
from memlens.allocator.replay import left_to_simulator, recorded_capacity, trace_releases
from memlens.allocator.settings import MIN_MAX_SPLIT_SIZE_MB
from memlens.allocator.simulator import K_LARGE_BUFFER, K_SMALL_BUFFER, K_SMALL_SIZE, get_allocation_size
from memlens.analysis.context import DeviceContext
from memlens.analysis.datatypes import Evidence, Finding, Severity
from memlens.analysis.settings import (
    FRAGMENTATION_HIGH_SAVING_FRACTION,
    FRAGMENTATION_MIN_BLOCKED_FRACTION,
    FRAGMENTATION_MIN_BYTES,
    FRAGMENTATION_MIN_FRACTION,
    IDLE_CACHE_MEDIUM_FRACTION,
    IDLE_CACHE_MIN_BYTES,
    IDLE_CACHE_MIN_FRACTION,
)
from memlens.errors import MemlensError
from memlens.snapshot.model import Action, DeviceTrace, Segment, Snapshot
from memlens.units import MiB, format_bytes

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
    sim: CachingAllocatorSimulator, event: int, request: int, stream: int, released: bool = False
) -> PoolState:
    """``released``: as the pool is once the allocator has freed its whole cached segments
    (``release_cached_blocks``, before it raises out-of-memory): its pieces only."""
    small = request <= K_SMALL_SIZE
    total, whole, largest, count = sim.cached_summary(small, stream, pieces_only=released)
    return PoolState(
        event=event,
        small_pool=small,
        stream=stream,
        request_bytes=request,
        free_bytes=total,
        free_in_pieces_bytes=total - whole,
        free_in_whole_segments_bytes=whole,
        largest_free_block_bytes=largest,
        free_blocks=count,
        new_segment_bytes=new_segment_bytes(request, sim.settings.expandable_segments),
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


# One replay serves both finders (fragmentation, then oom) of one analysis: remember the last few
# by the identity of the snapshot and trace they were made from (weakly, so nothing is kept alive).
_MEMO: dict[tuple[int, int, int | None], tuple[Any, Any, AllocatorEvidence]] = {}
_MEMO_SIZE = 4


def allocator_evidence(ctx: DeviceContext) -> AllocatorEvidence:
    """Replay the trace (only if some cudaMalloc could have been blocked, or it ran out of memory)
    and collect each candidate cudaMalloc's and the OOM's pool state."""
    key = (id(ctx.snapshot), id(ctx.trace), ctx.capacity)
    cached = _MEMO.get(key)
    if cached is not None and cached[0]() is ctx.snapshot and cached[1]() is ctx.trace:
        return cached[2]
    evidence = _allocator_evidence(ctx.snapshot, ctx.trace, ctx.capacity)
    if len(_MEMO) >= _MEMO_SIZE:
        _MEMO.clear()
    _MEMO[key] = (weakref.ref(ctx.snapshot), weakref.ref(ctx.trace), evidence)
    return evidence


def _allocator_evidence(snapshot: Snapshot, trace: DeviceTrace, capacity: int | None) -> AllocatorEvidence:
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

    states: dict[int, PoolState] = {}
    diverged: list[int] = []
    # cudaMallocs come early (the cache warms up in the first steps): the replay stops after the
    # last row it is asked about instead of running the whole trace.
    last_row = max([*candidates, *([] if oom_row is None else [oom_row])])

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

    def observe(row: int, sim: CachingAllocatorSimulator) -> None:
        run_start = pending_release.get(row)
        if run_start is not None:
            recorded_before = int(trace.reserved[run_start - 1]) if run_start else int(trace.baseline_reserved)
        else:
            recorded_before = int(trace.reserved[row]) - (int(trace.size[row]) if row != oom_row else 0)
        if not diverged and sim.reserved_bytes != recorded_before:
            diverged.append(row)
        stream = int(trace.stream[row])
        if row in candidates:
            states[row] = _pool_state(sim, row, candidates[row][1], stream)
        elif row == oom_row:
            # The recorded allocator gave up only after its free-and-retry released every unsplit
            # cached segment; where the simulator has yet to make that release, the pool it held
            # when it gave up is the simulator's pieces (the released bytes are in the recorded
            # device_free already).
            request = rounder.round_size(int(trace.size[row]))
            states[row] = _pool_state(sim, row, request, stream, released=run_start is not None)
        if row >= last_row:
            raise _ReplayDone

    notes: tuple[str, ...] = ()
    try:
        result = whatif(snapshot, capacity=capacity, device=trace.device, observer=observe)
        notes = tuple(result.notes)
    except _ReplayDone:
        pass
    except MemlensError as exc:
        # e.g. garbage_collection_threshold set and no capacity known: the replay cannot run, and
        # without it there is no pool state to judge a cudaMalloc by.
        return AllocatorEvidence(len(requests), (), None, 0, False, notes=(f"no allocator replay: {exc}",))
    cudamallocs = tuple(CudaMalloc(row, candidates[row][0], states[row]) for row in sorted(candidates) if row in states)
    return AllocatorEvidence(
        segment_allocs=len(requests),
        cudamallocs=cudamallocs,
        at_oom=states.get(oom_row) if oom_row is not None else None,
        oom_device_free_bytes=int(trace.device_free[oom_row]) if oom_row is not None else 0,
        replayed=True,
        diverged_at=diverged[0] if diverged else None,
        notes=notes,
    )


class _ReplayDone(Exception):
    """Raised by the observer once the replay has passed every row the analysis needs."""


# ------------------------------------------------------------------ what-if replays
@dataclass(frozen=True)
class ReplaySaving:
    setting: str  # as it goes into PYTORCH_CUDA_ALLOC_CONF
    peak_reserved: int
    saving: int  # simulated peak reserved with the recorded settings minus with this one
    oom: bool


def _max_split_candidate_mb(blocked: list[CudaMalloc]) -> int | None:
    """A ``max_split_size_mb`` that keeps blocks as large as the blocked large requests whole:
    the power of two (MiB) at or below the smallest of them, if PyTorch accepts it (> 20)."""
    large = [c.pool.request_bytes for c in blocked if not c.pool.small_pool]
    if not large:
        return None
    mb = 1 << max(0, (min(large) // MiB).bit_length() - 1)
    return mb if mb > MIN_MAX_SPLIT_SIZE_MB else None


def _replay_savings(ctx: DeviceContext, evidence: AllocatorEvidence, blocked: list[CudaMalloc]) -> list[ReplaySaving]:
    recorded = AllocatorSettings.from_snapshot_dict(ctx.snapshot.allocator_settings)
    # The replay reproduced the recorded cudaMallocs (checked row by row), so the recorded peak is
    # the replay's own with the recorded settings.
    baseline = int(ctx.trace.reserved.max())
    trials: list[tuple[str, AllocatorSettings]] = []
    if not recorded.expandable_segments:
        trials.append(("expandable_segments:True", dataclasses.replace(recorded, expandable_segments=True)))
    split_mb = _max_split_candidate_mb(blocked)
    if split_mb is not None and recorded.max_split_size is None:
        trials.append((f"max_split_size_mb:{split_mb}", dataclasses.replace(recorded, max_split_size=split_mb * MiB)))
    savings = []
    for setting, settings in trials:
        try:
            result = whatif(ctx.snapshot, settings=settings, capacity=ctx.capacity, device=ctx.device)
        except MemlensError:
            continue  # this setting cannot be replayed here: no saving is claimed for it
        peak = int(result.simulated["peak_reserved_bytes"])
        savings.append(ReplaySaving(setting, peak, baseline - peak, bool(result.simulated["oom"])))
    return savings


# ------------------------------------------------------------------ findings
def find(ctx: DeviceContext) -> list[Finding]:
    trace = ctx.trace
    has_history = ctx.events > 0 and bool((trace.action == Action.ALLOC).any())
    findings = _from_history(ctx) if has_history else _from_dump_state(ctx)
    findings.extend(_idle_cache(ctx))
    return findings


def moment_evidence(ctx: DeviceContext, prefix: str, event: int) -> Evidence:
    """Event, time and step of one trace row, as evidence keys."""
    evidence: Evidence = {f"{prefix}_event": event}
    time_us = ctx.time_at(event)
    if time_us is not None:
        evidence[f"{prefix}_time_us"] = time_us
    step = ctx.step_at(event)
    if step is not None:
        evidence[f"{prefix}_step"] = step
    return evidence


def _pool_evidence(prefix: str, state: PoolState) -> Evidence:
    return {
        f"{prefix}_pool": state.pool,
        f"{prefix}_stream": state.stream,
        f"{prefix}_request_bytes": state.request_bytes,
        f"{prefix}_pool_free_bytes": state.free_bytes,
        f"{prefix}_free_in_partly_used_segments_bytes": state.free_in_pieces_bytes,
        f"{prefix}_free_in_whole_segments_bytes": state.free_in_whole_segments_bytes,
        f"{prefix}_largest_free_block_bytes": state.largest_free_block_bytes,
        f"{prefix}_free_blocks": state.free_blocks,
    }


def _from_history(ctx: DeviceContext) -> list[Finding]:
    trace = ctx.trace
    evidence = allocator_evidence(ctx)
    blocked = evidence.blocked
    blocked_bytes = sum(c.segment_bytes for c in blocked)
    peak_reserved = int(trace.reserved.max())
    oom = evidence.at_oom if evidence.at_oom is not None and evidence.trusted(evidence.at_oom.event) else None
    # At an OOM the allocator has already released its whole free segments and retried: what its
    # pool still holds is pieces. If they, as one block or given back to the device, would have
    # held the request (or the segment it needed), fragmentation is what made it fail. A pool
    # with nothing free did not fail by fragmentation, whatever the device had left.
    oom_blocked = oom is not None and oom.fits_if_whole(evidence.oom_device_free_bytes)
    significant = blocked_bytes >= FRAGMENTATION_MIN_BYTES and blocked_bytes >= (
        FRAGMENTATION_MIN_BLOCKED_FRACTION * peak_reserved
    )
    if not (significant or oom_blocked):
        return []

    # A replay that did not reproduce the recorded run to its end cannot say what a setting would
    # save there (what it saw before it diverged is still evidence).
    faithful = evidence.diverged_at is None
    savings = _replay_savings(ctx, evidence, blocked) if faithful else []
    best = max(savings, key=lambda s: (not s.oom, s.saving), default=None)
    avoids_oom = oom is not None and best is not None and not best.oom
    reference = ctx.capacity or peak_reserved
    saving = max(best.saving, 0) if best is not None else 0
    # A finding's bytes are what its fix saves in the replay. Where every replayed setting leaves
    # the peak as high or higher (and avoids no OOM), the blocked cudaMallocs cost nothing at the
    # peak: there is no finding to make, and no setting to offer. An OOM the pieces caused stays
    # a finding (the failure is recorded), with no setting offered.
    helps = best is not None and (best.saving > 0 or avoids_oom)
    if savings and not helps:
        if not oom_blocked:
            return []
        best = None

    facts: Evidence = {
        "source": "replay of the trace through memlens' caching-allocator model (recorded settings)",
        "cudamallocs": evidence.segment_allocs,
        "blocked_cudamallocs": len(blocked),
        "blocked_cudamalloc_bytes": blocked_bytes,
        "recorded_peak_reserved_bytes": peak_reserved,
        "replay_reproduces_recorded_reserved": "yes" if faithful else f"no, from event {evidence.diverged_at}",
    }
    if ctx.capacity:
        facts["capacity_bytes"] = ctx.capacity
    parts = []
    if blocked:
        first, last = blocked[0], blocked[-1]
        worst = max(blocked, key=lambda c: (c.pool.free_bytes, -c.event))
        facts.update(moment_evidence(ctx, "first_blocked", first.event))
        facts.update(moment_evidence(ctx, "worst_blocked", worst.event))
        facts["worst_blocked_segment_bytes"] = worst.segment_bytes
        facts.update(_pool_evidence("worst_blocked", worst.pool))
        parts.append(
            f"{len(blocked)} of {evidence.segment_allocs} cudaMallocs ({format_bytes(blocked_bytes)}) were made while "
            f"their pool already held at least the request free, in no block large enough; "
            f"at event {worst.event:,} the "
            f"{worst.pool.pool} pool held {format_bytes(worst.pool.free_bytes)} free "
            f"({format_bytes(worst.pool.free_in_pieces_bytes)} inside partly used segments) for a "
            f"{format_bytes(worst.pool.request_bytes)} request, largest free block "
            f"{format_bytes(worst.pool.largest_free_block_bytes)}"
        )
        start, end = first.event, last.event + 1
        anchor = worst.event
    else:
        assert oom is not None
        start, end, anchor = oom.event, oom.event + 1, oom.event
    if oom is not None:
        facts.update(moment_evidence(ctx, "oom", oom.event))
        facts.update(_pool_evidence("oom", oom))
        facts["oom_device_free_bytes"] = evidence.oom_device_free_bytes
        facts["oom_blocked_by_fragmentation"] = "yes" if oom_blocked else "no"
        end = max(end, oom.event + 1)
        if oom_blocked:
            anchor = oom.event
            parts.append(
                f"out of memory at event {oom.event:,} asking for {format_bytes(oom.request_bytes)}: its pool held "
                f"{format_bytes(oom.free_bytes)} free in pieces (largest {format_bytes(oom.largest_free_block_bytes)}) "
                f"and the device {format_bytes(evidence.oom_device_free_bytes)}, together enough"
            )
    for trial in savings:
        name, value = trial.setting.split(":")
        if name == "max_split_size_mb":
            facts["max_split_size_mb_tried"] = int(value)
        facts[f"{name}_peak_reserved_bytes"] = trial.peak_reserved
        if not trial.oom:  # a replay cut off by its OOM has no peak to compare
            facts[f"{name}_saving_bytes"] = trial.saving
        if oom is not None:
            facts[f"{name}_avoids_oom"] = "no" if trial.oom else "yes"
        elif trial.oom:
            facts[f"{name}_runs_out_of_memory"] = "yes"
    if best is not None:
        facts["best_setting"] = best.setting

    severity: Severity
    if avoids_oom or saving >= FRAGMENTATION_HIGH_SAVING_FRACTION * reference:
        severity = "high"
    elif oom_blocked or saving >= FRAGMENTATION_MIN_BYTES:
        severity = "medium"
    else:
        severity = "low"
    # Without a setting that helps, the bytes are the pieces the failed request could not use
    # (or, no setting tried at all, the pieces of the worst blocked cudaMalloc's pool).
    stranded = oom.free_bytes if oom_blocked and oom is not None else max(
        (c.pool.free_in_pieces_bytes for c in blocked), default=oom.free_bytes if oom else 0
    )
    lead = "oom" if oom_blocked else "worst_blocked"
    facts = lead_with(facts, [
        f"{lead}_event", f"{lead}_request_bytes", f"{lead}_pool_free_bytes", f"{lead}_largest_free_block_bytes",
        "oom_device_free_bytes" if oom_blocked else "blocked_cudamallocs",
        "expandable_segments_avoids_oom" if oom_blocked else "expandable_segments_saving_bytes",
    ])
    return [
        Finding(
            kind="fragmentation",
            device=ctx.device,
            severity=severity,
            bytes=saving or stranded,
            start_event=start,
            end_event=end,
            start_us=ctx.time_at(start),
            end_us=ctx.time_at(end - 1),
            step=ctx.step_at(anchor),
            top_stacks=[],
            evidence=facts,
            summary="; ".join(parts) + ".",
            recommendation=_history_recommendation(peak_reserved, faithful, savings, best, oom is not None, helps),
            estimated_saving_bytes=saving or None,
        )
    ]


def lead_with(facts: Evidence, first: list[str]) -> Evidence:
    """The same evidence with ``first`` (those present) leading: reporters show the first few."""
    leading = {key: facts[key] for key in first if key in facts}
    return {**leading, **{key: value for key, value in facts.items() if key not in leading}}


def _history_recommendation(
    peak_reserved: int,
    faithful: bool,
    savings: list[ReplaySaving],
    best: ReplaySaving | None,
    had_oom: bool,
    helps: bool,
) -> str:
    baseline = format_bytes(peak_reserved)
    if not faithful:
        return ("memlens' allocator replay does not reproduce this trace's reserved memory, so it claims no saving; "
                "try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and compare the peak reserved.")
    if not savings:
        return ("expandable_segments is already on and no max_split_size_mb applies: keep tensor shapes stable "
                "between steps, and allocate long-lived tensors before the temporaries that surround them.")
    tried = "; ".join(
        f"with {s.setting} peak reserved is {format_bytes(s.peak_reserved)}"
        + (", still out of memory" if had_oom and s.oom else ", the failed request fits" if had_oom else "")
        for s in savings
    )
    if helps and best is not None:
        return (f"Set PYTORCH_CUDA_ALLOC_CONF={best.setting}. Replaying this trace through memlens' allocator "
                f"model: {baseline} peak reserved as recorded; {tried}.")
    return (f"No allocator setting memlens replayed avoids this failure ({baseline} peak reserved as recorded; "
            f"{tried}). Keep tensor shapes stable between steps so freed blocks fit the next requests, or "
            "free (or allocate earlier) the long-lived tensors that split the cached blocks.")


def _dump_pieces(segments: list[Segment]) -> tuple[int, int, int, int]:
    """Free bytes inside partly used segments, how many such segments, the largest piece, and the
    free bytes in whole free segments, at dump time."""
    pieces = partly = largest = whole = 0
    for segment in segments:
        free = [b.size for b in segment.blocks if not b.is_active]
        if not free:
            continue
        if len(free) == len(segment.blocks):
            whole += sum(free)
            continue
        pieces += sum(free)
        partly += 1
        largest = max(largest, max(free))
    return pieces, partly, largest, whole


def _dump_event(ctx: DeviceContext) -> int:
    return max(ctx.events - 1, 0)


def _from_dump_state(ctx: DeviceContext) -> list[Finding]:
    """No history: the dump's pieces are all there is. Nothing tells whether a request was ever
    blocked by them, so no saving is claimed."""
    reserved = sum(s.total_size for s in ctx.segments)
    pieces, partly, largest, whole = _dump_pieces(ctx.segments)
    share = pieces / reserved if reserved else 0.0
    if pieces < FRAGMENTATION_MIN_BYTES or share < FRAGMENTATION_MIN_FRACTION:
        return []
    at = _dump_event(ctx)
    facts: Evidence = {
        "free_in_partly_used_segments_bytes": pieces,
        "partly_used_segments": partly,
        "largest_free_piece_bytes": largest,
        "reserved_bytes": reserved,
        "share_of_reserved": round(share, 3),
        "free_in_whole_segments_bytes": whole,
        "moment": "dump",
        "segments": len(ctx.segments),
        "source": "dump-time segments (no allocation history)",
    }
    if ctx.events:
        facts.update(moment_evidence(ctx, "dump", at))
    return [
        Finding(
            kind="fragmentation",
            device=ctx.device,
            severity="low",
            bytes=pieces,
            start_event=at,
            end_event=at + 1 if ctx.events else 0,
            start_us=ctx.time_at(at),
            end_us=ctx.time_at(at),
            step=None,
            top_stacks=[],
            evidence=facts,
            summary=(f"At dump time {format_bytes(pieces)} ({share:.0%} of reserved) is free in pieces inside "
                     f"{partly} partly used segments; the largest piece is {format_bytes(largest)}."),
            recommendation=("The snapshot has no allocation history, so whether any request was blocked by these "
                            "pieces is unknown: record one (memlens record, or torch.cuda.memory."
                            "_record_memory_history) and triage it; memlens then replays it with expandable_segments "
                            "and reports the saving."),
            estimated_saving_bytes=None,
        )
    ]


def _idle_cache(ctx: DeviceContext) -> list[Finding]:
    """Whole free segments at dump time: cache the allocator keeps for later requests."""
    segments = [s for s in ctx.segments if s.blocks and not any(b.is_active for b in s.blocks)]
    idle = sum(s.total_size for s in segments)
    reserved = sum(s.total_size for s in ctx.segments)
    if idle < IDLE_CACHE_MIN_BYTES or idle < IDLE_CACHE_MIN_FRACTION * reserved:
        return []
    reference = ctx.capacity or reserved
    at = _dump_event(ctx)
    facts: Evidence = {
        "free_in_whole_segments_bytes": idle,
        "whole_free_segments": len(segments),
        "reserved_bytes": reserved,
        "share_of_reserved": round(idle / reserved, 3),
        "largest_whole_free_segment_bytes": max(s.total_size for s in segments),
        "moment": "dump",
    }
    if ctx.events:
        facts.update(moment_evidence(ctx, "dump", at))
    if ctx.capacity:
        facts["capacity_bytes"] = ctx.capacity
    return [
        Finding(
            kind="idle_cache",
            device=ctx.device,
            severity="medium" if idle >= IDLE_CACHE_MEDIUM_FRACTION * reference and ctx.capacity else "low",
            bytes=idle,
            start_event=at,
            end_event=at + 1 if ctx.events else 0,
            start_us=ctx.time_at(at),
            end_us=ctx.time_at(at),
            step=ctx.step_at(at) if ctx.events else None,
            top_stacks=[],
            evidence=facts,
            summary=(f"At dump time {format_bytes(idle)} ({idle / reserved:.0%} of reserved) sits in "
                     f"{len(segments)} entirely free segments: cached, not fragmented."),
            recommendation=(
                "torch.cuda.empty_cache() (after gc.collect()) gives it back to the device, which helps another "
                "process or a later phase (evaluation, another model); inside a training loop the next step "
                "reuses it, and the allocator releases it by itself before it runs out of memory. To cap the "
                "cache, set torch.cuda.set_per_process_memory_fraction(...) with "
                "PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:0.8."
            ),
            # Not a saving: the next step of a loop reuses it, and peak reserved stays where it is.
            estimated_saving_bytes=None,
        )
    ]
