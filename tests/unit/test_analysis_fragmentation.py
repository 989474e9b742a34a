"""Fragmentation from the allocator's evidence (blocked cudaMallocs, the OOM's pool), idle cache
apart from it.

The traces are written by memlens' caching-allocator simulator, so every segment, split and
cudaMalloc in them is one the real allocator's rules would make.
"""

from __future__ import annotations

from typing import Any

import pytest

from memlens.allocator import CachingAllocatorSimulator, SimulatedOOM
from memlens.analysis import Finding, Report, analyze
from memlens.analysis.schema import validate
from memlens.snapshot.reader import parse
from tests.unit.tracebuilder import MiB, TraceBuilder


def _kind(report: Report, kind: str) -> list[Finding]:
    return [f for f in report.findings if f.kind == kind]


def _snapshot(sim: CachingAllocatorSimulator, state_only: bool = False) -> Any:
    raw = sim.snapshot()
    if state_only:
        raw["device_traces"] = [[]]
    return parse(raw, source="<simulated>")


def _split_cache(sim: CachingAllocatorSimulator, kept_mib: int = 200) -> list[int]:
    """Eight 240 MiB segments, each then holding a ``kept_mib`` tensor and a free piece."""
    first = [sim.malloc(240 * MiB) for _ in range(8)]
    for address in first:
        sim.free(address)
    return [sim.malloc(kept_mib * MiB) for _ in range(8)]


def test_blocked_cudamallocs_are_counted_and_the_replay_gives_the_saving() -> None:
    sim = CachingAllocatorSimulator()
    kept = _split_cache(sim)
    # 320 MiB free in eight 40 MiB pieces: each 120 MiB request needs a new segment anyway.
    later = [sim.malloc(120 * MiB) for _ in range(3)]
    report = analyze(_snapshot(sim))
    assert validate(report.to_json()) == []
    (frag,) = _kind(report, "fragmentation")
    evidence = frag.evidence
    assert evidence["cudamallocs"] == 11
    assert evidence["blocked_cudamallocs"] == 3
    assert evidence["blocked_cudamalloc_bytes"] == 3 * 120 * MiB
    assert evidence["worst_blocked_request_bytes"] == 120 * MiB
    assert evidence["worst_blocked_pool_free_bytes"] == 320 * MiB
    assert evidence["worst_blocked_free_in_partly_used_segments_bytes"] == 320 * MiB
    assert evidence["worst_blocked_free_in_whole_segments_bytes"] == 0
    assert evidence["worst_blocked_largest_free_block_bytes"] == 40 * MiB
    # The moment is named: the first blocked cudaMalloc is the 9th segment_alloc row.
    rows = [i for i, e in enumerate(sim.trace) if e["action"] == "segment_alloc"]
    assert evidence["first_blocked_event"] == rows[8] == frag.start_event
    assert evidence["first_blocked_time_us"] == sim.trace[rows[8]]["time_us"] == frag.start_us
    # One expandable segment: 1920 MiB mapped, the three 120 MiB tensors fit in the 320 MiB left
    # after 8 x 200 MiB but the last, which maps two more 20 MiB pages: 1960 MiB against 2280 MiB.
    assert evidence["recorded_peak_reserved_bytes"] == 2280 * MiB
    assert evidence["replay_reproduces_recorded_reserved"] == "yes"
    assert evidence["expandable_segments_peak_reserved_bytes"] == 1960 * MiB
    assert frag.estimated_saving_bytes == 320 * MiB == frag.bytes
    assert frag.severity == "high"  # 14% of peak reserved
    assert "expandable_segments:True" in frag.recommendation
    assert "2.23 GiB" in frag.recommendation and "1.91 GiB" in frag.recommendation
    # Blocked requests of 120 MiB: max_split_size_mb:64 is replayed too, and reported as it is:
    # the 200 MiB tensors may then not take the 240 MiB cached blocks, which costs 1.56 GiB more.
    assert evidence["max_split_size_mb_tried"] == 64
    assert evidence["max_split_size_mb_saving_bytes"] == -1600 * MiB
    assert evidence["best_setting"] == "expandable_segments:True"
    del kept, later


def test_growth_into_a_full_pool_is_not_blocked() -> None:
    """cudaMallocs while every cached block is in use: the cache grows, nothing is fragmented."""
    sim = CachingAllocatorSimulator()
    live = [sim.malloc(150 * MiB) for _ in range(6)]
    for address in live[:3]:
        sim.free(address)
    [sim.malloc(150 * MiB) for _ in range(3)]  # reuse the three freed blocks exactly
    report = analyze(_snapshot(sim))
    assert _kind(report, "fragmentation") == []
    assert _kind(report, "idle_cache") == []


