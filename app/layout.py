"""The page: a toolbar (drop zone, snapshot picker, device), headline cards and four tabs.

Only structure lives here; every number is filled in by ``callbacks``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dash import dcc, html

from memlens.reporters.terminal import elide_apart
from memlens.units import format_bytes
from memlens_app.library import Library, Source
from memlens_app.panels.common import data_attributes
from memlens_app.panels.live import DASHBOARD_GROUP_BYS, DEFAULT_GROUP_BY
from memlens_app.panels.ranks import default_rank_sources, rank_sources

KIND_LABELS = {"cli": "command line", "sample": "sample", "upload": "uploaded", "follow": "following"}

PRECISIONS = ("bf16-mixed", "fp16-mixed", "fp32", "bf16", "fp16")
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "adam-8bit", "adafactor", "muon")
CHECKPOINTING = ("none", "selective", "full")
GROUP_BY_LABELS = {"category": "category (and stack)", "annotation": "annotation (record_function)",
                   "compile_context": "compile context", "module": "module", "file": "file:line",
                   "frame": "innermost frame", "stack": "whole stack"}


# How often the page asks how far an analysis has got (stopped once it is done).
PROGRESS_POLL_MS = 250

# About what the picker's width shows of a label; the browser cuts a longer one at its end, where
# rank files and runs of one job often read the same.
PICKER_LABEL_CHARS = 60


def source_options(library: Library, session: str | None) -> list[dict[str, str]]:
    """The picker's choices for ``session``: the public files and its own uploads, each label cut
    where it agrees with the others (elide_apart), so files that differ still differ."""
    sources = library.sources(session)
    labels = elide_apart([s.label for s in sources], PICKER_LABEL_CHARS)
    return [{"label": f"{label}  ({KIND_LABELS.get(s.kind, s.kind)})", "value": s.id}
            for s, label in zip(sources, labels, strict=True)]


def default_source(library: Library, session: str | None) -> Source | None:
    sources = library.sources(session)
    for kind in ("follow", "cli", "upload", "sample"):
        for source in sources:
            if source.kind == kind:
                return source
    return None


def _card(label: str, value_id: str) -> html.Div:
    return html.Div(className="card", children=[html.Div(label, className="card-label"),
                                                html.Div("–", id=value_id, className="card-value")])


def _field(label: str, component: Any, hint: str = "") -> html.Label:
    return html.Label(className="field", children=[
        html.Span(label, className="field-label"), component,
        html.Span(hint, className="field-hint") if hint else None,
    ])


def _number(input_id: str, value: float | None = None, placeholder: str = "", step: float = 1) -> dcc.Input:
    return dcc.Input(id=input_id, type="number", value=value, placeholder=placeholder, min=0, step=step,
                     debounce=True, className="input")


def _text(input_id: str, value: str = "", placeholder: str = "") -> dcc.Input:
    return dcc.Input(id=input_id, type="text", value=value, placeholder=placeholder, debounce=True,
                     className="input")


def budget_form() -> html.Div:
    return html.Div(className="budget-form", children=[
        html.H3("Model"),
        _field("parameters", _text("b-params", placeholder="e.g. 7B, 124M"), "total count; K/M/B suffixes"),
        # Where a prefilled count came from (the recorder's sidecar, or inferred from the snapshot).
        html.Div(id="b-params-note", className="muted"),
        dcc.Store(id="b-prefill"),
        _field("hidden size", _number("b-hidden", placeholder="d")),
        _field("layers", _number("b-layers", placeholder="L")),
        _field("attention heads", _number("b-heads", placeholder="a")),
        _field("vocabulary", _number("b-vocab", placeholder="V")),
        html.H3("Training setup"),
        # Filled from the snapshot's sidecar as memlens triage fills them; cleared = the sidecar's again.
        _field("precision", dcc.Dropdown(id="b-precision", options=list(PRECISIONS), value=None,
                                         placeholder="from the sidecar")),
        _field("optimizer", dcc.Dropdown(id="b-optimizer", options=list(OPTIMIZERS), value=None,
                                         placeholder="from the sidecar")),
        _field("micro-batch", _number("b-batch", placeholder="1")),
        _field("sequence length", _number("b-seq", placeholder="T")),
        _field("gradient accumulation", _number("b-accum", 1)),
        _field("activation checkpointing", dcc.Dropdown(id="b-checkpointing", options=list(CHECKPOINTING),
                                                        value="none", clearable=False)),
        _field("LoRA rank", _number("b-lora", placeholder="none"), "blank = full fine-tuning"),
        dcc.Checklist(id="b-flags", options=[{"label": " FlashAttention", "value": "flash"}],
                      value=["flash"], className="checklist"),
        html.H3("Device"),
        _field("capacity", _text("b-capacity", placeholder="e.g. 80GiB"), "GB = 1e9 B, GiB = 2^30 B"),
    ])


def parallel_uploads(library: Library) -> int:
    """Uploads the page sends at once: half the session's share of the workers, so that the
    page's own analyses (another snapshot picked meanwhile) still find room in it."""
    return max(1, library.queue.per_session // 2)


def build_layout(library: Library, max_upload_bytes: int, session: str | None, extra: Sequence[Any] = ()
                 ) -> html.Div:
    """The page of browser session ``session``; called per page load so the picker lists the
    uploads it made since the server started (and never another session's). ``extra``: components
    shown under the message area (``memlens_app.follow``'s banner and its poll)."""
    first = default_source(library, session)
    options = source_options(library, session)
    return html.Div(className="page", children=[
        dcc.Store(id="upload-event"),
        dcc.Store(id="view", data={}),
        html.Header(className="header", children=[
            html.Div(className="brand", children=[
                html.Span("memlens", className="logo"),
                html.Span("where did the GPU memory go?", className="tagline"),
            ]),
        ]),
        html.Div(className="toolbar", children=[
            html.Div(id="dropzone", className="dropzone",
                     **data_attributes({"max-upload": str(max_upload_bytes),
                                        "parallel-uploads": str(parallel_uploads(library))}),
                     children=[
                         html.Span("⇪", className="dropzone-icon"),
                         html.Div([html.B("Drop a snapshot with its sidecar, a run folder or a .zip"),
                                   html.Br(),
                                   html.Span(f"or click to choose files (up to {format_bytes(max_upload_bytes)}), ",
                                             className="muted"),
                                   html.Span("or a folder", id="choose-folder", className="link")]),
                     ]),
            html.Div(className="pickers", children=[
                _field("snapshot", dcc.Dropdown(id="source-picker", options=options,
                                                value=first.id if first else None,
                                                placeholder="Open a snapshot…", clearable=False)),
                html.Div(className="picker-row", children=[
                    _field("device", dcc.Dropdown(id="device-picker", clearable=False, searchable=False)),
                    _field("x axis", dcc.RadioItems(id="x-axis", options=[
                        {"label": " event", "value": "event"}, {"label": " time", "value": "time"}],
                        value="event", inline=True, className="radio")),
                ]),
            ]),
        ]),
        html.Div(id="upload-progress", className="upload-progress"),
        # The picked snapshot's analysis, stage by stage, until its timeline is drawn.
        html.Div(id="analysis-progress", className="analysis-progress"),
        dcc.Interval(id="progress-poll", interval=PROGRESS_POLL_MS, disabled=False),
        html.Div(id="message", className="message-area"),
        *extra,
        # The zoomed range of the timeline, when there is one: every panel follows it.
        html.Div(id="window-label", className="window-label"),
        html.Div(className="cards", children=[
            _card("peak allocated", "card-peak"),
            _card("peak reserved", "card-reserved"),
            _card("capacity", "card-capacity"),
            _card("events / steps", "card-events"),
            _card("findings", "card-findings"),
        ]),
        dcc.Tabs(id="tabs", value="timeline", className="tabs", children=[
            dcc.Tab(label="Timeline & findings", value="timeline", children=[
                html.Div(className="grid-timeline", children=[
                    html.Div(className="panel", children=[
                        dcc.Loading(dcc.Graph(id="timeline", config={"displaylogo": False,
                                                                     "scrollZoom": False}),
                                    type="dot", delay_show=300),
                        html.Div("Drag to zoom: the zoomed range is redrawn with every event and becomes the "
                                 "window every panel follows (the live breakdown shows its peak, the findings "
                                 "inside it are marked). Double-click to zoom out. Click a finding to jump to "
                                 "it. Click the curve to see what was live at that moment (next tab).",
                                 className="hint"),
                    ]),
                    html.Div(className="panel findings-panel", children=[
                        html.H2("Findings"), html.Div(id="findings", className="findings")]),
                ]),
                # The budget beside the timeline and the findings (the terminal's one screen): the
                # same reconciliation as memlens triage; the form to change it is in its own tab.
                html.Div(id="budget-summary", className="panel budget-summary"),
            ]),
            dcc.Tab(id="tab-peak", label="At the peak", value="peak", children=[
                html.Div(className="live-bar", children=[
                    html.Div(id="live-label", className="live-label"),
                    _field("group by", dcc.Dropdown(
                        id="group-by", value=DEFAULT_GROUP_BY, clearable=False, searchable=False,
                        options=[{"label": GROUP_BY_LABELS.get(g, g), "value": g} for g in DASHBOARD_GROUP_BYS])),
                    html.Button("Back to the peak", id="live-reset", n_clicks=0, className="button",
                                disabled=True),
                ]),
                html.Div(className="grid-two", children=[
                    html.Div(className="panel", children=[dcc.Graph(id="categories")]),
                    html.Div(className="panel", children=[dcc.Graph(id="segments")]),
                ]),
            ]),
            dcc.Tab(label="Budget & what-if", value="budget", children=[
                html.Div(className="grid-budget", children=[
                    html.Div(className="panel", children=[budget_form()]),
                    html.Div(className="panel", children=[
                        dcc.Graph(id="budget-graph"),
                        html.Div(id="budget-verdict", className="verdict"),
                        html.H2("What if…"),
                        html.P("Replay this run's allocations through memlens' caching-allocator simulator.",
                               className="muted"),
                        html.Div(className="whatif-controls", children=[
                            _field("extra memory", _text("w-extra", "8GiB")),
                            html.Button("Simulate", id="w-run", n_clicks=0, className="button"),
                        ]),
                        dcc.Loading(html.Div(id="whatif-result"), type="dot"),
                    ]),
                ]),
            ]),
            dcc.Tab(label="Compare", value="compare", children=[
                html.Div(className="panel", children=[
                    html.Div(className="picker-row compare-row", children=[
                        _field("compare with", dcc.Dropdown(
                            id="compare-picker", options=options,
                            placeholder="another snapshot or rank…")),
                        _field("its device", dcc.Dropdown(id="compare-device", clearable=False)),
                    ]),
                    dcc.Loading(dcc.Graph(id="compare-graph"), type="dot"),
                    html.Div(id="compare-table"),
                ]),
            ]),
            dcc.Tab(label="Ranks", value="ranks", children=[
                html.Div(className="panel", children=[
                    _field("ranks of one job", dcc.Dropdown(
                        id="ranks-picker", options=options, multi=True,
                        value=default_rank_sources(rank_sources(library.sources(session))),
                        placeholder="pick the snapshots of each rank…")),
                    html.Div(id="ranks-verdicts", className="ranks-verdicts-area"),
                    dcc.Loading(dcc.Graph(id="ranks-graph"), type="dot"),
                    html.Div("Click a rank's bar to open its timeline and findings.", className="hint"),
                    html.Div(id="ranks-table"),
                ]),
            ]),
        ]),
        html.Footer("memlens: snapshots are read with a loader that refuses any code in the pickle.",
                    className="footer"),
    ])
