"""Groups: the blocks live at one moment, summed by a grouping's labels.

``group_live(inputs, group_by, event)`` is every lifetime live after trace row ``event``,
grouped by ``labels_for(inputs, group_by)``. The groups add up exactly to
``DeviceTrace.allocated`` at that row: bytes the lifetimes cannot account for (a history that
lost rows) are a group of their own, never dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from memlens.analysis.lenses.inputs import LensInputs, allocated_at, exact_bincount, time_of
from memlens.analysis.lenses.labels import UNACCOUNTED, Labels, labels_for
from memlens.analysis.lenses.moments import Moment, MomentRecord, event_text, whole_peak
from memlens.analysis.lenses.rules import Rule


@dataclass(frozen=True)
class Group:
    name: str
    bytes: int
    blocks: int

    def record(self, total: int) -> GroupRecord:
        """The group as its JSON form's struct, with its share of ``total`` bytes."""
        return GroupRecord(self.name, self.bytes, self.bytes / total if total else 0.0, self.blocks)


class GroupRecord(msgspec.Struct, frozen=True):
    name: str
    bytes: int
    share: float  # of the bytes allocated at the moment (0.0 when none were)
    blocks: int


@dataclass(frozen=True)
class GroupBreakdown:
    """The blocks live at one moment of one device, grouped; ``sum(g.bytes) == allocated_bytes``."""

    group_by: str
    device: int
    moment: Moment
    time_us: int | None
    allocated_bytes: int
    groups: list[Group]

    def record(self) -> GroupBreakdownRecord:
        """The breakdown as its JSON form's struct (``memlens group --json``, the MCP group_by tool)."""
        return GroupBreakdownRecord(self.group_by, self.device, self.moment.record(self.time_us),
                                    self.allocated_bytes, [g.record(self.allocated_bytes) for g in self.groups])

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.record())


class GroupBreakdownRecord(msgspec.Struct, frozen=True):
    group_by: str
    device: int
    moment: MomentRecord
    allocated_bytes: int
    groups: list[GroupRecord]


def group_labels_at(inputs: LensInputs, labels: Labels, event: int | None, group_by: str,
                    moment: Moment | None = None) -> GroupBreakdown:
    """Sum the lifetimes live after ``event`` by ``labels`` (reuse one ``Labels`` for many moments).

    ``event=None`` is the allocated peak (as ``live_at``): on a trace with rows the peak row, on
    one without rows the dump."""
    index, trace = inputs.index, inputs.trace
    if event is None:
        event = whole_peak(trace)
    live = index.live_mask(event)
    codes = labels.codes[live]
    sizes = index.size[live]
    length = len(labels.names)
    totals = exact_bincount(codes, sizes, length)
    counts = np.bincount(codes, minlength=length)
    allocated = allocated_at(trace, event)
    groups = [Group(labels.names[c], int(totals[c]), int(counts[c])) for c in np.flatnonzero(counts)]
    residual = allocated - int(totals.sum())
    if residual:
        # Categories already have a name for bytes no one can place: ``breakdown`` puts a positive
        # gap in "unknown", and so does this (so group_by="category" is categories_at_peak).
        if group_by == "category" and residual > 0:
            groups = [Group(g.name, g.bytes + residual, g.blocks) if g.name == "unknown" else g for g in groups]
            if not any(g.name == "unknown" for g in groups):
                groups.append(Group("unknown", residual, 0))
        else:
            groups.append(Group(UNACCOUNTED, residual, 0))
    groups.sort(key=lambda g: (-g.bytes, g.name))
    moment = moment or Moment(event, "event", event_text(event))
    return GroupBreakdown(group_by, trace.device, moment, time_of(trace, event), allocated, groups)


def group_live(inputs: LensInputs, group_by: str, event: int | None = None, rules: Sequence[Rule] = (),
               moment: Moment | None = None) -> GroupBreakdown:
    """The blocks live after row ``event`` (``None``: the peak) grouped by ``group_by`` (one of
    ``labels.GROUP_BYS``)."""
    return group_labels_at(inputs, labels_for(inputs, group_by, rules), event, group_by, moment)
