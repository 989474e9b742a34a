"""A self-contained HTML report: the dashboard's figures and the findings, in one file to share.

plotly.js is embedded once (no network needed to open it); the figures come from
``memlens.figures``, the same builders the web app uses.
"""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import TYPE_CHECKING

from memlens.analysis.report import finding_rank, no_findings_text
from memlens.files import write_atomic
from memlens.units import counted, format_bytes

if TYPE_CHECKING:
    from memlens.analysis.report import DeviceReport, Finding, Report

_STYLE = """
body { font-family: -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2rem auto; max-width: 1200px;
       color: #1f2933; }
h1 { font-size: 1.4rem; } h2 { font-size: 1.1rem; margin-top: 2rem; border-bottom: 1px solid #e4e7eb; }
.meta { color: #52606d; } .finding { border-left: 4px solid #9aa5b1; padding: .2rem 1rem; margin: 1rem 0; }
.high { border-color: #d64545; } .medium { border-color: #f0b429; } .low { border-color: #2bb0ed; }
.fix { color: #0e7c3a; } code, .stack { font-family: ui-monospace, Menlo, monospace; font-size: .85rem; }
table { border-collapse: collapse; } td, th { padding: .2rem .8rem; text-align: right; }
td:first-child, th:first-child { text-align: left; }
"""


def _finding_html(finding: Finding) -> str:
    stacks = "".join(
        f"<div class='stack'>{html.escape(format_bytes(s.bytes))} × {s.count} &nbsp; "
        f"{html.escape(' ← '.join(s.frames[:4]))}</div>"
        for s in finding.top_stacks[:3]
    )
    saving = (f"<div class='fix'>would save ~{html.escape(format_bytes(finding.estimated_saving_bytes))}</div>"
              if finding.estimated_saving_bytes else "")
    return (
        f"<div class='finding {html.escape(finding.severity)}'>"
        f"<b>{html.escape(finding.kind.replace('_', ' '))}</b> · {html.escape(finding.severity)} · "
        f"{html.escape(format_bytes(finding.bytes))}"
        f"<p>{html.escape(finding.summary)}</p>{stacks}"
        f"<p class='fix'>Fix: {html.escape(finding.recommendation)}</p>{saving}</div>"
    )


def _categories_table(device: DeviceReport) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{html.escape(format_bytes(value))}</td></tr>"
        for name, value in sorted(device.categories_at_peak.items(), key=lambda kv: -kv[1]) if value
    )
    return f"<table><tr><th>category</th><th>live at peak</th></tr>{rows}</table>"


def render_html(report: Report, device: int | None = None) -> str:
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    from memlens import figures

    dev = report.device(device)
    parts = [
        figures.timeline_figure(dev),
        figures.categories_figure(dev),
        figures.segment_map_figure(dev.segment_map, dev.device),
    ]
    plots = "".join(pio.to_html(fig, full_html=False, include_plotlyjs=False) for fig in parts)
    findings = "".join(_finding_html(f) for f in sorted(dev.findings, key=finding_rank)) or (
        f"<p>{html.escape(no_findings_text(dev)[0].upper() + no_findings_text(dev)[1:])}.</p>")
    title = f"memlens report: {os.path.basename(report.source)}"
    peaks = (f"peak allocated {format_bytes(dev.peak_allocated_bytes)} · "
             f"peak reserved {format_bytes(dev.peak_reserved_bytes)}")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{_STYLE}</style><script>{get_plotlyjs()}</script></head>
<body><h1>{html.escape(title)}</h1>
<p class="meta">{html.escape(report.source)} · torch {html.escape(report.format_guess)} format · device {dev.device}
 · {dev.events:,} events · {counted(len(dev.steps), 'step')} ({html.escape(dev.step_source)}) · {html.escape(peaks)}</p>
<h2>Findings</h2>{findings}
<h2>Live at the peak</h2>{_categories_table(dev)}
<h2>Figures</h2>{plots}
</body></html>"""


def write_html(report: Report, path: str, device: int | None = None) -> None:
    """Write atomically (an existing report is replaced whole or not at all), with the mode any
    new file of the user's would get: a report is meant to be shared."""
    write_atomic(Path(path), render_html(report, device).encode("utf-8"))
