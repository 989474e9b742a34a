"""Plotly figure builders shared by the web app and ``memlens export``.

Every builder is a pure function of analysis results (a ``Report``, a ``DeviceReport``, a
``Snapshot``, a budget reconciliation) returning a ``plotly.graph_objects.Figure``. Nothing here
imports dash or computes an analysis: the numbers come from ``memlens.analyze``,
``memlens.budget`` and ``memlens.allocator``; this module only shapes them for the eye.

Long memory curves are cut down on the server with :func:`downsample_minmax`, which keeps the
smallest and the largest value of every bucket, so a one-event spike survives any zoom level
and the browser never receives more than a few thousand points per trace.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import plotly.graph_objects as go

from memlens.snapshot.model import Action, DeviceTrace, Snapshot
from memlens.units import GiB, KiB, MiB, format_bytes

# Points per trace sent to the browser by default: enough to look continuous at full-HD width
# (two points, the min and the max, per pixel column of a ~2000 px plot).
DEFAULT_MAX_POINTS = 4000
# Step boundaries drawn at most; past that they become a grey comb that hides the curve.
MAX_STEP_LINES = 200
# Segments drawn in the segment map; a snapshot can hold thousands of 2 MiB small-pool segments.
MAX_SEGMENTS_SHOWN = 48
# Stacks per category in the treemap; the rest is summed into one "other stacks" tile.
MAX_STACKS_PER_CATEGORY = 12

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporary", "unknown")
CATEGORY_COLORS: dict[str, str] = {
    "parameters": "#4C78A8",
    "gradients": "#F58518",
    "optimizer_state": "#B279A2",
    "activations": "#54A24B",
    "temporary": "#EECA3B",
    "unknown": "#9D9DA0",
}
FINDING_COLORS: dict[str, str] = {
    "leak": "#D62728",
    "activation_plateau": "#2CA02C",
    "optimizer_spike": "#9467BD",
    "fragmentation": "#FF7F0E",
    "idle_cache": "#BCBD22",
    "oom": "#8C1C13",
}
ALLOCATED_COLOR = "#1F77B4"
RESERVED_COLOR = "#7F7F7F"
SECOND_COLOR = "#E45756"
BLOCK_STATE_COLORS = {
    "active_allocated": "#1F77B4",
    "active_pending_free": "#AEC7E8",
    "inactive": "#F2B6B6",
}
BLOCK_STATE_LABELS = {
    "active_allocated": "allocated",
    "active_pending_free": "freed, waiting for its stream",
    "inactive": "free (cached)",
}

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


# --------------------------------------------------------------------------- downsampling


def downsample_indices(y: npt.ArrayLike, max_points: int) -> IntArray:
    """Indices of the points :func:`downsample_minmax` keeps (sorted, at most ``max_points``).

    The series is cut into ``(max_points - 2) // 2`` equal buckets; each contributes the index of
    its minimum and of its maximum, and the first and last points are always kept. So the global
    extremes and every spike wider than nothing survive.
    """
    values = np.asarray(y)
    n = int(values.shape[0])
    if max_points < 4:
        raise ValueError(f"max_points must be at least 4, got {max_points}")
    if n <= max_points:
        return np.arange(n, dtype=np.int64)
    buckets = (max_points - 2) // 2
    width = -(-n // buckets)  # ceil
    buckets = -(-n // width)  # the last bucket may be short; never an empty one
    padded = np.empty(buckets * width, dtype=values.dtype)
    padded[:n] = values
    padded[n:] = values[-1]  # padding repeats the last value: it can only tie, never win
    grid = padded.reshape(buckets, width)
    offsets = np.arange(buckets, dtype=np.int64) * width
    lows = np.minimum(np.argmin(grid, axis=1) + offsets, n - 1)
    highs = np.minimum(np.argmax(grid, axis=1) + offsets, n - 1)
    keep = np.concatenate(([0], lows, highs, [n - 1])).astype(np.int64)
    return np.unique(keep)


def downsample_minmax(
    x: npt.ArrayLike, y: npt.ArrayLike, max_points: int = DEFAULT_MAX_POINTS
) -> tuple[np.ndarray, np.ndarray]:
    """Cut ``(x, y)`` to at most ``max_points`` points, keeping every bucket's min and max.

    ``x`` must be sorted (event index or time). Series already short enough come back unchanged.
    """
    xs = np.asarray(x)
    ys = np.asarray(y)
    if xs.shape[0] != ys.shape[0]:
        raise ValueError(f"x and y differ in length ({xs.shape[0]} != {ys.shape[0]})")
    keep = downsample_indices(ys, max_points)
    return xs[keep], ys[keep]


# --------------------------------------------------------------------------- helpers


@dataclass(frozen=True)
class ByteScale:
    """The unit a plot's byte axis is drawn in, chosen so the numbers stay readable."""

    divisor: int
    unit: str

    @classmethod
    def for_max(cls, max_bytes: float) -> ByteScale:
        if max_bytes >= GiB:
            return cls(GiB, "GiB")
        if max_bytes >= MiB:
            return cls(MiB, "MiB")
        return cls(KiB, "KiB")

    def __call__(self, values: Any) -> Any:
        return np.asarray(values, dtype=np.float64) / self.divisor


