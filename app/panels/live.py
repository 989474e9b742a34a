"""What was live at one moment (the peak, the window's peak or a clicked row), grouped by a lens.

The moment: a clicked trace row when there is one, else the peak within the zoomed window
(``memlens.ops.moments.peak_of``, as ``memlens group --window`` finds it), else the peak. What
was live then comes from ``memlens.ops.group.live``: by category and stack (the treemap), or
grouped by any other lens at that same row. Every number is theirs; this module only picks the
row and the words.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go
from dash import html

from memlens import figures
from memlens.analysis.analysis import Analysis
from memlens.analysis.lenses.groups import GroupBreakdown
from memlens.analysis.live import LiveBreakdown
from memlens.errors import MemlensError
from memlens.figures.groups import groups_figure
from memlens.ops.group import GROUP_BYS, live
from memlens.ops.moments import peak_of
from memlens.units import format_bytes
from memlens_app.panels.timeline import Window

# The dashboard's lenses: every grouping of `memlens group --by` but user rules (those need a file).
DASHBOARD_GROUP_BYS = tuple(g for g in GROUP_BYS if g != "rules")
DEFAULT_GROUP_BY = "category"
CLICK_HINT = " · click the timeline's curve to see another moment, zoom it to pick a window"


@dataclass(frozen=True)
class LivePanel:
    """What the "At the peak" tab shows: its figure, the tab's label, the heading, and whether
    "Back to the peak" has anything to go back from."""

    figure: go.Figure
    tab_label: str
    heading: str
    reset_disabled: bool
    live: LiveBreakdown
    groups: GroupBreakdown | None = None  # the lens' breakdown (None when grouped by category)

    def outputs(self) -> tuple[Any, ...]:
        return (self.figure, self.tab_label,
                [html.B(self.heading), html.Span(CLICK_HINT, className="muted")], self.reset_disabled)


def moment_words(live: LiveBreakdown, window: Window | None, clicked: bool) -> str:
    """``"at the peak"``, ``"at event 1,234 (t = 0.5 s)"`` or ``"at the peak of events 10–90:
    event 42 (t = …)"``."""
    if clicked or window is None:
        return live.label
    where = "the run's peak" if live.is_peak else live.label.removeprefix("at ")
    return f"at the peak of {window.text}: {where}"


def live_panel(analysis: Analysis, device: int, *, marker: int | None = None, window: Window | None = None,
               group_by: str = DEFAULT_GROUP_BY) -> LivePanel:
    """The live breakdown of ``device`` at ``marker`` (a clicked row), else at the peak within
    ``window``, else at the peak; grouped by ``group_by`` (one of ``DASHBOARD_GROUP_BYS``)."""
    event: int | None = None
    clicked = marker is not None
    if clicked:
        event = marker
    elif window is not None:
        event = peak_of(analysis, device, window.moment).moment.event
    by = group_by if group_by in DASHBOARD_GROUP_BYS else DEFAULT_GROUP_BY
    try:
        answer = live(analysis, device, event, by)
    except MemlensError:  # a row from another snapshot or device: show the peak instead
        answer, clicked, window = live(analysis, device, None, by), False, None
    breakdown = answer.live
    words = moment_words(breakdown, window, clicked)
    heading = f"Live {words}: {format_bytes(breakdown.total_bytes)}"
    tab_label = ("At the window's peak" if window is not None and not clicked
                 else breakdown.label[0].upper() + breakdown.label[1:])
    if answer.groups is None:
        fig = figures.categories_figure(analysis.device(device), breakdown.categories,
                                        breakdown.top_stacks_by_category, title=f"{heading} by category and stack")
        return LivePanel(fig, tab_label, heading, not clicked, breakdown)
    fig = groups_figure(answer.groups, title=f"{heading} by {by.replace('_', ' ')}")
    return LivePanel(fig, tab_label, heading, not clicked, breakdown, answer.groups)


def segments_panel(analysis: Analysis, device: int) -> go.Figure:
    """The segment map at the dump (the state the file was taken in: no window applies to it)."""
    return figures.segment_map_figure(analysis.device(device).segment_map, device)
