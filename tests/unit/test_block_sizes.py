"""Allocated is block bytes, as ``torch.cuda.memory_allocated`` counts them (issue 20, section 2).

PyTorch's trace rows carry the *requested* size; the allocator counts the *block*: rounded to
512 B (or the ``roundup_power2_divisions`` steps), plus the tail of a large-pool free block that
``should_split`` kept whole. ``memlens.snapshot.blocks`` recovers the block of every row; these
tests hold it to hand-built layouts and to the simulator's own blocks over random runs.
"""

from __future__ import annotations

import io
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memlens.allocator import AllocatorSettings, CachingAllocatorSimulator, SimulatedOOM
from memlens.analysis import analyze, analyze_snapshot, live_at
from memlens.reporters.terminal import make_console, render_triage
from memlens.snapshot.blocks import block_sizes
from memlens.snapshot.model import Action
from memlens.snapshot.reader import parse
from memlens.units import MiB
from tests.unit.test_allocator_property import SIZES  # large-pool sizes leave tails of up to 1 MiB
from tests.unit.tracebuilder import MODEL, TraceBuilder

BASE = 0x7F00_0000_0000


def _entry(action: str, address: int, size: int) -> dict[str, Any]:
    return {"action": action, "addr": address, "size": size, "stream": 0}


def _raw(trace: list[dict[str, Any]], segments: list[dict[str, Any]], **settings: Any) -> dict[str, Any]:
    return {"segments": segments, "device_traces": [trace],
            "allocator_settings": {"expandable_segments": False, "max_split_size": -1, **settings}}


def _segment(address: int, total: int, blocks: list[tuple[int, int, int, str]]) -> dict[str, Any]:
    return {"device": 0, "address": address, "total_size": total, "stream": 0,
            "segment_type": "large" if total > 2 * MiB else "small", "segment_pool_id": (0, 0),
            "is_expandable": False, "frames": [],
            "blocks": [{"address": a, "size": s, "requested_size": r, "state": state} for a, s, r, state in blocks]}


def test_a_request_counts_its_512_byte_block_everywhere() -> None:
    b = TraceBuilder()
    b.alloc(1000, MODEL)
    b.alloc(3 * 4, MODEL)
    snapshot = b.snapshot()
    trace = snapshot.device(0)
    assert trace.size.tolist() == [1000, 12]  # the trace's requested bytes stay
    assert trace.block_size.tolist() == [1024, 512]
    assert trace.allocated.tolist() == [1024, 1536]
    analysis = analyze_snapshot(snapshot)
    device = analysis.report.device(0)
    assert device.peak_allocated_bytes == device.final_allocated_bytes == 1536
    assert sum(device.categories_at_peak.values()) == 1536
    assert live_at(analysis, 0).total_bytes == 1536
    assert device.peak_requested_bytes == 1012


def test_the_triage_header_says_what_was_requested_in_the_blocks() -> None:
    b = TraceBuilder()
    b.alloc(1000, MODEL)
    out = io.StringIO()
    render_triage(make_console(file=out, width=100, color=False), analyze(b.snapshot()))
    text = out.getvalue()
    assert "1000 B requested in the 1.00 KiB of blocks live at the peak" in text


def test_a_large_block_keeps_the_tail_should_split_left_whole() -> None:
    # One 20 MiB segment: 12 MiB leaves 8 MiB (split off); 7.5 MiB then leaves 0.5 MiB, which a
    # large-pool block keeps (remainder <= 1 MiB): its block is the whole 8 MiB.
    first, second = 12 * MiB, 15 * MiB // 2
    trace = [
        _entry("segment_alloc", BASE, 20 * MiB),
        _entry("alloc", BASE, first),
        _entry("alloc", BASE + first, second),
        _entry("free_requested", BASE + first, second),
        _entry("free_completed", BASE + first, second),
    ]
    segments = [_segment(BASE, 20 * MiB, [(BASE, first, first, "active_allocated"),
                                          (BASE + first, 8 * MiB, 0, "inactive")])]
    parsed = parse(_raw(trace, segments)).device(0)
    assert parsed.block_size.tolist() == [20 * MiB, first, 8 * MiB, 8 * MiB, 8 * MiB]
    assert parsed.allocated.tolist() == [0, first, 20 * MiB, first, first]


