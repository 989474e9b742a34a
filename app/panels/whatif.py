"""What if: this run's allocations replayed through the caching-allocator simulator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dash import html

from memlens.allocator.replay import RunFigures
from memlens.analysis.report import DeviceReport
from memlens.units import format_bytes, parse_bytes, parse_capacity
from memlens_app.worker import WhatIfAnswer

WHATIF_ROWS = (
    ("peak reserved", "peak_reserved_bytes", True),
    ("peak allocated", "peak_allocated_bytes", True),
    ("fragmentation at the peak", "fragmentation_at_peak_bytes", True),
    ("cudaMalloc calls (segments)", "segment_allocs", False),
    ("out of memory", "oom", False),
)


@dataclass(frozen=True)
class WhatIfRequest:
    """What the what-if replays are asked for: the device's capacity (None: unknown) and the extra bytes."""

    capacity: int | None
    extra: int


def whatif_request(device: DeviceReport, extra_text: str | None, capacity_text: str | None) -> WhatIfRequest:
    """The form's fields read (``MemlensError`` with the reason for a size that does not parse):
    the recorded capacity when the file has one, else the budget form's."""
    extra = parse_bytes(extra_text or "0")
    capacity = device.capacity_bytes or (parse_capacity(capacity_text, "capacity") if capacity_text else None)
    return WhatIfRequest(capacity, extra)


def whatif_panel(answer: WhatIfAnswer, asked: WhatIfRequest) -> html.Div:
    """The recorded run against expandable segments, and (when the capacity is known) against a
    device with ``asked.extra`` more memory, as a table. The replays themselves run in the
    analysis workers (``Library.whatif``), never in the server."""
    columns = [("recorded", answer.recorded), ("expandable_segments", answer.expandable)]
    notes = list(answer.notes)
    if answer.more_memory is not None and asked.capacity:
        columns.append((f"{format_bytes(asked.capacity + asked.extra)} device (+{format_bytes(asked.extra)})",
                        answer.more_memory))
    else:
        notes.append("The device capacity is unknown: enter it in the budget form to simulate more memory.")
    return whatif_table(columns, notes)


def whatif_table(columns: list[tuple[str, RunFigures]], notes: list[str]) -> html.Div:
    def cell(value: Any, as_bytes: bool) -> str:
        if value is None:
            return "n/a"
        if isinstance(value, bool):
            return "yes" if value else "no"
        return format_bytes(value) if as_bytes else f"{value:,}"

    table = html.Table(className="table whatif", children=[
        html.Thead(html.Tr([html.Th("")] + [html.Th(name.replace("_", " ")) for name, _ in columns])),
        html.Tbody([html.Tr([html.Td(label)] + [html.Td(cell(getattr(data, key), as_bytes))
                                                 for _, data in columns])
                    for label, key, as_bytes in WHATIF_ROWS]),
    ])
    return html.Div([table, html.Ul([html.Li(n) for n in notes], className="notes") if notes else None])
