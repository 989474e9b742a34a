"""``memlens serve --follow DIR``: the page follows a run folder as it is written.

The server's side is ``FolderFollow``: each name written into the folder (one per rank and run:
``memlens.ops.follow``'s series) is one source of the picker (kind ``follow``), pointed at that
name's newest complete snapshot (``Library.point``). ``refresh`` looks at the folder (a listing
and a stat a snapshot) and answers its generation, a token that moves when a snapshot appears.

The page's side: a ``dcc.Interval`` (``follow-poll``) asks every ``FOLLOW_POLL_MS``; when the
generation has moved, the picked followed source's new file is analysed through the library (the
analysis workers and the fair queue, as any file) and the page's ``follow-tick`` store changes.
``redraw`` (the one callback with that store as its Input) then draws every panel of the picked
snapshot anew, with the panels' own functions, in the view the page has (the zoom, the window,
the clicked row: the view store is read, never reset) and the tab it is on; the timeline keeps
plotly's own zoom too (its ``uirevision``). The page's other callbacks are not touched: they
redraw as before when the picker, the view or a form changes. The store also holds what this page has seen
(steps, findings), so the banner says what is new since *its* last look, a new finding (a leak:
how fast it grows, when the device is full) is announced there, and the timeline shades the steps
that arrived (``mark_new_steps``).
"""

from __future__ import annotations

import hashlib
import math
import threading
from pathlib import Path
from typing import Any

import numpy as np
from dash import Dash, Input, Output, State, dcc, html, no_update
from dash.exceptions import PreventUpdate

from memlens.ops.follow import FolderState, SnapshotFile, scan_folder, seen_in, steps_text, what_is_new
from memlens_app import inputs
from memlens_app.callbacks import X_AXES, budget_form_of
from memlens_app.layout import source_options
from memlens_app.library import Library
from memlens_app.panels.budget import budget_panel
from memlens_app.panels.common import device_of
from memlens_app.panels.live import DASHBOARD_GROUP_BYS, DEFAULT_GROUP_BY, live_panel, segments_panel
from memlens_app.panels.overview import overview
from memlens_app.panels.timeline import findings_panel, timeline_panel, window_of, window_text
from memlens_app.session import current_session

# How often the page asks whether the folder has moved: the look costs a listing and a stat a
# snapshot, and the issue asks for a new snapshot within a few seconds.
FOLLOW_POLL_MS = 2000
# The newest announcements the banner keeps showing (each said once when its finding first held).
MAX_ANNOUNCEMENTS = 5
NEW_STEPS_FILL = "rgba(255, 170, 0, 0.18)"
FOLLOW_KIND = "follow"
CARDS = ("card-peak", "card-reserved", "card-capacity", "card-events", "card-findings")
# The budget form's fields, in the order ``budget_form_of`` reads them (the page's draw_budget's).
BUDGET_FIELDS = (
    "b-params",
    "b-hidden",
    "b-layers",
    "b-heads",
    "b-vocab",
    "b-precision",
    "b-optimizer",
    "b-batch",
    "b-seq",
    "b-accum",
    "b-checkpointing",
    "b-lora",
    "b-flags",
    "b-capacity",
)


class FolderFollow:
    """The followed folder, its names' sources in ``library``, and the last look at it."""

    def __init__(self, folder: str | Path, library: Library) -> None:
        self.folder = Path(folder).resolve()
        self.library = library
        self._lock = threading.Lock()
        scan_folder(self.folder)  # a folder that is not there is refused now, not on the page

    def source_id(self, series: str) -> str:
        return "f-" + hashlib.sha1(f"{self.folder}\0{series}".encode(), usedforsecurity=False).hexdigest()[:12]

    def refresh(self) -> tuple[FolderState, list[tuple[str, str]]]:
        """Look at the folder; point each name's source at its newest snapshot. Returns the look
        and the followed ``(series, source id)``, the name written to last, last."""
        with self._lock:
            state = scan_folder(self.folder)
            newest: dict[str, SnapshotFile] = {}
            for snapshot in state.snapshots:  # oldest first: the newest of each name stays
                newest.pop(snapshot.series, None)
                newest[snapshot.series] = snapshot
            for series, snapshot in newest.items():
                self.library.point(
                    self.source_id(series),
                    series,
                    snapshot.path,
                    (snapshot.size, snapshot.mtime_ns),
                    kind=FOLLOW_KIND,
                    folder=self.folder.name,
                )
            return state, [(series, self.source_id(series)) for series in newest]


