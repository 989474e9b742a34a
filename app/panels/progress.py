"""The analysis' progress bar on the page (``memlens_app.progress`` says where it stands)."""

from __future__ import annotations

from typing import Any

from dash import html

from memlens_app.panels.common import data_attributes
from memlens_app.progress import DONE, FAILED, QUEUED, STARTING, Progress

# What the page says of each stage (the child's are the terminal's own words).
STAGE_TEXT = {QUEUED: "waiting for a worker", STARTING: "starting"}


def progress_view(name: str, state: Progress | None) -> Any:
    """The page's bar for the analysis of ``name``: None once it is done (or never asked for);
    the error's line when it failed."""
    if state is None or state.stage == DONE:
        return None
    if state.stage == FAILED:
        return html.Div(state.error or f"{name}: the analysis failed", className="analysis-failed")
    percent = round(100 * state.fraction)
    return html.Div(
        className="analysis-progress-row",
        **data_attributes({"stage": state.stage}),
        children=[
            html.Span(f"Analysing {name}: ", className="analysis-name"),
            html.Progress(value=str(percent), max="100", className="analysis-bar"),
            html.Span(f"{STAGE_TEXT.get(state.stage, state.stage)} {percent}%", className="analysis-stage"),
        ],
    )
