"""The wiring: each callback reads its Inputs, looks the analysis up by id, and hands plain values
to a panel function (``memlens_app.panels``), returning what it built.

No analysis and no page-building happens here: what a panel shows is decided in its module, where
it can be tested without Dash; this file only says which component feeds which panel, and which
input fired (Dash's callback context is read here and nowhere else).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import plotly.graph_objects as go
from dash import ALL, Dash, Input, Output, State, ctx, no_update
from dash.exceptions import PreventUpdate

from memlens.analysis import Analysis
from memlens.errors import MemlensError
from memlens.fleet import RankRow
from memlens.units import format_bytes
from memlens_app.layout import source_options
from memlens_app.library import DEFAULT_CONCURRENT_ANALYSES, Library
from memlens_app.panels.budget import BudgetForm, budget_panel, budget_prefill, capacity_of
from memlens_app.panels.common import alert, device_of, empty_figure
from memlens_app.panels.compare import compare_panel, device_choices
from memlens_app.panels.live import DEFAULT_GROUP_BY, live_panel, segments_panel
from memlens_app.panels.overview import no_overview, overview
from memlens_app.panels.ranks import (
    MIN_RANKS,
    default_rank_sources,
    failed_row,
    rank_path,
    rank_row,
    rank_sources,
    ranks_panel,
    source_of_click,
)
from memlens_app.panels.timeline import (
    findings_panel,
    timeline_panel,
    view_after_relayout,
    view_for_finding,
    view_with_marker,
    view_without_marker,
    view_without_window,
    window_of,
    window_text,
)
from memlens_app.panels.whatif import whatif_panel

log = logging.getLogger("memlens.app")

SNAPSHOT_PICKERS = ("source-picker", "device-picker")


def register_callbacks(app: Dash, library: Library) -> None:
    def analysis_of(source_id: str | None) -> Analysis:
        if not source_id:
            raise PreventUpdate
        try:
            return library.analysis(source_id)
        except MemlensError:
            # An upload gone from the server, or a file stopped by the analysis limits:
            # load_source shows why in the message area; the other panes stay as they are.
            raise PreventUpdate from None

    def new_snapshot() -> bool:
        """A new snapshot or device was picked: the view and moment belong to the previous one."""
        return ctx.triggered_id in SNAPSHOT_PICKERS

    # ------------------------------------------------------------- uploads and picking

    @app.callback(
        Output("source-picker", "options"),
        Output("source-picker", "value"),
        Output("compare-picker", "options"),
        Output("ranks-picker", "options"),
        Output("ranks-picker", "value"),
        Output("message", "children", allow_duplicate=True),
        Input("upload-event", "data"),
        prevent_initial_call=True,
    )
    def on_upload(event: dict[str, Any] | None) -> Any:
        if not event:
            raise PreventUpdate
        options = source_options(library)
        if event.get("error"):
            return options, no_update, options, options, no_update, alert(str(event["error"]))
        # An upload that completes a job's ranks (two or more loaded) shows that job side by side.
        job = default_rank_sources(rank_sources(library.sources()), prefer=event["id"])
        return (options, event["id"], options, options, job if event["id"] in job else no_update,
                alert(f"Loaded {event.get('name', 'the upload')}.", "ok"))

    @app.callback(
        Output("device-picker", "options"),
        Output("device-picker", "value"),
        Output("message", "children"),
        Output("card-peak", "children"),
        Output("card-reserved", "children"),
        Output("card-capacity", "children"),
        Output("card-events", "children"),
        Output("card-findings", "children"),
        Input("source-picker", "value"),
        Input("device-picker", "value"),
    )
    def load_source(source_id: str | None, device: int | None) -> Any:
        if not source_id:
            return no_overview(alert("Drop a snapshot above or pick one to begin.", "info")).outputs()
        try:
            report = library.analysis(source_id).report
        except MemlensError as exc:
            return no_overview(alert(str(exc))).outputs()
        return overview(report, device if ctx.triggered_id == "device-picker" else None).outputs()

    # ------------------------------------------------------------- the view: zoom (the window), click, finding

    @app.callback(
        Output("view", "data"),
        Input("source-picker", "value"),
        Input("device-picker", "value"),
        Input("timeline", "relayoutData"),
        Input({"type": "finding", "index": ALL}, "n_clicks"),
        Input("timeline", "clickData"),
        Input("live-reset", "n_clicks"),
        Input("x-axis", "value"),
        State("view", "data"),
    )
    def update_view(source_id: str | None, device: int | None, relayout: dict[str, Any] | None,
                    clicks: list[int | None], click: dict[str, Any] | None, _reset: int, x_axis: str,
                    view: dict[str, Any] | None) -> dict[str, Any]:
        trigger = ctx.triggered_id
        if trigger is None or new_snapshot():
            return {}
        if trigger == "live-reset":
            return view_without_marker(view)
        if trigger == "x-axis":
            return view_without_window(view)  # the other axis starts whole, and so do the panels
        analysis = analysis_of(source_id)
        device_id = device_of(analysis.report, device)
        if isinstance(trigger, dict) and trigger.get("type") == "finding":
            if not any(clicks):
                raise PreventUpdate  # the cards were redrawn, not clicked
            zoomed = view_for_finding(analysis.device(device_id), len(analysis.trace(device_id)),
                                      int(trigger["index"]))
        elif any(p.endswith("clickData") for p in ctx.triggered_prop_ids):
            zoomed = view_with_marker(view, click)
        else:
            zoomed = view_after_relayout(analysis, device_id, view, relayout, x_axis)
        if zoomed is None:
            raise PreventUpdate
        return zoomed

    @app.callback(
        Output("timeline", "figure"),
        Input("view", "data"),
        Input("x-axis", "value"),
        # Inputs, not State: a new snapshot must redraw even if the view store did not change.
        Input("source-picker", "value"),
        Input("device-picker", "value"),
    )
    def draw_timeline(view: dict[str, Any] | None, x_axis: str, source_id: str | None,
                      device: int | None) -> go.Figure:
        if not source_id:
            return empty_figure()
        try:
            analysis = library.analysis(source_id)
        except MemlensError:
            return empty_figure("This snapshot could not be loaded (see the message above).")
        if new_snapshot():
            view = {}
        elif ctx.triggered_id == "x-axis":
            view = view_without_window(view)  # update_view drops it from the store too
        return timeline_panel(analysis, device_of(analysis.report, device), view, x_axis)

    @app.callback(
        Output("findings", "children"),
        Output("window-label", "children"),
        Input("source-picker", "value"),
        Input("device-picker", "value"),
        Input("view", "data"),
    )
    def list_findings(source_id: str | None, device: int | None, view: dict[str, Any] | None) -> Any:
        analysis = analysis_of(source_id)
        device_id = device_of(analysis.report, device)
        window = None if new_snapshot() else window_of(view, len(analysis.trace(device_id)))
        return findings_panel(analysis.device(device_id), window), window_text(analysis, device_id, window)

    # ------------------------------------------------------------- live at the peak, the window's peak, a click

    @app.callback(
        Output("categories", "figure"),
        Output("tab-peak", "label"),
        Output("live-label", "children"),
        Output("live-reset", "disabled"),
        Input("source-picker", "value"),
        Input("device-picker", "value"),
        Input("view", "data"),
        Input("group-by", "value"),
    )
    def draw_live(source_id: str | None, device: int | None, view: dict[str, Any] | None,
                  group_by: str | None) -> Any:
        analysis = analysis_of(source_id)
        device_id = device_of(analysis.report, device)
        view = {} if new_snapshot() else (view or {})
        return live_panel(analysis, device_id, marker=view.get("marker"),
                          window=window_of(view, len(analysis.trace(device_id))),
                          group_by=group_by or DEFAULT_GROUP_BY).outputs()

    @app.callback(
        Output("segments", "figure"),
        Input("source-picker", "value"),
        Input("device-picker", "value"),
    )
    def draw_segments(source_id: str | None, device: int | None) -> Any:
        analysis = analysis_of(source_id)
        return segments_panel(analysis, device_of(analysis.report, device))

    # ------------------------------------------------------------- budget and what-if

    @app.callback(
        Output("b-params", "value"),
        Output("b-optimizer", "value"),
        Output("b-precision", "value"),
        Output("b-capacity", "value"),
        Output("b-params-note", "children"),
        Output("b-inferred", "data"),
        Input("source-picker", "value"),
        State("device-picker", "value"),
    )
    def prefill_budget(source_id: str | None, device: int | None) -> Any:
        report = analysis_of(source_id).report
        dr = report.devices[device_of(report, device)]
        prefill = budget_prefill(report.sidecar, dr.categories_at_peak.get("parameters", 0))
        capacity = capacity_of(dr, report.sidecar)
        return (prefill.params or "",
                prefill.form_optimizer or no_update,
                prefill.precision or no_update,
                format_bytes(capacity).replace(" ", "") if capacity else no_update,
                prefill.note,
                prefill.params if prefill.inferred else None)

    @app.callback(
        Output("budget-graph", "figure"),
        Output("budget-verdict", "children"),
        Input("source-picker", "value"),
        Input("device-picker", "value"),
        Input("b-params", "value"),
        Input("b-hidden", "value"),
        Input("b-layers", "value"),
        Input("b-heads", "value"),
        Input("b-vocab", "value"),
        Input("b-precision", "value"),
        Input("b-optimizer", "value"),
        Input("b-batch", "value"),
        Input("b-seq", "value"),
        Input("b-accum", "value"),
        Input("b-checkpointing", "value"),
        Input("b-lora", "value"),
        Input("b-flags", "value"),
        Input("b-capacity", "value"),
        State("b-inferred", "data"),
    )
    def draw_budget(source_id: str | None, device: int | None, params: str | None, hidden: int | None,
                    layers: int | None, heads: int | None, vocab: int | None, precision: str, optimizer: str,
                    batch: int | None, seq: int | None, accum: int | None, checkpointing: str,
                    lora: int | None, flags: list[str] | None, capacity_text: str | None,
                    inferred_params: str | None) -> Any:
        try:
            report = library.analysis(source_id).report if source_id else None
        except MemlensError:
            report = None
        if report is None:
            return empty_figure(""), None
        form = BudgetForm(params, hidden, layers, heads, vocab, precision, optimizer, batch, seq, accum,
                          checkpointing, lora, tuple(flags or ()), capacity_text, inferred_params)
        return budget_panel(report.devices[device_of(report, device)], form)

    @app.callback(
        Output("whatif-result", "children"),
        Input("w-run", "n_clicks"),
        State("w-extra", "value"),
        State("b-capacity", "value"),
        State("source-picker", "value"),
        State("device-picker", "value"),
        prevent_initial_call=True,
    )
    def run_whatif(_: int, extra_text: str | None, capacity_text: str | None, source_id: str | None,
                   device: int | None) -> Any:
        analysis = analysis_of(source_id)
        return whatif_panel(analysis, device_of(analysis.report, device), extra_text, capacity_text)

    # ------------------------------------------------------------- compare

    @app.callback(
        Output("compare-device", "options"),
        Output("compare-device", "value"),
        Input("compare-picker", "value"),
    )
    def compare_devices(source_id: str | None) -> Any:
        if not source_id:
            return [], None
        try:
            return device_choices(library.analysis(source_id).report)
        except MemlensError:
            return [], None

    @app.callback(
        Output("compare-graph", "figure"),
        Output("compare-table", "children"),
        Input("compare-device", "value"),
        Input("source-picker", "value"),
        Input("device-picker", "value"),
        Input("x-axis", "value"),
        State("compare-picker", "value"),
    )
    def draw_compare(device_b: int | None, source_a: str | None, device_a: int | None, x_axis: str,
                     source_b: str | None) -> Any:
        if not source_a or not source_b:
            return empty_figure("Pick a second snapshot (another run or another rank) to compare."), None
        try:
            a, b = library.analysis(source_a).report, library.analysis(source_b).report
        except MemlensError as exc:
            return empty_figure(""), alert(str(exc))
        return compare_panel(a, b, device_a, device_b, x_axis)

    # ------------------------------------------------------------- ranks of one job, side by side

    rows_by_source: dict[str, RankRow] = {}  # plain rows: kept after the analysis leaves the cache

    def rank_row_of(source_id: str) -> RankRow:
        if source_id in rows_by_source:
            return rows_by_source[source_id]
        try:
            source = library.source(source_id)
        except MemlensError as exc:
            return failed_row(source_id, str(exc))
        name = rank_path(source)
        try:
            row = rank_row(name, library.analysis(source_id).report)
        except MemlensError as exc:
            return failed_row(name, str(exc))  # not kept: the next look may succeed
        rows_by_source[source_id] = row
        return row

    @app.callback(
        Output("ranks-graph", "figure"),
        Output("ranks-table", "children"),
        Output("ranks-verdicts", "children"),
        Input("ranks-picker", "value"),
    )
    def draw_ranks(source_ids: list[str] | None) -> Any:
        chosen = [s for s in source_ids or [] if s]
        if len(chosen) < MIN_RANKS:
            return (empty_figure("Pick two or more snapshots of one job (its ranks) to see them side by side."),
                    None, None)
        with ThreadPoolExecutor(DEFAULT_CONCURRENT_ANALYSES) as pool:
            rows = list(pool.map(rank_row_of, chosen))
        return ranks_panel(rows, chosen).outputs()

    @app.callback(
        Output("source-picker", "value", allow_duplicate=True),
        Output("tabs", "value"),
        Input("ranks-graph", "clickData"),
        prevent_initial_call=True,
    )
    def open_rank(click: dict[str, Any] | None) -> Any:
        source_id = source_of_click(click)
        if source_id is None:
            raise PreventUpdate
        return source_id, "timeline"  # the clicked rank's own timeline and findings
