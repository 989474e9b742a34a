"""The caching-allocator rules, one small hand-made sequence each (CUDACachingAllocator.cpp)."""

from __future__ import annotations

import pytest

from memlens.allocator import AllocatorSettings, CachingAllocatorSimulator, SimulatedOOM, get_allocation_size
from memlens.errors import MemlensFormatError, MemlensOutOfMemory, MemlensUsageError
from memlens.units import MiB


def actions(sim: CachingAllocatorSimulator) -> list[str]:
    return [entry["action"] for entry in sim.trace]


def block_of(sim: CachingAllocatorSimulator, address: int) -> tuple[int, str]:
    for block_address, size, state in sim.iter_blocks():
        if block_address == address:
            return size, state
    raise AssertionError(f"no block at {address:#x}")


# ---------------------------------------------------------------- rounding and segment sizes
@pytest.mark.parametrize(
    ("requested", "rounded"),
    [(0, 512), (1, 512), (512, 512), (513, 1024), (1000, 1024), (MiB + 1, MiB + 512)],
)
def test_round_size_to_512(requested: int, rounded: int) -> None:
    assert CachingAllocatorSimulator().round_size(requested) == rounded


def test_roundup_power2_divisions() -> None:
    sim = CachingAllocatorSimulator(AllocatorSettings(roundup_power2_divisions=4))
    assert sim.round_size(5000) == 5120  # [4096, 8192) in 4 steps of 1024
    assert sim.round_size(4096) == 4096  # powers of two stay
    assert sim.round_size(1200) == 1536  # below 512 * divisions: plain 512 rounding
    per_interval = CachingAllocatorSimulator(AllocatorSettings(roundup_power2_divisions={2: 2}))
    assert per_interval.round_size(3 * MiB + 1) == 4 * MiB  # [2, 4) MiB in 2 steps
    assert per_interval.round_size(MiB + 1) == MiB + 512  # the 1 MiB interval has no divisions


@pytest.mark.parametrize(
    ("rounded", "segment"),
    [
        (512, 2 * MiB),
        (MiB, 2 * MiB),
        (MiB + 512, 20 * MiB),
        (9 * MiB + 512 * 1024, 20 * MiB),
        (10 * MiB, 10 * MiB),
        (10 * MiB + 512, 12 * MiB),
    ],
)
def test_get_allocation_size(rounded: int, segment: int) -> None:
    assert get_allocation_size(rounded) == segment


def test_small_and_large_pools_get_their_own_segments() -> None:
    sim = CachingAllocatorSimulator()
    small = sim.malloc(MiB)
    large = sim.malloc(MiB + 1)
    snapshot = sim.snapshot()
    kinds = {s["address"]: (s["segment_type"], s["total_size"]) for s in snapshot["segments"]}
    assert kinds[small] == ("small", 2 * MiB)
    assert kinds[large] == ("large", 20 * MiB)
    assert sim.segment_alloc_count == 2
    # Another small request packs into the same 2 MiB segment.
    assert sim.malloc(1000) == small + MiB
    assert sim.segment_alloc_count == 2


def test_addresses_are_deterministic_and_realistic() -> None:
    first = [CachingAllocatorSimulator().malloc(s) for s in (100, 5 * MiB, 50 * MiB)]
    second = [CachingAllocatorSimulator().malloc(s) for s in (100, 5 * MiB, 50 * MiB)]
    assert first == second
    assert first[0] == 0x7F0000000000


# ---------------------------------------------------------------- best fit, streams
def test_best_fit_takes_the_smallest_block_that_fits_then_the_lowest_address() -> None:
    sim = CachingAllocatorSimulator()
    a, b, c = (sim.malloc(s) for s in (30 * MiB, 12 * MiB, 12 * MiB))
    sim.free(a)
    sim.free(c)
    sim.free(b)
    # 12 MiB cached twice (b below c) and 30 MiB once: an 11 MiB request takes b.
    assert sim.malloc(11 * MiB) == b
    assert sim.malloc(11 * MiB) == c
    assert sim.malloc(11 * MiB) == a
    assert sim.segment_alloc_count == 3


def test_pools_are_per_stream() -> None:
    sim = CachingAllocatorSimulator()
    a = sim.malloc(4 * MiB, stream=1)
    sim.free(a)
    b = sim.malloc(4 * MiB, stream=0)
    assert b != a
    assert sim.segment_alloc_count == 2
    assert sim.malloc(4 * MiB, stream=1) == a


