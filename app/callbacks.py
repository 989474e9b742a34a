"""Thin callbacks: look up the analysis by id, hand it to a figure builder or a library call.

No analysis happens here. Numbers come from ``memlens.analysis.analyze_snapshot`` (through
``Library``: the report with its snapshot, for zoomed timelines, other moments and what-ifs),
``memlens.budget`` and ``memlens.allocator.whatif``; figures from ``memlens.figures``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go
from dash import ALL, Dash, Input, Output, State, ctx, html, no_update
from dash.exceptions import PreventUpdate

from memlens import figures, units
from memlens.analysis import Analysis, live_at
from memlens.analysis.report import Report, format_evidence
from memlens.analysis.views import timeline_of
from memlens.errors import MemlensError
from memlens.figures.compare import source_name
from memlens.units import format_bytes, parse_bytes
from memlens_app.layout import source_options
from memlens_app.library import Library

FP32_BYTES = 4  # a parameter count guessed from bytes assumes fp32 weights, and says so

log = logging.getLogger("memlens.app")

SEVERITY_ORDER = {"high": 0, "medium": 1, "low": 2}
# Padding around a finding when the timeline zooms to it, as a share of its width.
ZOOM_MARGIN = 0.15
_OPTIMIZER_CLASSES = {"adamw": "adamw", "adam": "adam", "sgd": "sgd", "adafactor": "adafactor",
                      "adamw8bit": "adam-8bit", "adam8bit": "adam-8bit", "muon": "muon"}


def alert(text: str, kind: str = "error") -> html.Div:
    return html.Div(text, className=f"alert alert-{kind}", role="alert")


def empty_figure(text: str = "Open a snapshot to begin.") -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=text, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                       font={"size": 14, "color": "#777"})
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.update_layout(template="plotly_white", height=300, margin={"l": 10, "r": 10, "t": 10, "b": 10})
    return fig


def parse_count(text: str | None) -> int | None:
    """``"7B"`` -> 7_000_000_000, ``"124M"``, ``"1.3e9"``; blank -> None."""
    if text is None or not str(text).strip():
        return None
    return units.parse_count(str(text))


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

    def report_of(source_id: str | None) -> Report:
        return analysis_of(source_id).report

    def device_of(report: Report, device: int | None) -> int:
        return device if device is not None and device in report.devices else figures.primary_device(report)

    # ------------------------------------------------------------- uploads and picking

    @app.callback(
        Output("source-picker", "options"),
        Output("source-picker", "value"),
        Output("compare-picker", "options"),
        Output("message", "children", allow_duplicate=True),
        Input("upload-event", "data"),
        prevent_initial_call=True,
    )
    def on_upload(event: dict[str, Any] | None) -> Any:
        if not event:
            raise PreventUpdate
        options = source_options(library)
        if event.get("error"):
            return options, no_update, options, alert(str(event["error"]))
        return options, event["id"], options, alert(f"Loaded {event.get('name', 'the upload')}.", "ok")

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
            return [], None, alert("Drop a snapshot above or pick one to begin.", "info"), *(["–"] * 5)
        try:
            report = library.analysis(source_id).report
        except MemlensError as exc:
            return [], None, alert(str(exc)), *(["–"] * 5)
        device_id = device_of(report, device if ctx.triggered_id == "device-picker" else None)
        dr = report.devices[device_id]
        options = [{"label": f"cuda:{d} ({report.devices[d].events:,} events)", "value": d}
                   for d in sorted(report.devices)]
        notes = list(dr.notes)
        message = html.Div([alert(n, "info") for n in notes[:4]]) if notes else None
        peak_at = ("before the window" if dr.peak_allocated_event is None
                   else f"event {dr.peak_allocated_event:,}")
        step_text = f"{len(dr.steps):,} steps ({dr.step_source})" if dr.steps else "no steps found"
        high = sum(1 for f in dr.findings if f.severity == "high")
        return (
            options, device_id, message,
            [format_bytes(dr.peak_allocated_bytes), html.Div(peak_at, className="card-sub")],
            [format_bytes(dr.peak_reserved_bytes),
             html.Div(f"{format_bytes(dr.peak_reserved_bytes - dr.peak_allocated_bytes)} above the "
                      "allocated peak", className="card-sub")],
            [format_bytes(dr.capacity_bytes) if dr.capacity_bytes else "unknown",
             html.Div(f"snapshot format {report.format_guess}", className="card-sub")],
            [f"{dr.events:,}", html.Div(step_text, className="card-sub")],
            [f"{len(dr.findings)}", html.Div(f"{high} high severity" if dr.findings else "nothing flagged",
                                             className="card-sub")],
        )

    # ------------------------------------------------------------- timeline and findings

    @app.callback(
        Output("view", "data"),
        Input("source-picker", "value"),
        Input("device-picker", "value"),
        Input("timeline", "relayoutData"),
        Input({"type": "finding", "index": ALL}, "n_clicks"),
        Input("timeline", "clickData"),
        Input("live-reset", "n_clicks"),
        State("view", "data"),
        State("x-axis", "value"),
    )
    def update_view(source_id: str | None, device: int | None, relayout: dict[str, Any] | None,
                    clicks: list[int | None], click: dict[str, Any] | None, _reset: int,
                    view: dict[str, Any] | None, x_axis: str) -> dict[str, Any]:
        trigger = ctx.triggered_id
        view = dict(view or {})
        if trigger in ("source-picker", "device-picker") or trigger is None:
            return {}
        if trigger == "live-reset":
            view.pop("marker", None)
            return view
        analysis = analysis_of(source_id)
        report = analysis.report
        device_id = device_of(report, device)
        trace = analysis.snapshot.device(device_id)
        if isinstance(trigger, dict) and trigger.get("type") == "finding":
            index = int(trigger["index"])
            if not any(clicks) or index >= len(report.devices[device_id].findings):
                raise PreventUpdate
            finding = report.devices[device_id].findings[index]
            margin = max(1, int((finding.end_event - finding.start_event) * ZOOM_MARGIN))
            return {"start": max(0, finding.start_event - margin),
                    "end": min(len(trace), finding.end_event + margin), "highlight": index}
        if trigger == "timeline" and ctx.triggered_prop_ids and any(
                p.endswith("clickData") for p in ctx.triggered_prop_ids):
            points = (click or {}).get("points") or []
            event = points[0].get("customdata") if points else None
            if isinstance(event, int):
                view["marker"] = event
                return view
            raise PreventUpdate
        relayout = relayout or {}
        if "xaxis.range[0]" not in relayout and (relayout.get("xaxis.autorange") or relayout.get("autosize")):
            return {"highlight": view.get("highlight")} if relayout.get("xaxis.autorange") else view
        x0 = relayout.get("xaxis.range[0]")
        x1 = relayout.get("xaxis.range[1]")
        if x0 is None and isinstance(relayout.get("xaxis.range"), list):
            x0, x1 = relayout["xaxis.range"]
        if x0 is None or x1 is None:
            raise PreventUpdate
        shown = timeline_of(trace, report.devices[device_id].steps, start=view.get("start") or 0,
                            end=view.get("end"), max_points=figures.DEFAULT_MAX_POINTS // 2)
        start, end = figures.event_range(shown, float(x0), float(x1), x_axis)
        view.update({"start": start, "end": end})
        return view

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
        report = analysis.report
        view = view or {}
        device_id = device_of(report, device)
        if ctx.triggered_id in ("source-picker", "device-picker"):
            view = {}  # the old view belongs to the previous snapshot
        elif ctx.triggered_id == "x-axis":
            view = {k: v for k, v in view.items() if k not in ("start", "end")}
        dr = report.devices[device_id]
        zoomed = view.get("start") is not None or view.get("end") is not None
        # The whole run, or the zoomed window at full resolution: cut from the trace, so a
        # one-row spike inside the window still shows.
        shown = timeline_of(analysis.snapshot.device(device_id), dr.steps, start=view.get("start") or 0,
                            end=view.get("end"), max_points=figures.DEFAULT_MAX_POINTS // 2)
        return figures.timeline_figure(dr, shown, x_axis="time" if x_axis == "time" else "event",
                                       zoomed=zoomed, highlight=view.get("highlight"),
                                       marker_event=view.get("marker"))

    @app.callback(
        Output("findings", "children"),
        Input("source-picker", "value"),
        Input("device-picker", "value"),
    )
    def list_findings(source_id: str | None, device: int | None) -> Any:
        try:
            report = report_of(source_id)
        except MemlensError:
            return None
        dr = report.devices[device_of(report, device)]
        if not dr.findings:
            return html.P("No leak, plateau, spike, fragmentation or OOM was flagged on this device.",
                          className="muted")
        return [finding_card(i, f, dr) for i, f in enumerate(dr.findings)]

    # ------------------------------------------------------------- at the peak (or a clicked moment)

    @app.callback(
        Output("moment", "data"),
        Input("view", "data"),
        State("moment", "data"),
    )
    def pick_moment(view: dict[str, Any] | None, current: int | None) -> int | None:
        marker = (view or {}).get("marker")
        if marker == current:
            raise PreventUpdate  # a zoom: the treemap stays as it is
        return marker

    @app.callback(
        Output("categories", "figure"),
        Output("tab-peak", "label"),
        Output("live-label", "children"),
        Output("live-reset", "disabled"),
        Input("source-picker", "value"),
        Input("device-picker", "value"),
        Input("moment", "data"),
    )
    def draw_live(source_id: str | None, device: int | None, moment: int | None) -> Any:
        try:
            analysis = analysis_of(source_id)
        except MemlensError:
            return empty_figure(""), "At the peak", None, True
        report = analysis.report
        device_id = device_of(report, device)
        # A new snapshot or device starts at its peak (the moment belongs to the old one).
        event = None if ctx.triggered_id in ("source-picker", "device-picker") else moment
        try:
            live = live_at(analysis, device_id, event)
        except MemlensError:
            live = live_at(analysis, device_id)
        heading = f"Live {live.label}: {format_bytes(live.total_bytes)}"
        fig = figures.categories_figure(report.devices[device_id], live.categories, live.top_stacks_by_category,
                                        title=f"{heading} by category and stack")
        hint = " · click the timeline's curve to see another moment"
        return (fig, live.label[0].upper() + live.label[1:],
                [html.B(heading), html.Span(hint, className="muted")], live.is_peak)

    @app.callback(
        Output("segments", "figure"),
        Input("source-picker", "value"),
        Input("device-picker", "value"),
    )
    def draw_segments(source_id: str | None, device: int | None) -> Any:
        try:
            report = report_of(source_id)
        except MemlensError:
            return empty_figure("")
        device_id = device_of(report, device)
        return figures.segment_map_figure(report.devices[device_id].segment_map, device_id)

    # ------------------------------------------------------------- budget

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
        try:
            report = report_of(source_id)
        except MemlensError:
            raise PreventUpdate from None
        sidecar = report.sidecar
        dr = report.devices[device_of(report, device)]
        prefill = budget_prefill(sidecar, dr.categories_at_peak.get("parameters", 0))
        capacity = dr.capacity_bytes or (sidecar.get("device") or {}).get("total_memory_bytes")
        return (prefill.params or "",
                _OPTIMIZER_CLASSES.get(prefill.optimizer, no_update),
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
        from memlens import budget as budget_api

        try:
            report = report_of(source_id)
        except MemlensError:
            return empty_figure(""), None
        dr = report.devices[device_of(report, device)]
        try:
            n_params = parse_count(params)
            if n_params is None:
                return (empty_figure("Enter the parameter count (and, for activations, the model shape) "
                                     "to compare theory with what was measured."), None)
            capacity = parse_bytes(capacity_text) if capacity_text else dr.capacity_bytes
            spec = budget_api.ModelSpec.from_numbers(
                n_params, hidden_size=_int(hidden), n_layers=_int(layers), n_heads=_int(heads),
                vocab_size=_int(vocab))
            setup = budget_api.TrainingSetup(
                precision=precision, optimizer=optimizer, micro_batch=_int(batch) or 1, seq_len=_int(seq),
                grad_accum=_int(accum) or 1, checkpointing=checkpointing, lora_rank=_int(lora),
                flash_attention="flash" in (flags or []))
            estimate = budget_api.estimate(spec, setup)
            reconciliation = budget_api.reconcile(estimate, dr)
        except MemlensError as exc:
            return empty_figure(str(exc)), alert(str(exc))
        fig = figures.budget_figure(reconciliation, capacity=capacity)
        described = not inferred_params or (params or "").strip() != inferred_params
        return fig, budget_verdict(estimate, reconciliation, capacity, described=described)

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
        from memlens.allocator import AllocatorSettings, whatif

        analysis = analysis_of(source_id)
        report = analysis.report
        device_id = device_of(report, device)
        dr = report.devices[device_id]
        try:
            extra = parse_bytes(extra_text or "0")
            capacity = dr.capacity_bytes or (parse_bytes(capacity_text) if capacity_text else None)
            recorded_settings = AllocatorSettings.from_snapshot_dict(analysis.snapshot.allocator_settings)
            expandable = whatif(analysis.snapshot, AllocatorSettings(expandable_segments=True),
                                capacity=capacity, device=device_id)
            more = None
            if capacity:
                more = whatif(analysis.snapshot, recorded_settings, capacity=capacity + extra, device=device_id)
        except MemlensError as exc:
            return alert(str(exc))
        columns = [("recorded", expandable.recorded), ("expandable_segments", expandable.simulated)]
        notes = list(expandable.notes)
        if more is not None:
            columns.append((f"{format_bytes(capacity + extra)} device (+{format_bytes(extra)})", more.simulated))
        else:
            notes.append("The device capacity is unknown: enter it in the budget form to simulate more memory.")
        return whatif_table(columns, notes)

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
            report = library.analysis(source_id).report
        except MemlensError:
            return [], None
        return ([{"label": f"cuda:{d}", "value": d} for d in sorted(report.devices)],
                figures.primary_device(report))

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
        da, db = device_of(a, device_a), device_of(b, device_b)
        names = (f"A: {source_name(a, da)}", f"B: {source_name(b, db)}")
        fig = figures.compare_figure(a, b, device_a=da, device_b=db, names=names, x_axis=x_axis)
        rows = figures.compare_rows(a, b, da, db)
        table = html.Table(className="table", children=[
            html.Thead(html.Tr([html.Th(""), html.Th(names[0]), html.Th(names[1]), html.Th("B − A")])),
            html.Tbody([html.Tr([html.Td(r["metric"]), html.Td(r["a"]), html.Td(r["b"]), html.Td(r["delta"])])
                        for r in rows]),
        ])
        return fig, table


def _int(value: Any) -> int | None:
    if value is None or value == "":
        return None
    return int(value)


def finding_card(index: int, finding: Any, device_report: Any) -> html.Div:
    color = figures.FINDING_COLORS.get(finding.kind, "#999")
    step = f"step {finding.step}" if finding.step is not None else f"events {finding.start_event:,}–" \
        f"{finding.end_event:,}"
    evidence = html.Table(className="evidence", children=[
        html.Tr([html.Td(str(k).replace("_", " ")), html.Td(format_evidence(k, v))])
        for k, v in finding.evidence.items()])
    stacks = [html.Details(className="stack", children=[
        html.Summary(f"{format_bytes(s.bytes)} in {s.count} allocation(s): "
                     f"{s.frames[0] if s.frames else '?'}"),
        html.Pre("\n".join(s.frames[:20]) or "(no stack recorded)")]) for s in finding.top_stacks[:5]]
    saving = (f" Estimated saving: {format_bytes(finding.estimated_saving_bytes)}."
              if finding.estimated_saving_bytes else "")
    return html.Div(
        id={"type": "finding", "index": index}, n_clicks=0, className=f"finding severity-{finding.severity}",
        style={"borderLeftColor": color}, title="click to zoom the timeline to this finding",
        children=[
            html.Div(className="finding-head", children=[
                html.Span(figures.finding_title(finding.kind), className="finding-kind",
                          style={"color": color}),
                html.Span(finding.severity, className=f"badge badge-{finding.severity}"),
                html.Span(format_bytes(finding.bytes), className="finding-bytes"),
            ]),
            html.Div(finding.summary, className="finding-summary"),
            html.Div(className="finding-fix", children=[html.B("Fix: "), finding.recommendation, saving]),
            html.Details(className="finding-details", children=[
                html.Summary(f"evidence and stacks ({step})"), evidence, *stacks]),
        ])


@dataclass(frozen=True)
class BudgetPrefill:
    """What the budget form can be filled with from what is known, and where it came from."""

    params: str | None = None
    optimizer: str = ""
    precision: str | None = None
    inferred: bool = False  # from the snapshot's parameter bytes, not from the user or the recorder
    note: str = ""


def budget_prefill(sidecar: dict[str, Any], parameter_bytes: int) -> BudgetPrefill:
    """The recorder's sidecar first; else the parameter bytes the analysis found, as an fp32 guess.

    Nothing is invented: a snapshot with neither leaves the form empty, and no verdict is shown.
    """
    model = sidecar.get("model") or {}
    optimizer = str((sidecar.get("optimizer") or {}).get("class") or "").lower()
    count = model.get("parameters_total")
    if isinstance(count, int | float) and count > 0:
        return BudgetPrefill(f"{count / 1e6:.3f}M", optimizer, None, False,
                             "from the recorder's sidecar (the model it saw)")
    if parameter_bytes > 0:
        guessed = parameter_bytes / FP32_BYTES
        return BudgetPrefill(f"{guessed / 1e6:.3f}M", optimizer, "fp32", True,
                             f"inferred: {format_bytes(parameter_bytes)} of parameters at the peak, at 4 bytes "
                             "each (fp32). Correct it (16-bit weights hold 2 bytes each) to get a verdict.")
    return BudgetPrefill(optimizer=optimizer)


def budget_verdict(estimate: Any, reconciliation: Any, capacity: int | None, described: bool = True) -> html.Div:
    parts: list[Any] = [html.P([html.B("Theory: "), f"{format_bytes(estimate.total_bytes)} in total "
                               f"({format_bytes(estimate.static_bytes)} static, "
                               f"{format_bytes(estimate.batch_bytes)} per micro-batch)."])]
    if not estimate.batch_bytes:
        parts.append(html.P("The theory has no activations yet: give the hidden size, layers and sequence "
                            "length for them.", className="muted"))
    if capacity:
        fits = estimate.fits(capacity)
        text = (f"fits in {format_bytes(capacity)}" if fits else
                f"does NOT fit in {format_bytes(capacity)}")
        parts.append(html.P([html.B("Verdict: "), html.Span(text, className="ok" if fits else "bad")]))
        try:
            best = estimate.max_micro_batch(capacity)
            parts.append(html.P(f"Largest micro-batch that fits: {best.micro_batch} "
                                f"({best.explanation})" if best.explanation else
                                f"Largest micro-batch that fits: {best.micro_batch}"))
        except MemlensError as exc:
            parts.append(html.P(str(exc), className="muted"))
    notes = list(getattr(reconciliation, "notes", []))
    if not described:
        # The parameter count was inferred from the measurement itself: comparing the two would
        # only echo the guess back as a verdict.
        parts.append(html.P("No verdict on the measurement yet: the parameter count was inferred from it. "
                            "Describe the model (or confirm the count) to compare.", className="muted"))
    elif notes:
        parts.append(html.Ul([html.Li(n) for n in notes], className="notes"))
    return html.Div(parts)


WHATIF_ROWS = (
    ("peak reserved", "peak_reserved_bytes", True),
    ("peak allocated", "peak_allocated_bytes", True),
    ("fragmentation at the peak", "fragmentation_at_peak_bytes", True),
    ("cudaMalloc calls (segments)", "segment_allocs", False),
    ("out of memory", "oom", False),
)


def whatif_table(columns: list[tuple[str, dict[str, Any]]], notes: list[str]) -> html.Div:
    def cell(value: Any, as_bytes: bool) -> str:
        if value is None:
            return "n/a"
        if isinstance(value, bool):
            return "yes" if value else "no"
        return format_bytes(value) if as_bytes else f"{value:,}"

    table = html.Table(className="table whatif", children=[
        html.Thead(html.Tr([html.Th("")] + [html.Th(name.replace("_", " ")) for name, _ in columns])),
        html.Tbody([html.Tr([html.Td(label)] + [html.Td(cell(data.get(key), as_bytes))
                                                 for _, data in columns])
                    for label, key, as_bytes in WHATIF_ROWS]),
    ])
    return html.Div([table, html.Ul([html.Li(n) for n in notes], className="notes") if notes else None])
