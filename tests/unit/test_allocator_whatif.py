"""What-if replay on snapshots the simulator wrote itself (so the truth is known)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from memlens.allocator import AllocatorSettings, CachingAllocatorSimulator, whatif
from memlens.allocator.simulator import DEFAULT_BASE_ADDRESS
from memlens.errors import MemlensUsageError
from memlens.snapshot.reader import parse
from memlens.units import MiB


def training_like(sim: CachingAllocatorSimulator, steps: int = 6, seed: int = 0) -> None:
    """Weights kept alive, activations freed in reverse, varying batch sizes, an empty_cache."""
    rng = random.Random(seed)
    weights = [sim.malloc(rng.choice([4, 16, 64]) * MiB + rng.randrange(512)) for _ in range(6)]
    for step in range(steps):
        batch = rng.choice([7, 8, 9])
        activations = [sim.malloc(batch * rng.choice([300_000, 1_500_000, 3 * MiB])) for _ in range(12)]
        temps = [sim.malloc(rng.randrange(1, 200_000)) for _ in range(10)]
        for address in temps:
            sim.free(address)
        for address in reversed(activations):
            sim.request_free(address)
            sim.complete_free(address)
        if step == 3:
            sim.empty_cache()
    del weights


def snapshot_of(sim: CachingAllocatorSimulator) -> Any:
    return parse(sim.snapshot(), source="<simulated>")


def test_replaying_a_complete_history_reproduces_it() -> None:
    sim = CachingAllocatorSimulator()
    training_like(sim)
    result = whatif(snapshot_of(sim))
    assert not result.seeded
    assert result.simulated.peak_reserved_bytes == result.recorded.peak_reserved_bytes == sim.peak_reserved_bytes
    assert result.simulated.segment_allocs == result.recorded.segment_allocs == sim.segment_alloc_count
    assert result.simulated.segment_frees == result.recorded.segment_frees
    assert result.simulated.final_reserved_bytes == sim.reserved_bytes
    assert result.simulated.fragmentation_at_peak_bytes == result.recorded.fragmentation_at_peak_bytes
    assert result.simulated.alloc_address_match == 1.0
    assert not result.simulated.oom and not result.recorded.oom


@pytest.mark.parametrize("fraction", [0.01, 0.2, 0.5, 0.8])
def test_a_window_that_starts_mid_run_is_seeded_from_the_final_state(fraction: float) -> None:
    sim = CachingAllocatorSimulator()
    training_like(sim, steps=4)
    raw = sim.snapshot()
    trace = raw["device_traces"][0]
    # Drop the oldest entries, as a wrapped ring buffer does (segment_alloc entries included).
    raw["device_traces"][0] = trace[int(len(trace) * fraction) :]
    snapshot = parse(raw, source="<window>")
    result = whatif(snapshot)
    assert result.seeded
    assert result.simulated.peak_reserved_bytes == result.recorded.peak_reserved_bytes
    assert result.simulated.segment_allocs == result.recorded.segment_allocs
    assert result.simulated.final_reserved_bytes == sim.reserved_bytes
    assert result.simulated.alloc_address_match == 1.0


def test_ghost_frees_and_request_only_frees() -> None:
    sim = CachingAllocatorSimulator()
    a = sim.malloc(4 * MiB)
    b = sim.malloc(4 * MiB)
    sim.free(a)
    raw = sim.snapshot()
    entries = raw["device_traces"][0]
    # A free of an address no segment holds, and a free_requested with no free_completed.
    ghost = dict(entries[-1], addr=0x10, action="free_completed")
    lonely = dict(entries[-2], addr=b, action="free_requested", size=4 * MiB)
    raw["device_traces"][0] = [*entries, ghost, lonely]
    raw["segments"][0]["blocks"] = [dict(blk, state="inactive") for blk in raw["segments"][0]["blocks"]]
    result = whatif(parse(raw, source="<ghosts>"))
    assert result.simulated.peak_reserved_bytes == 20 * MiB
    assert result.simulated.segment_allocs == 1


def fragmenting(sim: CachingAllocatorSimulator) -> None:
    for step in range(8):
        kept = []
        for i in range(10):
            big = sim.malloc((30 + 2 * step + i) * MiB)
            kept.append(sim.malloc(8 * MiB))
            sim.free(big)
        for address in kept:
            sim.free(address)


def test_expandable_segments_what_if_and_capacity_oom() -> None:
    sim = CachingAllocatorSimulator()
    fragmenting(sim)
    snapshot = snapshot_of(sim)
    recorded_peak = sim.peak_reserved_bytes
    expandable = whatif(snapshot, settings=AllocatorSettings(expandable_segments=True))
    assert expandable.simulated.peak_reserved_bytes < recorded_peak
    assert expandable.simulated.segment_allocs == 0 and expandable.simulated.segment_maps > 0

    tight = whatif(snapshot, capacity=recorded_peak // 4)
    assert tight.simulated.oom and not tight.recorded.oom
    event = tight.simulated.oom_event
    assert isinstance(event, int) and 0 < event < tight.recorded.events
    assert tight.simulated.oom_size_bytes > 0
    assert set(tight.to_json()) >= {"recorded", "simulated"}


def test_recorded_oom_is_reported() -> None:
    sim = CachingAllocatorSimulator(capacity=50 * MiB)
    sim.malloc(30 * MiB)
    with pytest.raises(Exception, match="out of memory"):
        sim.malloc(30 * MiB)
    result = whatif(snapshot_of(sim))
    assert result.recorded.oom and result.recorded.oom_event == 2
    assert result.recorded.oom_size_bytes == 30 * MiB


def test_gc_threshold_needs_a_capacity() -> None:
    sim = CachingAllocatorSimulator()
    sim.malloc(10)
    with pytest.raises(MemlensUsageError):
        whatif(snapshot_of(sim), settings=AllocatorSettings(garbage_collection_threshold=0.5))
    result = whatif(snapshot_of(sim), settings=AllocatorSettings(garbage_collection_threshold=0.5), capacity=MiB * 100)
    assert result.simulated.peak_reserved_bytes == 2 * MiB


def test_empty_snapshot() -> None:
    result = whatif(parse({"segments": [], "device_traces": []}, source="<empty>"))
    assert result.recorded.peak_reserved_bytes == result.simulated.peak_reserved_bytes == 0


def _oom_after_fragmentation() -> dict[str, Any]:
    """Two 20 MiB segments, each holding two 8 MiB tensors of which the first is freed: 24 MiB
    free in all, in 8 and 4 MiB pieces. Then a 16 MiB request fails with 4 MiB left on the device."""
    mib = 1 << 20
    bases = (0x7F00_0000_0000, 0x7F00_1000_0000)
    trace: list[dict[str, Any]] = []
    for base in bases:
        trace += [
            {"action": "segment_alloc", "addr": base, "size": 20 * mib, "stream": 0},
            {"action": "alloc", "addr": base, "size": 8 * mib, "stream": 0},
            {"action": "alloc", "addr": base + 8 * mib, "size": 8 * mib, "stream": 0},
        ]
    for base in bases:
        trace += [
            {"action": "free_requested", "addr": base, "size": 8 * mib, "stream": 0},
            {"action": "free_completed", "addr": base, "size": 8 * mib, "stream": 0},
        ]
    trace.append({"action": "oom", "size": 16 * mib, "device_free": 4 * mib, "stream": 0})

    def segment(base: int) -> dict[str, Any]:
        return {"device": 0, "address": base, "total_size": 20 * mib, "stream": 0, "segment_type": "large",
                "blocks": [{"address": base, "size": 8 * mib, "requested_size": 8 * mib, "state": "inactive"},
                           {"address": base + 8 * mib, "size": 8 * mib, "requested_size": 8 * mib,
                            "state": "active_allocated"},
                           {"address": base + 16 * mib, "size": 4 * mib, "requested_size": 0, "state": "inactive"}]}

    return {"segments": [segment(base) for base in bases], "device_traces": [trace]}


def test_the_failed_request_is_retried_in_the_replay() -> None:
    snapshot = parse(_oom_after_fragmentation())
    same = whatif(snapshot)
    assert same.capacity == 44 << 20  # inferred: reserved at the OOM + what the device had free
    assert same.simulated.segment_allocs == 2 and same.simulated.alloc_address_match == 1.0
    assert same.simulated.oom and same.simulated.oom_event == 10
    roomier = whatif(snapshot, capacity=64 << 20)
    assert not roomier.simulated.oom
    assert any("fits in the simulation" in note for note in roomier.notes)


def test_with_fresh_bases_tensors_agree_on_segment_and_offset_not_address() -> None:
    # Record with every segment 1 TiB above where a fresh simulator puts it (same order), so
    # the replay's fresh bases differ from the recorded ones but its choices do not.
    shift = 1 << 40
    next_base = [DEFAULT_BASE_ADDRESS + shift]

    def shifted(size: int) -> int:
        address = next_base[0]
        next_base[0] += (size + (2 * MiB - 1)) // (2 * MiB) * (2 * MiB)
        return address

    sim = CachingAllocatorSimulator(segment_addresses=shifted)
    training_like(sim)
    snapshot = snapshot_of(sim)
    fresh = whatif(snapshot, use_recorded_addresses=False)
    assert fresh.simulated.alloc_address_match == 0.0
    assert fresh.simulated.alloc_segment_offset_match == 1.0
    assert fresh.simulated.allocs_in_known_segment == sum(1 for e in sim.trace if e["action"] == "alloc")
    copied = whatif(snapshot)
    assert copied.simulated.alloc_address_match == copied.simulated.alloc_segment_offset_match == 1.0


@pytest.mark.parametrize("size_gib", [91, 95, 300])
def test_expandable_segments_reserve_room_for_a_tensor_beyond_80_gib(size_gib: int) -> None:
    """With no capacity known the address space was that of an assumed 80 GiB device (90 GiB):
    a larger tensor asserted. It is sized from the request now; a known capacity still OOMs."""
    size = size_gib << 30
    sim = CachingAllocatorSimulator(AllocatorSettings(expandable_segments=True))
    address = sim.malloc(size)
    assert sim.allocated_bytes == size and sim.reserved_bytes >= size
    sim.free(address)
    sim.malloc(size)  # the cached pages serve it again
    from memlens.allocator import SimulatedOOM

    with pytest.raises(SimulatedOOM):
        CachingAllocatorSimulator(AllocatorSettings(expandable_segments=True), capacity=80 << 30).malloc(size)


def test_the_figures_are_typed_and_their_json_is_their_fields() -> None:
    """``recorded`` and ``simulated`` are structs (the simulated ones add the placement match),
    and the result's JSON carries exactly their fields."""
    import msgspec

    from memlens.allocator.replay import RunFigures, SimulatedFigures

    sim = CachingAllocatorSimulator()
    training_like(sim, steps=2)
    result = whatif(snapshot_of(sim))
    assert type(result.recorded) is RunFigures and type(result.simulated) is SimulatedFigures
    data = result.to_json()
    assert list(data["recorded"]) == list(RunFigures.__struct_fields__)
    assert list(data["simulated"]) == list(SimulatedFigures.__struct_fields__)
    assert msgspec.convert(data["simulated"], SimulatedFigures) == result.simulated