def _resolve_device(report_or_device_report: Any, device: int | None, trace: DeviceTrace | None
                    ) -> tuple[Any, DeviceTrace]:
    """``(device_report, trace)`` from a ``Report`` (+ device) or a ``DeviceReport`` (+ trace)."""
    obj = report_or_device_report
    if hasattr(obj, "devices") and hasattr(obj, "snapshot"):
        device_id = primary_device(obj) if device is None else device
        device_report = obj.devices[device_id]
        return device_report, trace if trace is not None else obj.snapshot.device(device_id)
    if trace is None:
        trace = getattr(obj, "trace", None)
    if trace is None:
        raise TypeError("a DeviceReport needs its DeviceTrace: pass trace=snapshot.device(n)")
    return obj, trace


def primary_device(report: Any) -> int:
    """The device to show first: the report's own choice (most events), else the highest peak."""
    devices: Mapping[int, Any] = report.devices
    if not devices:
        raise ValueError("the report has no devices")
    if callable(getattr(report, "device", None)):
        return int(report.device(None).device)
    return max(devices, key=lambda d: (devices[d].peak_allocated_bytes, devices[d].events, -d))


def event_times_s(trace: DeviceTrace) -> FloatArray | None:
    """Seconds since the first event, or ``None`` when the file has no usable (sorted) times."""
    if not trace.has_time or len(trace) == 0:
        return None
    times = trace.time_us.astype(np.float64)
    if np.any(np.diff(times) < 0):
        return None
    return (times - times[0]) / 1e6


def event_range(trace: DeviceTrace, x_start: float | None, x_end: float | None, x_axis: str = "event"
                ) -> tuple[int | None, int | None]:
    """Turn a visible x range (event index or seconds) into event indices ``[start, end)``."""
    if x_axis == "time":
        seconds = event_times_s(trace)
        if seconds is not None:
            start = None if x_start is None else int(np.searchsorted(seconds, x_start, side="left"))
            end = None if x_end is None else int(np.searchsorted(seconds, x_end, side="right"))
            return start, end
    start = None if x_start is None else max(0, int(np.floor(x_start)))
    end = None if x_end is None else int(np.ceil(x_end)) + 1
    return start, end


def _layout(fig: go.Figure, title: str, height: int = 420, **extra: Any) -> go.Figure:
    settings: dict[str, Any] = {
        "title": {"text": title, "x": 0.01, "xanchor": "left", "font": {"size": 15}},
        "template": "plotly_white",
        "height": height,
        "margin": {"l": 60, "r": 20, "t": 48, "b": 44},
        "legend": {"orientation": "h", "yanchor": "bottom", "y": 1.0, "xanchor": "right", "x": 1.0},
        "hoverlabel": {"align": "left"},
    }
    settings.update(extra)
    fig.update_layout(**settings)
    return fig


