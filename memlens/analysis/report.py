"""What an analysis returns: plain dataclasses, and their JSON form (see ``schema.py``).

Reporters (terminal, JSON, HTML) and the web app read these; none of them re-analyses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from memlens.analysis.datatypes import (
    CATEGORIES,
    FINDING_KINDS,
    SCHEMA_VERSION,
    SEVERITIES,
    STEP_SOURCES,
    Evidence,
    Finding,
    StackBytes,
    Step,
    finding_rank,
    format_evidence,
)
from memlens.errors import MemlensUsageError
from memlens.snapshot.model import Snapshot

if TYPE_CHECKING:
    from memlens.analysis.live import LiveIndex

# The shared types live in ``datatypes`` (a leaf the analyses import); they are re-exported here
# so ``from memlens.analysis.report import Finding`` keeps working for reporters, the app and tests.
__all__ = [
    "CATEGORIES",
    "FINDING_KINDS",
    "SCHEMA_VERSION",
    "SEVERITIES",
    "STEP_SOURCES",
    "DeviceReport",
    "Evidence",
    "Finding",
    "Report",
    "StackBytes",
    "Step",
    "finding_rank",
    "format_evidence",
]


@dataclass
class DeviceReport:
    device: int
    events: int
    steps: list[Step]
    step_source: str
    peak_allocated_bytes: int
    peak_allocated_event: int | None
    peak_reserved_bytes: int
    peak_reserved_event: int | None
    peak_time_us: int | None
    baseline_allocated_bytes: int
    final_allocated_bytes: int
    final_reserved_bytes: int
    capacity_bytes: int | None
    categories_at_peak: dict[str, int]
    top_stacks_by_category: dict[str, list[StackBytes]]
    findings: list[Finding]
    # Freed by the program, still waiting on another stream: not allocated, still reserved.
    pending_free_peak_bytes: int = 0
    pending_free_final_bytes: int = 0
    # Optimizer.step windows as [start_event, end_event) and where they came from.
    optimizer_windows: list[tuple[int, int]] = field(default_factory=list)
    optimizer_window_source: str = "none"
    window_complete: bool = True
    notes: list[str] = field(default_factory=list)
    # Category code (index into CATEGORIES) of every trace row that is an alloc, -1 elsewhere.
    category_of_event: npt.NDArray[np.int8] | None = None
    # Every lifetime with the category analyze() gave it, for ``memlens.analysis.live_at`` (what
    # was live at any row). In memory only: not part of the JSON.
    live_index: LiveIndex | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "events": self.events,
            "window_complete": self.window_complete,
            "step_source": self.step_source,
            "steps": [s.to_json() for s in self.steps],
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_allocated_event": self.peak_allocated_event,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "peak_reserved_event": self.peak_reserved_event,
            "peak_time_us": self.peak_time_us,
            "baseline_allocated_bytes": self.baseline_allocated_bytes,
            "final_allocated_bytes": self.final_allocated_bytes,
            "final_reserved_bytes": self.final_reserved_bytes,
            "pending_free_peak_bytes": self.pending_free_peak_bytes,
            "pending_free_final_bytes": self.pending_free_final_bytes,
            "capacity_bytes": self.capacity_bytes,
            "categories_at_peak": {name: int(self.categories_at_peak.get(name, 0)) for name in CATEGORIES},
            "top_stacks_by_category": {
                name: [s.to_json() for s in self.top_stacks_by_category.get(name, [])] for name in CATEGORIES
            },
            "optimizer_windows": [[int(a), int(b)] for a, b in self.optimizer_windows],
            "optimizer_window_source": self.optimizer_window_source,
            "notes": list(self.notes),
            "findings": [f.to_json() for f in self.findings],
        }


@dataclass
class Report:
    source: str
    snapshot: Snapshot
    devices: dict[int, DeviceReport]
    findings: list[Finding]
    format_guess: str
    sidecar: dict[str, Any] = field(default_factory=dict)

    def device(self, device: int | None = None) -> DeviceReport:
        """The report of ``device``; with ``None`` the busiest: the highest peak, then the most events.

        Memory, not events, decides: a state-only snapshot whose 10 GiB sit on device 1 is about
        device 1, though no device has a recorded event.
        """
        if device is None:
            if not self.devices:
                raise KeyError("the report has no devices")
            return max(self.devices.values(),
                       key=lambda d: (d.peak_allocated_bytes, d.peak_reserved_bytes, d.events, -d.device))
        if device not in self.devices:
            known = ", ".join(str(d) for d in sorted(self.devices)) or "none"
            raise MemlensUsageError(f"{self.source}: no device {device} in this snapshot (devices: {known})")
        return self.devices[device]

    def to_json(self) -> dict[str, Any]:
        """The documented, stable JSON form (``memlens.analysis.schema.REPORT_SCHEMA``)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "source": self.source,
            "format_guess": self.format_guess,
            "devices": {str(d): report.to_json() for d, report in sorted(self.devices.items())},
            "findings": [f.to_json() for f in self.findings],
        }

    def to_json_str(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_json(), indent=indent)
