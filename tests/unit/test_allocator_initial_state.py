"""The seed of a mid-run replay, inferred from hand-built windows and final states."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memlens.allocator import AllocatorSettings
from memlens.allocator import engine as allocator_engine
from memlens.allocator.initial_state import InitialState, first_block_events, infer_initial_state
from memlens.snapshot.model import Action, Block, Segment
from memlens.snapshot.reader import load
from memlens.units import KiB, MiB
from tests.conftest import SAMPLE_SNAPSHOTS_DIR, real_snapshot_paths

SAMPLE_SNAPSHOTS = sorted(SAMPLE_SNAPSHOTS_DIR.glob("*.pickle"))


@contextlib.contextmanager
def python_engine() -> Iterator[None]:
    """The allocator's Python engine for the block: numpy's reference instead of the native pass."""
    allocator_engine.native_module.cache_clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(allocator_engine, "native_module", lambda: None)
        yield
    allocator_engine.native_module.cache_clear()

A = 0x7000_0000  # a 20 MiB large segment that predates the window
B = 0x8000_0000  # a 20 MiB large segment the window opens
C = 0x9000_0000  # a 2 MiB small segment the window closes without opening it


def segment(address: int, size: int, blocks: list[Block], kind: str = "large", expandable: bool = False) -> Segment:
    return Segment(0, address, size, 0, kind, (0, 0), expandable, blocks)


def infer(rows: list[tuple[Action, int, int]], final: list[Segment]) -> InitialState:
    actions = [int(a) for a, _, _ in rows]
    addresses = [address for _, address, _ in rows]
    sizes = [size for _, _, size in rows]
    return infer_initial_state(actions, addresses, sizes, [0] * len(rows), final, AllocatorSettings())


def test_a_complete_history_seeds_nothing() -> None:
    rows = [
        (Action.SEGMENT_ALLOC, B, 20 * MiB),
        (Action.ALLOC, B, 4 * MiB),
        (Action.ALLOC, B + 4 * MiB, 2 * MiB),
        (Action.FREE_REQUESTED, B, 4 * MiB),
        (Action.FREE_COMPLETED, B, 4 * MiB),
    ]
    final = [segment(B, 20 * MiB, [
        Block(B, 4 * MiB, 0, "inactive"),
        Block(B + 4 * MiB, 2 * MiB, 2 * MiB, "active_allocated"),
        Block(B + 6 * MiB, 14 * MiB, 0, "inactive"),
    ])]
    state = infer(rows, final)
    assert state.is_empty and state.live_blocks == 0 and not state.notes


def test_a_window_opened_mid_run_seeds_the_segments_it_did_not_open() -> None:
    kept = A  # live at the end, never touched by the window: live all along
    freed_in_window = A + 8 * MiB  # first event a free: allocated before the window
    rows = [
        (Action.FREE_REQUESTED, freed_in_window, 3 * MiB),
        (Action.FREE_COMPLETED, freed_in_window, 3 * MiB),
        (Action.SEGMENT_ALLOC, B, 20 * MiB),
        (Action.ALLOC, B, 16 * MiB),
    ]
    final = [
        segment(A, 20 * MiB, [Block(kept, 8 * MiB, 8 * MiB - 100, "active_allocated"),
                              Block(A + 8 * MiB, 12 * MiB, 0, "inactive")]),
        segment(B, 20 * MiB, [Block(B, 16 * MiB, 16 * MiB, "active_allocated"),
                              Block(B + 16 * MiB, 4 * MiB, 0, "inactive")]),
    ]
    state = infer(rows, final)
    # B was opened by the window: the replay opens it itself.
    assert [(s.address, s.size, s.source) for s in state.segments] == [(A, 20 * MiB, "final state")]
    # The kept block keeps its recorded block size; the freed one gets its rounded request.
    assert state.segments[0].live == [(kept, 8 * MiB, 8 * MiB - 100), (freed_in_window, 3 * MiB, 3 * MiB)]
    assert state.reserved_bytes == 20 * MiB


def test_a_segment_closed_in_the_window_but_never_opened_in_it_existed_before() -> None:
    block = C + 512
    rows = [
        (Action.FREE_REQUESTED, block, 1000),
        (Action.FREE_COMPLETED, block, 1000),
        (Action.SEGMENT_FREE, C, 2 * MiB),
        # Opened and closed inside the window: not part of the seed.
        (Action.SEGMENT_ALLOC, B, 20 * MiB),
        (Action.SEGMENT_FREE, B, 20 * MiB),
    ]
    state = infer(rows, [])
    seeded = [(s.address, s.size, s.is_small, s.source) for s in state.segments]
    assert seeded == [(C, 2 * MiB, True, "freed in window")]
    # A small-pool block is never extended over the gap after it.
    assert state.segments[0].live == [(block, 1024, 1000)]


def test_a_block_allocated_and_freed_inside_the_window_is_not_seeded() -> None:
    reused = A + 2 * MiB
    rows = [
        (Action.ALLOC, reused, 2 * MiB),  # first event an alloc: not live at the start
        (Action.FREE_REQUESTED, reused, 2 * MiB),
        (Action.FREE_COMPLETED, reused, 2 * MiB),
        (Action.ALLOC, reused, 2 * MiB),  # live at the end, but the window allocated it
    ]
    final = [segment(A, 20 * MiB, [Block(A, 2 * MiB, 2 * MiB, "inactive"),
                                   Block(reused, 2 * MiB, 2 * MiB, "active_allocated"),
                                   Block(A + 4 * MiB, 16 * MiB, 0, "inactive")])]
    state = infer(rows, final)
    assert [s.address for s in state.segments] == [A]
    assert state.segments[0].live == []


def test_a_freed_large_block_takes_the_tail_should_split_would_have_left_it() -> None:
    first = A
    second = A + 3 * MiB
    rows = [
        # 2 MiB + 512 KiB rounded is 2.5 MiB; the 512 KiB gap up to ``second`` is too small to
        # have been split off (large-pool remainders of 1 MiB or less stay with the block).
        (Action.FREE_COMPLETED, first, 2 * MiB + 512 * KiB),
        # Known only by its request, and the request overlaps the final state's next block.
        (Action.FREE_COMPLETED, second, 9 * MiB),
    ]
    final = [segment(A, 20 * MiB, [Block(A, 10 * MiB, 0, "inactive"),
                                   Block(A + 10 * MiB, 2 * MiB, 2 * MiB, "active_allocated"),
                                   Block(A + 12 * MiB, 8 * MiB, 0, "inactive")])]
    state = infer(rows, final)
    assert state.segments[0].live == [
        (first, 3 * MiB, 2 * MiB + 512 * KiB),
        (second, 7 * MiB, 9 * MiB),  # cut where the final state's block begins
        (A + 10 * MiB, 2 * MiB, 2 * MiB),
    ]


def test_frees_outside_every_known_segment_are_counted_and_dropped() -> None:
    rows = [(Action.FREE_COMPLETED, 0x10, 512), (Action.FREE_COMPLETED, A + MiB, 4 * MiB)]
    final = [segment(A, 20 * MiB, [Block(A, 20 * MiB, 0, "inactive")])]
    state = infer(rows, final)
    assert state.unplaced_frees == 1
    assert any("outside every known segment" in note for note in state.notes)
    assert [address for address, _, _ in state.segments[0].live] == [A + MiB]


def test_an_expandable_segment_the_window_maps_is_left_to_the_replay() -> None:
    rows = [(Action.SEGMENT_MAP, B, 20 * MiB), (Action.ALLOC, B, 20 * MiB)]
    final = [segment(B, 20 * MiB, [Block(B, 20 * MiB, 20 * MiB, "active_allocated")], expandable=True)]
    state = infer(rows, final)
    assert state.is_empty
    assert state.notes == ["expandable segments mapped during the window are rebuilt by the replay"]


def reference_first_block_events(codes: np.ndarray, addresses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The definition, one row at a time: each address's first alloc/free_requested/free_completed row."""
    first: dict[int, int] = {}
    for row, (code, address) in enumerate(zip(codes.tolist(), addresses.tolist(), strict=True)):
        if code <= int(Action.FREE_COMPLETED) and address not in first:
            first[address] = row
    return np.array(list(first), dtype=np.int64), np.array(list(first.values()), dtype=np.int64)


