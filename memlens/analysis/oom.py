"""Out of memory: from ``oom`` trace rows, or a state-only snapshot dumped at the failure.

Says what was requested, what was free and where, what was live by category, and which other
finding explains it. Runs last: it reads the findings the other finders made.

What was free is measured at the failure, never at dump time: with a history, the failed
request's pool as the allocator replay held it at the ``oom`` row (shared with the fragmentation
finder, one replay for both); without one, only the dump's totals, named as such.
"""

from __future__ import annotations

import numpy as np

from memlens.analysis import fragmentation
from memlens.analysis.categories import bytes_by_category
from memlens.analysis.context import DeviceContext
from memlens.analysis.datatypes import Evidence, EvidenceItem, Finding, amount, fact
from memlens.analysis.settings import OOM_NEAR_CAPACITY_FRACTION
from memlens.snapshot.model import Action
from memlens.units import MiB, format_bytes

_ADVICE = {
    "fragmentation": "enough memory was cached but not in one piece: see the fragmentation finding",
    "leak": "memory grew step after step until it ran out: see the leak finding",
    "optimizer_spike": "it failed inside optimizer.step: see the optimizer finding",
    "activation_plateau": "activations fill most of the device: see the activation finding",
}


def _explain(ctx: DeviceContext, event: int | None, live: dict[str, int], pool_known: bool) -> str:
    """Which finding explains the failure. ``pool_known``: the replay held the failed request's
    pool at the OOM row; then only the fragmentation finder's verdict on that row makes it a
    fragmentation failure, never another moment's blocked cudaMallocs."""
    kinds = {f.kind for f in ctx.findings}
    for f in ctx.findings:
        # The fragmentation finder set the request against its pool and the device at this row.
        if f.kind == "fragmentation" and event is not None and f.evidence.get("oom_blocked_by_fragmentation") == "yes" \
                and f.evidence.get("oom_event") == event:
            return "fragmentation"
    if "leak" in kinds:
        return "leak"
    for f in ctx.findings:
        if f.kind == "optimizer_spike" and event is not None and f.start_event <= event < f.end_event:
            return "optimizer_spike"
    if "activation_plateau" in kinds and live.get("activations", 0) >= max(live.values(), default=0):
        return "activation_plateau"
    if "fragmentation" in kinds and not pool_known:
        return "fragmentation"
    return "none"


def _why_no_room(pool: fragmentation.PoolState, device_free: int) -> str:
    """Why the request did not fit, from the replay's pool at the OOM and the device's free bytes."""
    request = format_bytes(pool.request_bytes)
    largest = format_bytes(pool.largest_free_block_bytes)
    if pool.fits_if_whole(device_free):
        if pool.free_bytes >= pool.request_bytes:
            return (f"its {pool.pool} pool held {format_bytes(pool.free_bytes)} free, enough for the {request} "
                    f"request but not in one piece (largest block {largest})")
        return (f"its {pool.pool} pool held {format_bytes(pool.free_bytes)} free in pieces (largest block {largest}): "
                f"with the {format_bytes(device_free)} left on the device enough for the "
                f"{format_bytes(pool.new_segment_bytes)} segment the {request} request needed, but not in one piece")
    held = f"its {pool.pool} pool held {format_bytes(pool.free_bytes)} free" + (
        f" (largest block {largest})" if pool.free_bytes else "")
    segment = pool.new_segment_bytes
    if segment > pool.request_bytes:
        opens = f"the {request} request opens a {format_bytes(segment)} segment"
        if pool.small_pool:
            opens += " (requests up to 1 MiB share 2 MiB segments)"
        elif segment == 20 * MiB and pool.request_bytes < 10 * MiB:
            opens += " (the allocator packs 1-10 MiB requests in 20 MiB segments)"
    else:
        opens = f"the {request} request needs a new {format_bytes(segment)} segment"
    return f"{held}, so {opens}, which did not fit in the {format_bytes(device_free)} left on the device"