def test_blocks_live_at_the_dump_agree_with_the_layout_rule() -> None:
    # 19.5 MiB in a fresh 20 MiB segment keeps the 0.5 MiB tail: the state says 20 MiB too.
    size = 39 * MiB // 2
    trace = [_entry("segment_alloc", BASE, 20 * MiB), _entry("alloc", BASE, size)]
    segments = [_segment(BASE, 20 * MiB, [(BASE, 20 * MiB, size, "active_allocated")])]
    snapshot = parse(_raw(trace, segments))
    device = snapshot.device(0)
    layout = block_sizes(device.action, device.address, device.size, snapshot.segments,
                         AllocatorSettings(), use_final_state=False)
    assert layout.tolist() == device.block_size.tolist() == [20 * MiB, 20 * MiB]
    assert device.final_allocated == 20 * MiB


def test_expandable_segments_split_every_remainder() -> None:
    size = 39 * MiB // 2
    trace = [_entry("segment_alloc", BASE, 20 * MiB), _entry("alloc", BASE, size),
             _entry("free_requested", BASE, size), _entry("free_completed", BASE, size)]
    segments = [_segment(BASE, 20 * MiB, [(BASE, 20 * MiB, 0, "inactive")])]
    parsed = parse(_raw(trace, segments, expandable_segments=True)).device(0)
    assert parsed.block_size[1:].tolist() == [size] * 3


def test_an_oversize_block_is_never_split() -> None:
    # max_split_size 40 MiB: a 90 MiB request in a 100 MiB free block takes all of it.
    trace = [_entry("segment_alloc", BASE, 100 * MiB), _entry("alloc", BASE, 100 * MiB),
             _entry("free_requested", BASE, 100 * MiB), _entry("free_completed", BASE, 100 * MiB),
             _entry("alloc", BASE, 90 * MiB), _entry("free_requested", BASE, 90 * MiB),
             _entry("free_completed", BASE, 90 * MiB)]
    segments = [_segment(BASE, 100 * MiB, [(BASE, 100 * MiB, 0, "inactive")])]
    parsed = parse(_raw(trace, segments, max_split_size=40 * MiB)).device(0)
    assert parsed.block_size.tolist() == [100 * MiB] * 7


def test_a_block_from_before_the_window_gets_its_kept_tail() -> None:
    # Freed in the window, never allocated in it: 19.5 MiB before a block 0.5 MiB later.
    size = 39 * MiB // 2
    trace = [_entry("free_requested", BASE, size), _entry("free_completed", BASE, size)]
    segments = [_segment(BASE, 20 * MiB, [(BASE, 20 * MiB, 0, "inactive")])]
    parsed = parse(_raw(trace, segments)).device(0)
    assert parsed.block_size.tolist() == [20 * MiB, 20 * MiB]
    assert parsed.baseline_allocated == 20 * MiB and parsed.final_allocated == 0


OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("malloc"), SIZES, st.integers(0, 1)),
        st.tuples(st.just("free"), st.integers(0, 10_000), st.just(0)),
        st.tuples(st.just("request"), st.integers(0, 10_000), st.just(0)),
        st.tuples(st.just("complete"), st.integers(0, 10_000), st.just(0)),
        st.tuples(st.just("empty_cache"), st.just(0), st.just(0)),
    ),
    max_size=80,
)
SETTINGS = st.builds(
    AllocatorSettings,
    max_split_size=st.sampled_from([None, 32 * MiB, 64 * MiB]),
    roundup_power2_divisions=st.sampled_from([None, 4, {1: 2, 16: 8}]),
    expandable_segments=st.booleans(),
)


