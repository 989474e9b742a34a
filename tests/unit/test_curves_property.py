"""Invariants of the absolute curves over generated traces (hypothesis).

Traces come from memlens' model of the caching allocator, which keeps the segment state and
the history in agreement the way PyTorch's allocator does. Cutting any prefix off (a ring buffer that
wrapped) must give the same curve for the events that remain: the baseline is rebuilt from
the final state.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from memlens.allocator import CachingAllocatorSimulator
from memlens.snapshot import parse

SEG = 2 << 20  # the largest request generated: small-pool and large-pool sizes alike


def build(ops: list[tuple[str, int]]) -> dict[str, Any]:
    """The snapshot of memlens' model of PyTorch's caching allocator after ``ops``: its trace and
    its segments agree as PyTorch's do (best-fit blocks, splits, merges, kept large-pool tails),
    so the block bytes the reader recovers from the layout are the allocator's own."""
    simulator = CachingAllocatorSimulator()
    live: list[int] = []
    for op, value in ops:
        if op == "alloc":
            live.append(simulator.malloc(value))
        elif live:
            simulator.free(live.pop(value % len(live)))
    return simulator.snapshot()


operations = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(min_value=1, max_value=SEG)),
        st.tuples(st.just("free"), st.integers(min_value=0, max_value=1000)),
    ),
    min_size=1,
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(ops=operations, cut=st.integers(min_value=0, max_value=400))
def test_allocated_stays_within_reserved_and_nonnegative(ops: list[tuple[str, int]], cut: int) -> None:
    raw = build(ops)
    full = parse(raw).device(0)
    assert (full.allocated >= 0).all()
    assert (full.allocated <= full.reserved).all()
    assert full.baseline_allocated == 0 and full.baseline_reserved == 0
    assert full.window_complete
    assert not full.curve_warnings

    entries = raw["device_traces"][0]
    cut = min(cut, len(entries))
    if 0 < cut < len(entries) and entries[cut]["action"] == "free_completed" and not any(
            e["action"] == "free_requested" for e in entries[cut:]):
        # A window that opens between a free's two rows and holds no other request cannot tell
        # the completion from the one free row of builds that write no free_requested (it is
        # read as the free): no reader can, so that cut is moved past the completion.
        cut += 1
    raw["device_traces"][0] = entries[cut:]
    window = parse(raw).device(0)
    # the ring buffer dropped `cut` events: the remaining curve is unchanged, baseline included
    assert window.allocated.tolist() == full.allocated[cut:].tolist()
    assert window.reserved.tolist() == full.reserved[cut:].tolist()
    if cut:
        assert window.baseline_allocated == int(full.allocated[cut - 1])
        assert window.baseline_reserved == int(full.reserved[cut - 1])
