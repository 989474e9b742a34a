"""The toolbar's device picker, the notes and the five headline cards of one device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dash import html

from memlens.analysis.report import Report
from memlens.units import format_bytes
from memlens_app.panels.common import NO_VALUE, alert, device_of

MAX_NOTES = 4  # the analysis' notes shown above the cards; the rest stay in the report


@dataclass(frozen=True)
class Overview:
    """What ``load_source`` puts on the page: the picker, a message and the cards, in order."""

    device_options: list[dict[str, Any]]
    device: int | None
    message: Any
    cards: tuple[Any, ...]  # peak, reserved, capacity, events/steps, findings

    def outputs(self) -> tuple[Any, ...]:
        return (self.device_options, self.device, self.message, *self.cards)


def no_overview(message: Any) -> Overview:
    return Overview([], None, message, (NO_VALUE,) * 5)


def _sub(text: str) -> html.Div:
    return html.Div(text, className="card-sub")


def overview(report: Report, device: int | None) -> Overview:
    """The cards of ``device`` (None or unknown: the report's first device)."""
    device_id = device_of(report, device)
    dr = report.devices[device_id]
    options = [{"label": f"cuda:{d} ({report.devices[d].events:,} events)", "value": d}
               for d in sorted(report.devices)]
    notes = list(dr.notes)
    message = html.Div([alert(n, "info") for n in notes[:MAX_NOTES]]) if notes else None
    peak_at = "before the window" if dr.peak_allocated_event is None else f"event {dr.peak_allocated_event:,}"
    step_text = f"{len(dr.steps):,} steps ({dr.step_source})" if dr.steps else "no steps found"
    high = sum(1 for f in dr.findings if f.severity == "high")
    cards = (
        [format_bytes(dr.peak_allocated_bytes), _sub(peak_at)],
        [format_bytes(dr.peak_reserved_bytes),
         _sub(f"{format_bytes(dr.peak_reserved_bytes - dr.peak_allocated_bytes)} above the allocated peak")],
        [format_bytes(dr.capacity_bytes) if dr.capacity_bytes else "unknown",
         _sub(f"snapshot format {report.format_guess}")],
        [f"{dr.events:,}", _sub(step_text)],
        [f"{len(dr.findings)}", _sub(f"{high} high severity" if dr.findings else "nothing flagged")],
    )
    return Overview(options, device_id, message, cards)
