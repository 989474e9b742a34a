"""The replay's observer and the simulator's read-only view of a pool, which the fragmentation
analysis reads at every recorded cudaMalloc."""

from __future__ import annotations

from memlens.allocator import AllocatorSettings, CachingAllocatorSimulator, whatif
from memlens.allocator.releases import ALLOCATOR
from memlens.allocator.replay import left_to_simulator, trace_releases
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


def test_after_the_allocators_free_and_retry_the_observer_sees_the_state_before_it() -> None:
    """A free-and-retry run is left to the simulator when the capacity is known: at the recorded
    segment_alloc after it, the simulator still holds what the allocator held before the run
    (the finders compare with the recorded reserved there); without a capacity the run is
    replayed as empty_cache() where it starts, and the observer sees the row's own state."""
    sim = CachingAllocatorSimulator(capacity=100 * MiB)
    sim.free(sim.malloc(60 * MiB))
    sim.malloc(70 * MiB)  # 60 + 70 > 100: the idle 60 MiB segment is released, then it fits
    snapshot = parse(sim.snapshot(), source="<retry>")
    trace = snapshot.device()
    (release,) = trace_releases(trace, snapshot.stacks, AllocatorSettings(), 100 * MiB)
    assert release.cause == ALLOCATOR and sim.trace[release.end]["action"] == "segment_alloc"
    assert left_to_simulator(release, 100 * MiB) and not left_to_simulator(release, None)

    def reserved_at(capacity: int | None) -> list[tuple[int, int]]:
        seen: list[tuple[int, int]] = []
        whatif(snapshot, capacity=capacity, observer=lambda row, replay: seen.append((row, replay.reserved_bytes)))
        return seen

    before_the_run = int(trace.reserved[release.start - 1])
    assert before_the_run == 60 * MiB
    assert reserved_at(100 * MiB)[-1] == (release.end, before_the_run)
    assert reserved_at(None)[-1] == (release.end, 0)  # with no capacity whatif infers none here
