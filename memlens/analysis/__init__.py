"""Snapshot analysis: steps, categories at the peak, and findings (leak, activation plateau,
optimizer spike, fragmentation, OOM).

``analyze(path_or_snapshot, capacity=None, device=None) -> Report`` returns plain data (what the
terminal, the JSON and the HTML export show). ``analyze_snapshot(...) -> Analysis`` returns that
report paired with its snapshot and per-allocation index, for consumers that ask new questions
(the web app, ``live_at``, what-if, the lenses). Each finder is a stateless
``find(ctx) -> list[Finding]`` run from ``FINDERS`` (``memlens.analysis.run``) in order; nothing
here prints. ``live_at(analysis, device, event)`` tells what was live after any trace row (by
category and stack), from the same per-allocation categories.

The names are imported on first use (PEP 562): ``memlens.analysis.report``, which a cached
triage renders, costs no numpy and none of the finders.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memlens._lazy import lazy_names

if TYPE_CHECKING:
    from memlens.analysis.analysis import Analysis as Analysis
    from memlens.analysis.analysis import live_at as live_at
    from memlens.analysis.live import LiveBreakdown as LiveBreakdown
    from memlens.analysis.report import CATEGORIES as CATEGORIES
    from memlens.analysis.report import FINDING_KINDS as FINDING_KINDS
    from memlens.analysis.report import SCHEMA_VERSION as SCHEMA_VERSION
    from memlens.analysis.report import DeviceReport as DeviceReport
    from memlens.analysis.report import Finding as Finding
    from memlens.analysis.report import Report as Report
    from memlens.analysis.report import StackBytes as StackBytes
    from memlens.analysis.report import Step as Step
    from memlens.analysis.run import FINDERS as FINDERS
    from memlens.analysis.run import analyze as analyze
    from memlens.analysis.run import analyze_snapshot as analyze_snapshot
    from memlens.analysis.settings import AnalysisSettings as AnalysisSettings

_HOMES = {
    **dict.fromkeys(("Analysis", "live_at"), "memlens.analysis.analysis"),
    "LiveBreakdown": "memlens.analysis.live",
    **dict.fromkeys(("CATEGORIES", "FINDING_KINDS", "SCHEMA_VERSION", "DeviceReport", "Finding", "Report",
                     "StackBytes", "Step"), "memlens.analysis.report"),
    **dict.fromkeys(("FINDERS", "analyze", "analyze_snapshot"), "memlens.analysis.run"),
    "AnalysisSettings": "memlens.analysis.settings",
}


__getattr__, __dir__ = lazy_names(__name__, _HOMES)

__all__ = [
    "CATEGORIES",
    "FINDERS",
    "FINDING_KINDS",
    "SCHEMA_VERSION",
    "Analysis",
    "AnalysisSettings",
    "DeviceReport",
    "Finding",
    "LiveBreakdown",
    "Report",
    "StackBytes",
    "Step",
    "analyze",
    "analyze_snapshot",
    "live_at",
]
