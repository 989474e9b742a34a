"""The timeline (the whole run, or the zoomed window at full resolution) and the findings list.

The page keeps one small ``view`` dict in the browser: ``start``/``end`` (the zoomed trace rows
``[start, end)``), ``highlight`` (a clicked finding) and ``marker`` (a clicked trace row). The
functions here turn one user action and the current view into the next view, and a view into
what the timeline and the findings show. The zoomed range is the page's **window**: the live
breakdown shows the peak within it and the findings list marks the findings inside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go
from dash import html

from memlens import figures
from memlens.analysis.analysis import Analysis
from memlens.analysis.datatypes import Finding, Timeline
from memlens.analysis.lenses.moments import Window as RowsWindow
from memlens.analysis.report import DeviceReport, no_findings_text
from memlens.ops.moments import peak_of, rows_window, timeline_between
from memlens.reporters.evidence import first_items, format_value, label
from memlens.units import format_bytes

View = dict[str, Any]

# Padding around a finding when the timeline zooms to it, as a share of its width.
ZOOM_MARGIN = 0.15
# Stacks and frames a finding card lists (the rest stay in the report).
CARD_STACKS = 5
CARD_FRAMES = 20


@dataclass(frozen=True)
class Window:
    """Trace rows ``first..last`` (both included) the user zoomed the timeline to."""

    first: int
    last: int

    @property
    def text(self) -> str:
        return self.moment.text  # "events 10–90", as the lenses name the window's peak

    @property
    def moment(self) -> RowsWindow:
        """The lenses' window of these rows (what ``memlens group --window FIRST:LAST`` reads)."""
        return rows_window(self.first, self.last)

    def overlaps(self, start_event: int, end_event: int) -> bool:
        """Whether rows ``[start_event, end_event)`` (a finding's span) reach into the window."""
        return start_event <= self.last and end_event > self.first


def window_of(view: View | None, rows: int) -> Window | None:
    """The zoomed rows of ``view`` on a trace of ``rows`` rows; None when not zoomed (or empty)."""
    view = view or {}
    start, end = view.get("start"), view.get("end")
    if start is None and end is None:
        return None
    first = max(0, int(start or 0))
    last = min(rows, int(end) if end is not None else rows) - 1
    if last < first:
        return None
    return Window(first, last)


def window_text(analysis: Analysis, device: int, window: Window | None) -> Any:
    """The banner naming the window and its peak (found as ``memlens group --window`` finds it)."""
    if window is None:
        return None
    peak = peak_of(analysis, device, window.moment)
    event = peak.moment.event
    where = f" at event {event:,}" if event is not None and event >= 0 else ""
    return [html.B(f"Window: {window.text}"), f" · peak {format_bytes(peak.allocated_bytes)}{where}",
            html.Span(" · the live breakdown shows this peak and the findings inside the window are marked;"
                      " double-click the timeline to clear", className="muted")]


def view_for_finding(device: DeviceReport, rows: int, index: int) -> View | None:
    """The view zoomed to finding ``index`` (with a margin), drawn stronger; None for no such finding."""
    if not 0 <= index < len(device.findings):
        return None
    finding = device.findings[index]
    margin = max(1, int((finding.end_event - finding.start_event) * ZOOM_MARGIN))
    return {"start": max(0, finding.start_event - margin), "end": min(rows, finding.end_event + margin),
            "highlight": index}


def view_with_marker(view: View | None, click: dict[str, Any] | None) -> View | None:
    """``view`` with the clicked trace row as its marker; None when the click hit no curve point."""
    points = (click or {}).get("points") or []
    event = points[0].get("customdata") if points else None
    if not isinstance(event, int):
        return None
    return {**(view or {}), "marker": event}


def view_without_marker(view: View | None) -> View:
    return {k: v for k, v in (view or {}).items() if k != "marker"}


def view_without_window(view: View | None) -> View:
    """``view`` zoomed out: no window, the highlighted finding and the clicked row kept."""
    return {k: v for k, v in (view or {}).items() if k not in ("start", "end")}


def shown_timeline(analysis: Analysis, device: int, view: View | None) -> Timeline:
    """The rows ``view`` shows: the whole run is the report's own timeline (already cut, with the
    same point budget); a zoomed window is cut from the trace at full resolution (a one-row spike
    inside it still shows)."""
    view = view or {}
    device_report = analysis.device(device)
    if view.get("start") is None and view.get("end") is None and device_report.timeline is not None:
        return device_report.timeline
    return timeline_between(analysis, device, start=view.get("start") or 0, end=view.get("end"))


