"""What changed between two snapshots: the peak, each category at the peak, and each stack.

PyTorch's ``_memory_viz compare`` diffs segments; people want to know *which code* grew.
Stacks are matched across files by their displayed Python frames (the two files have
different stack tables), so the same line of code lines up even when addresses differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from memlens.analysis.analysis import Analysis
from memlens.analysis.live import BEFORE_FIRST_ROW
from memlens.analysis.report import CATEGORIES, DeviceReport

TOP_STACKS = 10


@dataclass(frozen=True)
class StackChange:
    frames: tuple[str, ...]
    before_bytes: int
    after_bytes: int

    @property
    def delta_bytes(self) -> int:
        return self.after_bytes - self.before_bytes


@dataclass
class SnapshotDiff:
    before: str
    after: str
    peak_allocated: tuple[int, int]
    peak_reserved: tuple[int, int]
    categories: dict[str, tuple[int, int]]
    stacks: list[StackChange] = field(default_factory=list)
    findings_before: list[str] = field(default_factory=list)
    findings_after: list[str] = field(default_factory=list)

    def record(self) -> SnapshotDiffRecord:
        """The diff as its JSON form's struct (``memlens diff --json``, the MCP diff tool)."""
        return SnapshotDiffRecord(
            before=self.before,
            after=self.after,
            peak_allocated_bytes=Change.of(self.peak_allocated),
            peak_reserved_bytes=Change.of(self.peak_reserved),
            categories_at_peak={name: Change.of(v) for name, v in self.categories.items()},
            stacks=[StackChangeRecord(list(s.frames), s.before_bytes, s.after_bytes, s.delta_bytes)
                    for s in self.stacks],
            findings=FindingKindsChange(self.findings_before, self.findings_after),
        )

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.record())


class Change(msgspec.Struct, frozen=True):
    """Bytes before and after, and the difference."""

    before: int
    after: int
    delta: int

    @classmethod
    def of(cls, values: tuple[int, int]) -> Change:
        return cls(values[0], values[1], values[1] - values[0])


class StackChangeRecord(msgspec.Struct, frozen=True):
    frames: list[str]
    before: int
    after: int
    delta: int


class FindingKindsChange(msgspec.Struct, frozen=True):
    before: list[str]
    after: list[str]


class SnapshotDiffRecord(msgspec.Struct, frozen=True):
    before: str
    after: str
    peak_allocated_bytes: Change
    peak_reserved_bytes: Change
    categories_at_peak: dict[str, Change]
    stacks: list[StackChangeRecord]
    findings: FindingKindsChange


def live_bytes_by_stack(analysis: Analysis, device: DeviceReport) -> dict[tuple[str, ...], int]:
    """Bytes live at the peak, per displayed stack (all of them, not only the top few)."""
    index = analysis.live_index(device.device)
    # No peak row: a dump without rows or a peak before the first row; either way the lifetimes
    # live at the instant before row 0.
    peak = device.peak_allocated_event if device.peak_allocated_event is not None else BEFORE_FIRST_ROW
    mask = index.live_mask(peak)
    sizes = index.size[mask]
    stack_ids = index.stack_id[mask].astype(np.int64)
    totals = np.bincount(stack_ids + 1, weights=sizes.astype(np.float64)) if sizes.size else np.zeros(0)
    out: dict[tuple[str, ...], int] = {}
    for slot in np.flatnonzero(totals):
        key = tuple(index.facts.frames_for_display(int(slot) - 1)) or ("(no stack recorded)",)
        out[key] = out.get(key, 0) + round(totals[slot])
    return out


def diff_reports(before: Analysis, after: Analysis, device_before: int | None = None,
                 device_after: int | None = None, top: int = TOP_STACKS) -> SnapshotDiff:
    a, b = before.device(device_before), after.device(device_after)
    stacks_a, stacks_b = live_bytes_by_stack(before, a), live_bytes_by_stack(after, b)
    changes = [StackChange(key, stacks_a.get(key, 0), stacks_b.get(key, 0)) for key in stacks_a.keys() | stacks_b]
    changes = [c for c in changes if c.delta_bytes != 0]
    changes.sort(key=lambda c: (-abs(c.delta_bytes), c.frames))
    return SnapshotDiff(
        before=before.report.source,
        after=after.report.source,
        peak_allocated=(a.peak_allocated_bytes, b.peak_allocated_bytes),
        peak_reserved=(a.peak_reserved_bytes, b.peak_reserved_bytes),
        categories={name: (a.categories_at_peak.get(name, 0), b.categories_at_peak.get(name, 0))
                    for name in CATEGORIES},
        stacks=changes[:top],
        findings_before=sorted({f.kind for f in a.findings}),
        findings_after=sorted({f.kind for f in b.findings}),
    )
