"""What if: this run's allocations replayed through the caching-allocator simulator."""

from __future__ import annotations

from typing import Any

from dash import html

from memlens.analysis import Analysis
from memlens.errors import MemlensError
from memlens.units import format_bytes, parse_bytes
from memlens_app.panels.common import alert

WHATIF_ROWS = (
    ("peak reserved", "peak_reserved_bytes", True),
    ("peak allocated", "peak_allocated_bytes", True),
    ("fragmentation at the peak", "fragmentation_at_peak_bytes", True),
    ("cudaMalloc calls (segments)", "segment_allocs", False),
    ("out of memory", "oom", False),
)


def whatif_panel(analysis: Analysis, device: int, extra_text: str | None, capacity_text: str | None) -> Any:
    """The recorded run against expandable segments, and (when the capacity is known) against a
    device with ``extra_text`` more memory, as a table."""
    from memlens.allocator import AllocatorSettings, whatif

    dr = analysis.device(device)
    try:
        extra = parse_bytes(extra_text or "0")
        capacity = dr.capacity_bytes or (parse_bytes(capacity_text) if capacity_text else None)
        recorded_settings = AllocatorSettings.from_snapshot_dict(analysis.snapshot.allocator_settings)
        expandable = whatif(analysis.snapshot, AllocatorSettings(expandable_segments=True),
                            capacity=capacity, device=device)
        more = None
        if capacity:
            more = whatif(analysis.snapshot, recorded_settings, capacity=capacity + extra, device=device)
    except MemlensError as exc:
        return alert(str(exc))
    columns = [("recorded", expandable.recorded), ("expandable_segments", expandable.simulated)]
    notes = list(expandable.notes)
    if more is not None and capacity:
        columns.append((f"{format_bytes(capacity + extra)} device (+{format_bytes(extra)})", more.simulated))
    else:
        notes.append("The device capacity is unknown: enter it in the budget form to simulate more memory.")
    return whatif_table(columns, notes)


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
