"""What was live at one moment, grouped by a lens (annotation, module, file, frame, stack, ...).

Draws a ``memlens.analysis.lenses.GroupBreakdown`` as it is: the groups' bytes, share and block
counts come from the lens; this module only orders nothing anew, elides long names in the middle
(so ``file.py:123`` stays visible) and folds the tail past ``top`` groups into one bar.
"""

from __future__ import annotations

import plotly.graph_objects as go

from memlens.analysis.lenses.groups import GroupBreakdown
from memlens.figures._style import ALLOCATED_COLOR, ByteScale, layout, message_figure
from memlens.units import format_bytes

# Bars drawn; the rest of the groups are one "N more groups" bar (their sum, as the lens gave them).
DEFAULT_TOP_GROUPS = 25
LABEL_WIDTH = 60


def elide_middle(text: str, width: int = LABEL_WIDTH) -> str:
    """``very/long/path/model.py:123`` -> ``very/lo…/model.py:123``: both ends stay readable."""
    if len(text) <= width:
        return text
    keep_end = (width - 1) * 2 // 3
    return text[: width - 1 - keep_end] + "…" + text[-keep_end:]


def plotly_text(text: str) -> str:
    """Plotly reads a subset of HTML in labels: frames such as ``<module>`` must stay text."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def groups_figure(breakdown: GroupBreakdown, title: str | None = None, top: int = DEFAULT_TOP_GROUPS) -> go.Figure:
    """The groups of ``breakdown`` as horizontal bars, the largest on top."""
    by = breakdown.group_by.replace("_", " ")
    total = breakdown.allocated_bytes
    heading = title or f"Live {breakdown.moment.text}: {format_bytes(total)} by {by}"
    groups = [g for g in breakdown.groups if g.bytes > 0]
    if not groups:
        return message_figure(heading, "Nothing was live at this moment.")
    shown, rest = groups[:top], groups[top:]
    names = [plotly_text(elide_middle(g.name)) for g in shown]
    values = [g.bytes for g in shown]
    hovers = [f"{plotly_text(g.name)}<br>{format_bytes(g.bytes)} ({g.bytes / total:.1%} of live)"
              f" in {g.blocks:,} block(s)" if total else plotly_text(g.name) for g in shown]
    if rest:
        rest_bytes = sum(g.bytes for g in rest)
        names.append(f"{len(rest):,} more groups")
        values.append(rest_bytes)
        hovers.append(f"{len(rest):,} smaller groups: {format_bytes(rest_bytes)}")
    scale = ByteScale.for_max(max(values))
    fig = go.Figure(go.Bar(
        x=scale(values), y=names, orientation="h", marker_color=ALLOCATED_COLOR,
        text=[format_bytes(v) for v in values], textposition="auto",
        hovertext=hovers, hoverinfo="text",
    ))
    height = max(300, 60 + 22 * len(names))
    layout(fig, heading, height=height, margin={"l": 8, "r": 20, "t": 48, "b": 40}, showlegend=False)
    fig.update_yaxes(autorange="reversed", automargin=True)
    fig.update_xaxes(title_text=f"bytes ({scale.unit})")
    fig.layout.meta = {"group_by": breakdown.group_by, "groups": len(groups), "allocated_bytes": total}
    return fig
