"""Running the finders over a snapshot: ``analyze`` and ``analyze_snapshot`` (what
``memlens.analysis`` exposes; see the package's docstring)."""

from __future__ import annotations

import os
from collections.abc import Callable

import msgspec
import numpy as np

from memlens.analysis import activations, fragmentation, leak, oom, optimizer
from memlens.analysis.analysis import Analysis
from memlens.analysis.context import DeviceContext, build_context
from memlens.analysis.live import BEFORE_FIRST_ROW, LiveIndex, breakdown
from memlens.analysis.report import (
    DeviceReport,
    Finding,
    Report,
    finding_rank,
)
from memlens.analysis.settings import AnalysisSettings
from memlens.analysis.stacks import StackFacts
from memlens.analysis.views import segment_map_of, timeline_of
from memlens.sidecar import Sidecar
from memlens.snapshot.model import Snapshot

Finder = Callable[[DeviceContext], list[Finding]]


# Order matters only for OOM, which runs last and names the finding that explains it.
FINDERS: tuple[tuple[str, Finder], ...] = (
    ("leak", leak.find),
    ("activation_plateau", activations.find),
    ("optimizer_spike", optimizer.find),
    ("fragmentation", fragmentation.find),
    ("oom", oom.find),
)


def analyze(
    source: str | os.PathLike[str] | Snapshot,
    *,
    capacity: int | str | None = None,
    device: int | None = None,
    bytes_per_param: int | None = None,
    top_stacks: int | None = None,
) -> Report:
    """Analyse a snapshot file or a loaded ``Snapshot`` into a plain-data ``Report``.

    ``capacity``: the device's memory (bytes or "80GiB"; default the recorder's sidecar);
    ``device``: one device (default all); ``bytes_per_param``: to turn parameter bytes into a
    count (default fp32's 4); ``top_stacks``: stacks kept per category (default 5).
    """
    return analyze_snapshot(source, capacity=capacity, device=device, bytes_per_param=bytes_per_param,
                            top_stacks=top_stacks).report


def analyze_snapshot(
    source: str | os.PathLike[str] | Snapshot,
    *,
    capacity: int | str | None = None,
    device: int | None = None,
    bytes_per_param: int | None = None,
    top_stacks: int | None = None,
) -> Analysis:
    """``analyze``, keeping the snapshot and the per-allocation index with the report."""
    options = AnalysisSettings.from_kwargs(
        capacity=capacity, device=device, bytes_per_param=bytes_per_param, top_stacks=top_stacks
    )
    if isinstance(source, Snapshot):
        snapshot = source
    else:
        from memlens.snapshot.reader import load

        snapshot = load(source)
    if options.device is not None:
        traces = [snapshot.device(options.device)]  # raises MemlensUsageError when absent
    else:
        traces = [snapshot.devices[d] for d in snapshot.device_ids]
    facts = StackFacts.build(snapshot.stacks)
    devices: dict[int, DeviceReport] = {}
    live: dict[int, LiveIndex] = {}
    for trace in traces:
        ctx = build_context(snapshot, trace, options, facts)
        for _, find in FINDERS:
            ctx.findings.extend(find(ctx))
        live[trace.device] = LiveIndex.build(ctx.lifetimes, ctx.category, ctx.facts, ctx.settings.top_stacks)
        devices[trace.device] = _device_report(ctx, live[trace.device])
    findings = sorted((f for d in devices.values() for f in d.findings), key=finding_rank)
    report = Report(
        source=snapshot.source,
        devices=devices,
        findings=findings,
        format_guess=snapshot.format_guess,
        # The recorder's role lists are evidence for the categories (read from the snapshot),
        # not something a report needs to carry: they grow with the model and the steps.
        sidecar=msgspec.structs.replace(snapshot.sidecar, tensor_roles=None) if snapshot.sidecar is not None else None,
    )
    return Analysis(snapshot=snapshot, report=report, live=live)


def _device_report(ctx: DeviceContext, index: LiveIndex) -> DeviceReport:
    trace = ctx.trace
    n = ctx.events
    peak_reserved_event: int | None = None  # None: the instant before the first row (or no rows)
    peak_reserved = trace.baseline_reserved
    if n and int(trace.reserved.max()) >= trace.baseline_reserved:
        peak_reserved_event = int(np.argmax(trace.reserved))
        peak_reserved = int(trace.reserved[peak_reserved_event])
    # No rows: what the dump holds (every lifetime); a peak before the first row: the lifetimes
    # live when the history began.
    peak = ctx.peak_event if ctx.peak_event is not None else (BEFORE_FIRST_ROW if n else None)
    categories, top = breakdown(index, trace, peak)
    notes = list(ctx.notes)
    if n == 0 and not ctx.segments:
        # Said first: the other notes (no steps, no categories) follow from it.
        notes.insert(0, "the snapshot is empty on this device: no segments and no trace entries (dumped before "
                        "any CUDA allocation, or after the cache was emptied, with no history recorded)")
    return DeviceReport(
        device=ctx.device,
        events=n,
        steps=ctx.steps,
        step_source=ctx.step_source,
        peak_allocated_bytes=ctx.peak_allocated,
        peak_allocated_event=ctx.peak_event,
        peak_requested_bytes=int(ctx.lifetimes.requested[index.live_mask(peak)].sum()),
        peak_reserved_bytes=peak_reserved,
        peak_reserved_event=peak_reserved_event,
        peak_time_us=ctx.time_at(ctx.peak_event if ctx.peak_event is not None else 0) if n else None,
        peak_phase=ctx.phases.phase_of(ctx.peak_event) if ctx.steps and ctx.peak_event is not None else None,
        start_time_us=ctx.time_at(0) if n else None,
        outside_pytorch_bytes=outside_pytorch(ctx.snapshot.sidecar, ctx.device),
        peak_reserved_time_us=ctx.time_at(peak_reserved_event) if n and peak_reserved_event is not None else None,
        baseline_allocated_bytes=trace.baseline_allocated,
        final_allocated_bytes=trace.final_allocated,
        final_reserved_bytes=trace.final_reserved,
        pending_free_peak_bytes=trace.pending_free_peak,
        pending_free_final_bytes=trace.pending_free_final,
        capacity_bytes=ctx.capacity,
        categories_at_peak=categories,
        top_stacks_by_category=top,
        findings=sorted(ctx.findings, key=finding_rank),
        optimizer_windows=ctx.optimizer_windows,
        optimizer_window_source=ctx.optimizer_window_source,
        window_complete=trace.window_complete,
        notes=notes,
        timeline=timeline_of(trace, ctx.steps) if n else None,
        segment_map=segment_map_of(ctx.snapshot, ctx.device),
    )


__all__ = ["FINDERS", "Finder", "analyze", "analyze_snapshot", "outside_pytorch"]


def outside_pytorch(sidecar: Sidecar | None, device: int) -> int | None:
    """The most device memory the caching allocator did not hold at any step boundary (CUDA
    context, NCCL, libraries, other processes on the GPU), from the recorder's ``mem_get_info``
    readings; ``None`` where none were taken (the CPU recorder, a foreign snapshot)."""
    if sidecar is None or sidecar.outside_pytorch is None:
        return None
    counted = [entry.outside_pytorch_bytes for entry in sidecar.outside_pytorch
               if entry.device == device and entry.outside_pytorch_bytes is not None]
    return max(counted) if counted else None
