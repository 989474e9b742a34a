"""The report's pictures as plain data: a device's memory curve cut to a few thousand points
(``timeline_of``) and its segments when the snapshot was taken (``segment_map_of``).

Only these functions read the trace's arrays and the segments; the figures, the terminal and
the HTML export draw what they return, so a report saved as JSON draws the same as a live one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
import numpy.typing as npt

from memlens.analysis.datatypes import BlockState, BlockView, SegmentMap, SegmentView, Step, Timeline
from memlens.snapshot.envelope import envelope_rows
from memlens.snapshot.model import Action, DeviceTrace, Snapshot

# Buckets of a timeline (the report's, and each window the web app zooms to): each gives its min
# and max, so about twice as many points, per curve; the two curves share their points. Enough
# for a smooth curve at full-HD width and a 40-column sparkline per step.
REPORT_TIMELINE_BUCKETS = 1000
# Segments drawn block by block; a snapshot can hold thousands of 2 MiB small-pool segments.
MAX_SEGMENTS_SHOWN = 48
# OOM rows marked on a timeline: past a few dozen they are one red smear.
MAX_OOM_MARKS = 50

IntArray = npt.NDArray[np.int64]


def downsample_indices(y: npt.ArrayLike, max_points: int) -> IntArray:
    """Indices of at most ``max_points`` points of ``y`` (sorted) that keep its shape.

    The series is cut into ``(max_points - 2) // 2`` equal buckets; each contributes the index of
    its minimum and of its maximum, and the first and last points are always kept. So the global
    extremes and every spike wider than nothing survive. The buckets' extremes are the native
    core's envelope (``memlens.snapshot.envelope``).
    """
    return envelope_rows(y, max_points)


def _extremes_per_range(values: npt.NDArray[np.int64], bounds: IntArray) -> IntArray:
    """The index of the min and of the max of ``values`` in each ``[bounds[i], bounds[i+1])``."""
    keep: list[int] = []
    for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        if end > start:
            part = values[start:end]
            keep += [start + int(np.argmin(part)), start + int(np.argmax(part))]
    return np.asarray(keep, dtype=np.int64)


def timeline_of(
    trace: DeviceTrace,
    steps: Sequence[Step] = (),
    *,
    start: int = 0,
    end: int | None = None,
    max_points: int = 2 * REPORT_TIMELINE_BUCKETS,
) -> Timeline:
    """Rows ``[start, end)`` of ``trace`` as a ``Timeline`` of about ``max_points`` points, plus
    each step's first row, lowest and highest point (exact per-step peaks, boundaries on the
    curve)."""
    n = len(trace)
    end = n if end is None else min(max(end, start), n)
    start = min(max(start, 0), end)
    if end <= start:
        return Timeline(events=n)
    window = slice(start, end)
    keep = [downsample_indices(trace.allocated[window], max_points) + start,
            downsample_indices(trace.reserved[window], max_points) + start]
    inside = [s for s in steps if start <= s.start_event < end or start < s.end_event <= end]
    if inside:
        edges = sorted({start, end, *(min(max(e, start), end) for s in inside for e in (s.start_event, s.end_event))})
        bounds = np.asarray(edges, dtype=np.int64)
        keep += [np.minimum(bounds[:-1], end - 1), _extremes_per_range(trace.allocated, bounds)]
    rows = np.unique(np.concatenate(keep))
    oom = np.flatnonzero(trace.action[window] == int(Action.OOM))[:MAX_OOM_MARKS] + start
    return Timeline(
        events=n,
        event=rows.tolist(),
        allocated=trace.allocated[rows].tolist(),
        reserved=trace.reserved[rows].tolist(),
        time_us=trace.time_us[rows].tolist() if trace.has_time else None,
        oom_event=oom.tolist(),
        oom_allocated=trace.allocated[oom].tolist(),
        oom_requested=trace.size[oom].tolist(),
    )


def segment_map_of(snapshot: Snapshot, device: int, max_segments: int = MAX_SEGMENTS_SHOWN) -> SegmentMap:
    """Totals over every segment of ``device`` and the ``max_segments`` largest, block by block."""
    segments = sorted(snapshot.segments_on(device), key=lambda s: (-s.total_size, s.address))
    shown: list[SegmentView] = []
    for segment in segments[:max_segments]:
        blocks: list[BlockView] = []
        offset = 0
        for block in sorted(segment.blocks, key=lambda b: b.address):
            # A block outside its segment (a damaged file) is drawn after the previous one.
            relative = block.address - segment.address if block.address >= segment.address else offset
            state = block.state if block.state in ("active_allocated", "active_pending_free") else "inactive"
            blocks.append(BlockView(offset=relative, size=block.size, state=cast(BlockState, state)))
            offset = relative + block.size
        shown.append(SegmentView(address=segment.address, total_size=segment.total_size,
                                 segment_type=segment.segment_type, stream=segment.stream,
                                 pool_id=list(segment.pool_id), blocks=blocks))
    return SegmentMap(
        segments=len(segments),
        reserved_bytes=sum(s.total_size for s in segments),
        free_bytes=sum(s.free_size for s in segments),
        largest_free_bytes=max((s.largest_free_block for s in segments), default=0),
        shown=shown,
        hidden_bytes=sum(s.total_size for s in segments[max_segments:]),
    )


def downsample_minmax(
    x: npt.ArrayLike, y: npt.ArrayLike, max_points: int
) -> tuple[npt.NDArray[np.generic], npt.NDArray[np.generic]]:
    """Cut ``(x, y)`` to at most ``max_points`` points, keeping every bucket's min and max.

    ``x`` must be sorted (event index or time). Series already short enough come back unchanged.
    """
    xs = np.asarray(x)
    ys = np.asarray(y)
    if xs.shape[0] != ys.shape[0]:
        raise ValueError(f"x and y differ in length ({xs.shape[0]} != {ys.shape[0]})")
    keep = downsample_indices(ys, max_points)
    return xs[keep], ys[keep]
