"""What was live after any trace row: bytes by category and the stacks holding them.

The analysis keeps, per device, the lifetimes it paired and the category it gave each one
(``LiveIndex``, in ``Analysis.live``). ``live_at(analysis, device, event)`` (beside ``Analysis``,
in ``memlens.analysis.analysis``: it reads one) masks the lifetimes live after row ``event`` and
sums them (``breakdown``, here) by that same category, so nothing is
reclassified and ``live_at`` at the peak *is* ``categories_at_peak`` (``analyze`` builds the peak
numbers with ``breakdown`` too). One call is a few vectorised passes over the lifetimes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from memlens.analysis.categories import bytes_by_category
from memlens.analysis.datatypes import CATEGORIES, StackBytes
from memlens.analysis.lifetimes import Lifetimes
from memlens.analysis.stacks import StackFacts
from memlens.snapshot.model import DeviceTrace

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
