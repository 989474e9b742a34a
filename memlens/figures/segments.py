"""The segments when the snapshot was taken, each cut into its blocks."""

from __future__ import annotations

import plotly.graph_objects as go

from memlens.analysis.datatypes import SegmentMap
from memlens.figures._style import BLOCK_STATE_COLORS, BLOCK_STATE_LABELS, ByteScale, layout, message_figure
from memlens.units import format_bytes


def segment_map_figure(segment_map: SegmentMap, device: int) -> go.Figure:
    """Each segment as one bar cut into its blocks: allocated, waiting, and free (cached) pieces.

    Many small free pieces inside big segments are fragmentation: reserved memory that a large
    request cannot use. Segments are drawn largest first; the rest are summed in a note.
    """
    title = (f"Segments when the snapshot was taken, device {device}<br><span style='font-size:12px;"
             f"color:#5f6b76'>{segment_map.segments} segments, {format_bytes(segment_map.reserved_bytes)} "
             f"reserved, {format_bytes(segment_map.free_bytes)} free in pieces "
             f"(largest {format_bytes(segment_map.largest_free_bytes)})</span>")
    shown = segment_map.shown
    if not shown:
        return message_figure(title, "No segments on this device when the snapshot was taken.")
    scale = ByteScale.for_max(shown[0].total_size)
    columns: dict[str, dict[str, list[float | str]]] = {
        state: {"x": [], "base": [], "y": [], "text": []} for state in BLOCK_STATE_COLORS}
    labels = []
    for index, segment in enumerate(shown):
        label = f"#{index} {segment.segment_type} {format_bytes(segment.total_size)}"
        labels.append(label)
        for block in segment.blocks:
            column = columns[block.state]
            column["x"].append(block.size / scale.divisor)
            column["base"].append(block.offset / scale.divisor)
            column["y"].append(label)
            column["text"].append(f"{BLOCK_STATE_LABELS[block.state]}: {format_bytes(block.size)}<br>"
                                  f"at +{format_bytes(block.offset)} in segment 0x{segment.address:x}"
                                  f"<br>stream {segment.stream}, pool {tuple(segment.pool_id)}")
    fig = go.Figure()
    for state, column in columns.items():
        if column["x"]:
            fig.add_trace(go.Bar(
                x=column["x"], base=column["base"], y=column["y"], orientation="h", name=BLOCK_STATE_LABELS[state],
                marker={"color": BLOCK_STATE_COLORS[state], "line": {"color": "white", "width": 0.5}},
                hovertext=column["text"], hoverinfo="text",
            ))
    hidden = segment_map.segments - len(shown)
    if hidden:
        fig.add_annotation(text=f"+ {hidden} smaller segments ({format_bytes(segment_map.hidden_bytes)}) not drawn",
                           xref="paper", yref="paper", x=1, y=0, xanchor="right", yanchor="bottom",
                           showarrow=False, font={"size": 11}, bgcolor="rgba(255,255,255,0.8)")
    height = min(max(280, 20 * len(shown) + 130), 1400)
    layout(fig, title, height=height, barmode="overlay", bargap=0.25,
           margin={"l": 60, "r": 20, "t": 84, "b": 44})
    fig.update_yaxes(categoryorder="array", categoryarray=list(reversed(labels)), automargin=True,
                     tickfont={"size": 10})
    fig.update_xaxes(title_text=f"offset in segment ({scale.unit})")
    return fig
