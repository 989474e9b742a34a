"""Pairing alloc and free rows into lifetimes, ghosts included."""

from __future__ import annotations

import numpy as np

from memlens.analysis.lifetimes import build_lifetimes
from tests.unit.tracebuilder import MiB, TraceBuilder


def test_pairs_reused_addresses_and_ghosts() -> None:
    b = TraceBuilder()
    kept = b.ghost(4 * MiB)  # live through the window
    freed_ghost = b.ghost(2 * MiB)  # live at the start, freed in the window
    first = b.alloc(1 * MiB)
    b.free(first)
    b.free(freed_ghost)
    b.next_address = first  # the allocator hands the same address out again
    second = b.alloc(3 * MiB)
    snapshot = b.snapshot()
    trace = snapshot.device(0)
    lt = build_lifetimes(trace, snapshot.segments)
    by_size = {int(s): (int(a), int(f)) for s, a, f in zip(lt.size, lt.alloc_event, lt.free_event, strict=True)}
    n = len(trace)
    assert second == first
    assert by_size[1 * MiB] == (0, 1)  # alloc row 0, free_requested row 1 (memory_allocated drops there)
    assert by_size[3 * MiB] == (5, n)  # never freed
    assert by_size[2 * MiB] == (-1, 3)  # ghost free, at its request
    assert by_size[4 * MiB] == (-1, n)  # ghost block
    assert kept in set(lt.address.tolist())
    # Live bytes after every row equal the reader's allocated curve.
    for event in range(n):
        assert int(lt.size[lt.live_at(event)].sum()) == int(trace.allocated[event])
    assert np.all(lt.alloc_event < lt.free_event)
