"""Two snapshots (two runs, or two ranks) overlaid, with the diff table."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from dash import html

from memlens import figures
from memlens.analysis.report import Report
from memlens.figures.compare import source_name
from memlens_app.panels.common import device_of


def device_choices(report: Report) -> tuple[list[dict[str, Any]], int]:
    """The second snapshot's devices, and the one to compare first."""
    return [{"label": f"cuda:{d}", "value": d} for d in sorted(report.devices)], figures.primary_device(report)


def compare_panel(a: Report, b: Report, device_a: int | None, device_b: int | None, x_axis: str
                  ) -> tuple[go.Figure, html.Table]:
    """A against B: the allocated curves overlaid and the headline numbers side by side."""
    da, db = device_of(a, device_a), device_of(b, device_b)
    names = (f"A: {source_name(a, da)}", f"B: {source_name(b, db)}")
    fig = figures.compare_figure(a, b, device_a=da, device_b=db, names=names,
                                 x_axis="time" if x_axis == "time" else "event")
    rows = figures.compare_rows(a, b, da, db)
    table = html.Table(className="table", children=[
        html.Thead(html.Tr([html.Th(""), html.Th(names[0]), html.Th(names[1]), html.Th("B − A")])),
        html.Tbody([html.Tr([html.Td(r["metric"]), html.Td(r["a"]), html.Td(r["b"]), html.Td(r["delta"])])
                    for r in rows]),
    ])
    return fig, table