def _message_figure(title: str, message: str, height: int = 300) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                       font={"size": 14, "color": "#555"})
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, title, height=height)


def _wrap(text: str, width: int = 70) -> str:
    """Hover text lines break at ``<br>``; long sentences would run off the screen."""
    words, lines, line = text.split(), [], ""
    for word in words:
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        lines.append(line)
    return "<br>".join(lines)


def finding_title(kind: str) -> str:
    return {"oom": "out of memory", "activation_plateau": "activation plateau",
            "optimizer_spike": "optimizer spike"}.get(kind, kind.replace("_", " "))


# --------------------------------------------------------------------------- timeline


def timeline_figure(
    report_or_device_report: Any,
    start: int | None = None,
    end: int | None = None,
    max_points: int = DEFAULT_MAX_POINTS,
    *,
    device: int | None = None,
    trace: DeviceTrace | None = None,
    x_axis: str = "event",
    highlight: int | None = None,
    marker_event: int | None = None,
) -> go.Figure:
    """Allocated and reserved bytes over events ``[start, end)``, with steps, findings and the peak.

    ``x_axis`` is ``"event"`` (event index) or ``"time"`` (seconds since the first event; falls
    back to events when the file has no times). Each curve is downsampled to ``max_points``
    keeping every local min and max. ``highlight`` is the index (in ``findings``) of a finding to
    draw stronger; ``marker_event`` draws a vertical cursor (e.g. a clicked moment).
    """
    device_report, dtrace = _resolve_device(report_or_device_report, device, trace)
    n = len(dtrace)
    title = f"Memory over time, device {dtrace.device}"
    if n == 0:
        return _message_figure(
            title, "This snapshot has no allocation history (it was taken without "
            "_record_memory_history),<br>so there is no timeline: see the segment map and the categories.")
    lo = 0 if start is None else int(min(max(start, 0), n - 1))
    hi = n if end is None else int(min(max(end, lo + 1), n))

    seconds = event_times_s(dtrace) if x_axis == "time" else None
    use_time = seconds is not None
    xs_all: np.ndarray = seconds if seconds is not None else np.arange(n, dtype=np.int64)
    x_title = "time since the first event (s)" if use_time else "event index"

    peak_reserved = float(max(dtrace.reserved.max(), 1))
    capacity = getattr(device_report, "capacity_bytes", None)
    scale = ByteScale.for_max(max(peak_reserved, float(capacity or 0)))
    fig = go.Figure()

    window = slice(lo, hi)
    for name, values, color, fill in (
        ("reserved", dtrace.reserved, RESERVED_COLOR, "tozeroy"),
        ("allocated", dtrace.allocated, ALLOCATED_COLOR, None),
    ):
        keep = downsample_indices(values[window], max_points) + lo
        fig.add_trace(go.Scatter(
            x=xs_all[keep], y=scale(values[keep]), name=name, mode="lines",
            line={"color": color, "width": 1.2 if name == "reserved" else 1.6, "shape": "hv"},
            fill=fill, fillcolor="rgba(127,127,127,0.08)" if fill else None,
            # A plain list: dcc.Graph reads clickData's customdata from the figure's data, where a
            # numpy array stays base64-encoded (``{dtype, bdata}``) and cannot be indexed.
            customdata=keep.tolist(),
            hovertemplate=f"{name}: %{{y:.3f}} {scale.unit}<br>event %{{customdata}}<extra></extra>",
        ))

    _add_steps(fig, device_report, xs_all, lo, hi)
    _add_findings(fig, device_report, xs_all, lo, hi, highlight)
    _add_peak_and_ooms(fig, device_report, dtrace, xs_all, scale, lo, hi)

    if capacity:
        fig.add_hline(y=capacity / scale.divisor, line={"color": "#8C1C13", "dash": "dash", "width": 1},
                      annotation_text=f"capacity {format_bytes(capacity)}", annotation_position="top left")
    if marker_event is not None and 0 <= marker_event < n:
        fig.add_vline(x=float(xs_all[marker_event]), line={"color": "#333", "width": 1, "dash": "dot"})

    _layout(fig, title, height=440, hovermode="closest", uirevision=f"timeline-{dtrace.device}")
    fig.update_xaxes(title_text=x_title, range=[float(xs_all[lo]), float(xs_all[hi - 1])] if
                     (start is not None or end is not None) else None, showspikes=True, spikemode="across",
                     spikethickness=1)
    fig.update_yaxes(title_text=f"bytes ({scale.unit})", rangemode="tozero")
    fig.layout.meta = {"x_axis": "time" if use_time else "event", "start": lo, "end": hi, "events": n,
                       "points_per_trace": [len(t.x) for t in fig.data[:2]]}
    return fig