def follow_components(follow: FolderFollow | None) -> list[Any]:
    """What the page needs to follow (nothing when the server follows no folder). Called as a page
    is built, before its picker is: the folder is looked at first, so a new page lists what is
    there already."""
    if follow is None:
        return []
    follow.refresh()
    return [
        dcc.Store(id="follow-tick", data={}),
        html.Div(id="follow-banner", className="follow-banner"),
        dcc.Interval(id="follow-poll", interval=FOLLOW_POLL_MS),
    ]


def _tick(value: Any) -> dict[str, Any]:
    """The page's follow store, checked: what the page sent back is a dict of plain values."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise inputs.BadInput("follow state: expected an object")
    return value


def _whole_list(value: Any, field: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise inputs.BadInput(f"follow state: {field} must be a list of whole numbers")
    return list(value)


def _texts(value: Any, field: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise inputs.BadInput(f"follow state: {field} must be a list of text")
    return list(value)


def _findings(value: Any) -> set[tuple[str, int]]:
    if not isinstance(value, list):
        raise inputs.BadInput("follow state: findings must be a list")
    out = set()
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], int)):
            raise inputs.BadInput("follow state: each finding is [kind, device]")
        out.add((item[0], item[1]))
    return out


def register_follow_callbacks(app: Dash, library: Library, follow: FolderFollow | None) -> None:
    if follow is None:
        return

    @app.callback(
        Output("follow-tick", "data"),
        Output("follow-banner", "children"),
        Output("source-picker", "options", allow_duplicate=True),
        Output("source-picker", "value", allow_duplicate=True),
        Output("compare-picker", "options", allow_duplicate=True),
        Output("ranks-picker", "options", allow_duplicate=True),
        Input("follow-poll", "n_intervals"),
        State("follow-tick", "data"),
        State("source-picker", "value"),
        State("device-picker", "value"),
        prevent_initial_call=True,
    )
    def on_follow_poll(_ticks: Any, tick_value: Any, picked_value: Any, device_value: Any) -> Any:
        tick = _tick(tick_value)
        picked, device = inputs.source_id(picked_value), inputs.device(device_value)
        session = current_session()
        state, followed = follow.refresh()
        if tick.get("generation") == state.generation and tick.get("source") == picked:
            raise PreventUpdate
        followed_ids = {source_id for _, source_id in followed}
        value: Any = no_update
        if picked is None and followed:
            picked = value = followed[-1][1]
        known = set(_texts(tick.get("series"), "series"))
        new_series = [series for series, _ in followed if series not in known] if known else []
        out: dict[str, Any] = {
            "generation": state.generation,
            "source": picked,
            "series": [series for series, _ in followed],
            "announced": _texts(tick.get("announced"), "announced")[-MAX_ANNOUNCEMENTS:],
        }
        lines = [
            f"Following {follow.folder}: writing here: {', '.join(s for s, _ in followed) or 'nothing yet'}"
            + (f" (new: {', '.join(new_series)})" if new_series else "")
        ]
        if picked in followed_ids:
            report = library.analysis(picked, session).report
            same_source = tick.get("source") == picked
            seen_steps = set(_whole_list(tick.get("steps", []), "steps")) if same_source else set()
            seen_findings = _findings(tick.get("findings", [])) if same_source else set()
            new = what_is_new(report, seen_steps, seen_findings)
            steps, findings = seen_in(report)
            out["steps"] = sorted(steps)
            out["findings"] = sorted([kind, dev] for kind, dev in findings)
            out["new_steps"] = new.steps if same_source else []
            out["band"] = _band(report, device_of(report, device), out["new_steps"])
            source = library.source(picked, session)
            lines.append(
                f"Showing {Path(source.path).name}"
                + (
                    f"; new since the last look: steps {steps_text(out['new_steps'])} (shaded on the timeline)"
                    if out["new_steps"]
                    else ""
                )
            )
            out["announced"] = (out["announced"] + [a.text for a in new.announcements])[-MAX_ANNOUNCEMENTS:]
        banner = [html.Div([html.Div(line) for line in lines], className="alert alert-info follow-lines")]
        banner += [
            html.Div(f"New finding: {text}", className="alert alert-error follow-announcement")
            for text in out["announced"]
        ]
        options = source_options(library, session)
        return out, banner, options, value, options, options

    @app.callback(
        Output("timeline", "figure", allow_duplicate=True),
        Output("findings", "children", allow_duplicate=True),
        Output("window-label", "children", allow_duplicate=True),
        Output("device-picker", "options", allow_duplicate=True),  # each device's events anew; its value kept
        *(Output(card, "children", allow_duplicate=True) for card in CARDS),
        Output("categories", "figure", allow_duplicate=True),
        Output("tab-peak", "label", allow_duplicate=True),
        Output("live-label", "children", allow_duplicate=True),
        Output("live-reset", "disabled", allow_duplicate=True),
        Output("segments", "figure", allow_duplicate=True),
        Output("budget-graph", "figure", allow_duplicate=True),
        Output("budget-verdict", "children", allow_duplicate=True),
        Output("budget-summary", "children", allow_duplicate=True),
        Input("follow-tick", "data"),
        State("source-picker", "value"),
        State("device-picker", "value"),
        State("view", "data"),
        State("x-axis", "value"),
        State("group-by", "value"),
        State("b-prefill", "data"),
        *(State(field, "value") for field in BUDGET_FIELDS),
        prevent_initial_call=True,
    )
    def redraw(
        tick_value: Any,
        source_value: Any,
        device_value: Any,
        view_value: Any,
        x_axis_value: Any,
        group_by_value: Any,
        prefill_value: Any,
        *form_fields: Any,
    ) -> Any:
        """The picked snapshot's newer file, every panel drawn in the page's own view."""
        tick = _tick(tick_value)
        source_id, device = inputs.source_id(source_value), inputs.device(device_value)
        view, x_axis = inputs.view(view_value), inputs.choice(x_axis_value, X_AXES, "event", "x axis")
        group_by = inputs.choice(group_by_value, DASHBOARD_GROUP_BYS, DEFAULT_GROUP_BY, "group by")
        form = budget_form_of(list(form_fields), inputs.prefill(prefill_value))
        if not source_id or tick.get("source") != source_id:
            raise PreventUpdate  # not following what the page shows
        analysis = library.analysis(source_id, current_session())
        report = analysis.report
        device_id = device_of(report, device)
        window = window_of(view, analysis.device(device_id).events)
        shown = overview(report, device)
        live = live_panel(analysis, device_id, marker=view.get("marker"), window=window, group_by=group_by)
        return (
            mark_new_steps(timeline_panel(analysis, device_id, view, x_axis), tick, source_id),
            findings_panel(analysis.device(device_id), window),
            window_text(analysis, device_id, window),
            shown.device_options,
            *shown.cards,
            *live.outputs(),
            segments_panel(analysis, device_id),
            *budget_panel(report, device_id, form).outputs(),
        )


def _band(report: Any, device: int, new_steps: list[int]) -> list[int] | None:
    """The trace rows ``[start, end)`` of ``new_steps`` on ``device``."""
    chosen = [s for s in report.devices[device].steps if s.index in set(new_steps)]
    if not chosen:
        return None
    return [min(s.start_event for s in chosen), max(s.end_event for s in chosen)]


def mark_new_steps(figure: Any, tick_value: Any, source_id: str | None) -> Any:
    """The timeline with the steps that arrived since the page's last look shaded (on either x axis:
    the rows are placed by the curve's own points), and their indices in ``layout.meta``."""
    tick = _tick(tick_value)
    band = tick.get("band")
    if not band or tick.get("source") != source_id or not figure.data:
        return figure
    rows = _whole_list(band, "band")
    if len(rows) != 2:
        raise inputs.BadInput("follow state: band is [start, end]")
    curve = next((trace for trace in figure.data if trace.name == "allocated"), None)
    if curve is None or not curve.customdata:
        return figure
    events = np.asarray(curve.customdata, dtype=np.float64)
    xs = np.asarray(curve.x, dtype=np.float64)
    # Placed by the curve's points, so clipped to what is drawn: a zoomed window that ends before
    # the new steps shades nothing (zoomed out, they are shaded), and the meta names them anyway.
    x0, x1 = (float(np.interp(row, events, xs)) for row in rows)
    if math.isfinite(x0) and math.isfinite(x1) and x1 > x0:
        figure.add_vrect(
            x0=x0,
            x1=x1,
            fillcolor=NEW_STEPS_FILL,
            line_width=0,
            layer="below",
            annotation_text="new since the last look",
            annotation_position="top left",
        )
    meta = dict(figure.layout.meta or {})
    meta["new_steps"] = _whole_list(tick.get("new_steps", []), "new_steps")
    figure.layout.meta = meta
    return figure
