"""Plotly figure builders shared by the web app and ``memlens export``.

Every builder is a pure function of plain analysis results (a ``Report`` or ``DeviceReport``,
its ``Timeline`` and ``SegmentMap``, a budget reconciliation) returning a
``plotly.graph_objects.Figure``. Nothing here imports dash, reads a snapshot or computes an
analysis: the numbers come from ``memlens.analyze``, ``memlens.budget`` and ``memlens.allocator``;
this package only shapes them for the eye. One module a figure family: ``timeline``,
``categories``, ``groups`` (a lens's breakdown), ``segments``, ``budget``, ``compare``,
``ranks``; ``_style`` holds what they share.
"""

from __future__ import annotations

from memlens.analysis.report import Report
from memlens.figures._style import (
    ALLOCATED_COLOR,
    BLOCK_STATE_COLORS,
    CATEGORY_COLORS,
    FINDING_COLORS,
    RESERVED_COLOR,
    ByteScale,
    finding_title,
)
from memlens.figures.budget import budget_figure, budget_rows
from memlens.figures.categories import categories_bar_figure, categories_figure
from memlens.figures.compare import compare_figure, compare_rows
from memlens.figures.groups import groups_figure
from memlens.figures.ranks import ranks_figure
from memlens.figures.segments import segment_map_figure
from memlens.figures.timeline import event_range, timeline_figure, times_s


def primary_device(report: Report) -> int:
    """The device to show first: the report's own choice (the highest peak)."""
    return report.device(None).device


__all__ = [
    "ALLOCATED_COLOR",
    "BLOCK_STATE_COLORS",
    "CATEGORY_COLORS",
    "FINDING_COLORS",
    "RESERVED_COLOR",
    "ByteScale",
    "budget_figure",
    "budget_rows",
    "categories_bar_figure",
    "categories_figure",
    "compare_figure",
    "compare_rows",
    "event_range",
    "finding_title",
    "groups_figure",
    "primary_device",
    "ranks_figure",
    "segment_map_figure",
    "timeline_figure",
    "times_s",
]
