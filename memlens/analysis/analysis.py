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

from memlens.analysis.live import LiveIndex
from memlens.analysis.report import DeviceReport, Report
from memlens.errors import MemlensUsageError
from memlens.snapshot.model import DeviceTrace, Snapshot


@dataclass(frozen=True)
class Analysis:
    """``report`` analysed from ``snapshot``; ``live[d]`` every lifetime of device ``d`` with the
    category analysis gave it (what ``live_at`` and the lenses sum over)."""

    snapshot: Snapshot
    report: Report
    live: dict[int, LiveIndex] = field(default_factory=dict, repr=False)

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