def view_after_relayout(analysis: Analysis, device: int, view: View | None, relayout: dict[str, Any] | None,
                        x_axis: str) -> View | None:
    """The view after plotly reports a zoom, a pan or a reset; None when nothing changed.

    A double-click (autorange) zooms out: the window goes, the highlighted finding stays.
    """
    view = dict(view or {})
    relayout = relayout or {}
    if "xaxis.range[0]" not in relayout and (relayout.get("xaxis.autorange") or relayout.get("autosize")):
        return {"highlight": view.get("highlight")} if relayout.get("xaxis.autorange") else view
    x0, x1 = relayout.get("xaxis.range[0]"), relayout.get("xaxis.range[1]")
    if x0 is None and isinstance(relayout.get("xaxis.range"), list):
        x0, x1 = relayout["xaxis.range"]
    if x0 is None or x1 is None:
        return None
    shown = shown_timeline(analysis, device, view)
    start, end = figures.event_range(shown, float(x0), float(x1), "time" if x_axis == "time" else "event")
    view.update({"start": start, "end": end})
    return view


def timeline_panel(analysis: Analysis, device: int, view: View | None, x_axis: str) -> go.Figure:
    """The timeline of ``device`` as ``view`` shows it."""
    view = view or {}
    zoomed = view.get("start") is not None or view.get("end") is not None
    return figures.timeline_figure(analysis.device(device), shown_timeline(analysis, device, view),
                                   x_axis="time" if x_axis == "time" else "event", zoomed=zoomed,
                                   highlight=view.get("highlight"), marker_event=view.get("marker"))


def findings_in_window(findings: Sequence[Finding], window: Window | None) -> list[bool | None]:
    """For each finding, whether it reaches into ``window`` (None for all when there is none)."""
    if window is None:
        return [None] * len(findings)
    return [window.overlaps(f.start_event, f.end_event) for f in findings]


def findings_panel(device: DeviceReport, window: Window | None = None) -> Any:
    """The finding cards, those inside ``window`` marked and the others dimmed, with a count."""
    if not device.findings:
        text = no_findings_text(device)
        return html.P(text[0].upper() + text[1:] + ".", className="muted")
    inside = findings_in_window(device.findings, window)
    cards = [finding_card(i, f, in_window) for i, (f, in_window) in enumerate(zip(device.findings, inside,
                                                                                    strict=True))]
    if window is None:
        return cards
    count = sum(1 for flag in inside if flag)
    head = html.P(f"{count} of {len(device.findings)} inside the window ({window.text})",
                  id="findings-window", className="findings-window")
    return [head, *cards]


def finding_card(index: int, finding: Finding, in_window: bool | None = None) -> html.Div:
    """One finding: what, how much, the fix, and (folded) its evidence and stacks. ``in_window``:
    True/False when a window is selected (the card is marked or dimmed), None otherwise."""
    color = figures.FINDING_COLORS.get(finding.kind, "#999")
    span = (f"step {finding.step}" if finding.step is not None
            else f"events {finding.start_event:,}–{finding.end_event:,}")
    evidence = html.Table(className="evidence", children=[
        html.Tr([html.Td(label(item)), html.Td(format_value(item))]) for item in first_items(finding.evidence)])
    stacks = [html.Details(className="stack", children=[
        html.Summary(f"{format_bytes(s.bytes)} in {s.count} allocation(s): "
                     f"{s.frames[0] if s.frames else '?'}"),
        html.Pre("\n".join(s.frames[:CARD_FRAMES]) or "(no stack recorded)")])
        for s in finding.top_stacks[:CARD_STACKS]]
    saving = (f" Estimated saving: {format_bytes(finding.estimated_saving_bytes)}."
              if finding.estimated_saving_bytes else "")
    where = {None: "", True: " in-window", False: " outside-window"}[in_window]
    head = [
        html.Span(figures.finding_title(finding.kind), className="finding-kind", style={"color": color}),
        html.Span(finding.severity, className=f"badge badge-{finding.severity}"),
    ]
    if in_window:
        head.append(html.Span("in window", className="badge badge-window"))
    head.append(html.Span(format_bytes(finding.bytes), className="finding-bytes"))
    return html.Div(
        id={"type": "finding", "index": index}, n_clicks=0, className=f"finding severity-{finding.severity}{where}",
        style={"borderLeftColor": color}, title="click to zoom the timeline to this finding",
        children=[
            html.Div(className="finding-head", children=head),
            html.Div(finding.summary, className="finding-summary"),
            html.Div(className="finding-fix", children=[html.B("Fix: "), finding.recommendation, saving]),
            html.Details(className="finding-details", children=[
                html.Summary(f"evidence and stacks ({span})"), evidence, *stacks]),
        ])
