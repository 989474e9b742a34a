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
from dataclasses import dataclass

from memlens.allocator import AllocatorSettings, whatif
from memlens.allocator.settings import MIN_MAX_SPLIT_SIZE_MB
from memlens.analysis.context import DeviceContext
from memlens.analysis.datatypes import Evidence, EvidenceItem, EvidenceMeaning, Finding, Severity, amount, fact
from memlens.analysis.pool_replay import AllocatorEvidence, CudaMalloc, PoolState, new_segment_bytes
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
from memlens.snapshot.model import Action, Segment
from memlens.units import MiB, format_bytes

# The pool state types live in ``pool_replay`` (which the context holds the replay of); they are
# named here too, where the finders that read them are.
__all__ = ["AllocatorEvidence", "CudaMalloc", "PoolState", "find", "moment_evidence", "new_segment_bytes"]


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
        peak = int(result.simulated.peak_reserved_bytes)
        savings.append(ReplaySaving(setting, peak, baseline - peak, bool(result.simulated.oom)))
    return savings


# ------------------------------------------------------------------ findings
def find(ctx: DeviceContext) -> list[Finding]:
    trace = ctx.trace
    has_history = ctx.events > 0 and bool((trace.action == Action.ALLOC).any())
    findings = _from_history(ctx) if has_history else _from_dump_state(ctx)
    findings.extend(_idle_cache(ctx))
    return findings


def moment_evidence(ctx: DeviceContext, prefix: str, event: int) -> list[EvidenceItem]:
    """Event, time and step of one trace row, as evidence items."""
    evidence = [fact(f"{prefix}_event", event, "event", "moment")]
    time_us = ctx.time_at(event)
    if time_us is not None:
        evidence.append(fact(f"{prefix}_time_us", time_us, "us", "moment"))
    step = ctx.step_at(event)
    if step is not None:
        evidence.append(fact(f"{prefix}_step", step, "step", "moment"))
    return evidence


def _pool_evidence(prefix: str, state: PoolState, meaning: EvidenceMeaning) -> list[EvidenceItem]:
    """The pool at one moment: its request, its free bytes and largest block (``meaning``: what
    shows the finding, or its context), the rest context."""
    return [
        fact(f"{prefix}_request_bytes", state.request_bytes, "bytes", meaning),
        fact(f"{prefix}_pool_free_bytes", state.free_bytes, "bytes", meaning),
        fact(f"{prefix}_largest_free_block_bytes", state.largest_free_block_bytes, "bytes", meaning),
        fact(f"{prefix}_pool", state.pool, "text", "context"),
        fact(f"{prefix}_stream", state.stream, "count", "context"),
        fact(f"{prefix}_free_in_partly_used_segments_bytes", state.free_in_pieces_bytes, "bytes", "context"),
        fact(f"{prefix}_free_in_whole_segments_bytes", state.free_in_whole_segments_bytes, "bytes", "context"),
        fact(f"{prefix}_free_blocks", state.free_blocks, "count", "context"),
    ]


def _from_history(ctx: DeviceContext) -> list[Finding]:
    trace = ctx.trace
    evidence = ctx.allocator_evidence()
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

    # What shows the finding is where it failed (at the OOM the pieces made) or else the worst
    # blocked cudaMalloc: that moment's pool leads, the other's is context.
    lead: EvidenceMeaning = "context" if oom_blocked else "pattern"
    facts: list[EvidenceItem] = [
        fact("blocked_cudamalloc_bytes", blocked_bytes, "bytes", "amount"),
        fact("blocked_cudamallocs", len(blocked), "count", lead),
        fact("cudamallocs", evidence.segment_allocs, "count", "context"),
        fact("recorded_peak_reserved_bytes", peak_reserved, "bytes", "context"),
        fact("replay_reproduces_recorded_reserved", "yes" if faithful else f"no, from event {evidence.diverged_at}",
             "text", "context"),
        fact("source", "replay of the trace through memlens' caching-allocator model (recorded settings)", "text",
             "context"),
    ]
    if ctx.capacity:
        facts.append(fact("capacity_bytes", ctx.capacity, "bytes", "context"))
    if oom is not None and oom_blocked:  # the failure is the moment to read first
        facts += moment_evidence(ctx, "oom", oom.event)
    parts = []
    if blocked:
        first, last = blocked[0], blocked[-1]
        worst = max(blocked, key=lambda c: (c.pool.free_bytes, -c.event))
        facts += moment_evidence(ctx, "worst_blocked", worst.event)
        facts += moment_evidence(ctx, "first_blocked", first.event)
        facts.append(fact("worst_blocked_segment_bytes", worst.segment_bytes, "bytes", lead))
        facts += _pool_evidence("worst_blocked", worst.pool, lead)
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
        at_oom: EvidenceMeaning = "pattern" if oom_blocked else "context"
        if not oom_blocked:
            facts += moment_evidence(ctx, "oom", oom.event)
        facts += _pool_evidence("oom", oom, at_oom)
        facts.append(fact("oom_device_free_bytes", evidence.oom_device_free_bytes, "bytes", at_oom))
        facts.append(fact("oom_blocked_by_fragmentation", "yes" if oom_blocked else "no", "text", "cause"))
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
            facts.append(fact("max_split_size_mb_tried", int(value), "mib", "remedy"))
        if oom is not None:
            facts.append(fact(f"{name}_avoids_oom", "no" if trial.oom else "yes", "text", "remedy"))
        elif trial.oom:
            facts.append(fact(f"{name}_runs_out_of_memory", "yes", "text", "remedy"))
        if not trial.oom:  # a replay cut off by its OOM has no peak to compare
            facts.append(fact(f"{name}_saving_bytes", trial.saving, "bytes", "remedy"))
        facts.append(fact(f"{name}_peak_reserved_bytes", trial.peak_reserved, "bytes", "remedy"))
    if best is not None:
        facts.append(fact("best_setting", best.setting, "text", "remedy"))

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
            evidence=Evidence(facts),
            summary="; ".join(parts) + ".",
            recommendation=_history_recommendation(peak_reserved, faithful, savings, best, oom is not None, helps),
            estimated_saving_bytes=saving or None,
        )
    ]


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
    facts = [
        amount("free_in_partly_used_segments_bytes", pieces),
        fact("partly_used_segments", partly, "count", "pattern"),
        fact("largest_free_piece_bytes", largest, "bytes", "pattern"),
        fact("share_of_reserved", round(share, 3), "ratio", "pattern"),
        fact("moment", "dump", "text", "moment"),
        *(moment_evidence(ctx, "dump", at) if ctx.events else []),
        fact("reserved_bytes", reserved, "bytes", "context"),
        fact("free_in_whole_segments_bytes", whole, "bytes", "context"),
        fact("segments", len(ctx.segments), "count", "context"),
        fact("source", "dump-time segments (no allocation history)", "text", "context"),
    ]
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
            evidence=Evidence(facts),
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
    facts = [
        amount("free_in_whole_segments_bytes", idle),
        fact("whole_free_segments", len(segments), "count", "pattern"),
        fact("share_of_reserved", round(idle / reserved, 3), "ratio", "pattern"),
        fact("largest_whole_free_segment_bytes", max(s.total_size for s in segments), "bytes", "pattern"),
        fact("moment", "dump", "text", "moment"),
        *(moment_evidence(ctx, "dump", at) if ctx.events else []),
        fact("reserved_bytes", reserved, "bytes", "context"),
    ]
    if ctx.capacity:
        facts.append(fact("capacity_bytes", ctx.capacity, "bytes", "context"))
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
            evidence=Evidence(facts),
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
