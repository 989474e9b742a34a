"""What was live after any trace row: bytes by category and the stacks holding them.

The analysis keeps, per device, the lifetimes it paired and the category it gave each one
(``LiveIndex``, in ``Analysis.live``). ``live_at(analysis, device, event)`` masks the
lifetimes live after row ``event`` and sums them by that same category, so nothing is
reclassified and ``live_at`` at the peak *is* ``categories_at_peak`` (``analyze`` builds the peak
numbers with ``breakdown`` too). One call is a few vectorised passes over the lifetimes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from memlens.analysis.categories import bytes_by_category
from memlens.analysis.datatypes import CATEGORIES, StackBytes
from memlens.analysis.lifetimes import Lifetimes
from memlens.analysis.stacks import StackFacts
from memlens.errors import MemlensUsageError
from memlens.snapshot.model import DeviceTrace

if TYPE_CHECKING:
    # Only ``live_at``'s annotation: analysis.py imports this module at run time.
    from memlens.analysis.analysis import Analysis

I64 = npt.NDArray[np.int64]


# The instant before the first trace row, as an event index: what was live when the history began.
BEFORE_FIRST_ROW = -1


@dataclass(frozen=True)
class LiveIndex:
    """The per-lifetime arrays ``live_at`` needs, as ``analyze()`` built them (one device)."""

    alloc_event: I64  # -1: live before the window
    free_event: I64  # events (= len(trace)): never freed in the window
    size: I64
    stack_id: npt.NDArray[np.int32]
    category: npt.NDArray[np.int8]  # index into CATEGORIES, from categories.classify
    facts: StackFacts
    top_stacks: int  # how many stacks per category (AnalysisSettings.top_stacks)

    @classmethod
    def build(
        cls, lifetimes: Lifetimes, category: npt.NDArray[np.int8], facts: StackFacts, top_stacks: int
    ) -> LiveIndex:
        return cls(lifetimes.alloc_event, lifetimes.free_event, lifetimes.size, lifetimes.stack_id,
                   category, facts, top_stacks)

    def live_mask(self, event: int | None) -> npt.NDArray[np.bool_]:
        """Lifetimes live after row ``event``; ``None`` (a trace without rows): all of them;
        ``BEFORE_FIRST_ROW``: those live when the history began."""
        if event is None:
            return np.ones(self.size.shape[0], dtype=bool)
        return (self.alloc_event <= event) & (self.free_event > event)


@dataclass(frozen=True)
class LiveBreakdown:
    """Bytes live after trace row ``event`` on ``device``, by category and allocating stack."""

    device: int
    event: int | None  # None: a trace without rows (the blocks live at the dump)
    is_peak: bool
    time_us: int | None  # the row's time_us, when the file has times
    seconds: float | None  # since the trace's first row (the timeline's time axis)
    total_bytes: int  # == sum(categories.values()) == DeviceTrace.allocated[event]
    categories: dict[str, int]  # the six CATEGORIES
    top_stacks_by_category: dict[str, list[StackBytes]]

    @property
    def label(self) -> str:
        """``"at the peak"`` or ``"at event 1,234 (t = 0.512 s)"``."""
        if self.is_peak or self.event is None:
            return "at the peak"
        when = ""
        if self.seconds is not None:
            when = f" (t = {self.seconds:.3f} s)" if abs(self.seconds) >= 1 else f" (t = {self.seconds:.3g} s)"
        return f"at event {self.event:,}{when}"


def breakdown(index: LiveIndex, trace: DeviceTrace, event: int | None) -> tuple[dict[str, int],
                                                                                dict[str, list[StackBytes]]]:
    """Categories and top stacks of what is live after ``event`` (``None``: every lifetime)."""
    live = index.live_mask(event)
    categories = bytes_by_category(index.category, index.size, live)
    allocated = int(trace.allocated[event]) if event is not None and event >= 0 else trace.baseline_allocated
    # What the lifetimes cannot account for (a curve lifted over a wrapped ring buffer) is unknown.
    categories["unknown"] += max(allocated - sum(categories.values()), 0)
    top: dict[str, list[StackBytes]] = {}
    for code, name in enumerate(CATEGORIES):
        mask = live & (index.category == code)
        top[name] = index.facts.top_stacks(index.stack_id[mask], index.size[mask], index.top_stacks)
    return categories, top


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
