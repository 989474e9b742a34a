"""Recorded segment_free runs: the program's empty_cache() vs the allocator's own free-and-retry."""

from __future__ import annotations

from typing import Any

from memlens.allocator import AllocatorSettings, CachingAllocatorSimulator, whatif
from memlens.allocator.releases import ALLOCATOR, EMPTY_CACHE, UNKNOWN, Release, classify_releases
from memlens.snapshot.model import Action, Frame
from memlens.snapshot.reader import parse
from memlens.units import MiB

TRAIN = [{"filename": "/work/proj/train.py", "line": 12, "name": "train"}]
EMPTY_CACHE_CALL = [
    {"filename": "/venv/site-packages/torch/cuda/memory.py", "line": 222, "name": "empty_cache"},
    {"filename": "/work/proj/train.py", "line": 30, "name": "train"},
]
STACKS = {0: [Frame("/work/proj/train.py", 12, "train")],
          1: [Frame("/venv/site-packages/torch/cuda/memory.py", 222, "empty_cache")]}


def classify(
    rows: list[tuple[Action, int, int]],
    capacity: int | None = None,
    settings: AllocatorSettings | None = None,
    reserved_before: int = 0,
) -> list[Release]:
    actions = [int(a) for a, _, _ in rows]
    sizes = [size for _, size, _ in rows]
    stacks = [stack for _, _, stack in rows]
    reserved = []
    current = reserved_before
    for act, size in zip(actions, sizes, strict=True):
        current += size if act == Action.SEGMENT_ALLOC else -size if act == Action.SEGMENT_FREE else 0
        reserved.append(current)
    return classify_releases(actions, sizes, stacks, reserved, reserved_before, lambda s: STACKS.get(s, []),
                             settings or AllocatorSettings(), capacity)


def causes(releases: list[Release]) -> list[tuple[int, int, str]]:
    return [(r.start, r.end, r.cause) for r in releases]


def test_a_stack_through_empty_cache_is_the_programs_call() -> None:
    rows = [(Action.SEGMENT_FREE, 20 * MiB, 1), (Action.SEGMENT_FREE, 2 * MiB, 1), (Action.SEGMENT_ALLOC, 20 * MiB, 0)]
    assert causes(classify(rows)) == [(0, 2, EMPTY_CACHE)]


def test_a_release_that_no_new_segment_follows_is_empty_cache() -> None:
    rows = [(Action.ALLOC, MiB, -1), (Action.SEGMENT_FREE, 20 * MiB, -1), (Action.ALLOC, MiB, -1),
            (Action.SEGMENT_FREE, 2 * MiB, -1)]
    # One in the middle (an alloc served from the cache follows) and one that ends the window.
    assert causes(classify(rows)) == [(1, 2, EMPTY_CACHE), (3, 4, EMPTY_CACHE)]


def test_the_failing_mallocs_own_stack_marks_the_allocators_retry() -> None:
    rows = [(Action.SEGMENT_FREE, 20 * MiB, 0), (Action.SEGMENT_FREE, 20 * MiB, 0), (Action.SEGMENT_ALLOC, 40 * MiB, 0)]
    [release] = classify(rows)
    assert (release.start, release.end, release.cause) == (0, 2, ALLOCATOR)
    assert "same stack" in release.reason


def test_an_oom_right_after_the_release_is_the_last_retry() -> None:
    rows = [(Action.SEGMENT_FREE, 20 * MiB, -1), (Action.OOM, 80 * MiB, -1)]
    assert causes(classify(rows)) == [(0, 1, ALLOCATOR)]