# ---------------------------------------------------------------- splitting
def test_small_pool_splits_whenever_512_bytes_remain() -> None:
    sim = CachingAllocatorSimulator()
    a = sim.malloc(MiB)
    assert sim.malloc(MiB - 512) == a + MiB
    assert sim.malloc(512) == a + 2 * MiB - 512  # the last 512 bytes are split off and used
    assert sim.segment_alloc_count == 1


def test_large_pool_splits_only_when_more_than_1mib_remains() -> None:
    sim = CachingAllocatorSimulator()
    sim.free(sim.malloc(5 * MiB))  # a 20 MiB cached block
    whole = sim.malloc(19 * MiB + 512 * 1024)  # 0.5 MiB would remain: not split
    assert block_of(sim, whole) == (20 * MiB, "active_allocated")
    sim.free(whole)
    part = sim.malloc(18 * MiB)  # 2 MiB would remain: split
    assert block_of(sim, part) == (18 * MiB, "active_allocated")
    assert block_of(sim, part + 18 * MiB) == (2 * MiB, "inactive")


def test_max_split_size_rules() -> None:
    sim = CachingAllocatorSimulator(AllocatorSettings(max_split_size=100 * MiB))
    big = sim.malloc(200 * MiB)
    sim.free(big)
    # A request below max_split_size never takes an oversize cached block.
    small = sim.malloc(50 * MiB)
    assert small != big and sim.segment_alloc_count == 2
    # An oversize request takes one only if it is less than 20 MiB too big ...
    far = sim.malloc(150 * MiB)
    assert far != big and sim.segment_alloc_count == 3
    near = sim.malloc(190 * MiB)
    assert near == big
    # ... and oversize blocks are never split.
    assert block_of(sim, near) == (200 * MiB, "active_allocated")


def test_oversize_blocks_are_split_without_max_split_size() -> None:
    sim = CachingAllocatorSimulator()
    sim.free(sim.malloc(200 * MiB))
    part = sim.malloc(50 * MiB)
    assert block_of(sim, part) == (50 * MiB, "active_allocated")
    assert sim.segment_alloc_count == 1


# ---------------------------------------------------------------- merging and freeing
def test_free_neighbours_merge_and_empty_cache_releases_the_segment() -> None:
    sim = CachingAllocatorSimulator()
    a, b, c = (sim.malloc(4 * MiB) for _ in range(3))
    sim.free(b)
    sim.free(a)
    sim.check_invariants()
    assert block_of(sim, a) == (8 * MiB, "inactive")
    sim.empty_cache()  # c still lives in the segment: nothing to release
    assert sim.reserved_bytes == 20 * MiB
    sim.free(c)
    assert [(s, st) for _, s, st in sim.iter_blocks()] == [(20 * MiB, "inactive")]
    sim.empty_cache()
    assert sim.reserved_bytes == 0
    assert actions(sim)[-1] == "segment_free"
    assert sim.trace[-1]["size"] == 20 * MiB


def test_free_requested_keeps_the_block_until_free_completed() -> None:
    sim = CachingAllocatorSimulator()
    a = sim.malloc(4096)
    sim.request_free(a)
    assert block_of(sim, a) == (4096, "active_pending_free")
    b = sim.malloc(4096)
    assert b != a  # not reusable yet
    sim.complete_free(a)
    assert sim.malloc(4096) == a
    assert [e["action"] for e in sim.trace if e.get("addr") == a] == [
        "segment_alloc",
        "alloc",
        "free_requested",
        "free_completed",
        "alloc",
    ]


def test_trace_sizes_follow_pytorch() -> None:
    sim = CachingAllocatorSimulator(capacity=30 * MiB)
    a = sim.malloc(5 * MiB + 3)
    sim.free(a)
    with pytest.raises(SimulatedOOM):
        sim.malloc(31 * MiB + 1)  # fits nowhere, even after the cached 20 MiB is released
    by_action = {e["action"]: e for e in sim.trace}
    assert by_action["alloc"]["size"] == 5 * MiB + 3  # requested
    assert by_action["free_requested"]["size"] == 5 * MiB + 3
    assert by_action["free_completed"]["size"] == 5 * MiB + 3
    assert by_action["segment_alloc"]["size"] == 20 * MiB  # the segment
    oom = by_action["oom"]
    assert oom["size"] == 31 * MiB + 512  # rounded request
    assert "addr" not in oom and oom["device_free"] == 30 * MiB
    assert set(sim.trace[0]) == {"action", "addr", "size", "stream", "time_us", "frames"}


