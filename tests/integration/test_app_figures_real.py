"""Every figure builds from the real analysis of every real snapshot (all format versions)."""

from __future__ import annotations

from pathlib import Path

import pytest

import memlens
from memlens import figures
from memlens.budget import ModelSpec, TrainingSetup, estimate, reconcile
from tests.conftest import REAL_SNAPSHOTS_MISSING, real_snapshot_paths

PATHS = real_snapshot_paths()


@pytest.mark.skipif(not PATHS, reason=REAL_SNAPSHOTS_MISSING)
@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_every_figure_builds(path: Path) -> None:
    report = memlens.analyze(path)
    device = figures.primary_device(report)
    device_report = report.devices[device]
    trace = report.snapshot.device(device)
    for x_axis in ("event", "time"):
        timeline = figures.timeline_figure(report, device=device, x_axis=x_axis, max_points=1000)
        if len(trace):
            assert all(n <= 1000 for n in timeline.layout.meta["points_per_trace"])
            allocated = next(t for t in timeline.data if t.name == "allocated")
            scale = figures.ByteScale.for_max(max(trace.reserved.max(), device_report.capacity_bytes or 0))
            assert max(allocated.y) == pytest.approx(trace.allocated.max() / scale.divisor)
        timeline.to_json()
    for finding in device_report.findings:
        zoomed = figures.timeline_figure(report, finding.start_event, finding.end_event + 1, device=device)
        zoomed.to_json()
    figures.categories_figure(device_report).to_json()
    figures.segment_map_figure(report.snapshot, device).to_json()
    budget = estimate(ModelSpec.from_numbers(1e9, hidden_size=2048, n_layers=16, n_heads=16),
                      TrainingSetup(micro_batch=2, seq_len=1024))
    figures.budget_figure(reconcile(budget, device_report), capacity=80 << 30).to_json()
    figures.compare_figure(report, report).to_json()
    assert figures.compare_rows(report, report)[0]["delta"] == "+0 B"
