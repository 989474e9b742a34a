"""Pairing alloc and free rows into lifetimes, ghosts included."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from memlens.analysis.lifetimes import build_lifetimes
from tests.conftest import SAMPLE_SNAPSHOTS_DIR
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


@pytest.mark.parametrize("path", sorted(SAMPLE_SNAPSHOTS_DIR.glob("*.pickle")), ids=lambda p: p.name)
def test_the_per_lifetime_passes_do_not_depend_on_how_many_lifetimes_they_take_at_a_time(
    path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The categories, the step-local curve and the activation plateau take the lifetimes a range
    at a time (``lifetime_ranges``): each lifetime is decided on its own, so ranges of 3 lifetimes,
    which cut every step and window apart, give the report ranges of 2**18 give."""
    from memlens.analysis import lifetimes
    from memlens.ops.triage import TriageOptions, triage

    whole = triage(str(path), TriageOptions(cache=False)).to_json()
    monkeypatch.setattr(lifetimes, "LIFETIME_CHUNK", 3)
    assert triage(str(path), TriageOptions(cache=False)).to_json() == whole
