"""What every memlens figure shares: colours, the byte axis, the layout and small text helpers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import plotly.graph_objects as go

from memlens.units import GiB, KiB, MiB

# Step boundaries drawn at most; past that they become a grey comb that hides the curve.
MAX_STEP_LINES = 200
# Stacks per category in the treemap; the rest is summed into one "other stacks" tile.
MAX_STACKS_PER_CATEGORY = 12

CATEGORY_COLORS: dict[str, str] = {
    "parameters": "#4C78A8",
    "gradients": "#F58518",
    "optimizer_state": "#B279A2",
    "activations": "#54A24B",
    "temporary": "#EECA3B",
    "workspace": "#72B7B2",
    "leaked": "#D62728",
    "unknown": "#9D9DA0",
}
FINDING_COLORS: dict[str, str] = {
    "leak": "#D62728",
    "activation_plateau": "#2CA02C",
    "optimizer_spike": "#9467BD",
    "fragmentation": "#FF7F0E",
    "idle_cache": "#BCBD22",
    "oom": "#8C1C13",
}
ALLOCATED_COLOR = "#1F77B4"
RESERVED_COLOR = "#7F7F7F"
SECOND_COLOR = "#E45756"
BLOCK_STATE_COLORS = {
    "active_allocated": "#1F77B4",
    "active_pending_free": "#AEC7E8",
    "inactive": "#F2B6B6",
}
BLOCK_STATE_LABELS = {
    "active_allocated": "allocated",
    "active_pending_free": "freed, waiting for its stream",
    "inactive": "free (cached)",
}

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class ByteScale:
    """The unit a plot's byte axis is drawn in, chosen so the numbers stay readable."""

    divisor: int
    unit: str

    @classmethod
    def for_max(cls, max_bytes: float) -> ByteScale:
        if max_bytes >= GiB:
            return cls(GiB, "GiB")
        if max_bytes >= MiB:
            return cls(MiB, "MiB")
        return cls(KiB, "KiB")

    def __call__(self, values: npt.ArrayLike) -> FloatArray:
        return np.asarray(values, dtype=np.float64) / self.divisor


def layout(fig: go.Figure, title: str, height: int = 420, **extra: Any) -> go.Figure:
    settings: dict[str, Any] = {
        "title": {"text": title, "x": 0.01, "xanchor": "left", "font": {"size": 15}},
        "template": "plotly_white",
        "height": height,
        "margin": {"l": 60, "r": 20, "t": 48, "b": 44},
        "legend": {"orientation": "h", "yanchor": "bottom", "y": 1.0, "xanchor": "right", "x": 1.0},
        "hoverlabel": {"align": "left"},
    }
    settings.update(extra)
    fig.update_layout(**settings)
    return fig


def message_figure(title: str, message: str, height: int = 300) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                       font={"size": 14, "color": "#555"})
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return layout(fig, title, height=height)


def wrap(text: str, width: int = 70) -> str:
    """Hover text lines break at ``<br>``; long sentences would run off the screen."""
    words, lines, line = text.split(), [], ""
    for word in words:
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        lines.append(line)
    return "<br>".join(lines)


def finding_title(kind: str) -> str:
    return {"oom": "out of memory", "activation_plateau": "activation plateau",
            "optimizer_spike": "optimizer spike"}.get(kind, kind.replace("_", " "))


def rgba(hex_color: str, alpha: float) -> str:
    value = hex_color.lstrip("#")
    r, g, b = (int(value[i:i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


