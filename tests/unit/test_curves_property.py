"""Invariants of the absolute curves over generated traces (hypothesis).

Traces come from a tiny slab allocator that keeps the segment state and the history in
agreement, the way PyTorch's allocator does. Cutting any prefix off (a ring buffer that
wrapped) must give the same curve for the events that remain: the baseline is rebuilt from
the final state.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from memlens.snapshot import parse

SEG = 2 << 20


def build(ops: list[tuple[str, int]]) -> dict[str, Any]:
    trace: list[dict[str, Any]] = []
    segments: list[list[int]] = []  # [address, used]
    free_slots: dict[int, list[int]] = {}
    slot_size: dict[int, int] = {}
    live: dict[int, int] = {}
    for op, value in ops:
        if op == "alloc":
            size = value
            rounded = max(512, -(-size // 512) * 512)
            if free_slots.get(rounded):
                address = free_slots[rounded].pop()
            else:
                if not segments or segments[-1][1] + rounded > SEG:
                    address0 = 0x1000_0000 + len(segments) * SEG * 2
                    segments.append([address0, 0])
                    trace.append({"action": "segment_alloc", "addr": address0, "size": SEG, "stream": 0})
                address = segments[-1][0] + segments[-1][1]
                segments[-1][1] += rounded
                slot_size[address] = rounded
            live[address] = size
            trace.append({"action": "alloc", "addr": address, "size": size, "stream": 0})
        elif live:
            address = sorted(live)[value % len(live)]
            size = live.pop(address)
            free_slots.setdefault(slot_size[address], []).append(address)
            trace.append({"action": "free_requested", "addr": address, "size": size, "stream": 0})
            trace.append({"action": "free_completed", "addr": address, "size": size, "stream": 0})
    raw_segments = []
    for address0, _used in segments:
        blocks = [{"address": a, "size": slot_size[a], "requested_size": live.get(a, 0),
                   "state": "active_allocated" if a in live else "inactive"}
                  for a in sorted(slot_size) if address0 <= a < address0 + SEG]
        raw_segments.append({"device": 0, "address": address0, "total_size": SEG, "stream": 0, "blocks": blocks})
    return {"segments": raw_segments, "device_traces": [trace]}


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
    raw["device_traces"][0] = entries[cut:]
    window = parse(raw).device(0)
    # the ring buffer dropped `cut` events: the remaining curve is unchanged, baseline included
    assert window.allocated.tolist() == full.allocated[cut:].tolist()
    assert window.reserved.tolist() == full.reserved[cut:].tolist()
    if cut:
        assert window.baseline_allocated == int(full.allocated[cut - 1])
        assert window.baseline_reserved == int(full.reserved[cut - 1])