def _run(sim: CachingAllocatorSimulator, operations: list[tuple[str, int, int]]) -> list[int]:
    """The operations on ``sim``; the block size it handed out, per alloc row of its trace."""
    blocks: list[int] = []
    live: list[int] = []
    pending: list[int] = []
    for op, value, stream in operations:
        if op == "malloc":
            before = sim.allocated_bytes
            try:
                live.append(sim.malloc(value, stream))
            except SimulatedOOM:
                continue
            blocks.append(sim.allocated_bytes - before)
        elif op in ("free", "request") and live:
            address = live.pop(value % len(live))
            if op == "free":
                sim.free(address)
            else:
                sim.request_free(address)
                pending.append(address)
        elif op == "complete" and pending:
            sim.complete_free(pending.pop(value % len(pending)))
        elif op == "empty_cache":
            sim.empty_cache()
    return blocks


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SETTINGS, st.sampled_from([None, 200 * MiB]), OPERATIONS, st.integers(0, 200))
def test_every_alloc_row_gets_the_block_the_allocator_handed_out(
    allocator: AllocatorSettings, capacity: int | None, operations: list[tuple[str, int, int]], cut: int,
) -> None:
    sim = CachingAllocatorSimulator(allocator, capacity=capacity)
    truth = _run(sim, operations)
    raw = sim.snapshot()
    entries = raw["device_traces"][0]
    alloc_rows = [i for i, e in enumerate(entries) if e["action"] == "alloc"]
    assert len(alloc_rows) == len(truth)
    snapshot = parse(raw)
    trace = snapshot.device(0)
    for use_final_state in (True, False):
        # the native core's pass (where built), the vectorised one and the reference in row order
        for passes in ({}, {"native": False}, {"sweep": True}):
            measured = block_sizes(trace.action, trace.address, trace.size, snapshot.segments, allocator,
                                   use_final_state=use_final_state, **passes)
            assert measured[alloc_rows].tolist() == truth
    active_allocated = sum(b["size"] for s in raw["segments"] for b in s["blocks"]
                           if b["state"] == "active_allocated")
    assert trace.final_allocated == active_allocated
    assert not trace.curve_warnings
    assert (trace.allocated <= trace.reserved).all()

    # A window that opens mid-run (a ring buffer that wrapped): every alloc it still holds gets
    # the same block, and the end is still the state's.
    cut = min(cut, len(entries))
    raw["device_traces"][0] = entries[cut:]
    window = parse(raw).device(0)
    kept = [truth[k] for k, row in enumerate(alloc_rows) if row >= cut]
    assert window.block_size[window.action == int(Action.ALLOC)].tolist() == kept
    swept = block_sizes(window.action, window.address, window.size, snapshot.segments, allocator, sweep=True)
    assert swept.tolist() == window.block_size.tolist()
    assert window.final_allocated == active_allocated
    # A block from before the window is measured from the layout when it opened: never more than
    # its block, so the curve never rises above the whole history's.
    assert (window.allocated <= trace.allocated[cut:]).all()


def test_addresses_at_the_top_of_int64_are_measured_without_overflow() -> None:
    top = (1 << 63) - 40 * MiB
    size = 39 * MiB // 2
    trace = [_entry("segment_alloc", top, 20 * MiB), _entry("alloc", top, size),
             _entry("free_requested", top, size), _entry("free_completed", top, size)]
    segments = [_segment(top, 20 * MiB, [(top, 20 * MiB, 0, "inactive")])]
    parsed = parse(_raw(trace, segments)).device(0)
    assert parsed.block_size[1:].tolist() == [20 * MiB] * 3