def test_idle_cache_is_not_fragmentation() -> None:
    """Whole free segments: 942 of 994 MiB free with nothing split is cache, not fragmentation."""
    sim = CachingAllocatorSimulator()
    keep = sim.malloc(52 * MiB)
    rest = [sim.malloc(size * MiB) for size in (400, 300, 242)]
    for address in rest:
        sim.free(address)
    for state_only in (False, True):
        report = analyze(_snapshot(sim, state_only))
        assert _kind(report, "fragmentation") == []
        (idle,) = _kind(report, "idle_cache")
        assert idle.bytes == idle.evidence["free_in_whole_segments_bytes"] == 942 * MiB
        assert idle.evidence["whole_free_segments"] == 3
        assert idle.evidence["reserved_bytes"] == 994 * MiB
        assert idle.estimated_saving_bytes is None  # the next step reuses it: no peak is lowered
        assert idle.severity == "low"
        assert "empty_cache" in idle.recommendation and "garbage_collection_threshold" in idle.recommendation
        assert "fragment" not in idle.summary.replace("not fragmented", "")
        assert validate(report.to_json()) == []
    del keep


def test_state_only_pieces_are_reported_without_a_saving() -> None:
    sim = CachingAllocatorSimulator()
    _split_cache(sim, kept_mib=150)
    report = analyze(_snapshot(sim, state_only=True))
    (frag,) = _kind(report, "fragmentation")
    assert frag.evidence["free_in_partly_used_segments_bytes"] == 720 * MiB == frag.bytes
    assert frag.evidence["partly_used_segments"] == 8
    assert frag.evidence["largest_free_piece_bytes"] == 90 * MiB
    assert frag.evidence["moment"] == "dump"
    assert frag.estimated_saving_bytes is None
    assert frag.severity == "low"
    assert "expandable_segments:True" not in frag.recommendation


def test_same_pieces_with_history_but_no_blocked_request_is_no_finding() -> None:
    """The dump holds the same pieces, but no cudaMalloc ever waited on them."""
    sim = CachingAllocatorSimulator()
    _split_cache(sim, kept_mib=150)
    assert _kind(analyze(_snapshot(sim)), "fragmentation") == []


def test_oom_blocked_by_pieces_that_expandable_segments_avoids() -> None:
    sim = CachingAllocatorSimulator(capacity=2000 * MiB)
    _split_cache(sim)
    with pytest.raises(SimulatedOOM):
        sim.malloc(120 * MiB)  # 80 MiB left on the device, 320 MiB free in 40 MiB pieces
    report = analyze(_snapshot(sim))
    (frag,) = _kind(report, "fragmentation")
    oom_row = len(sim.trace) - 1
    assert frag.evidence["oom_event"] == oom_row
    assert frag.evidence["oom_request_bytes"] == 120 * MiB
    assert frag.evidence["oom_pool_free_bytes"] == 320 * MiB
    assert frag.evidence["oom_largest_free_block_bytes"] == 40 * MiB
    assert frag.evidence["oom_device_free_bytes"] == 80 * MiB
    assert frag.evidence["oom_blocked_by_fragmentation"] == "yes"
    assert frag.evidence["expandable_segments_avoids_oom"] == "yes"
    assert frag.severity == "high"
    assert "the failed request fits" in frag.recommendation
    (oom,) = _kind(report, "oom")
    assert oom.evidence["explained_by"] == "fragmentation"
    assert oom.evidence["pool_largest_free_block_bytes"] == 40 * MiB
    assert oom.evidence["oom_event"] == oom_row
    assert "largest block 40.00 MiB" in oom.summary


def test_oom_that_no_layout_could_have_avoided_is_not_fragmentation() -> None:
    sim = CachingAllocatorSimulator(capacity=2000 * MiB)
    _split_cache(sim)
    with pytest.raises(SimulatedOOM):
        sim.malloc(600 * MiB)  # 320 MiB in pieces + 80 MiB on the device: not enough anyway
    report = analyze(_snapshot(sim))
    assert _kind(report, "fragmentation") == []
    (oom,) = _kind(report, "oom")
    assert oom.evidence["explained_by"] != "fragmentation"
    assert oom.evidence["pool_free_bytes"] == 320 * MiB


def test_small_pool_blocked_cudamallocs_below_the_floor_are_no_finding() -> None:
    """Blocked small-pool cudaMallocs cost 2 MiB each: a handful is not worth a setting."""
    sim = CachingAllocatorSimulator()
    blocks = [sim.malloc(512 * 1024) for _ in range(16)]  # four full 2 MiB segments
    for address in blocks[1::2]:
        sim.free(address)  # 4 MiB free, in 512 KiB pieces
    later = [sim.malloc(1024 * 1024) for _ in range(4)]  # two new 2 MiB segments
    report = analyze(_snapshot(sim))
    assert _kind(report, "fragmentation") == []
    from memlens.analysis.context import build_context
    from memlens.analysis.settings import AnalysisSettings

    snapshot = _snapshot(sim)
    evidence = build_context(snapshot, snapshot.device(0), AnalysisSettings()).allocator_evidence()
    blocked = evidence.blocked
    assert [c.pool.pool for c in blocked] == ["small", "small"]
    assert blocked[0].pool.free_bytes == 4 * MiB and blocked[0].pool.largest_free_block_bytes == 512 * 1024
    del later


