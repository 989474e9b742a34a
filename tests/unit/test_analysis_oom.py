"""OOM: from an oom row, or a state-only dump near capacity."""

from __future__ import annotations

from memlens.analysis import Finding, Report, analyze
from memlens.units import GiB
from tests.unit.tracebuilder import MODEL, MiB, TraceBuilder


def _oom(report: Report) -> list[Finding]:
    return [f for f in report.findings if f.kind == "oom"]


def test_oom_row_reports_request_free_and_cause() -> None:
    b = TraceBuilder()
    live = [b.alloc(100 * MiB, MODEL) for _ in range(6)]
    for address in live[::2]:
        b.free(address)
    b.add_free_space(300 * MiB)
    b.oom(200 * MiB, device_free=50 * MiB)
    (oom,) = _oom(analyze(b.snapshot()))
    assert oom.bytes == 200 * MiB
    assert oom.evidence["device_free_bytes"] == 50 * MiB
    assert oom.evidence["cached_free_bytes"] >= 200 * MiB
    assert oom.evidence["explained_by"] == "fragmentation"
    live = sum(int(v) for k, v in oom.evidence.items() if k.startswith("live_"))
    assert live == oom.evidence["allocated_bytes"] == 300 * MiB
    assert oom.severity == "high"


def test_state_only_dump_near_capacity() -> None:
    b = TraceBuilder()
    b.ghost(int(7.8 * GiB))
    report = analyze(b.snapshot(), capacity="8GiB")
    (oom,) = _oom(report)
    assert "near capacity" in str(oom.evidence["source"])


def test_no_oom_without_evidence() -> None:
    b = TraceBuilder()
    b.ghost(1 * GiB)
    assert _oom(analyze(b.snapshot())) == []
    assert _oom(analyze(b.snapshot(), capacity="80GiB")) == []


def test_the_reason_comes_from_the_replayed_pool_at_the_failure() -> None:
    """Earlier cudaMallocs were blocked by pieces, but at the OOM the large pool held 0 B free: a
    5 MiB request opens a 20 MiB segment, which did not fit in the 14 MiB the device had left.
    That is no fragmentation failure, and the explanation says what happened."""
    import pytest

    from memlens.allocator import CachingAllocatorSimulator, SimulatedOOM
    from memlens.snapshot.reader import parse

    sim = CachingAllocatorSimulator(capacity=2294 * MiB)
    first = [sim.malloc(240 * MiB) for _ in range(8)]
    for address in first:
        sim.free(address)
    [sim.malloc(200 * MiB) for _ in range(8)]  # eight 40 MiB pieces
    [sim.malloc(120 * MiB) for _ in range(3)]  # blocked cudaMallocs: the pieces are too small
    [sim.malloc(40 * MiB) for _ in range(8)]  # the pieces filled: nothing free in the pool
    with pytest.raises(SimulatedOOM):
        sim.malloc(5 * MiB)
    report = analyze(parse(sim.snapshot(), source="<simulated>"))
    (oom,) = _oom(report)
    assert oom.evidence["pool_free_bytes"] == 0
    assert oom.evidence["device_free_bytes"] == 14 * MiB
    assert oom.evidence["new_segment_bytes"] == 20 * MiB
    assert oom.evidence["explained_by"] != "fragmentation"
    assert "not in one piece" not in oom.summary + oom.recommendation
    assert ("its large pool held 0 B free, so the 5.00 MiB request opens a 20.00 MiB segment "
            "(the allocator packs 1-10 MiB requests in 20 MiB segments), which did not fit in the "
            "14.00 MiB left on the device") in oom.summary
    # 0 B in the pool plus 14 MiB on the device is no fragmentation failure either.
    frag = [f for f in report.findings if f.kind == "fragmentation"]
    assert all(f.evidence.get("oom_blocked_by_fragmentation") != "yes" for f in frag)


def test_one_replay_is_shared_by_fragmentation_and_oom_through_the_context(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The fragmentation and OOM finders of one device read one replay, held by the analysis
    context (no module-level memo keyed by object identity): each analysis replays once per
    device, and a second analysis of the same snapshot object replays again."""
    from memlens.analysis import context

    calls: list[int] = []
    replay = context.replay_pool_states

    def counted(snapshot, trace, capacity):  # type: ignore[no-untyped-def]
        calls.append(trace.device)
        return replay(snapshot, trace, capacity)

    monkeypatch.setattr(context, "replay_pool_states", counted)
    b = TraceBuilder()
    live = [b.alloc(100 * MiB, MODEL) for _ in range(6)]
    for address in live[::2]:
        b.free(address)
    b.add_free_space(300 * MiB)
    b.oom(200 * MiB, device_free=50 * MiB)
    snapshot = b.snapshot()
    report = analyze(snapshot)
    assert {f.kind for f in report.findings} >= {"oom", "fragmentation"}  # both finders read the replay
    assert calls == [0]
    analyze(snapshot)
    assert calls == [0, 0]