def test_the_vectorised_pass_gives_the_same_blocks_in_small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import memlens.snapshot.blocks as blocks

    monkeypatch.setattr(blocks, "_CHUNK_PAIRS", 3)
    for seed in range(20):
        rng = random.Random(seed)
        operations = [("malloc", rng.choice([rng.randint(MiB + 1, 12 * MiB), rng.randint(12 * MiB, 120 * MiB)]), 0)
                      if rng.random() < 0.55 else ("free", rng.randint(0, 999), 0) for _ in range(90)]
        sim = CachingAllocatorSimulator(AllocatorSettings())
        truth = _run(sim, operations)
        snapshot = parse(sim.snapshot())
        trace = snapshot.device(0)
        measured = block_sizes(trace.action, trace.address, trace.size, snapshot.segments, AllocatorSettings(),
                               use_final_state=False)
        assert measured[trace.action == int(Action.ALLOC)].tolist() == truth


def test_settings_pytorch_would_refuse_round_with_the_defaults_and_say_so() -> None:
    trace = [_entry("segment_alloc", BASE, 2 * MiB), _entry("alloc", BASE, 1000)]
    segments = [_segment(BASE, 2 * MiB, [(BASE, 1024, 1000, "active_allocated"),
                                         (BASE + 1024, 2 * MiB - 1024, 0, "inactive")])]
    parsed = parse(_raw(trace, segments, max_split_size=1024)).device(0)  # under PyTorch's 20 MiB floor
    assert parsed.block_size.tolist() == [2 * MiB, 1024]
    assert any("block sizes follow the default rounding" in w for w in parsed.curve_warnings)


@pytest.mark.parametrize("inner", [4096, 3 * MiB])
def test_a_block_inside_another_ones_tail_is_measured_alike_by_both_python_passes(inner: int) -> None:
    """A history no allocator writes: an alloc inside a live large block's kept tail. The sweep
    sees the large pool only; the vectorised pass used to cut the block at a small-pool alloc."""
    trace = [_entry("segment_alloc", BASE, 20 * MiB), _entry("alloc", BASE, 19 * MiB + 100),
             _entry("alloc", BASE + 19 * MiB + 512, inner), _entry("free_completed", BASE, 19 * MiB + 100),
             _entry("alloc", BASE, 3 * MiB)]
    snapshot = parse(_raw(trace, []))
    window = snapshot.device(0)
    allocator = AllocatorSettings.from_snapshot_dict(snapshot.allocator_settings)
    vectorised = block_sizes(window.action, window.address, window.size, [], allocator, native=False)
    swept = block_sizes(window.action, window.address, window.size, [], allocator, sweep=True)
    assert vectorised.tolist() == swept.tolist()


def test_a_history_the_allocator_wrote_is_measured_by_the_vectorised_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """The row-by-row sweep measures only histories no allocator writes (a free at another size
    than its block, an address allocated twice): the simulator's runs, whole or cut mid-run as a
    ring buffer keeps them, stay on the vectorised pass."""
    import memlens.snapshot.blocks as blocks

    def no_sweep(*_: object) -> None:
        raise AssertionError("the sweep ran on a history the allocator wrote")

    monkeypatch.setattr(blocks, "_sweep_large_blocks", no_sweep)
    for seed in range(20):
        rng = random.Random(seed)
        operations = [("malloc", rng.choice([rng.randint(1, MiB), rng.randint(MiB + 1, 30 * MiB)]), 0)
                      if rng.random() < 0.55 else (rng.choice(["free", "request", "complete"]), rng.randint(0, 999), 0)
                      for _ in range(90)]
        sim = CachingAllocatorSimulator(AllocatorSettings())
        _run(sim, operations)
        snapshot = parse(sim.snapshot())
        trace = snapshot.device(0)
        for cut in (0, rng.randrange(trace.action.size)):
            window = slice(cut, None)
            block_sizes(trace.action[window], trace.address[window], trace.size[window], snapshot.segments,
                        AllocatorSettings(), native=False)
