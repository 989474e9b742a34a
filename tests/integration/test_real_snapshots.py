"""Every real CUDA snapshot in ../shared/real_snapshots loads, and its curves are true totals."""

from __future__ import annotations

from pathlib import Path

import pytest

import memlens
from tests.conftest import known_real_snapshots, needs_real_snapshots, real_snapshot, real_snapshot_paths

pytestmark = needs_real_snapshots

# From SOURCES.md: trace entries per device and the torch release each was written by.
EXPECTED_EVENTS = {
    "Charran78__DocuBox__dump_snapshot.pickle": 0,
    "LfieLike__SketchKV2__my_snapshot.pickle": 1,
    "MAGMA27__assignment2-systems__memory_snapshot.pickle": 5163,
    "Yiyi-philosophy__LLM-inference__1.3b_snapshot.pickle": 1,
    "Yiyi-philosophy__LLM-inference__oom_snapshot.pickle": 1,
    "ZidongLiu__DeComFL__memory.pickle": 23105,
    "bcrafton__assignment2-systems__memory_snapshot.pickle": 6486,
    "silmont2000__assignment2-systems__mem_snapshot.pickle": 97,
    "silmont2000__assignment2-systems__memory_forward_bf16_128.pickle": 2811,
    "volcengine__verl__mem.pickle": 0,
}
COMPLETE_WINDOWS = {"ZidongLiu__DeComFL__memory.pickle", "silmont2000__assignment2-systems__mem_snapshot.pickle"}


def test_the_known_files_present_load_with_their_recorded_event_counts() -> None:
    known = known_real_snapshots(EXPECTED_EVENTS)
    if not known:
        pytest.skip("none of the files this table knows is in the folder")
    for name in known:
        assert memlens.load(real_snapshot(name), cache=False).device().events == EXPECTED_EVENTS[name], name


@pytest.mark.parametrize("path", real_snapshot_paths(), ids=lambda p: p.name[:40])
def test_loads_with_final_state_identities(path: Path) -> None:
    snap = memlens.load(path, cache=False)
    for device in snap.device_ids:
        check_final_state_identities(snap, device)


def check_final_state_identities(snap: memlens.Snapshot, device: int) -> None:
    trace = snap.device(device)
    segments = snap.segments_on(device)
    allocated = sum(b.size for s in segments for b in s.blocks if b.state == "active_allocated")
    pending = sum(b.size for s in segments for b in s.blocks if b.state == "active_pending_free")
    # Block bytes, as torch.cuda.memory_allocated counts them; it leaves pending frees out.
    assert trace.final_allocated == allocated
    assert trace.pending_free_final == pending
    assert trace.final_reserved == sum(s.total_size for s in segments)
    assert trace.baseline_allocated >= 0 and trace.baseline_reserved >= 0
    if trace.events:
        assert (trace.allocated >= 0).all()
        assert (trace.allocated <= trace.reserved).all()
    assert not trace.curve_warnings
    for seg in segments:  # blocks tile their segment
        assert sum(b.size for b in seg.blocks) == seg.total_size


@pytest.mark.parametrize("name", sorted(COMPLETE_WINDOWS))
def test_complete_windows_add_up_from_zero(name: str) -> None:
    """Where the history saw everything, summing the events from zero gives the final state."""
    snap = memlens.load(real_snapshot(name), cache=False)
    trace = snap.device(0)
    assert trace.window_complete
    assert trace.baseline_allocated == 0 and trace.baseline_reserved == 0
    segments = snap.segments_on(0)
    assert int(trace.allocated[-1]) == sum(b.size for s in segments for b in s.blocks if b.is_allocated)
    assert int(trace.reserved[-1]) == sum(s.total_size for s in segments)


def test_ghost_allocations_lift_the_baseline() -> None:
    """MAGMA27's window starts mid-run: 1.37 GB was live before the first event (not zero)."""
    trace = memlens.load(real_snapshot("MAGMA27__assignment2-systems__memory_snapshot.pickle")).device(0)
    assert not trace.window_complete
    assert trace.baseline_allocated > 1_000_000_000
    assert int(trace.allocated[0]) >= trace.baseline_allocated


def test_torch_2_0_files_have_block_addresses_from_history() -> None:
    snap = memlens.load(real_snapshot("Yiyi-philosophy__LLM-inference__oom_snapshot.pickle"))
    assert snap.format_guess == "2.0"
    seg = snap.segments[0]
    assert seg.blocks[0].address == seg.address
    assert any(b.stack_id >= 0 for s in snap.segments for b in s.blocks)