def test_tracebuilder_whole_free_segments_are_idle_cache() -> None:
    b = TraceBuilder()
    b.alloc(100 * MiB)
    b.add_free_space(*([100 * MiB] * 3))
    report = analyze(b.snapshot())
    assert _kind(report, "fragmentation") == []
    (idle,) = _kind(report, "idle_cache")
    assert idle.bytes == 300 * MiB


def test_a_replay_that_does_not_reproduce_the_run_is_no_evidence() -> None:
    """The snapshot claims power-of-two rounding its trace was not made with: the replay's
    segments (256 MiB for each 240 MiB request) stop matching the recorded reserved bytes at the
    second cudaMalloc, and nothing it sees after that is reported."""
    sim = CachingAllocatorSimulator()
    _split_cache(sim)
    [sim.malloc(120 * MiB) for _ in range(3)]
    raw = sim.snapshot()
    raw["allocator_settings"]["roundup_power2_divisions"] = {str(1 << i): 4 for i in range(16)}
    snapshot = parse(raw, source="<simulated>")
    from memlens.analysis.context import build_context
    from memlens.analysis.settings import AnalysisSettings

    evidence = build_context(snapshot, snapshot.device(0), AnalysisSettings()).allocator_evidence()
    rows = [i for i, e in enumerate(sim.trace) if e["action"] == "segment_alloc"]
    assert evidence.diverged_at == rows[1]
    assert [c for c in evidence.cudamallocs if c.pool.blocked]  # what the diverged replay saw...
    assert evidence.blocked == []  # ...is not evidence
    assert _kind(analyze(snapshot), "fragmentation") == []


def test_a_trace_the_replay_cannot_run_gets_no_fragmentation_and_no_error() -> None:
    """garbage_collection_threshold acts relative to a capacity: with none known, no replay."""
    sim = CachingAllocatorSimulator()
    _split_cache(sim)
    [sim.malloc(120 * MiB) for _ in range(3)]
    raw = sim.snapshot()
    raw["allocator_settings"]["garbage_collection_threshold"] = 0.8
    report = analyze(parse(raw, source="<simulated>"))
    assert _kind(report, "fragmentation") == []


def _free_and_retry_run() -> CachingAllocatorSimulator:
    """A 1000 MiB device whose allocator twice frees an idle cached segment and retries: once
    before a cudaMalloc that then fits, once before an OOM that fragmentation explains."""
    sim = CachingAllocatorSimulator(capacity=1000 * MiB)
    first = [sim.malloc(200 * MiB) for _ in range(4)]
    for address in first:
        sim.free(address)
    kept = [sim.malloc(160 * MiB) for _ in range(4)]  # 160 MiB free in four 40 MiB pieces
    sim.free(sim.malloc(100 * MiB))  # an idle 100 MiB segment: 900 MiB reserved
    kept.append(sim.malloc(150 * MiB))  # 900 + 150 > 1000: the idle segment goes, then it fits
    sim.free(sim.malloc(46 * MiB))  # another idle segment: 996 MiB reserved
    with pytest.raises(SimulatedOOM):
        sim.malloc(120 * MiB)  # the idle 46 MiB go, and still only 50 MiB on the device
    assert sim.alloc_retries == 2 and sim.segment_free_count == 2
    return sim


def test_the_allocators_own_free_and_retry_keeps_the_replay_trusted() -> None:
    """With a capacity the replay leaves the allocator's free-and-retry runs to the simulator,
    which releases inside the malloc after the recorded segment_alloc / oom row: at that row it
    still holds the released segments. That is the recorded state before the run, not a
    divergence (it used to discard every row from the first retry on, the OOM included)."""
    sim = _free_and_retry_run()
    actions = [e["action"] for e in sim.trace]
    retry_row = actions.index("segment_free") + 1
    oom_row = len(actions) - 1
    assert actions[retry_row] == "segment_alloc" and actions[oom_row - 1:] == ["segment_free", "oom"]
    report = analyze(_snapshot(sim), capacity=1000 * MiB)
    (frag,) = _kind(report, "fragmentation")
    evidence = frag.evidence
    assert evidence["replay_reproduces_recorded_reserved"] == "yes"
    # The 100, 150 and 46 MiB cudaMallocs found 160 MiB in 40 MiB pieces; the 150 MiB one also
    # the idle 100 MiB segment, as the allocator searched its pool before releasing it.
    assert evidence["blocked_cudamallocs"] == 3 and evidence["worst_blocked_event"] == retry_row
    assert evidence["worst_blocked_pool_free_bytes"] == 260 * MiB
    assert evidence["worst_blocked_free_in_partly_used_segments_bytes"] == 160 * MiB
    assert evidence["worst_blocked_free_in_whole_segments_bytes"] == 100 * MiB
    # At the OOM the idle segment is already gone: the pool holds its pieces, the device 50 MiB.
    assert evidence["oom_event"] == oom_row
    assert evidence["oom_pool_free_bytes"] == 160 * MiB
    assert evidence["oom_free_in_whole_segments_bytes"] == 0
    assert evidence["oom_largest_free_block_bytes"] == 40 * MiB
    assert evidence["oom_device_free_bytes"] == 50 * MiB
    assert evidence["oom_blocked_by_fragmentation"] == "yes"
    (oom,) = _kind(report, "oom")
    assert oom.evidence["explained_by"] == "fragmentation"


