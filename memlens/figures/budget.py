"""The theoretical budget's line items next to what was measured at the peak."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import plotly.graph_objects as go

from memlens.figures._style import ByteScale, layout, message_figure
from memlens.units import format_bytes


def budget_rows(reconciliation: Any) -> list[tuple[str, float | None, float | None]]:
    """``(name, theory_bytes, measured_bytes)`` rows from a budget reconciliation.

    Accepts the reconciliation object of ``memlens.budget.reconcile`` (``.rows`` of objects
    with ``category``/``name``, ``theory``/``theory_bytes``, ``measured``/``measured_bytes``),
    a mapping ``name -> (theory, measured)``, or such rows as dicts.
    """
    rows = getattr(reconciliation, "rows", reconciliation)
    if isinstance(rows, Mapping):
        return [(str(k), _num(v[0]), _num(v[1])) for k, v in rows.items()]
    out = []
    for row in rows:
        name = _field(row, "category", "name", "label")
        theory = _field(row, "theory_bytes", "theory", "theoretical_bytes", "estimate_bytes")
        measured = _field(row, "measured_bytes", "measured")
        out.append((str(name), _num(theory), _num(measured)))
    return out


def _field(row: Any, *names: str) -> Any:
    for name in names:
        if isinstance(row, Mapping) and name in row:
            return row[name]
        if hasattr(row, name):
            return getattr(row, name)
    return None


def _num(value: Any) -> float | None:
    return None if value is None else float(value)


def budget_figure(reconciliation: Any, capacity: int | None = None, title: str | None = None) -> go.Figure:
    """Theoretical line items next to the measured categories at the peak, side by side."""
    rows = budget_rows(reconciliation)
    heading = title or "Budget: theory vs measured at the peak"
    if not rows:
        return message_figure(heading, "No budget yet: fill in the model and training setup.")
    largest = max([v for _, t, m in rows for v in (t, m) if v is not None] + [float(capacity or 0), 1.0])
    scale = ByteScale.for_max(largest)
    names = [name.replace("_", " ") for name, _, _ in rows]
    fig = go.Figure()
    columns = (("theory", [t for _, t, _ in rows], "#9ECAE9"),
               ("measured", [m for _, _, m in rows], "#1F77B4"))
    for label, values, color in columns:
        fig.add_trace(go.Bar(
            x=names, y=[None if v is None else v / scale.divisor for v in values], name=label,
            marker_color=color, text=[format_bytes(v) if v is not None else "n/a" for v in values],
            textposition="outside", cliponaxis=False,
            hovertemplate=f"{label} %{{x}}: %{{text}}<extra></extra>",
        ))
    if capacity:
        fig.add_hline(y=capacity / scale.divisor, line={"color": "#8C1C13", "dash": "dash", "width": 1},
                      annotation_text=f"capacity {format_bytes(capacity)}", annotation_position="top left")
    layout(fig, heading, height=400, barmode="group", bargap=0.25)
    fig.update_yaxes(title_text=f"bytes ({scale.unit})", rangemode="tozero")
    return fig
