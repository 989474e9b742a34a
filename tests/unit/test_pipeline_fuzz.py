"""Odd but well-formed snapshots (frees without allocs, OOMs, unknown actions, segments on two
devices, stray annotations) go through analysis, the figures, diff and what-if without crashing:
a user's file only ever gets a report or one MemlensError."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memlens import figures
from memlens.allocator import whatif
from memlens.analysis import analyze_snapshot
from memlens.analysis.report import Report
from memlens.compare import diff_reports
from memlens.errors import MemlensError
from memlens.snapshot.reader import parse

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow

ADDRESSES = [0, 512, 1024, 4096, 1 << 21, 1 << 30]
SIZES = [0, 1, 512, 1 << 20, 1 << 22, 1 << 31]
FRAMES = [
    {"filename": "train.py", "line": 3, "name": "forward"},
    {"filename": "torch/optim/adam.py", "line": 9, "name": "step"},
    {"filename": "torch/autograd/__init__.py", "line": 1, "name": "backward"},
    {"filename": "??", "line": 0, "name": "c10::alloc"},
]
entry = st.fixed_dictionaries(
    {
        "action": st.sampled_from(["alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
                                   "segment_map", "segment_unmap", "oom", "snapshot", "weird"]),
        "addr": st.sampled_from(ADDRESSES),
        "size": st.sampled_from(SIZES),
        "stream": st.sampled_from([0, 7]),
    },
    optional={"frames": st.lists(st.sampled_from(FRAMES), max_size=3), "device_free": st.sampled_from(SIZES)},
)


@st.composite
def snapshots(draw: st.DrawFn) -> dict[str, Any]:
    entries = draw(st.lists(entry, max_size=50))
    for time, item in enumerate(entries):
        item["time_us"] = 1000 + time
    segments = []
    for index in range(draw(st.integers(0, 3))):
        base = ADDRESSES[index + 2]
        states = draw(st.lists(st.sampled_from(["active_allocated", "inactive", "active_pending_free"]),
                               min_size=4, max_size=4))
        blocks = [{"address": base + k * 512, "size": 512, "requested_size": draw(st.integers(0, 512)),
                   "state": state} for k, state in enumerate(states)]
        segments.append({"device": draw(st.sampled_from([0, 0, 1])), "address": base, "total_size": 2048,
                         "stream": 0, "blocks": blocks})
    annotations = draw(st.lists(st.fixed_dictionaries({
        "name": st.sampled_from(["ProfilerStep#1", "Optimizer.step#Adam.step", "memlens.step#2",
                                 "Optimizer.zero_grad#SGD.zero_grad"]),
        "stage": st.sampled_from(["START", "END"]),
        "device": st.just(0),
        "time_us": st.integers(900, 1100),
    }), max_size=6))
    return {"segments": segments, "device_traces": [entries, []], "external_annotations": annotations}


@settings(max_examples=60, deadline=None)
@given(raw=snapshots())
def test_every_stage_survives_odd_snapshots(raw: dict[str, Any]) -> None:
    try:
        snapshot = parse(raw)
        for capacity in (None, 1 << 30):
            analysis = analyze_snapshot(snapshot, capacity=capacity)
            report = analysis.report
            assert Report.from_json(report.to_json()) == report
            for device, device_report in report.devices.items():
                figures.timeline_figure(device_report)
                figures.categories_figure(device_report)
                figures.segment_map_figure(device_report.segment_map, device)
            diff_reports(analysis, analysis)
        whatif(snapshot)
    except MemlensError:
        pass
