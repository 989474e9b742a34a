"""The wiring: each callback reads its Inputs, looks the analysis up by id, and hands plain values
to a panel function (``memlens_app.panels``), returning what it built.

No analysis and no page-building happens here: what a panel shows is decided in its module, where
it can be tested without Dash; this file only says which component feeds which panel, and which
input fired (Dash's callback context is read here and nowhere else).

Two things every callback does first: it checks its inputs' types and ranges
(``memlens_app.inputs``: a forged request gets one line in the message area, never a
traceback), and it looks snapshots up in the asking browser session's space
(``memlens_app.session``), so another visitor's uploads cannot be opened by id.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import plotly.graph_objects as go
from dash import ALL, Dash, Input, Output, State, ctx, no_update, set_props
from dash.exceptions import PreventUpdate

from memlens.analysis.analysis import Analysis
from memlens.errors import MemlensError
from memlens.ops.fleet import RankRow, failed_row, rank_row
from memlens.units import format_bytes
from memlens_app import inputs
from memlens_app.layout import CHECKPOINTING, OPTIMIZERS, PRECISIONS, source_options
from memlens_app.library import DEFAULT_CONCURRENT_ANALYSES, Library
from memlens_app.panels.budget import SIDECAR_FIELDS, BudgetForm, budget_panel, budget_prefill, capacity_of
from memlens_app.panels.common import alert, device_of, empty_figure
from memlens_app.panels.compare import compare_panel, device_choices
from memlens_app.panels.live import DASHBOARD_GROUP_BYS, DEFAULT_GROUP_BY, live_panel, segments_panel
from memlens_app.panels.overview import no_overview, overview
from memlens_app.panels.progress import progress_view
from memlens_app.panels.ranks import (
    MIN_RANKS,
    default_rank_sources,
    rank_path,
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
from memlens_app.panels.whatif import whatif_panel, whatif_request
from memlens_app.session import client_gone_check, current_session
from memlens_app.worker import AnalysisCrashed, JobAbandoned

log = logging.getLogger("memlens.app")

SNAPSHOT_PICKERS = ("source-picker", "device-picker")
X_AXES = ("event", "time")
FLAGS = ("flash",)


def answer_error(error: Exception) -> None:
    """The app's ``on_error``: a callback that raised answers with one line in the message area
    (and leaves its outputs as they were) instead of an HTTP 500 with a traceback."""
    if isinstance(error, inputs.BadInput):
        message = f"Refused a request from the page: {error}"
    elif isinstance(error, MemlensError):
        message = str(error)
    else:
        log.error("a dashboard callback failed", exc_info=error)
        message = "memlens failed to draw this (an internal error; see the server log)"
    set_props("message", {"children": alert(message)})


def register_callbacks(app: Dash, library: Library) -> None:
    def analysis_of(source_id: str | None) -> Analysis:
        if not source_id:
            raise PreventUpdate
        try:
            return library.analysis(source_id, current_session())
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
    def on_upload(event_data: Any) -> Any:
        event = inputs.upload_event(event_data)
        if not event:
            raise PreventUpdate
        session = current_session()
        options = source_options(library, session)
        if event.get("error"):
            return options, no_update, options, options, no_update, alert(event["error"])
        if not event.get("id"):  # a sidecar kept until its snapshot comes
            return options, no_update, options, options, no_update, alert(event.get("note", ""), "info")
        library.source(event["id"], session)  # only this session's own uploads (and public files)
        # An upload that completes a job's ranks (two or more loaded) shows that job side by side.
        job = default_rank_sources(rank_sources(library.sources(session)), prefer=event["id"])
        return (options, event["id"], options, options, job if event["id"] in job else no_update,
                alert(f"Loaded {event.get('name', 'the upload')}" + (f" ({event['note']})." if event.get("note")
                                                                      else "."), "ok"))

    @app.callback(
        Output("analysis-progress", "children"),
        Output("progress-poll", "disabled"),
        Input("progress-poll", "n_intervals"),
        Input("source-picker", "value"),
    )
    def show_progress(ticks_value: Any, source_value: Any) -> Any:
        """The picked snapshot's analysis, stage by stage (``memlens_app.progress``); the poll
        stops once it is done or failed, and starts again with the next snapshot picked."""
        inputs.clicks(ticks_value, "progress poll")  # a count of the poll's ticks
        source_id = inputs.source_id(source_value)
        if not source_id:
            return None, True
        try:
            source = library.source(source_id, current_session())
            state = library.progress(source_id, current_session())
        except MemlensError:
            return None, True
        return progress_view(source.label, state), state is not None and state.finished

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
    def load_source(source_value: Any, device_value: Any) -> Any:
        source_id, device = inputs.source_id(source_value), inputs.device(device_value)
        if not source_id:
            return no_overview(alert("Drop a snapshot above or pick one to begin.", "info")).outputs()
        try:
            report = library.analysis(source_id, current_session()).report
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
    def update_view(source_value: Any, device_value: Any, relayout_value: Any, clicks_value: Any,
                    click_value: Any, reset_value: Any, x_axis_value: Any, view_value: Any) -> dict[str, Any]:
        source_id, device = inputs.source_id(source_value), inputs.device(device_value)
        relayout, clicks = inputs.relayout(relayout_value), inputs.click_list(clicks_value)
        click, x_axis = inputs.click_data(click_value), inputs.choice(x_axis_value, X_AXES, "event", "x axis")
        view = inputs.view(view_value)
        inputs.clicks(reset_value, "back to the peak")
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
            shown = analysis.device(device_id)  # its trace rows are the report's events
            zoomed = view_for_finding(shown, shown.events, inputs.index(trigger.get("index"), "finding"))
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
    def draw_timeline(view_value: Any, x_axis_value: Any, source_value: Any, device_value: Any) -> go.Figure:
        view, x_axis = inputs.view(view_value), inputs.choice(x_axis_value, X_AXES, "event", "x axis")
        source_id, device = inputs.source_id(source_value), inputs.device(device_value)
        if not source_id:
            return empty_figure()
        try:
            analysis = library.analysis(source_id, current_session())
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
    def list_findings(source_value: Any, device_value: Any, view_value: Any) -> Any:
        source_id, device, view = inputs.source_id(source_value), inputs.device(device_value), inputs.view(view_value)
        analysis = analysis_of(source_id)
        device_id = device_of(analysis.report, device)
        window = None if new_snapshot() else window_of(view, analysis.device(device_id).events)
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
    def draw_live(source_value: Any, device_value: Any, view_value: Any, group_by_value: Any) -> Any:
        source_id, device, view = inputs.source_id(source_value), inputs.device(device_value), inputs.view(view_value)
        group_by = inputs.choice(group_by_value, DASHBOARD_GROUP_BYS, DEFAULT_GROUP_BY, "group by")
        analysis = analysis_of(source_id)
        device_id = device_of(analysis.report, device)
        view = {} if new_snapshot() else (view or {})
        return live_panel(analysis, device_id, marker=view.get("marker"),
                          window=window_of(view, analysis.device(device_id).events),
                          group_by=group_by).outputs()

    @app.callback(
        Output("segments", "figure"),
        Input("source-picker", "value"),
        Input("device-picker", "value"),
    )
    def draw_segments(source_value: Any, device_value: Any) -> Any:
        analysis = analysis_of(inputs.source_id(source_value))
        return segments_panel(analysis, device_of(analysis.report, inputs.device(device_value)))

    # ------------------------------------------------------------- budget and what-if

    @app.callback(
        Output("b-params", "value"),
        Output("b-hidden", "value"),
        Output("b-layers", "value"),
        Output("b-heads", "value"),
        Output("b-vocab", "value"),
        Output("b-precision", "value"),
        Output("b-optimizer", "value"),
        Output("b-batch", "value"),
        Output("b-seq", "value"),
        Output("b-capacity", "value"),
        Output("b-params-note", "children"),
        Output("b-prefill", "data"),
        Input("source-picker", "value"),
        State("device-picker", "value"),
    )
    def prefill_budget(source_value: Any, device_value: Any) -> Any:
        report = analysis_of(inputs.source_id(source_value)).report
        dr = report.devices[device_of(report, inputs.device(device_value))]
        prefill = budget_prefill(report.sidecar, dr.categories_at_peak.get("parameters", 0))
        capacity = capacity_of(dr, report.sidecar)
        # Every sidecar field is set, to None where this file's sidecar has none: the previous
        # file's shapes must not stay in the form.
        values = [prefill.value(field) for field in SIDECAR_FIELDS]
        precision, optimizer = prefill.value("precision"), prefill.value("optimizer")
        values[SIDECAR_FIELDS.index("precision")] = precision if precision in PRECISIONS else None
        values[SIDECAR_FIELDS.index("optimizer")] = optimizer if optimizer in OPTIMIZERS else None
        return (*values,
                format_bytes(capacity).replace(" ", "") if capacity else no_update,
                prefill.note,
                prefill.store())

    @app.callback(
        Output("budget-graph", "figure"),
        Output("budget-verdict", "children"),
        Output("budget-summary", "children"),
        # The prefill, not the picker: a new file's budget is drawn once its form is filled.
        Input("b-prefill", "data"),
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
        State("source-picker", "value"),
    )
    def draw_budget(prefill_value: Any, device_value: Any, *fields: Any) -> Any:
        *form_fields, source_value = fields
        source_id, device = inputs.source_id(source_value), inputs.device(device_value)
        form = budget_form_of(form_fields, inputs.prefill(prefill_value))
        try:
            report = library.analysis(source_id, current_session()).report if source_id else None
        except MemlensError:
            report = None
        if report is None:
            return empty_figure(""), None, None
        return budget_panel(report, device_of(report, device), form).outputs()

    @app.callback(
        Output("whatif-result", "children"),
        Input("w-run", "n_clicks"),
        State("w-extra", "value"),
        State("b-capacity", "value"),
        State("source-picker", "value"),
        State("device-picker", "value"),
        prevent_initial_call=True,
    )
    def run_whatif(clicks_value: Any, extra_value: Any, capacity_value: Any, source_value: Any,
                   device_value: Any) -> Any:
        inputs.clicks(clicks_value, "simulate")
        extra_text, capacity_text = inputs.text(extra_value, "extra memory"), inputs.text(capacity_value, "capacity")
        source_id, device = inputs.source_id(source_value), inputs.device(device_value)
        session = current_session()
        analysis = analysis_of(source_id)
        device_id = device_of(analysis.report, device)
        try:
            asked = whatif_request(analysis.device(device_id), extra_text, capacity_text)
            answer = library.whatif(source_id or "", session, device_id, asked.capacity, asked.extra,
                                    abandoned=client_gone_check())
        except JobAbandoned as exc:
            log.warning("%s", exc)  # nobody is left to read the answer: the server log says why
            return alert(str(exc))
        except MemlensError as exc:
            return alert(str(exc))
        except AnalysisCrashed as exc:
            log.error("the what-if simulation failed:\n%s", exc)
            return alert("memlens failed to simulate this run (an internal error; see the server log)")
        return whatif_panel(answer, asked)

    # ------------------------------------------------------------- compare

    @app.callback(
        Output("compare-device", "options"),
        Output("compare-device", "value"),
        Input("compare-picker", "value"),
    )
    def compare_devices(source_value: Any) -> Any:
        source_id = inputs.source_id(source_value, "compare with")
        if not source_id:
            return [], None
        try:
            return device_choices(library.analysis(source_id, current_session()).report)
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
    def draw_compare(device_b_value: Any, source_a_value: Any, device_a_value: Any, x_axis_value: Any,
                     source_b_value: Any) -> Any:
        device_b, device_a = inputs.device(device_b_value, "its device"), inputs.device(device_a_value)
        source_a, source_b = inputs.source_id(source_a_value), inputs.source_id(source_b_value, "compare with")
        x_axis = inputs.choice(x_axis_value, X_AXES, "event", "x axis")
        if not source_a or not source_b:
            return empty_figure("Pick a second snapshot (another run or another rank) to compare."), None
        session = current_session()
        try:
            a, b = library.analysis(source_a, session).report, library.analysis(source_b, session).report
        except MemlensError as exc:
            return empty_figure(""), alert(str(exc))
        return compare_panel(a, b, device_a, device_b, x_axis)

    # ------------------------------------------------------------- ranks of one job, side by side

    rows_by_source: dict[str, RankRow] = {}  # plain rows: kept after the analysis leaves the cache

    def rank_row_of(source_id: str, session: str) -> RankRow:
        try:
            source = library.source(source_id, session)  # before the cache: rows are scoped too
        except MemlensError as exc:
            return failed_row(source_id, str(exc))
        if source_id in rows_by_source:
            return rows_by_source[source_id]
        name = rank_path(source)
        try:
            row = rank_row(name, library.analysis(source_id, session).report)
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
    def draw_ranks(source_values: Any) -> Any:
        chosen = inputs.source_ids(source_values, "ranks of one job")
        if len(chosen) < MIN_RANKS:
            return (empty_figure("Pick two or more snapshots of one job (its ranks) to see them side by side."),
                    None, None)
        session = current_session()  # the pool's threads are outside the request
        with ThreadPoolExecutor(DEFAULT_CONCURRENT_ANALYSES) as pool:
            rows = list(pool.map(lambda source_id: rank_row_of(source_id, session), chosen))
        return ranks_panel(rows, chosen).outputs()

    @app.callback(
        Output("source-picker", "value", allow_duplicate=True),
        Output("tabs", "value"),
        Input("ranks-graph", "clickData"),
        prevent_initial_call=True,
    )
    def open_rank(click_value: Any) -> Any:
        source_id = source_of_click(inputs.click_data(click_value, "ranks click"))
        if source_id is None:
            raise PreventUpdate
        return source_id, "timeline"  # the clicked rank's own timeline and findings


def budget_form_of(fields: list[Any], prefill: dict[str, Any] | None) -> BudgetForm:
    """The budget form's fields (in the callback's order), each checked (what the counts and sizes
    mean is the panel's), with what the form was filled with."""
    (params, hidden, layers, heads, vocab, precision, optimizer, batch, seq, accum, checkpointing, lora, flags,
     capacity) = fields
    return BudgetForm(
        inputs.text(params, "parameters"), inputs.number(hidden, "hidden size"), inputs.number(layers, "layers"),
        inputs.number(heads, "attention heads"), inputs.number(vocab, "vocabulary"),
        inputs.optional_choice(precision, PRECISIONS, "precision"),
        inputs.optional_choice(optimizer, OPTIMIZERS, "optimizer"), inputs.number(batch, "micro-batch"),
        inputs.number(seq, "sequence length"), inputs.number(accum, "gradient accumulation"),
        inputs.choice(checkpointing, CHECKPOINTING, "none", "activation checkpointing"),
        inputs.number(lora, "LoRA rank"), tuple(inputs.choices(flags, FLAGS, "flags")),
        inputs.text(capacity, "capacity"), prefill)