def _add_steps(fig: go.Figure, device_report: Any, xs: np.ndarray, lo: int, hi: int) -> None:
    steps = [s for s in getattr(device_report, "steps", []) if lo <= s.start_event < hi]
    if len(steps) < 2:
        return
    stride = max(1, -(-len(steps) // MAX_STEP_LINES))
    shown = steps[::stride]
    # One trace of vertical segments separated by gaps: cheaper than hundreds of layout shapes.
    line_x: list[float | None] = []
    line_y: list[float | None] = []
    labels: list[str | None] = []
    for step in shown:
        x = float(xs[step.start_event])
        line_x += [x, x, None]
        line_y += [0.0, 1.0, None]
        label = f"step {step.index} starts (event {step.start_event})"
        labels += [label, label, None]
    fig.add_trace(go.Scatter(
        x=line_x, y=line_y, yaxis="y2", mode="lines", name="step boundaries",
        line={"color": "rgba(80,80,80,0.35)", "width": 1, "dash": "dot"},
        text=labels, hovertemplate="%{text}<extra></extra>",
    ))
    fig.update_layout(yaxis2={"overlaying": "y", "range": [0, 1], "visible": False, "fixedrange": True})


def _add_findings(fig: go.Figure, device_report: Any, xs: np.ndarray, lo: int, hi: int,
                  highlight: int | None) -> None:
    findings = list(getattr(device_report, "findings", []))
    for index, finding in enumerate(findings):
        start = int(finding.start_event)
        stop = max(int(finding.end_event), start + 1)
        if stop <= lo or start >= hi:
            continue
        x0 = float(xs[max(start, 0)])
        x1 = float(xs[min(stop, len(xs)) - 1])
        if x1 <= x0:
            x1 = x0 + (1e-6 if xs.dtype.kind == "f" else 1)
        color = FINDING_COLORS.get(finding.kind, "#999999")
        strong = highlight == index
        text = (f"<b>{finding_title(finding.kind)}</b> ({finding.severity}, {format_bytes(finding.bytes)})"
                f"<br>{_wrap(finding.summary)}<br><i>{_wrap(finding.recommendation)}</i>")
        # A filled polygon on the hidden 0..1 axis: a shape cannot carry hover text, a trace can.
        fig.add_trace(go.Scatter(
            x=[x0, x1, x1, x0, x0], y=[0, 0, 1, 1, 0], yaxis="y2", mode="lines", fill="toself",
            fillcolor=_rgba(color, 0.22 if strong else 0.12),
            line={"color": _rgba(color, 0.9 if strong else 0.35), "width": 2 if strong else 0.5},
            hoveron="fills", hoverinfo="text", text=text, name=finding_title(finding.kind),
            legendgroup=finding.kind, showlegend=index == _first_of_kind(findings, finding.kind),
        ))
    if findings:
        fig.update_layout(yaxis2={"overlaying": "y", "range": [0, 1], "visible": False, "fixedrange": True})


def _first_of_kind(findings: Sequence[Any], kind: str) -> int:
    return next(i for i, f in enumerate(findings) if f.kind == kind)


def _add_peak_and_ooms(fig: go.Figure, device_report: Any, trace: DeviceTrace, xs: np.ndarray,
                       scale: ByteScale, lo: int, hi: int) -> None:
    peak_event = getattr(device_report, "peak_allocated_event", None)
    if peak_event is None or not 0 <= peak_event < len(trace):
        peak_event = int(np.argmax(trace.allocated))
    peak_bytes = int(trace.allocated[peak_event])
    if lo <= peak_event < hi:
        fig.add_trace(go.Scatter(
            x=[float(xs[peak_event])], y=[peak_bytes / scale.divisor], mode="markers+text", name="peak",
            marker={"symbol": "triangle-down", "size": 13, "color": "#D62728",
                    "line": {"color": "white", "width": 1}},
            text=[f"peak {format_bytes(peak_bytes)}"], textposition="top center",
            hovertemplate=f"peak allocated {format_bytes(peak_bytes)}<br>event {peak_event}<extra></extra>",
        ))
    oom_rows = np.flatnonzero(trace.action[lo:hi] == int(Action.OOM)) + lo
    if oom_rows.size:
        oom_rows = oom_rows[:50]
        fig.add_trace(go.Scatter(
            x=xs[oom_rows], y=scale(trace.allocated[oom_rows]), mode="markers", name="OOM",
            marker={"symbol": "x", "size": 12, "color": FINDING_COLORS["oom"]},
            customdata=np.stack([oom_rows, trace.size[oom_rows]], axis=1),
            hovertemplate="out of memory at event %{customdata[0]}<br>asked for %{customdata[1]:,} bytes"
                          "<extra></extra>",
        ))


def _rgba(hex_color: str, alpha: float) -> str:
    value = hex_color.lstrip("#")
    r, g, b = (int(value[i:i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


# --------------------------------------------------------------------------- categories


def categories_figure(
    device_report: Any,
    categories: Mapping[str, int] | None = None,
    stacks: Mapping[str, Sequence[Any]] | None = None,
    *,
    kind: str = "treemap",
    title: str | None = None,
) -> go.Figure:
    """What was live, by category then by allocating stack, as a treemap (or ``kind="sunburst"``).

    By default the numbers are the device report's ``categories_at_peak`` and
    ``top_stacks_by_category``; pass ``categories``/``stacks`` to draw another moment.
    """
    cats = dict(categories if categories is not None else getattr(device_report, "categories_at_peak", {}))
    by_stack = stacks if stacks is not None else getattr(device_report, "top_stacks_by_category", {})
    total = sum(int(v) for v in cats.values())
    heading = title or f"Live at the peak: {format_bytes(total)} by category and stack"
    if total <= 0:
        return _message_figure(heading, "Nothing was live at this moment.")
    root = "live"
    ids, labels, parents, values, colors, hovers = [root], [f"live {format_bytes(total)}"], [""], [total], [
        "#FFFFFF"], [f"all live tensors: {format_bytes(total)}"]
    ordered = sorted(cats, key=lambda c: (CATEGORIES.index(c) if c in CATEGORIES else len(CATEGORIES), c))
    for category in ordered:
        cat_bytes = int(cats[category])
        if cat_bytes <= 0:
            continue
        color = CATEGORY_COLORS.get(category, "#BBBBBB")
        ids.append(category)
        labels.append(category.replace("_", " "))
        parents.append(root)
        values.append(cat_bytes)
        colors.append(color)
        hovers.append(f"{category}: {format_bytes(cat_bytes)} ({100 * cat_bytes / total:.1f}% of live)")
        remaining = cat_bytes
        entries = sorted(by_stack.get(category, []), key=lambda s: -int(s.bytes))
        for rank, entry in enumerate(entries[:MAX_STACKS_PER_CATEGORY]):
            stack_bytes = min(int(entry.bytes), remaining)
            if stack_bytes <= 0:
                continue
            remaining -= stack_bytes
            frames = list(entry.frames)
            ids.append(f"{category}/{rank}")
            labels.append(_short_frame(frames[0]) if frames else "(no stack recorded)")
            parents.append(category)
            values.append(stack_bytes)
            colors.append(_rgba(color, 0.55))
            stack_text = "<br>".join(frames[:8]) if frames else "(no stack recorded)"
            hovers.append(f"{format_bytes(stack_bytes)} in {int(entry.count)} tensor(s)<br>{stack_text}")
        if remaining > 0 and entries:
            ids.append(f"{category}/other")
            labels.append("other stacks")
            parents.append(category)
            values.append(remaining)
            colors.append(_rgba(color, 0.3))
            hovers.append(f"{format_bytes(remaining)} from stacks not listed")
    trace_cls = go.Sunburst if kind == "sunburst" else go.Treemap
    extra: dict[str, Any] = {}
    if kind != "sunburst":
        extra = {"tiling": {"pad": 2}, "pathbar": {"visible": False}}
    fig = go.Figure(trace_cls(
        ids=ids, labels=labels, parents=parents, values=values, branchvalues="total",
        marker={"colors": colors}, hovertext=hovers, hoverinfo="text", textinfo="label+value",
        texttemplate="%{label}<br>%{percentRoot:.1%}", maxdepth=3, **extra,
    ))
    return _layout(fig, heading, height=440, margin={"l": 8, "r": 8, "t": 48, "b": 8})


def _short_frame(frame: str, width: int = 48) -> str:
    text = str(frame)
    return text if len(text) <= width else text[: width - 1] + "…"


def categories_bar_figure(categories: Mapping[str, int], title: str = "Live by category") -> go.Figure:
    """One horizontal stacked bar of categories (used for compact summaries in export)."""
    fig = go.Figure()
    for category in CATEGORIES:
        value = int(categories.get(category, 0))
        if value:
            fig.add_trace(go.Bar(x=[value / GiB], y=[""], orientation="h", name=category,
                                 marker_color=CATEGORY_COLORS[category],
                                 hovertemplate=f"{category}: {format_bytes(value)}<extra></extra>"))
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title_text="GiB")
    return _layout(fig, title, height=180)


# --------------------------------------------------------------------------- segments


def segment_map_figure(snapshot: Snapshot, device: int | None = None,
                       max_segments: int = MAX_SEGMENTS_SHOWN) -> go.Figure:
    """Each segment as one bar cut into its blocks: allocated, waiting, and free (cached) pieces.

    Many small free pieces inside big segments are fragmentation: reserved memory that a large
    request cannot use. Segments are drawn largest first; the rest are summed in the title.
    """
    if device is None:
        device = snapshot.device().device if snapshot.devices else 0
    segments = sorted(snapshot.segments_on(device), key=lambda s: (-s.total_size, s.address))
    reserved = sum(s.total_size for s in segments)
    free = sum(s.free_size for s in segments)
    largest_free = max((s.largest_free_block for s in segments), default=0)
    title = (f"Segments when the snapshot was taken, device {device}<br><span style='font-size:12px;"
             f"color:#5f6b76'>{len(segments)} segments, {format_bytes(reserved)} reserved, "
             f"{format_bytes(free)} free in pieces (largest {format_bytes(largest_free)})</span>")
    if not segments:
        return _message_figure(title, "No segments on this device when the snapshot was taken.")
    shown = segments[:max_segments]
    scale = ByteScale.for_max(shown[0].total_size)
    columns: dict[str, dict[str, list[Any]]] = {
        state: {"x": [], "base": [], "y": [], "text": []} for state in BLOCK_STATE_COLORS}
    labels = []
    for index, segment in enumerate(shown):
        label = f"#{index} {segment.segment_type} {format_bytes(segment.total_size)}"
        labels.append(label)
        offset = 0
        for block in sorted(segment.blocks, key=lambda b: b.address):
            rel = block.address - segment.address if block.address >= segment.address else offset
            state = block.state if block.state in columns else "inactive"
            col = columns[state]
            col["x"].append(block.size / scale.divisor)
            col["base"].append(rel / scale.divisor)
            col["y"].append(label)
            col["text"].append(f"{BLOCK_STATE_LABELS[state]}: {format_bytes(block.size)}<br>"
                               f"at +{format_bytes(rel)} in segment 0x{segment.address:x}"
                               f"<br>stream {segment.stream}, pool {segment.pool_id}")
            offset = rel + block.size
    fig = go.Figure()
    for state, col in columns.items():
        if col["x"]:
            fig.add_trace(go.Bar(
                x=col["x"], base=col["base"], y=col["y"], orientation="h", name=BLOCK_STATE_LABELS[state],
                marker={"color": BLOCK_STATE_COLORS[state], "line": {"color": "white", "width": 0.5}},
                hovertext=col["text"], hoverinfo="text",
            ))
    hidden = len(segments) - len(shown)
    if hidden:
        rest = sum(s.total_size for s in segments[max_segments:])
        fig.add_annotation(text=f"+ {hidden} smaller segments ({format_bytes(rest)}) not drawn",
                           xref="paper", yref="paper", x=1, y=0, xanchor="right", yanchor="bottom",
                           showarrow=False, font={"size": 11}, bgcolor="rgba(255,255,255,0.8)")
    height = min(max(280, 20 * len(shown) + 130), 1400)
    _layout(fig, title, height=height, barmode="overlay", bargap=0.25,
            margin={"l": 60, "r": 20, "t": 84, "b": 44})
    fig.update_yaxes(categoryorder="array", categoryarray=list(reversed(labels)), automargin=True,
                     tickfont={"size": 10})
    fig.update_xaxes(title_text=f"offset in segment ({scale.unit})")
    return fig


# --------------------------------------------------------------------------- budget


def budget_rows(reconciliation: Any) -> list[tuple[str, float | None, float | None]]:
    """``(name, theory_bytes, measured_bytes)`` rows from a budget reconciliation.

    Accepts the reconciliation object of ``memlens.budget.reconcile`` (``.rows`` of objects
    with ``category``/``name``, ``theory``/``theory_bytes``, ``measured``/``measured_bytes``),
    a mapping ``name -> (theory, measured)``, or such rows as dicts.
    """
    rows = getattr(reconciliation, "rows", reconciliation)
    if isinstance(rows, Mapping):
        return [(str(k), _num(v[0]), _num(v[1])) for k, v in rows.items()]
    out = []
    for row in rows:
        name = _field(row, "category", "name", "label")
        theory = _field(row, "theory_bytes", "theory", "theoretical_bytes", "estimate_bytes")
        measured = _field(row, "measured_bytes", "measured")
        out.append((str(name), _num(theory), _num(measured)))
    return out


def _field(row: Any, *names: str) -> Any:
    for name in names:
        if isinstance(row, Mapping) and name in row:
            return row[name]
        if hasattr(row, name):
            return getattr(row, name)
    return None


def _num(value: Any) -> float | None:
    return None if value is None else float(value)


def budget_figure(reconciliation: Any, capacity: int | None = None, title: str | None = None) -> go.Figure:
    """Theoretical line items next to the measured categories at the peak, side by side."""
    rows = budget_rows(reconciliation)
    heading = title or "Budget: theory vs measured at the peak"
    if not rows:
        return _message_figure(heading, "No budget yet: fill in the model and training setup.")
    largest = max([v for _, t, m in rows for v in (t, m) if v is not None] + [float(capacity or 0), 1.0])
    scale = ByteScale.for_max(largest)
    names = [name.replace("_", " ") for name, _, _ in rows]
    fig = go.Figure()
    columns = (("theory", [t for _, t, _ in rows], "#9ECAE9"),
               ("measured", [m for _, _, m in rows], "#1F77B4"))
    for label, values, color in columns:
        fig.add_trace(go.Bar(
            x=names, y=[None if v is None else v / scale.divisor for v in values], name=label,
            marker_color=color, text=[format_bytes(v) if v is not None else "n/a" for v in values],
            textposition="outside", cliponaxis=False,
            hovertemplate=f"{label} %{{x}}: %{{text}}<extra></extra>",
        ))
    if capacity:
        fig.add_hline(y=capacity / scale.divisor, line={"color": "#8C1C13", "dash": "dash", "width": 1},
                      annotation_text=f"capacity {format_bytes(capacity)}", annotation_position="top left")
    _layout(fig, heading, height=400, barmode="group", bargap=0.25)
    fig.update_yaxes(title_text=f"bytes ({scale.unit})", rangemode="tozero")
    return fig


# --------------------------------------------------------------------------- compare


def compare_figure(
    report_a: Any,
    report_b: Any,
    *,
    device_a: int | None = None,
    device_b: int | None = None,
    names: tuple[str, str] | None = None,
    max_points: int = DEFAULT_MAX_POINTS,
    x_axis: str = "event",
) -> go.Figure:
    """Two allocated-bytes timelines overlaid (x = event index, or seconds since each start)."""
    fig = go.Figure()
    series = []
    for report, device, color in ((report_a, device_a, ALLOCATED_COLOR), (report_b, device_b, SECOND_COLOR)):
        device_report, trace = _resolve_device(report, device, None)
        series.append((report, device_report, trace, color))
    largest = max(float(t.allocated.max()) if len(t) else 1.0 for _, _, t, _ in series)
    scale = ByteScale.for_max(largest)
    labels = names or tuple(_source_name(r, t.device) for r, _, t, _ in series)
    for (_, device_report, trace, color), label in zip(series, labels, strict=True):
        if len(trace) == 0:
            continue
        seconds = event_times_s(trace) if x_axis == "time" else None
        xs: np.ndarray = seconds if seconds is not None else np.arange(len(trace))
        keep = downsample_indices(trace.allocated, max_points)
        fig.add_trace(go.Scatter(
            x=xs[keep], y=scale(trace.allocated[keep]), mode="lines", name=f"{label}",
            line={"color": color, "width": 1.5, "shape": "hv"},
            hovertemplate=f"{label}<br>allocated %{{y:.3f}} {scale.unit}<extra></extra>",
        ))
        peak = int(device_report.peak_allocated_bytes)
        fig.add_hline(y=peak / scale.divisor, line={"color": color, "dash": "dot", "width": 1},
                      annotation_text=f"peak {format_bytes(peak)}", annotation_position="top right")
    _layout(fig, "Allocated bytes, overlaid", height=400, hovermode="closest")
    fig.update_xaxes(title_text="time since the first event (s)" if x_axis == "time" else "event index")
    fig.update_yaxes(title_text=f"bytes ({scale.unit})", rangemode="tozero")
    return fig


def _source_name(report: Any, device: int) -> str:
    source = str(getattr(report, "source", "snapshot")).replace("\\", "/").rsplit("/", 1)[-1]
    return f"{source} [dev {device}]"


def compare_rows(report_a: Any, report_b: Any, device_a: int | None = None, device_b: int | None = None
                 ) -> list[dict[str, str]]:
    """The diff table: headline numbers and categories at the peak of two reports, side by side."""
    da, _ = _resolve_device(report_a, device_a, None)
    db, _ = _resolve_device(report_b, device_b, None)

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
