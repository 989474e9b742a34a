"""Replaying real snapshots with their own settings reproduces what the real allocator did."""

from __future__ import annotations

from pathlib import Path

import pytest

from memlens.allocator import AllocatorSettings, whatif
from memlens.allocator.fidelity import PEAK_RESERVED_TOLERANCE, SEGMENT_ALLOC_TOLERANCE, fidelity
from memlens.units import GiB
from tests.conftest import REAL_SNAPSHOTS_DIR, needs_real_snapshots, real_snapshot_paths

pytestmark = needs_real_snapshots

# History recorded from before the first segment_alloc: replayed from an empty allocator.
COMPLETE = {"ZidongLiu__DeComFL__memory.pickle", "silmont2000__assignment2-systems__mem_snapshot.pickle"}
# No segment events in the window: it starts mid-run and is seeded from the final state.
MID_RUN = {
    "MAGMA27__assignment2-systems__memory_snapshot.pickle",
    "bcrafton__assignment2-systems__memory_snapshot.pickle",
    "silmont2000__assignment2-systems__memory_forward_bf16_128.pickle",
}
WITH_HISTORY = sorted(COMPLETE | MID_RUN)


@pytest.mark.parametrize("name", WITH_HISTORY)
@pytest.mark.parametrize("use_recorded_addresses", [True, False], ids=["recorded-addresses", "fresh-addresses"])
def test_replay_reproduces_peak_reserved_and_cudamalloc_count(name: str, use_recorded_addresses: bool) -> None:
    row = fidelity(REAL_SNAPSHOTS_DIR / name, use_recorded_addresses=use_recorded_addresses)
    assert row.history == ("complete" if name in COMPLETE else "mid-run (seeded)")
    assert row.peak_error <= PEAK_RESERVED_TOLERANCE, row
    assert row.segment_alloc_error <= SEGMENT_ALLOC_TOLERANCE, row


@pytest.mark.parametrize("name", WITH_HISTORY)
def test_replay_puts_every_tensor_where_the_real_allocator_did(name: str) -> None:
    row = fidelity(REAL_SNAPSHOTS_DIR / name)
    assert row.alloc_address_match == 1.0, row


@pytest.mark.parametrize("path", real_snapshot_paths(), ids=lambda p: Path(p).name[:40])
def test_every_real_snapshot_replays(path: Path) -> None:
    row = fidelity(path)
    assert row.within_bounds, row
    expandable = whatif(path, settings=AllocatorSettings(expandable_segments=True), capacity=80 * GiB)
    assert expandable.simulated["peak_reserved_bytes"] > 0 or row.recorded_peak_reserved == 0


def test_expandable_segments_help_the_complete_history_run() -> None:
    path = REAL_SNAPSHOTS_DIR / "ZidongLiu__DeComFL__memory.pickle"
    recorded = whatif(path)
    expandable = whatif(path, settings=AllocatorSettings(expandable_segments=True))
    assert expandable.simulated["segment_allocs"] == 0 and expandable.simulated["segment_maps"] > 0
    assert expandable.simulated["peak_reserved_bytes"] <= recorded.recorded["peak_reserved_bytes"]
    # A GPU smaller than the recorded peak runs out of memory, and the replay says where.
    small = whatif(path, capacity=recorded.recorded["peak_reserved_bytes"] // 2)
    assert small.simulated["oom"] and small.simulated["oom_event"] is not None
