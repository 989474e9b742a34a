"""The figure builders, without a browser: downsampling invariants and what each figure draws."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import plotly.graph_objects as go
import pytest

from memlens import figures
from memlens.snapshot.reader import parse
from memlens.units import GiB, MiB

# --------------------------------------------------------------------------- downsampling


def test_short_series_come_back_unchanged() -> None:
    x = np.arange(10)
    y = np.arange(10) * 3
    xs, ys = figures.downsample_minmax(x, y, 100)
    assert xs.tolist() == x.tolist()
    assert ys.tolist() == y.tolist()


@pytest.mark.parametrize("n", [4001, 10_007, 1_000_000])
@pytest.mark.parametrize("max_points", [4, 100, 4000])
def test_point_count_is_bounded_and_extremes_kept(n: int, max_points: int) -> None:
    rng = np.random.default_rng(n + max_points)
    y = np.cumsum(rng.integers(-100, 101, size=n))
    x = np.arange(n)
    xs, ys = figures.downsample_minmax(x, y, max_points)
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
    xs, _ = figures.downsample_minmax(np.arange(n), y, 400)
    assert set(spikes) <= set(xs.tolist())
    assert set(dips) <= set(xs.tolist())
    assert len(xs) <= 400


def test_every_bucket_keeps_its_min_and_max() -> None:
    rng = np.random.default_rng(3)
    y = rng.normal(size=50_000)
    max_points = 1000
    keep = figures.downsample_indices(y, max_points)
    buckets = (max_points - 2) // 2
    width = -(-len(y) // buckets)
    for start in range(0, len(y), width):
        chunk = y[start:start + width]
        kept = y[keep[(keep >= start) & (keep < start + width)]]
        assert kept.max() == chunk.max() and kept.min() == chunk.min()


def test_downsample_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        figures.downsample_minmax([1, 2], [1], 10)
    with pytest.raises(ValueError):
        figures.downsample_minmax(np.arange(10), np.arange(10), 2)


def test_downsampling_a_million_points_is_fast() -> None:
    import time

    y = np.random.default_rng(0).integers(0, 1 << 40, size=1_000_000)
    t0 = time.perf_counter()
    figures.downsample_minmax(np.arange(len(y)), y, 4000)
    assert time.perf_counter() - t0 < 1.0


# --------------------------------------------------------------------------- fakes mimicking the Report

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


@dataclass
class FakeStep:
    index: int
    start_event: int
    end_event: int
    start_us: int | None = None
    end_us: int | None = None


@dataclass
class FakeStackBytes:
    frames: list[str]
    bytes: int
    count: int


@dataclass
class FakeFinding:
    kind: str
    start_event: int
    end_event: int
    bytes: int = 4 * MiB
    device: int = 0
    severity: str = "high"
    summary: str = "memory grows by 1 MiB every step and never comes back"
    recommendation: str = "store loss.item(), not loss"
    top_stacks: list[FakeStackBytes] = field(default_factory=list)


@dataclass
class FakeDeviceReport:
    device: int
    events: int
    steps: list[FakeStep]
    findings: list[FakeFinding]
    peak_allocated_bytes: int
    peak_allocated_event: int
    peak_reserved_bytes: int
    final_allocated_bytes: int
    categories_at_peak: dict[str, int]
    top_stacks_by_category: dict[str, list[FakeStackBytes]]
    capacity_bytes: int | None = None


@dataclass
class FakeReport:
    source: str
    snapshot: object
    devices: dict[int, FakeDeviceReport]


def fake_report(source: str = "run.pickle", **kwargs: int) -> FakeReport:
    snapshot = parse(_raw_snapshot(**kwargs), source=source)
    trace = snapshot.device(0)
    per_step = len(trace) // kwargs.get("steps", 4)
    steps = [FakeStep(i, i * per_step, (i + 1) * per_step) for i in range(kwargs.get("steps", 4))]
    peak_event = int(np.argmax(trace.allocated))
    device_report = FakeDeviceReport(
        device=0, events=len(trace), steps=steps,
        findings=[FakeFinding("leak", 0, len(trace)),
                  FakeFinding("activation_plateau", 10, 60, severity="low")],
        peak_allocated_bytes=int(trace.allocated.max()), peak_allocated_event=peak_event,
        peak_reserved_bytes=int(trace.reserved.max()), final_allocated_bytes=int(trace.allocated[-1]),
        categories_at_peak={"parameters": 0, "gradients": 0, "optimizer_state": 0,
                            "activations": 200 * MiB, "temporary": 0, "unknown": 3 * MiB},
        top_stacks_by_category={"activations": [FakeStackBytes(["forward (train.py:10)", "main (train.py:3)"],
                                                               200 * MiB, 50)]},
        capacity_bytes=4 * GiB,
    )
    return FakeReport(source=source, snapshot=snapshot, devices={0: device_report})


# --------------------------------------------------------------------------- timeline


def _trace_named(fig: go.Figure, name: str) -> go.Scatter:
    return next(t for t in fig.data if t.name == name)


def test_timeline_draws_curves_steps_findings_and_peak() -> None:
    report = fake_report()
    fig = figures.timeline_figure(report)
    names = [t.name for t in fig.data]
    assert names[:2] == ["reserved", "allocated"]
    assert "step boundaries" in names and "peak" in names
    assert "leak" in names and "activation plateau" in names
    allocated = _trace_named(fig, "allocated")
    trace = report.snapshot.device(0)
    assert max(allocated.y) == pytest.approx(trace.allocated.max() / GiB)  # 2 GiB reserved: GiB axis
    leak = _trace_named(fig, "leak")
    assert leak.fill == "toself" and "loss.item()" in leak.text
    assert fig.layout.meta["points_per_trace"] == [len(trace), len(trace)]
    # capacity line
    assert any("capacity" in (a.text or "") for a in fig.layout.annotations)


def test_timeline_bounds_points_and_zooms_to_full_detail() -> None:
    report = fake_report(steps=40, per_step=200)
    trace = report.snapshot.device(0)
    assert len(trace) > 4000
    overview = figures.timeline_figure(report, max_points=500)
    assert all(n <= 500 for n in overview.layout.meta["points_per_trace"])
    assert max(_trace_named(overview, "allocated").y) == pytest.approx(trace.allocated.max() / GiB)
    zoomed = figures.timeline_figure(report, start=1000, end=1400, max_points=500)
    xs = np.asarray(_trace_named(zoomed, "allocated").x)
    assert xs.tolist() == list(range(1000, 1400)), "every event of the visible range"
    assert zoomed.layout.xaxis.range == (1000, 1399)


def test_timeline_time_axis_and_event_range() -> None:
    report = fake_report()
    trace = report.snapshot.device(0)
    fig = figures.timeline_figure(report, x_axis="time")
    assert fig.layout.meta["x_axis"] == "time"
    assert fig.layout.xaxis.title.text.startswith("time")
    seconds = figures.event_times_s(trace)
    assert seconds is not None
    start, end = figures.event_range(trace, float(seconds[20]), float(seconds[30]), "time")
    assert start == 20 and end is not None and end >= 31
    assert figures.event_range(trace, 5.2, 9.7) == (5, 11)


def test_timeline_accepts_a_device_report_with_its_trace() -> None:
    report = fake_report()
    fig = figures.timeline_figure(report.devices[0], trace=report.snapshot.device(0), highlight=0,
                                  marker_event=5)
    assert _trace_named(fig, "leak").line.width == 2
    with pytest.raises(TypeError):
        figures.timeline_figure(report.devices[0])


def test_timeline_without_history_says_so() -> None:
    raw = _raw_snapshot()
    raw["device_traces"] = [[]]
    snapshot = parse(raw)
    report = fake_report()
    report.snapshot = snapshot
    fig = figures.timeline_figure(report)
    assert "no allocation history" in fig.layout.annotations[0].text


def test_timeline_marks_oom() -> None:
    raw = _raw_snapshot()
    raw["device_traces"][0].append({"action": "oom", "addr": 0, "size": 8 * GiB, "stream": 0,
                                    "time_us": 10**7, "device_free": 1024, "frames": FRAMES})
    report = fake_report()
    report.snapshot = parse(raw)
    fig = figures.timeline_figure(report)
    assert _trace_named(fig, "OOM").customdata[0][1] == 8 * GiB


# --------------------------------------------------------------------------- the others


def test_categories_treemap_and_sunburst() -> None:
    device_report = fake_report().devices[0]
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
    snapshot = fake_report().snapshot
    fig = figures.segment_map_figure(snapshot, 0)
    names = {t.name for t in fig.data}
    assert names == {"allocated", "free (cached)"}
    free = next(t for t in fig.data if t.name == "free (cached)")
    assert sum(free.x) * GiB == pytest.approx(snapshot.segments[0].free_size)
    assert "1 segments" in fig.layout.title.text
    assert "No segments" in figures.segment_map_figure(snapshot, 3).layout.annotations[0].text


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
    a = fake_report("a.pickle", steps=4)
    b = fake_report("b.pickle", steps=6)
    fig = figures.compare_figure(a, b)
    assert [t.name for t in fig.data] == ["a.pickle [dev 0]", "b.pickle [dev 0]"]
    rows = {r["metric"]: r for r in figures.compare_rows(a, b)}
    assert rows["peak allocated"]["delta"] == "+2.00 MiB"
    assert rows["steps"]["a"] == "4" and rows["steps"]["b"] == "6"


def test_figures_serialise_to_json() -> None:
    report = fake_report()
    for fig in (figures.timeline_figure(report), figures.categories_figure(report.devices[0]),
                figures.segment_map_figure(report.snapshot), figures.compare_figure(report, report)):
        assert fig.to_json()
