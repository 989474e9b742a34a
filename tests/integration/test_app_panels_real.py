"""Every dashboard panel builds from the real analysis of every real snapshot (state-only files,
windows, several devices), and every lens at the window's peak adds up to what was live there."""

from __future__ import annotations

from pathlib import Path

import pytest

import memlens
from memlens.analysis import analyze_snapshot
from memlens.ops.fleet import rank_row
from memlens_app.panels.budget import BudgetForm, budget_panel
from memlens_app.panels.compare import compare_panel
from memlens_app.panels.live import DASHBOARD_GROUP_BYS, live_panel, segments_panel
from memlens_app.panels.overview import overview
from memlens_app.panels.ranks import ranks_panel
from memlens_app.panels.timeline import findings_panel, timeline_panel, window_of, window_text
from tests.conftest import REAL_SNAPSHOTS_MISSING, real_snapshot_paths

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow

PATHS = real_snapshot_paths()


@pytest.mark.timeout(300)
@pytest.mark.skipif(not PATHS, reason=REAL_SNAPSHOTS_MISSING)
@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_every_panel_builds(path: Path) -> None:
    analysis = analyze_snapshot(memlens.load(path))
    report = analysis.report
    assert overview(report, None).device in report.devices
    for device in report.devices:
        rows = len(analysis.trace(device))
        # The middle half of the trace, as a drag-zoom would pick it (none on a state-only file).
        view = {"start": rows // 4, "end": 3 * rows // 4} if rows >= 4 else {}
        window = window_of(view, rows)
        assert (window is None) == (rows < 4)
        timeline_panel(analysis, device, view, "time").to_json()
        findings_panel(analysis.device(device), window)
        window_text(analysis, device, window)
        segments_panel(analysis, device).to_json()
        for group_by in DASHBOARD_GROUP_BYS:
            for where in (None, window):
                panel = live_panel(analysis, device, window=where, group_by=group_by)
                panel.figure.to_json()
                if where is not None:
                    assert where.first <= panel.live.event <= where.last
                    assert panel.live.total_bytes == int(analysis.trace(device).allocated[
                        where.first:where.last + 1].max())
                if panel.groups is not None:
                    assert sum(g.bytes for g in panel.groups.groups) == panel.live.total_bytes
        budget_panel(report, device, BudgetForm(params="1B", hidden=2048, layers=16, heads=16,
                                                seq=1024, capacity="80GiB")).figure.to_json()
    compare_panel(report, report, None, None, "time")[0].to_json()
    row = rank_row(str(path), report)
    assert row.ok and row.peak_allocated_bytes == report.device(None).peak_allocated_bytes
    ranks_panel([row, row]).figure.to_json()