def as_pairs(found: tuple[np.ndarray, np.ndarray]) -> set[tuple[int, int]]:
    return set(zip(found[0].tolist(), found[1].tolist(), strict=True))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(list(Action)), st.integers(0, 12)), max_size=60))
def test_each_address_first_block_event_by_either_engine(rows: list[tuple[Action, int]]) -> None:
    """The native pass and numpy's unique both find what the row-by-row definition finds."""
    codes = np.array([int(action) for action, _ in rows], dtype=np.int8)
    addresses = np.array([512 * slot for _, slot in rows], dtype=np.int64)
    expected = as_pairs(reference_first_block_events(codes, addresses))
    assert as_pairs(first_block_events(codes, addresses)) == expected
    with python_engine():
        assert as_pairs(first_block_events(codes, addresses)) == expected


@pytest.mark.parametrize("path", [*SAMPLE_SNAPSHOTS, *real_snapshot_paths()], ids=lambda p: p.name)
def test_the_initial_state_is_the_same_on_either_engine(path: Path) -> None:
    """Every sample and real snapshot's devices: the seed the native pass gives is numpy's."""
    snapshot = load(str(path), cache=False)
    for device, trace in snapshot.devices.items():
        columns = (np.asarray(trace.action), np.asarray(trace.address), np.asarray(trace.size),
                   np.asarray(trace.stream))
        final = snapshot.segments_on(device)
        native = infer_initial_state(*columns, final, AllocatorSettings())
        with python_engine():
            reference = infer_initial_state(*columns, final, AllocatorSettings())
        assert native == reference
