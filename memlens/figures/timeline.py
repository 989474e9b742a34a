"""Memory over time: allocated and reserved bytes, with steps, findings, the peak and OOMs.

Drawn from a ``Timeline`` (plain data: the report's own, or one the web app cuts from the trace
for a zoomed window), never from the trace, so a saved report draws the same as a live one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import plotly.graph_objects as go

from memlens.analysis.datatypes import Finding, Timeline
from memlens.analysis.report import DeviceReport
from memlens.figures._style import (
    ALLOCATED_COLOR,
    FINDING_COLORS,
    MAX_STEP_LINES,
    RESERVED_COLOR,
    ByteScale,
    FloatArray,
    finding_title,
    layout,
    message_figure,
    rgba,
    wrap,
)
from memlens.snapshot.envelope import envelope_rows
from memlens.units import format_bytes

XAxis = Literal["event", "time"]

# Pixel columns of the drawn envelope: wider than any screen's plot area, so each curve is drawn
# with at most two points (its minimum and maximum) per pixel column, plus its first and last.
ENVELOPE_COLUMNS = 2000
MAX_POINTS_PER_CURVE = 2 * ENVELOPE_COLUMNS + 2


def times_s(timeline: Timeline) -> FloatArray | None:
    """Seconds since the first row at each point, or ``None`` without usable (sorted) times."""
    if timeline.time_us is None or not timeline.time_us:
        return None
    times = np.asarray(timeline.time_us, dtype=np.float64)
    if np.any(np.diff(times) < 0):
        return None
    return (times - times[0]) / 1e6


def _x_of(timeline: Timeline, x_axis: XAxis) -> tuple[FloatArray, bool]:
    """The x of each point (event index or seconds) and whether it is time."""
    seconds = times_s(timeline) if x_axis == "time" else None
    if seconds is not None:
        return seconds, True
    return np.asarray(timeline.event, dtype=np.float64), False


def _x_at(timeline: Timeline, xs: FloatArray, events: Sequence[int] | np.ndarray) -> FloatArray:
    """The x of any rows: exact at the timeline's points (steps' first rows are among them),
    interpolated between them."""
    return np.interp(np.asarray(events, dtype=np.float64), np.asarray(timeline.event, dtype=np.float64), xs)


def event_range(timeline: Timeline, x_start: float | None, x_end: float | None, x_axis: XAxis = "event"
                ) -> tuple[int | None, int | None]:
    """Turn a visible x range (event index or seconds) into trace rows ``[start, end)``."""
    if x_axis == "time":
        seconds = times_s(timeline)
        if seconds is not None:
            rows = np.asarray(timeline.event, dtype=np.int64)
            start = None if x_start is None else int(rows[min(int(np.searchsorted(seconds, x_start, "left")),
                                                              len(rows) - 1)])
            stop = int(np.searchsorted(seconds, x_end, "right")) if x_end is not None else None
            end = None if stop is None else (int(rows[stop]) if stop < len(rows) else timeline.events)
            return start, end
    start = None if x_start is None else max(0, int(np.floor(x_start)))
    end = None if x_end is None else int(np.ceil(x_end)) + 1
    return start, end


def timeline_figure(
    device: DeviceReport,
    timeline: Timeline | None = None,
    *,
    x_axis: XAxis = "event",
    zoomed: bool = False,
    highlight: int | None = None,
    marker_event: int | None = None,
) -> go.Figure:
    """Allocated and reserved bytes over ``timeline`` (default: the report's own), with steps,
    findings and the peak.

    ``x_axis`` is ``"event"`` (event index) or ``"time"`` (seconds since the first event; falls
    back to events when the file has no times). ``zoomed``: the timeline is a window, and the
    axis is fixed to it. ``highlight`` is the index (in ``device.findings``) of a finding to draw
    stronger; ``marker_event`` draws a vertical cursor (e.g. a clicked moment).
    """
    timeline = timeline if timeline is not None else device.timeline
    title = f"Memory over time, device {device.device}"
    if timeline is None or not timeline.event:
        return message_figure(
            title, "This snapshot has no allocation history (it was taken without "
            "_record_memory_history),<br>so there is no timeline: see the segment map and the categories.")
    rows = np.asarray(timeline.event, dtype=np.int64)
    lo, hi = int(rows[0]), int(rows[-1]) + 1
    xs, use_time = _x_of(timeline, x_axis)
    x_title = "time since the first event (s)" if use_time else "event index"

    capacity = device.capacity_bytes
    scale = ByteScale.for_max(max(float(max(timeline.reserved)), float(capacity or 0), 1.0))
    fig = go.Figure()
    for name, values, color, fill in (
        ("reserved", timeline.reserved, RESERVED_COLOR, "tozeroy"),
        ("allocated", timeline.allocated, ALLOCATED_COLOR, None),
    ):
        # However many points the timeline holds (a window's, or the steps' extremes of a run of
        # thousands of steps), the browser draws each curve's envelope: a bounded number of points
        # that keeps every column's peak.
        drawn = envelope_rows(np.asarray(values, dtype=np.int64), MAX_POINTS_PER_CURVE)
        events = np.asarray(timeline.event, dtype=np.int64)[drawn]
        fig.add_trace(go.Scatter(
            x=xs[drawn], y=scale(np.asarray(values, dtype=np.int64)[drawn]), name=name, mode="lines",
            line={"color": color, "width": 1.2 if name == "reserved" else 1.6, "shape": "hv"},
            fill=fill, fillcolor="rgba(127,127,127,0.08)" if fill else None,
            # A plain list: dcc.Graph reads clickData's customdata from the figure's data, where a
            # numpy array stays base64-encoded (``{dtype, bdata}``) and cannot be indexed.
            customdata=events.tolist(),
            hovertemplate=f"{name}: %{{y:.3f}} {scale.unit}<br>event %{{customdata}}<extra></extra>",
        ))

    _add_steps(fig, device, timeline, xs, lo, hi)
    _add_findings(fig, device.findings, timeline, xs, lo, hi, highlight)
    _add_peak_and_ooms(fig, device, timeline, xs, scale, lo, hi)

    if capacity:
        fig.add_hline(y=capacity / scale.divisor, line={"color": "#8C1C13", "dash": "dash", "width": 1},
                      annotation_text=f"capacity {format_bytes(capacity)}", annotation_position="top left")
    if marker_event is not None and lo <= marker_event < hi:
        fig.add_vline(x=float(_x_at(timeline, xs, [marker_event])[0]),
                      line={"color": "#333", "width": 1, "dash": "dot"})

    layout(fig, title, height=440, hovermode="closest", uirevision=f"timeline-{device.device}")
    fig.update_xaxes(title_text=x_title, range=[float(xs[0]), float(xs[-1])] if zoomed else None,
                     showspikes=True, spikemode="across", spikethickness=1)
    fig.update_yaxes(title_text=f"bytes ({scale.unit})", rangemode="tozero")
    fig.layout.meta = {"x_axis": "time" if use_time else "event", "start": lo, "end": hi,
                       "events": timeline.events, "points_per_trace": [len(t.x) for t in fig.data[:2]]}
    return fig


def _hidden_axis(fig: go.Figure) -> None:
    fig.update_layout(yaxis2={"overlaying": "y", "range": [0, 1], "visible": False, "fixedrange": True})


def _add_steps(fig: go.Figure, device: DeviceReport, timeline: Timeline, xs: FloatArray, lo: int, hi: int
               ) -> None:
    steps = [s for s in device.steps if lo <= s.start_event < hi]
    if len(steps) < 2:
        return
    stride = max(1, -(-len(steps) // MAX_STEP_LINES))
    shown = steps[::stride]
    # One trace of vertical segments separated by gaps: cheaper than hundreds of layout shapes.
    line_x: list[float | None] = []
    line_y: list[float | None] = []
    labels: list[str | None] = []
    for step, x in zip(shown, _x_at(timeline, xs, [s.start_event for s in shown]).tolist(), strict=True):
        line_x += [x, x, None]
        line_y += [0.0, 1.0, None]
        label = f"step {step.index} starts (event {step.start_event})"
        labels += [label, label, None]
    fig.add_trace(go.Scatter(
        x=line_x, y=line_y, yaxis="y2", mode="lines", name="step boundaries",
        line={"color": "rgba(80,80,80,0.35)", "width": 1, "dash": "dot"},
        text=labels, hovertemplate="%{text}<extra></extra>",
    ))
    _hidden_axis(fig)


def _add_findings(fig: go.Figure, findings: Sequence[Finding], timeline: Timeline, xs: FloatArray,
                  lo: int, hi: int, highlight: int | None) -> None:
    first_of_kind: dict[str, int] = {}
    for index, finding in enumerate(findings):
        first_of_kind.setdefault(finding.kind, index)
    for index, finding in enumerate(findings):
        start = int(finding.start_event)
        stop = max(int(finding.end_event), start + 1)
        if stop <= lo or start >= hi:
            continue
        x0, x1 = (float(x) for x in _x_at(timeline, xs, [max(start, lo), min(stop, hi) - 1]))
        if x1 <= x0:
            x1 = x0 + 1e-6
        color = FINDING_COLORS.get(finding.kind, "#999999")
        strong = highlight == index
        text = (f"<b>{finding_title(finding.kind)}</b> ({finding.severity}, {format_bytes(finding.bytes)})"
                f"<br>{wrap(finding.summary)}<br><i>{wrap(finding.recommendation)}</i>")
        # A filled polygon on the hidden 0..1 axis: a shape cannot carry hover text, a trace can.
        fig.add_trace(go.Scatter(
            x=[x0, x1, x1, x0, x0], y=[0, 0, 1, 1, 0], yaxis="y2", mode="lines", fill="toself",
            fillcolor=rgba(color, 0.22 if strong else 0.12),
            line={"color": rgba(color, 0.9 if strong else 0.35), "width": 2 if strong else 0.5},
            hoveron="fills", hoverinfo="text", text=text, name=finding_title(finding.kind),
            legendgroup=finding.kind, showlegend=index == first_of_kind[finding.kind],
        ))
    if findings:
        _hidden_axis(fig)


def _add_peak_and_ooms(fig: go.Figure, device: DeviceReport, timeline: Timeline, xs: FloatArray,
                       scale: ByteScale, lo: int, hi: int) -> None:
    peak_event = device.peak_allocated_event
    if peak_event is not None and lo <= peak_event < hi:
        peak_bytes = device.peak_allocated_bytes
        fig.add_trace(go.Scatter(
            x=[float(_x_at(timeline, xs, [peak_event])[0])], y=[peak_bytes / scale.divisor],
            mode="markers+text", name="peak",
            marker={"symbol": "triangle-down", "size": 13, "color": "#D62728",
                    "line": {"color": "white", "width": 1}},
            text=[f"peak {format_bytes(peak_bytes)}"], textposition="top center",
            hovertemplate=f"peak allocated {format_bytes(peak_bytes)}<br>event {peak_event}<extra></extra>",
        ))
    if timeline.oom_event:
        fig.add_trace(go.Scatter(
            x=_x_at(timeline, xs, timeline.oom_event), y=scale(timeline.oom_allocated), mode="markers",
            name="OOM", marker={"symbol": "x", "size": 12, "color": FINDING_COLORS["oom"]},
            customdata=[[e, r] for e, r in zip(timeline.oom_event, timeline.oom_requested, strict=True)],
            hovertemplate="out of memory at event %{customdata[0]}<br>asked for %{customdata[1]:,} bytes"
                          "<extra></extra>",
        ))