def find(ctx: DeviceContext) -> list[Finding]:
    trace = ctx.trace
    lt = ctx.lifetimes
    rows = np.flatnonzero(trace.action == Action.OOM) if ctx.events else np.zeros(0, dtype=np.int64)
    pool = None
    if rows.size:
        at = int(rows[-1])
        requested = int(trace.size[at])
        device_free = int(trace.device_free[at])
        allocated, reserved = int(trace.allocated[at]), int(trace.reserved[at])
        live = bytes_by_category(ctx.category, lt.size, lt.live_at(at))
        source = "oom trace entry"
        event: int | None = at
        if (trace.action == Action.ALLOC).any():
            pool = ctx.allocator_evidence().at_oom
    else:
        reserved = sum(s.total_size for s in ctx.segments)
        if not ctx.capacity or reserved < OOM_NEAR_CAPACITY_FRACTION * ctx.capacity:
            return []
        at = max(ctx.events - 1, 0)
        requested = 0
        device_free = ctx.capacity - reserved
        allocated = sum(b.size for s in ctx.segments for b in s.blocks if b.is_allocated)
        live = bytes_by_category(ctx.category, lt.size, lt.free_event >= ctx.events)
        snapshots = int((trace.action == Action.SNAPSHOT).sum()) if ctx.events else 0
        source = f"state near capacity at dump ({reserved / ctx.capacity:.0%})" + (
            "; the trace holds a snapshot entry" if snapshots else ""
        )
        event = None
    cached_free = max(reserved - allocated, 0)
    live["unknown"] = live.get("unknown", 0) + max(allocated - sum(live.values()), 0)
    cause = _explain(ctx, event, live, pool is not None)
    # The request, what was free for it, when, and why it did not fit.
    evidence: list[EvidenceItem] = [
        amount("requested_bytes", requested),
        fact("device_free_bytes", device_free, "bytes", "pattern"),
    ]
    if pool is not None:
        where = ""  # the reason says what the pool held
        reason = _why_no_room(pool, device_free)
        evidence += [
            fact("pool_free_bytes", pool.free_bytes, "bytes", "pattern"),
            fact("pool_largest_free_block_bytes", pool.largest_free_block_bytes, "bytes", "pattern"),
            fact("new_segment_bytes", pool.new_segment_bytes, "bytes", "pattern"),
            fact("pool", pool.pool, "text", "context"),
            fact("pool_free_in_partly_used_segments_bytes", pool.free_in_pieces_bytes, "bytes", "context"),
        ]
    else:
        # A pass over every block at the dump: only for the run that has this finding.
        largest_free = max((s.largest_free_block for s in ctx.segments), default=0)
        evidence += [
            fact("moment", "oom" if event is not None else "dump", "text", "moment"),
            fact("largest_free_block_at_dump_bytes", largest_free, "bytes", "pattern"),
        ]
        where = f"largest cached piece at dump time {format_bytes(largest_free)}"
    evidence.append(fact("cached_free_bytes", cached_free, "bytes", "pattern"))
    if event is not None:
        evidence += fragmentation.moment_evidence(ctx, "oom", event)
    evidence.append(fact("explained_by", cause, "text", "cause"))
    if pool is not None:
        evidence.append(fact("reason", reason, "text", "cause"))
    evidence += [
        fact("allocated_bytes", allocated, "bytes", "context"),
        fact("reserved_bytes", reserved, "bytes", "context"),
        fact("oom_events", int(rows.size), "count", "context"),
        fact("source", source, "text", "context"),
        *(fact(f"live_{name}_bytes", value, "bytes", "context") for name, value in live.items()),
    ]
    if ctx.capacity:
        evidence.append(fact("capacity_bytes", ctx.capacity, "bytes", "context"))
    asked = f"asked for {format_bytes(requested)} with " if requested else ""
    summary = (
        f"Out of memory: {asked}{format_bytes(device_free)} free on the device and "
        f"{format_bytes(cached_free)} reserved but unallocated"
    )
    # With the replay's pool the reason says what it held; without it, what the dump shows.
    summary += f". Why: {reason}." if pool is not None else f" ({where})."
    recommendation = _ADVICE.get(cause, "lower the batch size, or see the categories live at the failure")
    return [
        Finding(
            kind="oom",
            device=ctx.device,
            severity="high",
            bytes=requested or allocated,
            start_event=at,
            end_event=at + 1 if ctx.events else 0,
            start_us=ctx.time_at(at),
            end_us=ctx.time_at(at),
            step=ctx.step_at(at) if ctx.events else None,
            top_stacks=ctx.top_stacks(lt.live_at(at) if event is not None else lt.free_event >= ctx.events),
            evidence=Evidence(evidence),
            summary=summary,
            recommendation=recommendation[0].upper() + recommendation[1:] + ".",
            estimated_saving_bytes=None,
        )
    ]
