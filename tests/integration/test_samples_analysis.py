"""What the analyzer finds in each bundled sample: exactly what sample_snapshots/README.md says."""

from __future__ import annotations

import json
from functools import cache

import pytest

import memlens
from memlens.allocator import AllocatorSettings
from memlens.analysis import Report
from tests.conftest import SAMPLE_SNAPSHOTS_DIR

pytestmark = pytest.mark.skipif(not SAMPLE_SNAPSHOTS_DIR.is_dir(), reason="sample_snapshots/ missing")


@cache
def report(name: str) -> Report:
    return memlens.analyze(SAMPLE_SNAPSHOTS_DIR / f"{name}.pickle")


def kinds(name: str) -> set[str]:
    return {f.kind for f in report(name).findings}


def test_healthy_run_has_no_finding_and_marked_steps() -> None:
    device = report("healthy").device()
    assert kinds("healthy") == set()
    assert device.step_source == "memlens" and len(device.steps) == 5


def test_leak_run_is_a_leak_and_the_stacks_point_at_the_kept_forward() -> None:
    (leak,) = [f for f in report("leak").findings if f.kind == "leak"]
    assert 4 << 20 < leak.evidence["bytes_per_step"] < 6 << 20  # ~4.8 MiB a step
    assert any(frame.startswith("leak (") and "make_samples.py" in frame for s in leak.top_stacks for frame in s.frames)


def test_activation_heavy_run_has_an_activation_plateau_that_checkpointing_shrinks() -> None:
    (plateau,) = [f for f in report("activations").findings if f.kind == "activation_plateau"]
    assert plateau.evidence["share_of_peak"] > 0.5
    assert plateau.estimated_saving_bytes and plateau.estimated_saving_bytes > 0
    checkpointed = report("activations_checkpointed").device()
    assert checkpointed.peak_allocated_bytes < 0.5 * report("activations").device().peak_allocated_bytes
    assert "activation_plateau" not in kinds("activations_checkpointed")


def test_fragmentation_run_ends_in_an_oom_explained_by_fragmentation() -> None:
    found = {f.kind: f for f in report("fragmentation_oom").findings}
    assert {"oom", "fragmentation"} <= set(found)
    assert found["oom"].bytes == 24 << 20
    assert "fragmentation" in found["oom"].recommendation
    assert "expandable_segments:True" in found["fragmentation"].recommendation
    assert report("fragmentation_oom").device().capacity_bytes == 112 << 20  # from the sidecar


def test_expandable_segments_would_have_avoided_the_oom() -> None:
    path = SAMPLE_SNAPSHOTS_DIR / "fragmentation_oom.pickle"
    same = memlens.whatif(path)  # the recorded settings and capacity (from the sidecar): it fails again
    assert same.capacity == 112 << 20
    assert same.recorded.oom and same.simulated.oom
    assert same.simulated.oom_event == same.recorded.oom_event
    expandable = memlens.whatif(path, settings=AllocatorSettings(expandable_segments=True))
    assert not expandable.simulated.oom
    assert any("fits in the simulation" in note for note in expandable.notes)


def test_two_ranks_rank1_is_the_heavier() -> None:
    peaks = {rank: report(f"ddp_rank{rank}").device().peak_allocated_bytes for rank in (0, 1)}
    assert peaks[1] > peaks[0]
    summary = json.loads((SAMPLE_SNAPSHOTS_DIR / "ddp_ranks.json").read_text())
    assert "1" in json.dumps(summary)
    assert kinds("ddp_rank0") == kinds("ddp_rank1") == set()
