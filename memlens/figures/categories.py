"""What was live at a moment, by category and then by the stack that allocated it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from memlens.analysis.datatypes import CATEGORIES, StackBytes
from memlens.analysis.report import DeviceReport
from memlens.figures._style import (
    CATEGORY_COLORS,
    MAX_STACKS_PER_CATEGORY,
    layout,
    message_figure,
    rgba,
)
from memlens.units import GiB, format_bytes


def categories_figure(
    device_report: DeviceReport,
    categories: Mapping[str, int] | None = None,
    stacks: Mapping[str, Sequence[StackBytes]] | None = None,
    *,
    kind: str = "treemap",
    title: str | None = None,
) -> go.Figure:
    """What was live, by category then by allocating stack, as a treemap (or ``kind="sunburst"``).

    By default the numbers are the device report's ``categories_at_peak`` and
    ``top_stacks_by_category``; pass ``categories``/``stacks`` to draw another moment.
    """
    cats = dict(categories if categories is not None else device_report.categories_at_peak)
    by_stack = stacks if stacks is not None else device_report.top_stacks_by_category
    total = sum(int(v) for v in cats.values())
    heading = title or f"Live at the peak: {format_bytes(total)} by category and stack"
    if total <= 0:
        return message_figure(heading, "Nothing was live at this moment.")
    root = "live"
    ids, labels, parents, values, colors, hovers = [root], [f"live {format_bytes(total)}"], [""], [total], [
        "#FFFFFF"], [f"all live tensors: {format_bytes(total)}"]
    ordered = sorted(cats, key=lambda c: (CATEGORIES.index(c) if c in CATEGORIES else len(CATEGORIES), c))
    for category in ordered:
        cat_bytes = int(cats[category])
        if cat_bytes <= 0:
            continue
        color = CATEGORY_COLORS.get(category, "#BBBBBB")
        ids.append(category)
        labels.append(category.replace("_", " "))
        parents.append(root)
        values.append(cat_bytes)
        colors.append(color)
        hovers.append(f"{category}: {format_bytes(cat_bytes)} ({100 * cat_bytes / total:.1f}% of live)")
        remaining = cat_bytes
        entries = sorted(by_stack.get(category, []), key=lambda s: -int(s.bytes))
        for rank, entry in enumerate(entries[:MAX_STACKS_PER_CATEGORY]):
            stack_bytes = min(int(entry.bytes), remaining)
            if stack_bytes <= 0:
                continue
            remaining -= stack_bytes
            frames = list(entry.frames)
            ids.append(f"{category}/{rank}")
            labels.append(_short_frame(frames[0]) if frames else "(no stack recorded)")
            parents.append(category)
            values.append(stack_bytes)
            colors.append(rgba(color, 0.55))
            stack_text = "<br>".join(frames[:8]) if frames else "(no stack recorded)"
            hovers.append(f"{format_bytes(stack_bytes)} in {int(entry.count)} tensor(s)<br>{stack_text}")
        if remaining > 0 and entries:
            ids.append(f"{category}/other")
            labels.append("other stacks")
            parents.append(category)
            values.append(remaining)
            colors.append(rgba(color, 0.3))
            hovers.append(f"{format_bytes(remaining)} from stacks not listed")
    trace_cls = go.Sunburst if kind == "sunburst" else go.Treemap
    extra: dict[str, Any] = {}
    if kind != "sunburst":
        extra = {"tiling": {"pad": 2}, "pathbar": {"visible": False}}
    fig = go.Figure(trace_cls(
        ids=ids, labels=labels, parents=parents, values=values, branchvalues="total",
        marker={"colors": colors}, hovertext=hovers, hoverinfo="text", textinfo="label+value",
        texttemplate="%{label}<br>%{percentRoot:.1%}", maxdepth=3, **extra,
    ))
    return layout(fig, heading, height=440, margin={"l": 8, "r": 8, "t": 48, "b": 8})


def _short_frame(frame: str, width: int = 48) -> str:
    text = str(frame)
    return text if len(text) <= width else text[: width - 1] + "…"


def categories_bar_figure(categories: Mapping[str, int], title: str = "Live by category") -> go.Figure:
    """One horizontal stacked bar of categories (used for compact summaries in export)."""
    fig = go.Figure()
    for category in CATEGORIES:
        value = int(categories.get(category, 0))
        if value:
            fig.add_trace(go.Bar(x=[value / GiB], y=[""], orientation="h", name=category,
                                 marker_color=CATEGORY_COLORS[category],
                                 hovertemplate=f"{category}: {format_bytes(value)}<extra></extra>"))
    fig.updatelayout(barmode="stack")
    fig.update_xaxes(title_text="GiB")
    return layout(fig, title, height=180)
