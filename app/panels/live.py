"""What was live at one moment (the peak, the window's peak or a clicked row), grouped by a lens.

The moment: a clicked trace row when there is one, else the peak within the zoomed window
(``lenses.moments.resolve_moment(window)``, as ``memlens group --window`` finds it), else the peak.
Grouped ``by="category"`` it is the category-and-stack treemap of ``live_at``; any other lens is
``lenses.group_live`` at that same row. Every number is theirs; this module only picks the row
and the words.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go
from dash import html

from memlens import figures
from memlens.analysis import Analysis, LiveBreakdown, live_at
from memlens.analysis.lenses.groups import GroupBreakdown, group_live
from memlens.analysis.lenses.inputs import lens_inputs_of
from memlens.analysis.lenses.labels import GROUP_BYS
from memlens.analysis.lenses.moments import resolve_moment
from memlens.errors import MemlensError
from memlens.figures.groups import groups_figure
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
        event = resolve_moment(lens_inputs_of(analysis, device), window.moment).event
    try:
        live = live_at(analysis, device, event)
    except MemlensError:  # a row from another snapshot or device: show the peak instead
        live, clicked, window = live_at(analysis, device), False, None
    words = moment_words(live, window, clicked)
    heading = f"Live {words}: {format_bytes(live.total_bytes)}"
    tab_label = ("At the window's peak" if window is not None and not clicked
                 else live.label[0].upper() + live.label[1:])
    if group_by == DEFAULT_GROUP_BY or group_by not in DASHBOARD_GROUP_BYS:
        fig = figures.categories_figure(analysis.device(device), live.categories, live.top_stacks_by_category,
                                        title=f"{heading} by category and stack")
        return LivePanel(fig, tab_label, heading, not clicked, live)
    groups = group_live(lens_inputs_of(analysis, device), group_by, live.event)
    fig = groups_figure(groups, title=f"{heading} by {group_by.replace('_', ' ')}")
    return LivePanel(fig, tab_label, heading, not clicked, live, groups)


def segments_panel(analysis: Analysis, device: int) -> go.Figure:
    """The segment map at the dump (the state the file was taken in: no window applies to it)."""
    return figures.segment_map_figure(analysis.device(device).segment_map, device)
