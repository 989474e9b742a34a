"""The analysis on every real CUDA snapshot in ../shared/real_snapshots."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import memlens
from memlens.analysis import CATEGORIES, analyze
from memlens.analysis.schema import validate
from memlens.snapshot.model import Snapshot
from tests.conftest import REAL_SNAPSHOTS_MISSING, real_snapshot, real_snapshot_paths

PATHS = real_snapshot_paths()
pytestmark = pytest.mark.skipif(not PATHS, reason=REAL_SNAPSHOTS_MISSING)

_loaded: dict[str, Snapshot] = {}


def _load(name: str) -> Snapshot:
    if name not in _loaded:
        _loaded[name] = memlens.load(real_snapshot(name), cache=False)  # skips when absent
    return _loaded[name]


@pytest.mark.parametrize("path", PATHS, ids=[p.name.split("__")[0] for p in PATHS])
def test_every_real_snapshot_analyses_and_validates(path: Path) -> None:
    report = analyze(_load(path.name))
    assert validate(report.to_json()) == []
    for device in report.devices.values():
        assert set(device.categories_at_peak) == set(CATEGORIES)
        assert sum(device.categories_at_peak.values()) == device.peak_allocated_bytes
        assert device.peak_reserved_bytes >= device.peak_allocated_bytes


def _overlaps(finding_range: tuple[int, int], window: tuple[int, int]) -> bool:
    return finding_range[0] < window[1] and window[0] < finding_range[1]


def test_bcrafton_optimizer_spike_overlaps_the_annotated_step() -> None:
    snapshot = _load("bcrafton")
    report = analyze(snapshot)
    (spike,) = [f for f in report.findings if f.kind == "optimizer_spike"]
    starts = [a.time_us for a in snapshot.annotations if a.name.startswith("Optimizer.step") and a.stage == "START"]
    ends = [a.time_us for a in snapshot.annotations if a.name.startswith("Optimizer.step") and a.stage == "END"]
    assert spike.start_us is not None and spike.end_us is not None
    assert spike.start_us < ends[0] and starts[0] < spike.end_us
    assert spike.evidence["window_source"] == "annotations"
    assert spike.severity == "high"  # the global peak is inside optimizer.step


def test_bcrafton_without_annotations_finds_the_optimizer_from_frames() -> None:
    """The frame-based path on a real file: strip the annotation and find the same phase."""
    snapshot = _load("bcrafton")
    annotated = analyze(snapshot).device(0).optimizer_windows[0]
    stripped = dataclasses.replace(snapshot, annotations=[])
    device = analyze(stripped).device(0)
    assert device.optimizer_window_source == "frames"
    (spike,) = [f for f in device.findings if f.kind == "optimizer_spike"]
    assert _overlaps((spike.start_event, spike.end_event), annotated)


def test_magma27_forward_backward_plateau_and_no_invented_optimizer() -> None:
    """MAGMA27's file records one forward + backward (the script at that commit calls no
    optimizer: benchmarking_script.py lines 64-73), so there is no optimizer phase to find."""
    report = analyze(_load("MAGMA27"))
    device = report.device(0)
    (plateau,) = [f for f in report.findings if f.kind == "activation_plateau"]
    assert plateau.evidence["share_of_peak"] > 0.8
    assert device.categories_at_peak["activations"] > 0.8 * device.peak_allocated_bytes
    assert device.optimizer_windows == []
    assert not [f for f in report.findings if f.kind == "optimizer_spike"]


def test_decomfl_has_steps_and_no_leak() -> None:
    report = analyze(_load("ZidongLiu"))
    device = report.device(0)
    assert device.step_source == "optimizer_annotations"
    assert len(device.steps) >= 2
    assert not [f for f in report.findings if f.kind == "leak"]


def test_oom_dump_is_reported_when_the_capacity_is_known() -> None:
    snapshot = _load("Yiyi-philosophy__LLM-inference__oom")
    assert not [f for f in analyze(snapshot).findings if f.kind == "oom"]  # capacity unknown: no guess
    (oom,) = [f for f in analyze(snapshot, capacity="11.5GiB").findings if f.kind == "oom"]
    assert oom.evidence["reserved_bytes"] > 0.95 * 11.5 * 2**30