def test_free_of_unknown_address_is_a_usage_error() -> None:
    with pytest.raises(MemlensUsageError):
        CachingAllocatorSimulator().free(0x1234)


# ---------------------------------------------------------------- capacity, retry, OOM
def test_cudamalloc_failure_frees_cached_blocks_and_retries() -> None:
    sim = CachingAllocatorSimulator(capacity=40 * MiB)
    sim.free(sim.malloc(30 * MiB))
    # Stream 1 cannot use stream 0's cache; the 20 MiB cudaMalloc only fits after a release.
    sim.malloc(20 * MiB, stream=1)
    assert actions(sim)[-3:] == ["segment_free", "segment_alloc", "alloc"]
    assert sim.reserved_bytes == 20 * MiB


def test_oom_when_the_capacity_is_exceeded() -> None:
    sim = CachingAllocatorSimulator(capacity=40 * MiB)
    sim.malloc(30 * MiB)
    with pytest.raises(SimulatedOOM) as caught:
        sim.malloc(20 * MiB)
    assert isinstance(caught.value, MemlensOutOfMemory)
    assert not isinstance(caught.value, MemlensUsageError | MemlensFormatError)  # a result, not a mistake
    assert caught.value.requested == 20 * MiB
    assert caught.value.device_free == 10 * MiB
    assert actions(sim)[-1] == "oom"
    assert sim.oom_count == 1


def test_max_split_size_releases_oversize_blocks_before_everything() -> None:
    sim = CachingAllocatorSimulator(AllocatorSettings(max_split_size=64 * MiB), capacity=280 * MiB)
    big = sim.malloc(200 * MiB)
    keep = sim.malloc(5 * MiB)  # a split 20 MiB segment that stays
    sim.free(sim.malloc(30 * MiB))  # an unsplit cached block below max_split_size
    sim.free(big)
    sim.malloc(80 * MiB)  # 200 MiB is too big for it (>= 80 + 20); cudaMalloc fails, frees it
    assert actions(sim)[-3:] == ["segment_free", "segment_alloc", "alloc"]
    assert sim.segment_free_count == 1  # only the oversize block, not the 30 MiB one
    assert sim.is_allocated(keep)
    assert sim.reserved_bytes == 130 * MiB


def test_memory_fraction_limits_reserved() -> None:
    sim = CachingAllocatorSimulator(AllocatorSettings(memory_fraction=0.5), capacity=100 * MiB)
    sim.malloc(40 * MiB)
    with pytest.raises(SimulatedOOM):
        sim.malloc(20 * MiB)


def test_garbage_collection_threshold_frees_old_cached_blocks() -> None:
    def run(threshold: float) -> int:
        sim = CachingAllocatorSimulator(AllocatorSettings(garbage_collection_threshold=threshold), capacity=100 * MiB)
        a, b = sim.malloc(30 * MiB), sim.malloc(30 * MiB)
        sim.free(a)
        sim.free(b)
        sim.malloc(12 * MiB, stream=1)  # no cache hit: GC runs before cudaMalloc
        return sim.reserved_bytes

    assert run(0.0) == 72 * MiB
    assert run(0.5) == 12 * MiB  # 60 MiB cached > 50 MiB threshold: both old blocks go


# ---------------------------------------------------------------- expandable segments
def test_expandable_segments_map_20mib_pages() -> None:
    sim = CachingAllocatorSimulator(AllocatorSettings(expandable_segments=True))
    a = sim.malloc(5 * MiB)
    assert actions(sim) == ["segment_map", "alloc"]
    assert sim.trace[0]["size"] == 20 * MiB and sim.segment_alloc_count == 0
    b = sim.malloc(30 * MiB)
    assert b == a + 5 * MiB  # grows in place
    assert sim.reserved_bytes == 40 * MiB
    segments = sim.snapshot()["segments"]
    assert len(segments) == 1 and segments[0]["is_expandable"] and segments[0]["total_size"] == 40 * MiB
    sim.free(a)
    sim.free(b)
    sim.empty_cache()
    assert sim.reserved_bytes == 0
    assert actions(sim)[-1] == "segment_unmap"
    sim.check_invariants()