def test_without_stacks_the_capacity_decides_or_the_cause_stays_unknown() -> None:
    rows = [(Action.SEGMENT_FREE, 20 * MiB, -1), (Action.SEGMENT_ALLOC, 40 * MiB, -1)]
    # 60 MiB reserved before: a 40 MiB cudaMalloc does not fit in 90 MiB, does in 200 MiB.
    assert causes(classify(rows, capacity=90 * MiB, reserved_before=60 * MiB)) == [(0, 1, ALLOCATOR)]
    assert causes(classify(rows, capacity=200 * MiB, reserved_before=60 * MiB)) == [(0, 1, UNKNOWN)]
    assert causes(classify(rows, capacity=None, reserved_before=60 * MiB)) == [(0, 1, UNKNOWN)]
    gc = AllocatorSettings(garbage_collection_threshold=0.5)
    assert causes(classify(rows, capacity=100 * MiB, settings=gc, reserved_before=60 * MiB)) == [(0, 1, ALLOCATOR)]


def retry_run(capacity: int) -> Any:
    """A 60 MiB segment cached, then a 70 MiB request that fits only once it is released."""
    sim = CachingAllocatorSimulator(capacity=capacity)
    sim.free(sim.malloc(60 * MiB, frames=TRAIN))
    sim.free(sim.malloc(70 * MiB, frames=TRAIN))
    assert sim.segment_free_count == 1 and sim.alloc_retries == 1
    return parse(sim.snapshot(), source="<retry>")


def test_the_allocators_retry_is_left_to_the_simulator() -> None:
    snapshot = retry_run(capacity=100 * MiB)
    same = whatif(snapshot, capacity=100 * MiB)
    assert [r.cause for r in same.releases] == [ALLOCATOR]
    assert same.simulated.segment_frees == same.recorded.segment_frees == 1
    assert same.simulated.peak_reserved_bytes == same.recorded.peak_reserved_bytes == 70 * MiB
    # On a bigger GPU the allocator would not have needed to release anything.
    bigger = whatif(snapshot, capacity=200 * MiB)
    assert bigger.simulated.segment_frees == 0
    assert bigger.simulated.peak_reserved_bytes == 130 * MiB
    # Without a capacity the simulation cannot run short: the recorded choice is carried, and said.
    unknown = whatif(snapshot)
    assert unknown.simulated.segment_frees == 1
    assert any("replayed as empty_cache()" in note for note in unknown.notes)


def test_the_programs_empty_cache_is_replayed_under_any_capacity() -> None:
    sim = CachingAllocatorSimulator(capacity=100 * MiB)
    sim.free(sim.malloc(60 * MiB, frames=TRAIN))
    sim.empty_cache(frames=EMPTY_CACHE_CALL)
    sim.free(sim.malloc(70 * MiB, frames=TRAIN))
    snapshot = parse(sim.snapshot(), source="<empty_cache>")
    result = whatif(snapshot, capacity=200 * MiB)
    assert [r.cause for r in result.releases] == [EMPTY_CACHE]
    assert result.simulated.segment_frees == 1
    assert result.simulated.peak_reserved_bytes == 70 * MiB
    assert not any("replayed as empty_cache()" in note for note in result.notes)


def test_each_stack_is_examined_once_however_many_runs_share_it() -> None:
    """50,000 runs sharing one deep stack walked it 50,000 times (434 s on a 4 MB file)."""
    rows = [(Action.SEGMENT_ALLOC, 2 * MiB, 0)]
    for _ in range(500):
        rows += [(Action.SEGMENT_FREE, 2 * MiB, 0), (Action.SEGMENT_ALLOC, 2 * MiB, 0)]
    rows += [(Action.SEGMENT_FREE, 2 * MiB, 1), (Action.ALLOC, MiB, 1)]
    asked: list[int] = []

    def frames_of(stack: int) -> list[Frame]:
        asked.append(stack)
        return STACKS.get(stack, [])

    actions = [int(a) for a, _, _ in rows]
    sizes = [size for _, size, _ in rows]
    releases = classify_releases(actions, sizes, [s for _, _, s in rows], [0] * len(rows), 0, frames_of,
                                 AllocatorSettings(), None)
    assert len(releases) == 501
    assert releases[-1].cause == EMPTY_CACHE
    assert sorted(asked) == [0, 1]
