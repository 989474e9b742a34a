"""The replay's observer and the simulator's read-only view of a pool, which the fragmentation
analysis reads at every recorded cudaMalloc."""

from __future__ import annotations

from memlens.allocator import CachingAllocatorSimulator, whatif
from memlens.snapshot.reader import parse

MiB = 1 << 20


def test_cached_blocks_tells_pieces_from_whole_segments() -> None:
    sim = CachingAllocatorSimulator()
    whole = sim.malloc(100 * MiB)
    split = sim.malloc(60 * MiB)
    sim.free(whole)
    sim.free(split)
    kept = sim.malloc(40 * MiB)  # best fit: the 60 MiB segment, split into 40 + a 20 MiB piece
    assert sorted(sim.cached_blocks(small=False, stream=0)) == [(20 * MiB, False), (100 * MiB, True)]
    assert sim.cached_blocks(small=True, stream=0) == []
    assert sim.cached_blocks(small=False, stream=7) == []
    del kept


def test_observer_sees_the_state_before_each_recorded_cudamalloc() -> None:
    sim = CachingAllocatorSimulator()
    first = sim.malloc(100 * MiB)
    sim.free(first)
    sim.malloc(60 * MiB)  # reuses the cached 100 MiB segment: no cudaMalloc
    sim.malloc(80 * MiB)  # the 40 MiB piece left cannot hold it: cudaMalloc
    snapshot = parse(sim.snapshot(), source="<simulated>")
    seen: list[tuple[int, int, list[tuple[int, bool]]]] = []
    whatif(snapshot, observer=lambda row, replay: seen.append(
        (row, replay.reserved_bytes, replay.cached_blocks(False, 0))))
    rows = [i for i, e in enumerate(sim.trace) if e["action"] == "segment_alloc"]
    assert [row for row, _, _ in seen] == rows
    assert seen[0][1:] == (0, [])
    assert seen[1][1:] == (100 * MiB, [(40 * MiB, False)])
