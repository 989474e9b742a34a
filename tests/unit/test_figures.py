"""The figure builders, without a browser: downsampling invariants and what each figure draws."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import plotly.graph_objects as go
import pytest

from memlens import figures
from memlens.analysis.datatypes import FindingKind, Severity
from memlens.analysis.report import DeviceReport, Finding, Report, StackBytes, Step
from memlens.analysis.views import downsample_indices, downsample_minmax, segment_map_of, timeline_of
from memlens.snapshot.model import DeviceTrace, Snapshot
from memlens.snapshot.reader import parse
from memlens.units import GiB, MiB

# --------------------------------------------------------------------------- downsampling


def test_short_series_come_back_unchanged() -> None:
    x = np.arange(10)
    y = np.arange(10) * 3
    xs, ys = downsample_minmax(x, y, 100)
    assert xs.tolist() == x.tolist()
    assert ys.tolist() == y.tolist()


@pytest.mark.parametrize("n", [4001, 10_007, 1_000_000])
@pytest.mark.parametrize("max_points", [4, 100, 4000])
def test_point_count_is_bounded_and_extremes_kept(n: int, max_points: int) -> None:
    rng = np.random.default_rng(n + max_points)
    y = np.cumsum(rng.integers(-100, 101, size=n))
    x = np.arange(n)
    xs, ys = downsample_minmax(x, y, max_points)
    assert len(xs) <= max_points
    assert ys.max() == y.max()
    assert ys.min() == y.min()
    assert xs[0] == 0 and xs[-1] == n - 1
    assert np.all(np.diff(xs) > 0), "x stays sorted with no duplicates"
    assert np.array_equal(ys, y[xs]), "kept points are real points"


def test_every_local_spike_survives() -> None:
    n = 1_000_000
    y = np.full(n, 5, dtype=np.int64)
    spikes = [17, 123_456, 500_001, 999_998]
    dips = [42, 777_777]
    y[spikes] = [50, 60, 70, 80]
    y[dips] = [-1, -2]
    xs, _ = downsample_minmax(np.arange(n), y, 400)
    assert set(spikes) <= set(xs.tolist())
    assert set(dips) <= set(xs.tolist())
    assert len(xs) <= 400


def test_every_bucket_keeps_its_min_and_max() -> None:
    rng = np.random.default_rng(3)
    y = rng.normal(size=50_000)
    max_points = 1000
    keep = downsample_indices(y, max_points)
    buckets = (max_points - 2) // 2
    width = -(-len(y) // buckets)
    for start in range(0, len(y), width):
        chunk = y[start:start + width]
        kept = y[keep[(keep >= start) & (keep < start + width)]]
        assert kept.max() == chunk.max() and kept.min() == chunk.min()


def test_downsample_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        downsample_minmax([1, 2], [1], 10)
    with pytest.raises(ValueError):
        downsample_minmax(np.arange(10), np.arange(10), 2)


# --------------------------------------------------------------------------- a hand-made report

FRAMES = [{"filename": "train.py", "line": 10, "name": "forward"}, {"filename": "train.py", "line": 3,
                                                                      "name": "main"}]


def _raw_snapshot(steps: int = 4, per_step: int = 50, leak: int = MiB) -> dict:
    """A small, exact raw snapshot: per step, activations rise then fall; each step leaks one block."""
    trace, time_us = [], 0
    address = (1 << 30) + per_step * 4 * MiB  # leaks live above the activations' reused addresses
    live_leaks = []
    for _ in range(steps):
        step_addrs = []
        for i in range(per_step):
            act_address = (1 << 30) + i * 4 * MiB
            time_us += 10
            trace.append({"action": "alloc", "addr": act_address, "size": 4 * MiB, "stream": 0,
                          "time_us": time_us, "frames": FRAMES})
            step_addrs.append(act_address)
        for a in step_addrs:
            time_us += 10
            trace.append({"action": "free_requested", "addr": a, "size": 4 * MiB, "stream": 0,
                          "time_us": time_us, "frames": FRAMES})
            trace.append({"action": "free_completed", "addr": a, "size": 4 * MiB, "stream": 0,
                          "time_us": time_us, "frames": FRAMES})
        time_us += 10
        trace.append({"action": "alloc", "addr": address, "size": leak, "stream": 0, "time_us": time_us,
                      "frames": FRAMES})
        live_leaks.append(address)
        address += 4 * MiB
    segment = {"device": 0, "address": 1 << 30, "total_size": 2 * GiB, "allocated_size": leak * steps,
               "active_size": leak * steps, "requested_size": leak * steps, "stream": 0,
               "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
               "blocks": [{"address": a, "size": leak, "requested_size": leak, "state": "active_allocated",
                           "frames": FRAMES} for a in live_leaks]}
    # below the leaks and after them, free (cached) pieces
    first_leak = min(live_leaks) - (1 << 30)
    used = max(live_leaks) + leak - (1 << 30)
    segment["blocks"].insert(0, {"address": 1 << 30, "size": first_leak, "requested_size": 0,
                                 "state": "inactive", "frames": []})
    segment["blocks"].append({"address": (1 << 30) + used, "size": 2 * GiB - used, "requested_size": 0,
                              "state": "inactive", "frames": []})
    return {"segments": [segment], "device_traces": [trace]}


def _finding(kind: FindingKind, start: int, end: int, severity: Severity = "high") -> Finding:
    return Finding(kind=kind, device=0, severity=severity, bytes=4 * MiB, start_event=start, end_event=end,
                   start_us=None, end_us=None, step=None, top_stacks=[], evidence={},
                   summary="memory grows by 1 MiB every step and never comes back",
                   recommendation="store loss.item(), not loss", estimated_saving_bytes=None)


@dataclass
class Fixture:
    """A hand-made report (numbers chosen here, not analysed) and the snapshot it describes."""

    report: Report
    snapshot: Snapshot

    @property
    def device(self) -> DeviceReport:
        return self.report.devices[0]

    @property
    def trace(self) -> DeviceTrace:
        return self.snapshot.device(0)


def fake_report(source: str = "run.pickle", raw: dict[str, Any] | None = None, **kwargs: int) -> Fixture:
    snapshot = parse(raw if raw is not None else _raw_snapshot(**kwargs), source=source)
    trace = snapshot.device(0)
    count = kwargs.get("steps", 4)
    per_step = max(len(trace) // count, 1)
    steps = [Step(i, i * per_step, (i + 1) * per_step, None, None) for i in range(count)] if len(trace) else []
    peak_event = int(np.argmax(trace.allocated)) if len(trace) else None
    device_report = DeviceReport(
        device=0, events=len(trace), step_source="memlens", steps=steps,
        findings=[_finding("leak", 0, len(trace)), _finding("activation_plateau", 10, 60, severity="low")],
        peak_allocated_bytes=int(trace.allocated.max()) if len(trace) else 0, peak_allocated_event=peak_event,
        peak_reserved_bytes=int(trace.reserved.max()) if len(trace) else 0, peak_reserved_event=None,
        peak_time_us=None, baseline_allocated_bytes=0,
        final_allocated_bytes=int(trace.allocated[-1]) if len(trace) else 0, final_reserved_bytes=0,
        categories_at_peak={"parameters": 0, "gradients": 0, "optimizer_state": 0,
                            "activations": 200 * MiB, "temporary": 0, "unknown": 3 * MiB},
        top_stacks_by_category={"activations": [StackBytes(["forward (train.py:10)", "main (train.py:3)"],
                                                           200 * MiB, 50)]},
        capacity_bytes=4 * GiB,
        timeline=timeline_of(trace, steps) if len(trace) else None,
        segment_map=segment_map_of(snapshot, 0),
    )
    report = Report(source=source, format_guess="2.1+", devices={0: device_report},
                    findings=list(device_report.findings))
    return Fixture(report, snapshot)


# --------------------------------------------------------------------------- timeline


def _trace_named(fig: go.Figure, name: str) -> go.Scatter:
    return next(t for t in fig.data if t.name == name)


def test_timeline_draws_curves_steps_findings_and_peak() -> None:
    fixture = fake_report()
    fig = figures.timeline_figure(fixture.device)
    names = [t.name for t in fig.data]
    assert names[:2] == ["reserved", "allocated"]
    assert "step boundaries" in names and "peak" in names
    assert "leak" in names and "activation plateau" in names
    allocated = _trace_named(fig, "allocated")
    trace = fixture.trace
    assert max(allocated.y) == pytest.approx(trace.allocated.max() / GiB)  # 2 GiB reserved: GiB axis
    leak = _trace_named(fig, "leak")
    assert leak.fill == "toself" and "loss.item()" in leak.text
    assert fig.layout.meta["points_per_trace"] == [len(trace), len(trace)]  # short: every row
    # capacity line
    assert any("capacity" in (a.text or "") for a in fig.layout.annotations)


def test_report_timeline_keeps_extremes_and_each_steps_peak() -> None:
    fixture = fake_report(steps=40, per_step=200)
    trace, device = fixture.trace, fixture.device
    assert len(trace) > 4000
    timeline = timeline_of(trace, device.steps, max_points=500)
    assert len(timeline.event) < 700 and timeline.events == len(trace)
    assert max(timeline.allocated) == int(trace.allocated.max())
    assert min(timeline.allocated) == int(trace.allocated.min())
    points = np.asarray(timeline.event)
    values = np.asarray(timeline.allocated)
    for step in device.steps:
        inside = (points >= step.start_event) & (points < step.end_event)
        assert step.start_event in timeline.event, "every step's first row is a point"
        assert values[inside].max() == trace.allocated[step.start_event:step.end_event].max()
    assert timeline.allocated == trace.allocated[points].tolist(), "kept points are real points"


def test_timeline_zooms_to_full_detail() -> None:
    fixture = fake_report(steps=40, per_step=200)
    zoom = timeline_of(fixture.trace, fixture.device.steps, start=1000, end=1400, max_points=500)
    zoomed = figures.timeline_figure(fixture.device, zoom, zoomed=True)
    xs = np.asarray(_trace_named(zoomed, "allocated").x)
    assert xs.tolist() == list(range(1000, 1400)), "every event of the visible range"
    assert zoomed.layout.xaxis.range == (1000, 1399)


def test_timeline_time_axis_and_event_range() -> None:
    fixture = fake_report()
    trace, timeline = fixture.trace, fixture.device.timeline
    assert timeline is not None
    fig = figures.timeline_figure(fixture.device, x_axis="time")
    assert fig.layout.meta["x_axis"] == "time"
    assert fig.layout.xaxis.title.text.startswith("time")
    seconds = figures.times_s(timeline)
    assert seconds is not None and len(seconds) == len(trace)
    start, end = figures.event_range(timeline, float(seconds[20]), float(seconds[30]), "time")
    assert start == 20 and end is not None and end >= 31
    assert figures.event_range(timeline, 5.2, 9.7) == (5, 11)


def test_timeline_highlight_and_marker() -> None:
    fixture = fake_report()
    fig = figures.timeline_figure(fixture.device, highlight=0, marker_event=5)
    assert _trace_named(fig, "leak").line.width == 2
    assert any(shape.line.dash == "dot" for shape in fig.layout.shapes)


def test_timeline_without_history_says_so() -> None:
    raw = _raw_snapshot()
    raw["device_traces"] = [[]]
    fig = figures.timeline_figure(fake_report(raw=raw).device)
    assert "no allocation history" in fig.layout.annotations[0].text


def test_timeline_marks_oom() -> None:
    raw = _raw_snapshot()
    raw["device_traces"][0].append({"action": "oom", "addr": 0, "size": 8 * GiB, "stream": 0,
                                    "time_us": 10**7, "device_free": 1024, "frames": FRAMES})
    fig = figures.timeline_figure(fake_report(raw=raw).device)
    assert _trace_named(fig, "OOM").customdata[0][1] == 8 * GiB


# --------------------------------------------------------------------------- the others


def test_categories_treemap_and_sunburst() -> None:
    device_report = fake_report().device
    fig = figures.categories_figure(device_report)
    treemap = fig.data[0]
    assert isinstance(treemap, go.Treemap)
    assert "activations" in treemap.ids and "activations/0" in treemap.ids
    values = dict(zip(treemap.ids, treemap.values, strict=True))
    assert values["live"] == values["activations"] + values["unknown"]
    assert "forward (train.py:10)" in treemap.hovertext[list(treemap.ids).index("activations/0")]
    sun = figures.categories_figure(device_report, kind="sunburst")
    assert isinstance(sun.data[0], go.Sunburst)
    empty = figures.categories_figure(device_report, categories={"activations": 0})
    assert "Nothing was live" in empty.layout.annotations[0].text


def test_segment_map_shows_allocated_and_free_pieces() -> None:
    fixture = fake_report()
    snapshot = fixture.snapshot
    fig = figures.segment_map_figure(fixture.device.segment_map, 0)
    names = {t.name for t in fig.data}
    assert names == {"allocated", "free (cached)"}
    free = next(t for t in fig.data if t.name == "free (cached)")
    assert sum(free.x) * GiB == pytest.approx(snapshot.segments[0].free_size)
    assert "1 segments" in fig.layout.title.text
    assert "No segments" in figures.segment_map_figure(segment_map_of(snapshot, 3), 3).layout.annotations[0].text


def test_budget_figure_side_by_side() -> None:
    rows = [{"category": "parameters", "theory_bytes": 2 * GiB, "measured_bytes": 2.1 * GiB},
            {"category": "activations", "theory_bytes": 6 * GiB, "measured_bytes": None}]
    fig = figures.budget_figure(rows, capacity=16 * GiB)
    theory, measured = fig.data
    assert fig.layout.barmode == "group"
    assert list(theory.y) == [2, 6] and measured.y[1] is None and measured.text[1] == "n/a"
    mapping = figures.budget_figure({"weights": (1 * GiB, 1 * GiB)})
    assert list(mapping.data[0].x) == ["weights"]
    assert "No budget" in figures.budget_figure([]).layout.annotations[0].text


def test_compare_overlays_and_diffs() -> None:
    a = fake_report("a.pickle", steps=4).report
    b = fake_report("b.pickle", steps=6).report
    fig = figures.compare_figure(a, b)
    assert [t.name for t in fig.data] == ["a.pickle [dev 0]", "b.pickle [dev 0]"]
    rows = {r["metric"]: r for r in figures.compare_rows(a, b)}
    assert rows["peak allocated"]["delta"] == "+2.00 MiB"
    assert rows["steps"]["a"] == "4" and rows["steps"]["b"] == "6"


def test_figures_serialise_to_json() -> None:
    fixture = fake_report()
    device = fixture.device
    for fig in (figures.timeline_figure(device), figures.categories_figure(device),
                figures.segment_map_figure(device.segment_map, 0),
                figures.compare_figure(fixture.report, fixture.report)):
        assert fig.to_json()
