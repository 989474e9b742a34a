"""Every figure builds from the real analysis of every real snapshot (all format versions)."""

from __future__ import annotations

from pathlib import Path

import pytest

import memlens
from memlens import figures
from memlens.analysis import analyze_snapshot
from memlens.analysis.views import REPORT_TIMELINE_BUCKETS, timeline_of
from memlens.budget import ModelSpec, TrainingSetup, estimate, reconcile
from tests.conftest import REAL_SNAPSHOTS_MISSING, real_snapshot_paths

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow

PATHS = real_snapshot_paths()


@pytest.mark.skipif(not PATHS, reason=REAL_SNAPSHOTS_MISSING)
@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_every_figure_builds(path: Path) -> None:
    analysis = analyze_snapshot(memlens.load(path))
    report = analysis.report
    device = figures.primary_device(report)
    device_report = report.devices[device]
    trace = analysis.snapshot.device(device)
    for x_axis in ("event", "time"):
        timeline = figures.timeline_figure(device_report, x_axis=x_axis)
        if len(trace):
            # At most the buckets' min and max of both curves and each step's first row, min, max.
            most = 2 * 2 * REPORT_TIMELINE_BUCKETS + 3 * len(device_report.steps) + 2
            assert all(n <= most for n in timeline.layout.meta["points_per_trace"])
            allocated = next(t for t in timeline.data if t.name == "allocated")
            scale = figures.ByteScale.for_max(max(trace.reserved.max(), device_report.capacity_bytes or 0))
            assert max(allocated.y) == pytest.approx(trace.allocated.max() / scale.divisor)
        timeline.to_json()
    for finding in device_report.findings:
        window = timeline_of(trace, device_report.steps, start=finding.start_event, end=finding.end_event + 1)
        figures.timeline_figure(device_report, window, zoomed=True).to_json()
    figures.categories_figure(device_report).to_json()
    figures.segment_map_figure(device_report.segment_map, device).to_json()
    budget = estimate(ModelSpec.from_numbers(1e9, hidden_size=2048, n_layers=16, n_heads=16),
                      TrainingSetup(micro_batch=2, seq_len=1024))
    figures.budget_figure(reconcile(budget, device_report), capacity=80 << 30).to_json()
    figures.compare_figure(report, report).to_json()
    assert figures.compare_rows(report, report)[0]["delta"] == "+0 B"
