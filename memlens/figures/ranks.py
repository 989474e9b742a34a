"""The ranks of one job side by side: per-rank categories at the peak stacked, the outliers marked.

Draws ``memlens.ops.fleet.side_by_side(fleet)`` as it is (columns, one entry per analysed rank);
every number comes from the fleet's rows, the outlier verdicts from its outlier analysis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import plotly.graph_objects as go

from memlens.analysis.datatypes import CATEGORIES
from memlens.figures._style import CATEGORY_COLORS, RESERVED_COLOR, ByteScale, layout, message_figure
from memlens.units import format_bytes

if TYPE_CHECKING:
    from memlens.ops.fleet import RanksSideBySide

OUTLIER_COLOR = "#C62828"


def ranks_figure(side: RanksSideBySide, title: str = "Ranks side by side: live at each rank's peak",
                 keys: Sequence[str] | None = None) -> go.Figure:
    """One stacked bar per rank (its categories at its own peak), its peak reserved as a marker,
    outlier ranks' labels in red with an "outlier" note above the bar. ``keys`` (one per rank, e.g.
    the app's source ids) ride along as each bar's ``customdata``, so a click can tell which rank."""
    labels = [str(label) for label in side.labels]
    if not labels:
        return message_figure(title, "No rank could be analysed.")
    customdata = list(keys) if keys is not None else None
    if customdata is not None and len(customdata) != len(labels):
        raise ValueError(f"{len(customdata)} keys for {len(labels)} ranks")
    allocated = [int(v) for v in side.peak_allocated_bytes]
    reserved = [int(v) for v in side.peak_reserved_bytes]
    scale = ByteScale.for_max(max([*allocated, *reserved, 1]))
    fig = go.Figure()
    for category in CATEGORIES:
        values = [int(v) for v in side.categories_at_peak.get(category, [0] * len(labels))]
        if not any(values):
            continue
        fig.add_trace(go.Bar(
            x=labels, y=scale(values), name=category.replace("_", " "), marker_color=CATEGORY_COLORS[category],
            customdata=customdata,
            hovertext=[f"{label}: {category} {format_bytes(v)} at its peak" for label, v in zip(labels, values,
                                                                                               strict=True)],
            hoverinfo="text",
        ))
    fig.add_trace(go.Scatter(
        x=labels, y=scale(reserved), name="peak reserved", mode="markers",
        marker={"symbol": "line-ew-open", "size": 18, "color": RESERVED_COLOR, "line": {"width": 2}},
        hovertext=[f"{label}: peak reserved {format_bytes(v)}" for label, v in zip(labels, reserved, strict=True)],
        hoverinfo="text",
    ))
    outliers = [bool(flag) for flag in side.outlier]
    for label, top, flagged in zip(labels, (max(a, r) for a, r in zip(allocated, reserved, strict=True)),
                                   outliers, strict=True):
        if flagged:
            fig.add_annotation(x=label, y=top / scale.divisor, text="outlier", showarrow=True, arrowhead=2,
                               ax=0, ay=-28, font={"color": OUTLIER_COLOR, "size": 13},
                               arrowcolor=OUTLIER_COLOR)
    layout(fig, title, height=440, barmode="stack", hovermode="closest")
    fig.update_yaxes(title_text=f"bytes ({scale.unit})", rangemode="tozero")
    fig.update_xaxes(type="category", tickmode="array", tickvals=labels,
                     ticktext=[f"<span style='color:{OUTLIER_COLOR}'><b>{label}</b></span>" if flagged else label
                               for label, flagged in zip(labels, outliers, strict=True)])
    fig.layout.meta = {"ranks": len(labels), "outliers": [label for label, flagged in zip(labels, outliers,
                                                                                          strict=True) if flagged]}
    return fig
