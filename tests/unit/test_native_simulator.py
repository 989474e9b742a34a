"""The native allocator model against the Python reference, call for call (differential tests).

Every operation sequence hypothesis makes is run through both engines; after each call the two
must agree on the returned address (or the OOM and its message), every counter, every block
(address, size, state), the trace entries and the whole ``snapshot()``, frames included.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memlens.allocator.engine import native_module
from memlens.allocator.settings import AllocatorSettings
from memlens.allocator.simulator import CachingAllocatorSimulator as PythonSimulator
from memlens.allocator.simulator import SimulatedOOM
from memlens.errors import MemlensUsageError
from memlens.units import MiB

pytestmark = [
    pytest.mark.skipif(native_module() is None, reason="the native core is not built (or MEMLENS_PURE_PYTHON)"),
    pytest.mark.slow,
]

if native_module() is not None:
    from memlens.allocator.native import NativeCachingAllocatorSimulator
else:  # pragma: no cover - skipped above
    NativeCachingAllocatorSimulator = PythonSimulator

SIZES = st.one_of(
    st.integers(0, 4096),  # tiny tensors
    st.integers(4096, MiB),  # small pool
    st.integers(MiB + 1, 12 * MiB),  # large pool, 20 MiB segments
    st.integers(12 * MiB, 120 * MiB),  # own segments, some oversize
)
FRAMES = st.sampled_from([None, [], [{"filename": "train.py", "line": 7, "name": "step"}]])
OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("malloc"), SIZES, st.integers(0, 2), FRAMES),
        st.tuples(st.just("free"), st.integers(0, 10_000), st.just(0), FRAMES),
        st.tuples(st.just("request"), st.integers(0, 10_000), st.just(0), FRAMES),
        st.tuples(st.just("complete"), st.integers(0, 10_000), st.just(0), FRAMES),
        st.tuples(st.just("empty_cache"), st.just(0), st.just(0), FRAMES),
        st.tuples(st.just("bad_free"), st.integers(0, 10_000), st.just(0), FRAMES),
        # a request sized against a block freed before (value/16 of it): the cached-block reuse
        # rules (oversize, kLargeBuffer round-up, split thresholds) are decided at these edges
        st.tuples(st.just("reuse"), st.integers(1, 24), st.integers(0, 1), FRAMES),
        st.tuples(st.just("reuse"), st.integers(15, 17), st.just(0), FRAMES),
    ),
    max_size=150,
)
SETTINGS = st.builds(
    AllocatorSettings,
    max_split_size=st.sampled_from([None, 32 * MiB, 64 * MiB]),
    roundup_power2_divisions=st.sampled_from([None, 4, {1: 2, 16: 8}, {2: 1, 64: 16}]),
    expandable_segments=st.booleans(),
    garbage_collection_threshold=st.sampled_from([0.0, 0.5, 0.8]),
    memory_fraction=st.sampled_from([1.0, 0.9]),
)
CAPACITIES = st.sampled_from([None, 60 * MiB, 200 * MiB, 1000 * MiB])


def _state(sim: Any) -> dict[str, Any]:
    return {
        "counters": [
            sim.reserved_bytes, sim.allocated_bytes, sim.requested_bytes, sim.peak_reserved_bytes,
            sim.peak_allocated_bytes, sim.segment_alloc_count, sim.segment_free_count, sim.segment_map_count,
            sim.segment_unmap_count, sim.alloc_retries, sim.oom_count, sim.device_free_bytes,
        ],
        "blocks": list(sim.iter_blocks()),
        "pools": [(sim.cached_blocks(small, stream), sim.cached_summary(small, stream, pieces))
                  for small in (True, False) for stream in (0, 1, 2) for pieces in (False, True)],
        "trace": list(sim.trace),
    }


def _call(sim: Any, name: str, *args: Any) -> Any:
    try:
        return ("ok", getattr(sim, name)(*args))
    except SimulatedOOM as exc:
        return ("oom", str(exc), exc.requested, exc.rounded, exc.device_free, exc.allocated, exc.reserved)
    except MemlensUsageError as exc:
        return ("usage", str(exc))


def _run_both(allocator_settings: AllocatorSettings, capacity: int | None, operations: list[Any]) -> None:
    if capacity is None and allocator_settings.garbage_collection_threshold:
        capacity = 400 * MiB
    reference = PythonSimulator(allocator_settings, capacity=capacity)
    native = NativeCachingAllocatorSimulator(allocator_settings, capacity=capacity)
    live: list[int] = []
    pending: list[int] = []
    freed_sizes: list[int] = [MiB]
    sizes: dict[int, int] = {}
    for name, value, stream, frames in operations:
        if name == "reuse":
            name, value = "malloc", freed_sizes[-1] * value // 16
        if name == "malloc":
            outcome = _call(reference, "malloc", value, stream, frames)
            assert _call(native, "malloc", value, stream, frames) == outcome
            if outcome[0] == "ok":
                live.append(outcome[1])
                sizes[outcome[1]] = value
        elif name in ("free", "request") and live:
            address = live.pop(value % len(live))
            freed_sizes.append(sizes.pop(address))
            method = "free" if name == "free" else "request_free"
            assert _call(native, method, address, frames) == _call(reference, method, address, frames)
            if name == "request":
                pending.append(address)
        elif name == "complete" and pending:
            address = pending.pop(value % len(pending))
            assert _call(native, "complete_free", address, frames) == _call(reference, "complete_free", address, frames)
        elif name == "empty_cache":
            reference.empty_cache(frames)
            native.empty_cache(frames)
        elif name == "bad_free":
            address = value * 512 + 3  # never a block's address: both refuse it the same way
            assert _call(native, "free", address, frames) == _call(reference, "free", address, frames)
        assert _state(native) == _state(reference)
        native.check_invariants()
    assert native.snapshot() == reference.snapshot()
    for size in (0, 1, 511, 513, MiB + 1, 3 * MiB + 7, 40 * MiB + 1, 1 << 40):
        assert native.round_size(size) == reference.round_size(size)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SETTINGS, CAPACITIES, OPERATIONS)
def test_native_matches_python_call_for_call(
    allocator_settings: AllocatorSettings, capacity: int | None, operations: list[Any]
) -> None:
    _run_both(allocator_settings, capacity, operations)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    SETTINGS,
    st.lists(st.tuples(st.integers(0, 40), st.integers(1, 8), st.integers(0, 5)), max_size=6),
    OPERATIONS,
)
def test_native_matches_python_from_restored_segments(
    allocator_settings: AllocatorSettings, layout: list[tuple[int, int, int]], operations: list[Any]
) -> None:
    """Segments restored with live blocks (a replay's seeded start), then the same calls."""
    reference = PythonSimulator(allocator_settings, capacity=None, record_history=False)
    native = NativeCachingAllocatorSimulator(allocator_settings, capacity=None, record_history=False)
    base = 0x7E0000000000
    for index, (offset_pages, pages, live_pages) in enumerate(layout):
        address = base + index * 64 * MiB
        size = pages * 2 * MiB
        live = [(address + offset_pages * 512, min(live_pages * 4096 + 512, size - offset_pages * 512), 100)]
        args = (address, size, index % 2, None, live if live[0][1] > 0 else [])
        assert _call(native, "restore_segment", *args) == _call(reference, "restore_segment", *args)
    assert _state(native) == _state(reference)
    for name, value, stream, frames in operations:
        if name == "malloc":
            assert _call(native, "malloc", value, stream, frames) == _call(reference, "malloc", value, stream, frames)
        elif name == "empty_cache":
            native.empty_cache(frames)
            reference.empty_cache(frames)
    assert _state(native) == _state(reference)
    native.check_invariants()


def test_clock_and_segment_hints_are_asked_like_the_python_model() -> None:
    times = iter(range(10, 10_000))
    hints = iter([0x10000000, None, 0x10000000, 0x30000000] * 10)
    sims = [
        cls(AllocatorSettings(), clock=lambda: next(times), segment_addresses=lambda _size: next(hints))
        for cls in (PythonSimulator, NativeCachingAllocatorSimulator)
    ]
    for sim in sims:
        times = iter(range(10, 10_000))
        hints = iter([0x10000000, None, 0x10000000, 0x30000000] * 10)
        addresses = [sim.malloc(size) for size in (3 * MiB, 30 * MiB, 50 * MiB, 100, 70 * MiB)]
        sim.free(addresses[1])
        sim.empty_cache()
    assert sims[1].trace == sims[0].trace
    assert sims[1].snapshot() == sims[0].snapshot()


def test_negative_and_absurd_requests_are_usage_errors() -> None:
    native = NativeCachingAllocatorSimulator()
    with pytest.raises(MemlensUsageError, match="negative size"):
        native.malloc(-1)
    with pytest.raises(MemlensUsageError):
        native.malloc(1 << 62)
    with pytest.raises(MemlensUsageError, match="a device needs more than 0 bytes"):
        NativeCachingAllocatorSimulator(capacity=0)


@pytest.mark.parametrize("max_split", [None, 32 * MiB, 64 * MiB])
@pytest.mark.parametrize("expandable", [False, True])
def test_native_matches_python_on_the_reuse_edges(max_split: int | None, expandable: bool) -> None:
    """A block freed, then requests at every sixteenth of its size, and a neighbour kept live:
    each reuse rule (oversize blocks, the kLargeBuffer round-up, the split thresholds) is decided
    at such an edge, which random sequences reach only by luck."""
    allocator_settings = AllocatorSettings(max_split_size=max_split, expandable_segments=expandable)
    for block in (3000, MiB - 512, MiB + 512, 2 * MiB, 9 * MiB, 12 * MiB, 19 * MiB, 21 * MiB, 33 * MiB,
                  50 * MiB, 70 * MiB, 100 * MiB, 130 * MiB):
        for sixteenths in range(1, 25):
            _run_both(allocator_settings, None, [
                ("malloc", block, 0, None), ("malloc", 4096, 0, None), ("free", 0, 0, None),
                ("reuse", sixteenths, 0, None), ("reuse", sixteenths, 0, None), ("empty_cache", 0, 0, None),
            ])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_native_matches_python_with_thousands_of_live_blocks(seed: int) -> None:
    """Thousands of blocks live at once, freed in random order: the native engine's address
    index (an open-addressing hash map) grows many times and deletes from the middle of its
    probe runs, which a sequence of 150 calls never reaches."""
    import random

    rng = random.Random(seed)
    sims = [PythonSimulator(record_history=False), NativeCachingAllocatorSimulator(record_history=False)]
    live: list[int] = []
    pending: list[int] = []
    for step in range(12_000):
        grow = step < 6_000 or rng.random() < 0.3
        if grow or not live:
            size = rng.choice([512, 4096, 70_000, 3 * MiB, 25 * MiB])
            addresses = [sim.malloc(size) for sim in sims]
            assert addresses[1] == addresses[0]
            live.append(addresses[0])
        else:
            address = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.3:
                for sim in sims:
                    sim.request_free(address)
                pending.append(address)
            else:
                for sim in sims:
                    sim.free(address)
        if pending and rng.random() < 0.2:
            address = pending.pop(rng.randrange(len(pending)))
            for sim in sims:
                sim.complete_free(address)
        if step % 1_000 == 0:
            probes = live[-50:] + pending[-50:] + [a + 512 for a in live[-50:]]
            assert [sims[1].is_allocated(a) for a in probes] == [sims[0].is_allocated(a) for a in probes]
    assert list(sims[1].iter_blocks()) == list(sims[0].iter_blocks())
    assert sims[1].snapshot() == sims[0].snapshot()
    sims[1].check_invariants()