def test_expandable_small_pool_maps_2mib_pages() -> None:
    sim = CachingAllocatorSimulator(AllocatorSettings(expandable_segments=True))
    sim.malloc(1000)
    assert sim.trace[0]["action"] == "segment_map" and sim.trace[0]["size"] == 2 * MiB


def _fragmenting_sequence(sim: CachingAllocatorSimulator) -> None:
    """A free block pinned by a small live neighbour, then a request a bit bigger than it."""
    sim.free(sim.malloc(30 * MiB))
    b = sim.malloc(20 * MiB)
    sim.malloc(8 * MiB)  # pins the segment
    sim.free(b)
    sim.malloc(22 * MiB)


def test_fragmentation_ooms_without_expandable_segments_and_fits_with_them() -> None:
    plain = CachingAllocatorSimulator(capacity=50 * MiB)
    with pytest.raises(SimulatedOOM):
        _fragmenting_sequence(plain)
    assert plain.reserved_bytes == 30 * MiB  # the split segment could not be released

    expandable = CachingAllocatorSimulator(AllocatorSettings(expandable_segments=True), capacity=50 * MiB)
    _fragmenting_sequence(expandable)
    assert expandable.reserved_bytes <= 50 * MiB
    assert "segment_unmap" in actions(expandable)
    expandable.check_invariants()


# ---------------------------------------------------------------- snapshot schema
def test_snapshot_schema_matches_pytorch() -> None:
    sim = CachingAllocatorSimulator(device=1)
    frames = [{"filename": "train.py", "line": 3, "name": "step"}]
    a = sim.malloc(3000, frames=frames)
    sim.malloc(5000)
    sim.free(a)
    snapshot = sim.snapshot()
    assert set(snapshot) == {"segments", "device_traces", "allocator_settings"}
    assert snapshot["device_traces"][0] == [] and len(snapshot["device_traces"][1]) == len(sim.trace)
    (segment,) = snapshot["segments"]
    assert set(segment) == {
        "device", "address", "total_size", "allocated_size", "active_size", "requested_size",
        "stream", "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks",
    }  # fmt: skip
    assert segment["device"] == 1 and segment["frames"] == frames
    assert [b["state"] for b in segment["blocks"]] == ["inactive", "active_allocated", "inactive"]
    assert segment["allocated_size"] == 5120 and segment["requested_size"] == 5000
    assert set(segment["blocks"][0]) == {"address", "size", "requested_size", "state", "frames"}
    assert sim.trace[0]["frames"] == frames
    assert snapshot["allocator_settings"]["max_split_size"] == -1


def test_restore_segment_seeds_live_blocks_and_free_gaps() -> None:
    sim = CachingAllocatorSimulator()
    base = 0x7E0000000000
    sim.restore_segment(base, 20 * MiB, live_blocks=[(base + 4 * MiB, 4 * MiB, 4 * MiB - 100)])
    assert [(a - base, s, st) for a, s, st in sim.iter_blocks()] == [
        (0, 4 * MiB, "inactive"),
        (4 * MiB, 4 * MiB, "active_allocated"),
        (8 * MiB, 12 * MiB, "inactive"),
    ]
    assert sim.malloc(11 * MiB) == base + 8 * MiB
    assert sim.trace[0]["action"] == "alloc"  # restoring records nothing
    sim.free(base + 4 * MiB)
    sim.check_invariants()
    with pytest.raises(MemlensUsageError):
        sim.restore_segment(base + MiB, 2 * MiB)  # overlaps


def test_custom_clock_stamps_entries() -> None:
    ticks = iter(range(100, 200))
    sim = CachingAllocatorSimulator(clock=lambda: next(ticks))
    sim.malloc(10)
    assert [e["time_us"] for e in sim.trace] == [100, 101]


def test_no_history_records_nothing() -> None:
    sim = CachingAllocatorSimulator(record_history=False)
    sim.free(sim.malloc(10))
    assert sim.trace == [] and sim.snapshot()["device_traces"] == [[]]