def _random_run(seed: int, capacities: tuple[int, ...] = (), steps: int = 120) -> CachingAllocatorSimulator:
    """``steps`` mallocs and frees of six sizes (3-250 MiB) in a random order: a run whose
    cudaMallocs are sometimes blocked by pieces (fixed seeds, so every run of the test replays the
    same trace). With ``capacities`` (MiB, one picked by the seed) it stops at its first OOM."""
    import random

    rnd = random.Random(seed)
    sim = CachingAllocatorSimulator(capacity=rnd.choice(capacities) * MiB if capacities else None)
    live: list[int] = []
    sizes = [rnd.choice([3, 7, 12, 30, 50, 90, 130, 200, 250]) * MiB + rnd.randrange(0, MiB) for _ in range(6)]
    try:
        for _ in range(steps):
            if live and rnd.random() < 0.45:
                sim.free(live.pop(rnd.randrange(len(live))))
            else:
                live.append(sim.malloc(rnd.choice(sizes)))
    except SimulatedOOM:
        pass
    return sim


def test_blocked_cudamallocs_that_no_setting_helps_are_no_finding() -> None:
    """13 cudaMallocs (2.26 GiB) were blocked by pieces, but replayed with expandable_segments the
    peak reserved is 192 MiB *higher*, and with max_split_size_mb higher too: no fix saves
    anything, so no finding is headlined with the stranded bytes, and no setting is offered."""
    from memlens.analysis.pool_replay import replay_pool_states

    snapshot = _snapshot(_random_run(34))
    evidence = replay_pool_states(snapshot, snapshot.device(0), None)
    assert len(evidence.blocked) == 13
    assert sum(c.segment_bytes for c in evidence.blocked) == 2316 * MiB
    assert _kind(analyze(snapshot), "fragmentation") == []


def test_a_finding_s_bytes_are_what_the_helping_setting_saves() -> None:
    """expandable_segments would cost 256 MiB more here; max_split_size_mb:128 saves 32 MiB: the
    finding is 32 MiB and offers that setting only."""
    (frag,) = _kind(analyze(_snapshot(_random_run(19))), "fragmentation")
    assert frag.evidence["expandable_segments_saving_bytes"] == -256 * MiB
    assert frag.evidence["max_split_size_mb_saving_bytes"] == 32 * MiB
    assert frag.bytes == frag.estimated_saving_bytes == 32 * MiB
    assert frag.evidence["best_setting"] == "max_split_size_mb:128"
    assert frag.recommendation.startswith("Set PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128.")
    assert "ALLOC_CONF=expandable_segments" not in frag.recommendation


def test_an_oom_the_pieces_caused_that_no_setting_avoids_offers_no_setting() -> None:
    """At the OOM the large pool held 67.76 MiB in pieces (largest 20.15 MiB) and the device
    54 MiB, together enough for the 90.08 MiB request; replayed with expandable_segments or
    max_split_size_mb the run still runs out of memory. The failure stays a finding, its bytes
    the stranded pieces; no setting is offered and no "saving" is read off a replay cut short."""
    (frag,) = _kind(analyze(_snapshot(_random_run(60, capacities=(600, 800, 1000, 1500), steps=200))), "fragmentation")
    evidence = frag.evidence
    assert evidence["oom_blocked_by_fragmentation"] == "yes"
    assert evidence["expandable_segments_avoids_oom"] == evidence["max_split_size_mb_avoids_oom"] == "no"
    assert "best_setting" not in evidence
    assert not any(key.endswith("_saving_bytes") for key in evidence)
    assert frag.bytes == evidence["oom_pool_free_bytes"] and frag.estimated_saving_bytes is None
    assert frag.recommendation.startswith("No allocator setting memlens replayed avoids this failure")
    assert "Set PYTORCH_CUDA_ALLOC_CONF" not in frag.recommendation
