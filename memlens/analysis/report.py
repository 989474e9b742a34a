"""What an analysis returns: plain data, and its JSON form, both from one definition.

A ``Report`` holds numbers, names and text only: no snapshot, no arrays, no index. What
``to_json`` writes is the whole report, and ``Report.from_json`` reads it back equal. The
terminal and HTML reporters read a report and nothing else; consumers that need the snapshot
too (the web app, ``live_at``, what-if) take a ``memlens.analysis.Analysis``, which pairs the
two.

Serialisation, validation and the JSON Schema are all derived from these dataclasses by msgspec
(``memlens.analysis.schema``): there is no second, hand-written description of the format to
drift from this one. Why msgspec rather than pydantic: see the README ("Dependencies").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from memlens.analysis.datatypes import (
    CATEGORIES,
    FINDING_KINDS,
    SCHEMA_VERSION,
    SEVERITIES,
    STEP_SOURCES,
    BlockView,
    Evidence,
    EvidenceItem,
    Finding,
    OptimizerWindowSource,
    PeakPhase,
    PlainData,
    SegmentMap,
    SegmentView,
    StackBytes,
    Step,
    StepSource,
    Timeline,
    as_json,
    busiest_first,
    decode_hook,
    encode_json,
    finding_rank,
)
from memlens.errors import MemlensFormatError, MemlensUsageError
from memlens.sidecar import Sidecar

# The shared types live in ``datatypes`` (a leaf the analyses import); they are re-exported here
# so ``from memlens.analysis.report import Finding`` keeps working for reporters, the app and tests.
__all__ = [
    "CATEGORIES",
    "FINDING_KINDS",
    "SCHEMA_VERSION",
    "SEVERITIES",
    "STEP_SOURCES",
    "BlockView",
    "BudgetCheck",
    "BudgetRow",
    "DeviceReport",
    "Evidence",
    "EvidenceItem",
    "Finding",
    "Report",
    "SegmentMap",
    "SegmentView",
    "StackBytes",
    "Step",
    "Timeline",
    "as_json",
    "finding_rank",
    "no_findings_text",
]


# How a measured category compares with its theory: within the tolerance, outside it, not
# compared (a total whose theory is incomplete, a category with no theory), its theory not
# estimated (the budget lacks the architecture) or not measured.
BudgetVerdict = Literal["within", "outside", "not_compared", "not_estimated", "not_measured"]


@dataclass(frozen=True, kw_only=True)
class BudgetRow(PlainData):
    """One measured category at the peak next to its theory; ``ratio`` = measured / theory."""

    category: str
    theory_bytes: int | None  # None: the budget could not estimate it
    measured_bytes: int | None
    ratio: float | None
    verdict: BudgetVerdict
    tolerance: float
    theory_items: list[str]
    note: str = ""


@dataclass(frozen=True, kw_only=True)
class BudgetCheck(PlainData):
    """The theoretical budget reconciled with a device's categories at the peak (``ok``: no
    category is outside its tolerance)."""

    ok: bool
    rows: list[BudgetRow]
    # The largest micro-batch on the device's capacity, scaled from what was measured at the peak,
    # and the line saying what it used; None/"" without a capacity or the measured batch.
    largest_batch: int | None = None
    largest_batch_note: str = ""


@dataclass(kw_only=True)
class DeviceReport(PlainData):
    """One device's analysis. Field order is the JSON's order (``kw_only`` lets it be)."""

    device: int
    events: int
    window_complete: bool = True
    step_source: StepSource
    steps: list[Step]
    peak_allocated_bytes: int
    peak_allocated_event: int | None
    # What the program requested in the blocks live at the allocated peak (allocated counts the
    # blocks, as memory_allocated does); None in reports from before it existed.
    peak_requested_bytes: int | None = None
    peak_reserved_bytes: int
    peak_reserved_event: int | None
    peak_time_us: int | None
    # The phase of the step the allocated peak fell in; None without detected steps (the phase
    # cannot be told) or in reports from before it existed.
    peak_phase: PeakPhase | None = None
    # Time of the first trace row and of the reserved peak: to say "+1.234 s" without the trace.
    start_time_us: int | None = None
    peak_reserved_time_us: int | None = None
    baseline_allocated_bytes: int
    final_allocated_bytes: int
    final_reserved_bytes: int
    # Freed by the program, still waiting on another stream: not allocated, still reserved.
    pending_free_peak_bytes: int = 0
    pending_free_final_bytes: int = 0
    # CUDA only: the most device memory in use outside the caching allocator at a step boundary
    # (the recorder's mem_get_info against memory_reserved); None when not measured.
    outside_pytorch_bytes: int | None = None
    capacity_bytes: int | None
    categories_at_peak: dict[str, int]
    top_stacks_by_category: dict[str, list[StackBytes]]
    # Optimizer.step windows as [start_event, end_event) and where they came from.
    optimizer_windows: list[tuple[int, int]] = field(default_factory=list)
    optimizer_window_source: OptimizerWindowSource = "none"
    notes: list[str] = field(default_factory=list)
    findings: list[Finding]
    timeline: Timeline | None = None
    segment_map: SegmentMap = field(default_factory=SegmentMap)
    # The budget beside the measurement (``memlens.ops.triage``), from the options and the
    # recorder's sidecar; None when neither says enough about the model, or not asked.
    budget: BudgetCheck | None = None

    @property
    def empty(self) -> bool:
        """No trace entries and no segments: the snapshot holds nothing for this device, so
        "no finding" means nothing was looked at, not that nothing stood out."""
        return self.events == 0 and self.segment_map.segments == 0 and self.peak_reserved_bytes == 0


def no_findings_text(device: DeviceReport) -> str:
    """What every face says of a device without findings (starting lower-case, no full stop)."""
    if device.empty:
        return ("the snapshot is empty on this device (no segments, no trace entries): "
                "there was nothing to analyse")
    return "no leak, activation plateau, optimizer spike, fragmentation or OOM stood out"



@dataclass(kw_only=True)
class Report(PlainData):
    schema_version: int = SCHEMA_VERSION
    source: str
    format_guess: str
    devices: dict[int, DeviceReport]
    findings: list[Finding]
    # The recorder's sidecar (run metadata: model, optimizer, device, ranks, shapes), as read
    # and migrated (``memlens.sidecar``); None for a file memlens did not record.
    sidecar: Sidecar | None = None

    def device(self, device: int | None = None) -> DeviceReport:
        """The report of ``device``; with ``None`` the busiest (``datatypes.busiest_first``)."""
        if device is None:
            if not self.devices:
                raise MemlensUsageError(f"{self.source}: the report has no devices")
            return max(self.devices.values(), key=lambda d: busiest_first(
                d.peak_allocated_bytes, d.peak_reserved_bytes, d.events, d.device))
        if device not in self.devices:
            known = ", ".join(str(d) for d in sorted(self.devices)) or "none"
            raise MemlensUsageError(f"{self.source}: no device {device} in this snapshot (devices: {known})")
        return self.devices[device]

    def to_json(self) -> dict[str, Any]:
        """The documented, stable JSON form (``memlens.analysis.schema.REPORT_SCHEMA``)."""
        return as_json(self)

    def to_json_str(self, indent: int | None = 2) -> str:
        if indent is None:
            return encode_json(self).decode("utf-8")
        return json.dumps(self.to_json(), indent=indent)

    @classmethod
    def from_json(cls, data: str | bytes | dict[str, Any], source: str = "<report>") -> Report:
        """A report back from its JSON (text or parsed); a ``MemlensFormatError`` naming the
        first field that does not fit, e.g. ``Expected `int`, got `str` - at `$.devices...```."""
        try:
            # Parsed JSON goes back through the JSON decoder, which reads the devices' text keys
            # as numbers (``convert`` would not, strictly) and checks exactly as for text.
            text = msgspec.json.encode(data) if isinstance(data, dict) else data
            report = msgspec.json.decode(text, type=cls, dec_hook=decode_hook)
        except msgspec.ValidationError as exc:
            raise MemlensFormatError(source, f"not a memlens report: {exc}") from None
        except msgspec.DecodeError as exc:
            raise MemlensFormatError(source, f"not a memlens report (invalid JSON: {exc})") from None
        if report.schema_version != SCHEMA_VERSION:
            raise MemlensFormatError(source, f"report schema_version {report.schema_version} is not "
                                     f"{SCHEMA_VERSION}, the one this memlens reads")
        return report
