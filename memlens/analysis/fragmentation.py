"""Fragmentation: reserved memory far above allocated memory.

At the allocated peak the gap (reserved - allocated) splits into *internal* fragmentation
(rounding: block size - requested size, known per live allocation) and *external* (cached free
pieces inside segments). Block-level detail (largest free piece, segments with only small
free pieces) exists only for the dump-time state, so it is reported from there. The gain of
``expandable_segments`` is estimated as the external gap at the peak: an upper bound.
"""

from __future__ import annotations

import numpy as np

from memlens.analysis.context import DeviceContext
from memlens.analysis.report import Finding
from memlens.analysis.settings import (
    ALLOCATOR_ROUNDING,
    FRAGMENTATION_HIGH_FRACTION,
    FRAGMENTATION_MIN_BYTES,
    FRAGMENTATION_MIN_FRACTION,
    SMALL_FREE_PIECE,
)
from memlens.snapshot.model import Action
from memlens.units import MiB, format_bytes

# A "typical" large request: this percentile of the window's alloc sizes.
TYPICAL_REQUEST_PERCENTILE = 90


def _rounded(size: np.ndarray) -> np.ndarray:
    return np.maximum(ALLOCATOR_ROUNDING, (size + ALLOCATOR_ROUNDING - 1) // ALLOCATOR_ROUNDING * ALLOCATOR_ROUNDING)


def find(ctx: DeviceContext) -> list[Finding]:
    trace = ctx.trace
    n = ctx.events
    lt = ctx.lifetimes
    blocks = [b for s in ctx.segments for b in s.blocks]
    end_internal = sum(b.size - b.requested_size for b in blocks if b.is_active)
    end_free = [b.size for b in blocks if not b.is_active]
    end_external = sum(end_free)
    largest_free = max(end_free, default=0)

    oom_rows = np.flatnonzero(trace.action == Action.OOM) if n else np.zeros(0, dtype=np.int64)
    alloc_sizes = trace.size[trace.action == Action.ALLOC] if n else np.zeros(0, dtype=np.int64)
    if oom_rows.size:
        typical = int(trace.size[oom_rows[-1]])
    elif alloc_sizes.size:
        typical = int(np.percentile(alloc_sizes, TYPICAL_REQUEST_PERCENTILE))
    else:
        typical = max((b.size for b in blocks if b.is_active), default=0)
    small_only = sum(
        1 for s in ctx.segments if s.free_size > 0 and s.largest_free_block < max(typical, SMALL_FREE_PIECE)
    )

    if n:
        at = int(oom_rows[-1]) if oom_rows.size else int(ctx.peak_event or 0)
        reserved = int(trace.reserved[at])
        allocated = int(trace.allocated[at])
        live = lt.live_at(at)
        internal = int((_rounded(lt.size[live]) - lt.size[live]).sum())
        gap = max(reserved - allocated, 0)
        external = max(gap - internal, 0)
        gap_curve = trace.reserved - trace.allocated
        worst = int(np.argmax(gap_curve))
        where = "at the out-of-memory error" if oom_rows.size else "at the allocated peak"
    else:
        at, worst = 0, 0
        reserved = sum(s.total_size for s in ctx.segments)
        allocated = sum(b.requested_size for b in blocks if b.is_active)
        internal, external = end_internal, end_external
        gap = max(reserved - allocated, 0)
        gap_curve = np.zeros(0, dtype=np.int64)
        where = "at dump time"
    share = external / reserved if reserved else 0.0
    # At an OOM the size thresholds do not apply: if the cached free pieces plus what the device
    # still had would have held the request, fragmentation is what made it fail.
    blocked = bool(oom_rows.size) and external + int(trace.device_free[at]) >= typical > 0
    if not blocked and (external < FRAGMENTATION_MIN_BYTES or share < FRAGMENTATION_MIN_FRACTION):
        return []

    expandable = bool(ctx.snapshot.allocator_settings.get("expandable_segments"))
    split_mb = max(128, 1 << max(0, int(np.ceil(np.log2(max(typical, 1) / MiB)))))
    if expandable:
        recommendation = (
            f"expandable_segments is already on: try PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:{split_mb} so large "
            "cached blocks are not split for small requests, and keep tensor shapes stable between steps."
        )
    else:
        recommendation = (
            "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (segments grow in place instead of leaving "
            f"holes): up to ~{format_bytes(external)} of reserved memory back; or max_split_size_mb:{split_mb}; "
            "keep tensor shapes stable between steps."
        )
    evidence: dict[str, int | float | str] = {
        "reserved_bytes": reserved,
        "allocated_bytes": allocated,
        "gap_bytes": gap,
        "internal_bytes": internal,
        "external_bytes": external,
        "external_share_of_reserved": round(share, 3),
        "where": where,
        "typical_request_bytes": typical,
        "largest_free_block_at_dump_bytes": largest_free,
        "free_bytes_at_dump": end_external,
        "internal_bytes_at_dump": end_internal,
        "segments_with_only_small_free_pieces": small_only,
        "segments_at_dump": len(ctx.segments),
        "expandable_segments": int(expandable),
    }
    if gap_curve.size:
        evidence["max_gap_bytes"] = int(gap_curve[worst])
        evidence["max_gap_event"] = worst
    if blocked:
        evidence["device_free_at_oom_bytes"] = int(trace.device_free[at])
    severity = "high" if oom_rows.size or share >= FRAGMENTATION_HIGH_FRACTION else "medium"
    return [
        Finding(
            kind="fragmentation",
            device=ctx.device,
            severity=severity,
            bytes=external,
            start_event=at,
            end_event=at + 1 if n else 0,
            start_us=ctx.time_at(at),
            end_us=ctx.time_at(at),
            step=ctx.step_at(at) if n else None,
            top_stacks=[],
            evidence=evidence,
            summary=(
                f"{format_bytes(external)} ({share:.0%} of reserved) sits in cached free pieces {where}"
                + (f"; with the {format_bytes(int(trace.device_free[at]))} the device still had, that would have "
                   f"held the failed {format_bytes(typical)} request, but no piece was large enough "
                   f"(largest at dump: {format_bytes(largest_free)})." if blocked else
                   f"; the largest free block at dump time is {format_bytes(largest_free)} vs a typical request "
                   f"of {format_bytes(typical)}.")
            ),
            recommendation=recommendation,
            estimated_saving_bytes=external,
        )
    ]
