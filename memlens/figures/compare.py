"""Two runs side by side: their allocated curves overlaid and the diff table's rows."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import plotly.graph_objects as go

from memlens.analysis.datatypes import CATEGORIES
from memlens.analysis.report import DeviceReport, Report
from memlens.figures._style import ALLOCATED_COLOR, SECOND_COLOR, ByteScale, layout
from memlens.figures.timeline import XAxis, times_s
from memlens.units import format_bytes


def compare_figure(
    report_a: Report,
    report_b: Report,
    *,
    device_a: int | None = None,
    device_b: int | None = None,
    names: tuple[str, str] | None = None,
    x_axis: XAxis = "event",
) -> go.Figure:
    """Two allocated-bytes timelines overlaid (x = event index, or seconds since each start)."""
    fig = go.Figure()
    series = [(report_a, report_a.device(device_a), ALLOCATED_COLOR),
              (report_b, report_b.device(device_b), SECOND_COLOR)]
    largest = max(max(d.peak_allocated_bytes for _, d, _ in series), 1)
    scale = ByteScale.for_max(largest)
    labels = names or tuple(source_name(r, d.device) for r, d, _ in series)
    for (_, device, color), label in zip(series, labels, strict=True):
        timeline = device.timeline
        if timeline is None or not timeline.event:
            continue
        seconds = times_s(timeline) if x_axis == "time" else None
        xs = seconds if seconds is not None else np.asarray(timeline.event)
        fig.add_trace(go.Scatter(
            x=xs, y=scale(timeline.allocated), mode="lines", name=f"{label}",
            line={"color": color, "width": 1.5, "shape": "hv"},
            hovertemplate=f"{label}<br>allocated %{{y:.3f}} {scale.unit}<extra></extra>",
        ))
        peak = device.peak_allocated_bytes
        fig.add_hline(y=peak / scale.divisor, line={"color": color, "dash": "dot", "width": 1},
                      annotation_text=f"peak {format_bytes(peak)}", annotation_position="top right")
    layout(fig, "Allocated bytes, overlaid", height=400, hovermode="closest")
    fig.update_xaxes(title_text="time since the first event (s)" if x_axis == "time" else "event index")
    fig.update_yaxes(title_text=f"bytes ({scale.unit})", rangemode="tozero")
    return fig


def source_name(report: Report, device: int) -> str:
    source = report.source.replace("\\", "/").rsplit("/", 1)[-1]
    return f"{source} [dev {device}]"


def compare_rows(report_a: Report, report_b: Report, device_a: int | None = None, device_b: int | None = None
                 ) -> list[dict[str, str]]:
    """The diff table: headline numbers and categories at the peak of two reports, side by side."""
    da: DeviceReport = report_a.device(device_a)
    db: DeviceReport = report_b.device(device_b)

    def row(name: str, a: float | None, b: float | None, as_bytes: bool = True) -> dict[str, str]:
        def show(v: float | None) -> str:
            if v is None:
                return "n/a"
            return format_bytes(v) if as_bytes else f"{int(v):,}"
        delta = "" if a is None or b is None else (
            ("+" if b >= a else "") + (format_bytes(b - a) if as_bytes else f"{int(b - a):,}"))
        return {"metric": name, "a": show(a), "b": show(b), "delta": delta}

    rows = [
        row("peak allocated", da.peak_allocated_bytes, db.peak_allocated_bytes),
        row("peak reserved", da.peak_reserved_bytes, db.peak_reserved_bytes),
        row("final allocated", da.final_allocated_bytes, db.final_allocated_bytes),
        row("events", da.events, db.events, as_bytes=False),
        row("steps", len(da.steps), len(db.steps), as_bytes=False),
        row("findings", len(da.findings), len(db.findings), as_bytes=False),
    ]
    for category in _ordered_union(da.categories_at_peak, db.categories_at_peak):
        rows.append(row(f"at peak: {category.replace('_', ' ')}", da.categories_at_peak.get(category, 0),
                        db.categories_at_peak.get(category, 0)))
    return rows


def _ordered_union(a: Iterable[str], b: Iterable[str]) -> list[str]:
    names = set(a) | set(b)
    return sorted(names, key=lambda c: (CATEGORIES.index(c) if c in CATEGORIES else len(CATEGORIES), c))
