"""Invariants of the simulator over random alloc/free sequences (hypothesis)."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memlens.allocator import AllocatorSettings, CachingAllocatorSimulator, SimulatedOOM
from memlens.units import MiB

SIZES = st.one_of(
    st.integers(1, 4096),  # tiny tensors
    st.integers(4096, MiB),  # small pool
    st.integers(MiB + 1, 12 * MiB),  # large pool, 20 MiB segments
    st.integers(12 * MiB, 120 * MiB),  # own segments, some oversize
)
OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("malloc"), SIZES, st.integers(0, 1)),
        st.tuples(st.just("free"), st.integers(0, 10_000), st.just(0)),
        st.tuples(st.just("request"), st.integers(0, 10_000), st.just(0)),
        st.tuples(st.just("empty_cache"), st.just(0), st.just(0)),
    ),
    max_size=80,
)
SETTINGS = st.builds(
    AllocatorSettings,
    max_split_size=st.sampled_from([None, 32 * MiB, 64 * MiB]),
    roundup_power2_divisions=st.sampled_from([None, 4, {1: 2, 16: 8}]),
    expandable_segments=st.booleans(),
    garbage_collection_threshold=st.sampled_from([0.0, 0.5]),
)


def check_snapshot(snapshot: dict[str, Any], sim: CachingAllocatorSimulator) -> None:
    live: list[tuple[int, int]] = []
    reserved = 0
    for segment in snapshot["segments"]:
        cursor = segment["address"]
        for block in segment["blocks"]:
            assert block["address"] == cursor  # blocks tile the segment exactly
            assert block["size"] > 0 and block["size"] % 512 == 0
            cursor += block["size"]
            if block["state"] != "inactive":
                live.append((block["address"], block["size"]))
        assert cursor == segment["address"] + segment["total_size"]
        reserved += segment["total_size"]
    live.sort()
    for (a, size), (b, _) in itertools.pairwise(live):
        assert a + size <= b  # no two live blocks overlap
    assert reserved == sim.reserved_bytes
    assert sim.allocated_bytes <= sim.reserved_bytes
    assert sim.requested_bytes <= sim.allocated_bytes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SETTINGS, st.sampled_from([None, 200 * MiB]), OPERATIONS)
def test_invariants_hold_after_every_operation(
    allocator_settings: AllocatorSettings, capacity: int | None, operations: list[tuple[str, int, int]]
) -> None:
    if capacity is None and allocator_settings.garbage_collection_threshold:
        capacity = 400 * MiB
    sim = CachingAllocatorSimulator(allocator_settings, capacity=capacity)
    live: list[int] = []
    for name, value, stream in operations:
        if name == "malloc":
            try:
                live.append(sim.malloc(value, stream=stream))
            except SimulatedOOM:
                assert sim.trace[-1]["action"] == "oom"
        elif name in ("free", "request") and live:
            address = live.pop(value % len(live))
            if name == "free":
                sim.free(address)
            else:
                sim.request_free(address)
                sim.complete_free(address)
        elif name == "empty_cache":
            sim.empty_cache()
        sim.check_invariants()
        assert sim.reserved_bytes <= (capacity or 1 << 62)
    check_snapshot(sim.snapshot(), sim)
    for address in live:
        sim.free(address)
    sim.empty_cache()
    sim.check_invariants()
    assert sim.allocated_bytes == 0 and sim.reserved_bytes == 0
