"""What the panels share: alerts, the placeholder figure, the device to show, typed-in numbers."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from dash import html

from memlens import figures, units
from memlens.analysis.report import Report
from memlens.errors import MemlensUsageError

NO_VALUE = "–"  # what a card shows before a snapshot is open


def alert(text: str, kind: str = "error") -> html.Div:
    return html.Div(text, className=f"alert alert-{kind}", role="alert")


def data_attributes(values: dict[str, str]) -> dict[str, Any]:
    """``data-*`` attributes for a component (Dash passes them through; its stubs do not list them)."""
    return {f"data-{name}": value for name, value in values.items()}


def empty_figure(text: str = "Open a snapshot to begin.") -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=text, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                       font={"size": 14, "color": "#777"})
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.update_layout(template="plotly_white", height=300, margin={"l": 10, "r": 10, "t": 10, "b": 10})
    return fig


def device_of(report: Report, device: int | None) -> int:
    """``device`` when the report has it, else the one the report shows first (the highest peak)."""
    return device if device is not None and device in report.devices else figures.primary_device(report)


# The most parameters a model typed into the form may have: a thousand times today's largest
# (a count like 1e308 would overflow every float the budget is drawn with).
MAX_PARAMETER_COUNT = 10**15


def parse_count(text: str | None) -> int | None:
    """``"7B"`` -> 7_000_000_000, ``"124M"``, ``"1.3e9"``; blank -> None."""
    if text is None or not str(text).strip():
        return None
    count = units.parse_count(str(text))
    if count > MAX_PARAMETER_COUNT:
        raise MemlensUsageError(f"{text!r} is more parameters than memlens budgets for (at most 1e15)")
    return count


def as_int(value: Any, what: str = "the number", minimum: int | None = 1) -> int | None:
    """A number input's value (None or "" when left blank) as a whole number of at least
    ``minimum``, parsed as the CLI and the MCP tools parse theirs (``units.parse_whole``): 0
    heads, 1e400, nan or 5,000 digits are a one-line usage error the panel shows."""
    if value is None or value == "":
        return None
    return units.parse_whole(value, what, minimum)
