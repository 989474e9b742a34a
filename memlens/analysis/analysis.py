"""A snapshot and its report, together: what interactive consumers need.

The report (``memlens.analysis.report``) is plain data and enough to print, save or draw the
overview. Anything that asks a new question of the run (what was live at another moment, a
what-if replay, a group-by at a window's peak, a zoomed timeline) needs the snapshot and the
per-allocation index analysis built. ``Analysis`` pairs them explicitly, so no report has to
carry a snapshot and a reader of the code can tell which consumers need which.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from memlens.analysis.live import BEFORE_FIRST_ROW, LiveBreakdown, LiveIndex, breakdown
from memlens.analysis.report import DeviceReport, Report
from memlens.errors import MemlensUsageError
from memlens.snapshot.model import DeviceTrace, Snapshot

# Python-object costs per item for ``Analysis.held_bytes`` (CPython 3.11, 64-bit), measured
# against tracemalloc on real and synthetic snapshots: within 5% for large analyses, 0.5x-1.6x
# for those of a few MiB.
_FRAME_BYTES = 160  # a Frame (slots) and its strings' headers, plus the strings' characters
_STACK_BYTES = 64  # a stack's tuple, plus 8 per frame it refers to
_BLOCK_BYTES = 150
_SEGMENT_BYTES = 400
_STEP_BYTES = 600
_REPORT_BYTES = 1 << 20  # findings, categories, top stacks, caches: small and bounded per device


@dataclass(frozen=True)
class Analysis:
    """``report`` analysed from ``snapshot``; ``live[d]`` every lifetime of device ``d`` with the
    category analysis gave it (what ``live_at`` and the lenses sum over)."""

    snapshot: Snapshot
    report: Report
    live: dict[int, LiveIndex] = field(default_factory=dict, repr=False)

    def held_bytes(self) -> int:
        """An estimate of the memory this analysis holds, for caches bounded in bytes (the
        dashboard's reports, the MCP server's analyses): the numpy columns exactly (the trace,
        the lifetimes), the Python objects (frames, stacks, blocks, steps) at measured costs."""
        snapshot = self.snapshot
        total = _REPORT_BYTES
        for trace in snapshot.devices.values():
            total += trace.nbytes() + sum(len(t) + 64 for t in (*trace.user_metadata, *trace.compile_context))
        for index in self.live.values():
            total += sum(column.nbytes for column in (index.alloc_event, index.free_event, index.size,
                                                      index.stack_id, index.category))
        stacks = snapshot.stacks
        total += sum(_FRAME_BYTES + len(f.filename) + len(f.name) for f in stacks.frames)
        total += _STACK_BYTES * len(stacks.stacks) + 8 * sum(map(len, stacks.stacks))
        total += sum(_SEGMENT_BYTES + _BLOCK_BYTES * len(s.blocks) for s in snapshot.segments)
        total += _STEP_BYTES * sum(len(device.steps) for device in self.report.devices.values())
        return total

    def device(self, device: int | None = None) -> DeviceReport:
        """The device report (``None``: the busiest), as ``Report.device``."""
        return self.report.device(device)

    def trace(self, device: int | None = None) -> DeviceTrace:
        return self.snapshot.device(self.device(device).device)

    def live_index(self, device: int | None = None) -> LiveIndex:
        device_id = self.device(device).device
        if device_id not in self.live:
            raise MemlensUsageError(f"{self.report.source}: device {device_id} was not analysed "
                                    "per allocation")
        return self.live[device_id]

    def category_of_event(self, device: int | None = None) -> npt.NDArray[np.int8]:
        """For each trace row that allocates, the index into ``CATEGORIES`` of the category the
        analysis gave that allocation; -1 on every other row."""
        index = self.live_index(device)
        rows = np.full(len(self.trace(device)), -1, dtype=np.int8)
        made = index.alloc_event >= 0
        rows[index.alloc_event[made]] = index.category[made]
        return rows


def live_at(analysis: Analysis, device: int | None, event: int | None = None) -> LiveBreakdown:
    """What was live on ``device`` (``None``: the main device) after trace row ``event``.

    ``event=None`` means the peak. At the peak the result equals the device report's
    ``categories_at_peak`` and ``top_stacks_by_category``. Raises ``MemlensUsageError`` for an
    unknown device or a row outside the trace.
    """
    device_report = analysis.device(device)  # MemlensUsageError for an unknown device
    trace = analysis.snapshot.device(device_report.device)
    n = len(trace)
    peak = device_report.peak_allocated_event
    if peak is None and n:
        peak = BEFORE_FIRST_ROW  # the peak was the instant the history began
    if event is None:
        event = peak
    elif not 0 <= int(event) < n:
        raise MemlensUsageError(f"event {event} is outside the trace of device {device_report.device} "
                                f"(0..{n - 1})" if n else f"device {device_report.device} has no trace rows")
    event = None if event is None else int(event)
    categories, top = breakdown(analysis.live_index(device_report.device), trace, event)
    time_us = int(trace.time_us[max(event, 0)]) if event is not None and trace.has_time else None
    seconds = (time_us - int(trace.time_us[0])) / 1e6 if time_us is not None else None
    return LiveBreakdown(
        device=device_report.device,
        event=event,
        is_peak=event == peak,
        time_us=time_us,
        seconds=seconds,
        total_bytes=sum(categories.values()),
        categories=categories,
        top_stacks_by_category=top,
    )
