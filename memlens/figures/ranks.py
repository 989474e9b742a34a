"""The ranks of one job side by side: per-rank categories at the peak stacked, the outliers marked.

``side_by_side(fleet)`` shapes a ``memlens.fleet.rows.FleetReport`` into chart columns (one entry
per analysed rank) and ``ranks_figure`` draws them as they are; every number comes from the
fleet's rows, the outlier verdicts from its outlier analysis.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import plotly.graph_objects as go

from memlens.analysis.datatypes import CATEGORIES
from memlens.figures._style import CATEGORY_COLORS, RESERVED_COLOR, ByteScale, layout, message_figure
from memlens.fleet.rows import FleetReport, RankRow
from memlens.units import format_bytes

OUTLIER_COLOR = "#C62828"


class RanksSideBySide(msgspec.Struct, frozen=True):
    """The ranks side by side as columns, for a chart (the dashboard's per-rank bars): one entry
    per analysed file in table order, the categories at the peak stacked, outliers marked."""

    labels: list[str]
    paths: list[str]
    peak_allocated_bytes: list[int]
    peak_reserved_bytes: list[int]
    categories_at_peak: dict[str, list[int]]
    step_time_ms: list[float | None]
    outlier: list[bool]
    verdicts: list[str]
    failed: list[RankRow]


def side_by_side(fleet: FleetReport) -> RanksSideBySide:
    """``fleet``'s analysed ranks as chart columns (``ranks_figure``)."""
    good_indices = [index for index, row in enumerate(fleet.rows) if row.ok]
    good = [fleet.rows[index] for index in good_indices]
    outlying = {o.index for o in fleet.outliers}
    return RanksSideBySide(
        labels=[row.label for row in good],
        paths=[row.path for row in good],
        peak_allocated_bytes=[row.peak_allocated_bytes for row in good],
        peak_reserved_bytes=[row.peak_reserved_bytes for row in good],
        categories_at_peak={name: [row.categories_at_peak.get(name, 0) for row in good] for name in CATEGORIES},
        step_time_ms=[row.step_time_ms for row in good],
        outlier=[index in outlying for index in good_indices],
        verdicts=[o.verdict for o in fleet.outliers],
        failed=[row for row in fleet.rows if not row.ok],
    )




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
