"""``live_at``: what was live after any trace row, by category and stack."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import memlens
from memlens.analysis import CATEGORIES, LiveBreakdown, analyze_snapshot, live_at
from memlens.analysis.categories import bytes_by_category
from memlens.analysis.context import build_context
from memlens.analysis.settings import AnalysisSettings
from memlens.analysis.stacks import StackFacts
from memlens.errors import MemlensUsageError
from tests.conftest import REAL_SNAPSHOTS_DIR, REAL_SNAPSHOTS_MISSING
from tests.unit.tracebuilder import MODEL, MiB, TraceBuilder, training_run

PARAMS = 4 * 32 * MiB


def _rows(b: TraceBuilder, action: str, size: int) -> list[int]:
    return [i for i, e in enumerate(b.trace) if e["action"] == action and e["size"] == size]


def test_at_the_peak_equals_categories_at_peak() -> None:
    report = analyze_snapshot(training_run(3).snapshot())
    device = report.device(0)
    live = live_at(report, 0, device.peak_allocated_event)
    assert isinstance(live, LiveBreakdown)
    assert live.is_peak and live.label == "at the peak"
    assert live.categories == device.categories_at_peak
    assert live.top_stacks_by_category == device.top_stacks_by_category
    assert live.total_bytes == device.peak_allocated_bytes
    assert live_at(report, None).categories == device.categories_at_peak  # event None: the peak


def test_during_the_first_forward() -> None:
    """Three activations made in step 1: they, the parameters and nothing else are live."""
    b = training_run(2)
    report = analyze_snapshot(b.snapshot())
    third = _rows(b, "alloc", 64 * MiB)[2]
    live = live_at(report, 0, third)
    assert live.categories["parameters"] == PARAMS
    assert live.categories["activations"] == 3 * 64 * MiB
    assert live.categories["gradients"] == 0 and live.categories["optimizer_state"] == 0
    assert live.total_bytes == int(report.snapshot.device(0).allocated[third])
    assert not live.is_peak
    assert live.top_stacks_by_category["activations"][0].frames[0].startswith("forward (/work/proj/model.py")
    assert live.top_stacks_by_category["activations"][0].count == 3
    assert live.top_stacks_by_category["gradients"] == []


def test_between_steps_gradients_and_optimizer_state_remain() -> None:
    b = training_run(2)
    report = analyze_snapshot(b.snapshot())
    device = report.device(0)
    end_of_step_1 = device.steps[0].end_event - 1
    live = live_at(report, 0, end_of_step_1)
    assert live.categories == {"parameters": PARAMS, "gradients": PARAMS, "optimizer_state": 2 * PARAMS,
                               "activations": 0, "temporary": 0, "workspace": 0, "leaked": 0, "unknown": 0}
    assert live.total_bytes == int(report.snapshot.device(0).allocated[end_of_step_1])
    assert live.top_stacks_by_category["optimizer_state"][0].count == 8


def test_every_row_sums_to_the_allocated_curve() -> None:
    b = training_run(3, leak=8 * MiB)
    report = analyze_snapshot(b.snapshot())
    allocated = report.snapshot.device(0).allocated
    for event in range(0, len(allocated), 7):
        assert live_at(report, 0, event).total_bytes == int(allocated[event])


def test_a_kept_leak_is_live_after_its_step() -> None:
    b = training_run(3, leak=8 * MiB)
    report = analyze_snapshot(b.snapshot())
    device = report.device(0)
    last = device.events - 1
    live = live_at(report, 0, last)
    leaked = sum(s.bytes for name in CATEGORIES for s in live.top_stacks_by_category[name]
                 if s.frames and s.frames[0].startswith("train (/work/proj/train.py:50)"))
    assert leaked == 3 * 8 * MiB


def test_label_names_the_event_and_time() -> None:
    b = training_run(2)
    report = analyze_snapshot(b.snapshot())
    trace = report.snapshot.device(0)
    live = live_at(report, 0, 5)
    assert live.time_us == int(trace.time_us[5])
    assert live.seconds == pytest.approx((trace.time_us[5] - trace.time_us[0]) / 1e6)
    assert live.label == f"at event 5 (t = {live.seconds:.3g} s)"

    untimed = TraceBuilder(with_time=False)
    untimed.free(untimed.alloc(MiB, MODEL))
    untimed.alloc(2 * MiB, MODEL)
    live = live_at(analyze_snapshot(untimed.snapshot()), 0, 0)
    assert live.seconds is None and live.label == "at event 0"


def test_bad_event_or_device_is_a_usage_error() -> None:
    report = analyze_snapshot(training_run(1).snapshot())
    n = report.device(0).events
    for event in (-1, n):
        with pytest.raises(MemlensUsageError, match="outside the trace"):
            live_at(report, 0, event)
    with pytest.raises(MemlensUsageError, match="no device 3"):
        live_at(report, 3, 0)


def test_state_only_snapshot() -> None:
    b = TraceBuilder()
    b.ghost(10 * MiB)
    report = analyze_snapshot(b.snapshot())
    live = live_at(report, 0)
    assert live.event is None and live.is_peak
    assert live.categories == report.device(0).categories_at_peak
    with pytest.raises(MemlensUsageError):
        live_at(report, 0, 0)


REAL = sorted(REAL_SNAPSHOTS_DIR.glob("*.pickle")) if REAL_SNAPSHOTS_DIR.is_dir() else []


@pytest.mark.skipif(not REAL, reason=REAL_SNAPSHOTS_MISSING)
@pytest.mark.parametrize("path", REAL, ids=[p.name.split("__")[0] for p in REAL])
def test_real_snapshot_peak_matches(path: Path) -> None:
    """At the peak, live_at equals categories_at_peak and what the analysis context says
    independently (its own live mask and categories); elsewhere it covers the curve."""
    snapshot = memlens.load(path, cache=False)
    report = analyze_snapshot(snapshot)
    facts = StackFacts.build(snapshot.stacks)
    for device, dr in report.report.devices.items():
        live = live_at(report, device, dr.peak_allocated_event)
        assert live.categories == dr.categories_at_peak
        assert live.top_stacks_by_category == dr.top_stacks_by_category
        assert live.total_bytes == sum(dr.categories_at_peak.values())
        if not dr.events:
            continue
        trace = snapshot.device(device)
        ctx = build_context(snapshot, trace, AnalysisSettings(), facts)
        # The peak is the highest row, or the instant before row 0 when more was live then.
        peak = int(np.argmax(trace.allocated))
        peak_bytes = int(trace.allocated[peak])
        if trace.baseline_allocated > peak_bytes:
            peak, peak_bytes = -1, trace.baseline_allocated
        assert dr.peak_allocated_bytes == peak_bytes
        assert dr.peak_allocated_event == (None if peak < 0 else peak)
        expected = bytes_by_category(ctx.category, ctx.lifetimes.size, ctx.lifetimes.live_at(peak))
        expected["unknown"] += max(peak_bytes - sum(expected.values()), 0)
        assert live.categories == expected
        for event in np.linspace(0, dr.events - 1, 5).astype(int):
            other = live_at(report, device, int(event))
            assert other.total_bytes >= int(trace.allocated[event])
            assert set(other.categories) == set(CATEGORIES)
