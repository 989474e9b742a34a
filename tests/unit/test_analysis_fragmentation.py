"""Fragmentation: reserved far above allocated, split into internal and external."""

from __future__ import annotations

from memlens.analysis import Finding, Report, analyze
from tests.unit.tracebuilder import MiB, TraceBuilder


def _frag(report: Report) -> list[Finding]:
    return [f for f in report.findings if f.kind == "fragmentation"]


def test_cached_free_pieces_are_external_fragmentation() -> None:
    b = TraceBuilder()
    kept = [b.alloc(100 * MiB) for _ in range(4)]
    b.free(kept[0])
    b.add_free_space(*([100 * MiB] * 3 + [512 * 1024] * 4))
    (frag,) = _frag(analyze(b.snapshot()))
    assert frag.evidence["external_bytes"] == frag.bytes
    # At the peak all four blocks were live; the cache then held the pieces minus that one block.
    assert frag.bytes == 300 * MiB + 4 * 512 * 1024 - 100 * MiB
    assert frag.evidence["largest_free_block_at_dump_bytes"] == 100 * MiB
    assert "expandable_segments:True" in frag.recommendation
    assert frag.estimated_saving_bytes == frag.bytes


def test_rounding_is_internal_fragmentation() -> None:
    b = TraceBuilder()
    b.alloc(100 * MiB + 1)
    b.add_free_space(200 * MiB)
    (frag,) = _frag(analyze(b.snapshot()))
    assert frag.evidence["internal_bytes"] == 511


def test_tight_reservation_is_not_fragmentation() -> None:
    b = TraceBuilder()
    for _ in range(4):
        b.alloc(100 * MiB)
    b.add_free_space(2 * MiB)
    assert _frag(analyze(b.snapshot())) == []


def test_state_only_snapshot_uses_the_dump_state() -> None:
    b = TraceBuilder()
    b.ghost(100 * MiB)
    b.add_free_space(400 * MiB)
    (frag,) = _frag(analyze(b.snapshot()))
    assert frag.evidence["where"] == "at dump time"


def test_small_fragmentation_that_blocked_an_oom_is_reported() -> None:
    """Under the usual size threshold, but the cached pieces plus the device's free memory would
    have held the failed request: that OOM is fragmentation's doing."""
    b = TraceBuilder()
    for _ in range(4):
        b.alloc(10 * MiB)
    b.add_free_space(*([8 * MiB] * 4))  # 32 MiB cached, no piece larger than 8 MiB
    b.oom(24 * MiB, device_free=20 * MiB)
    report = analyze(b.snapshot())
    (frag,) = _frag(report)
    assert frag.severity == "high"
    assert frag.evidence["device_free_at_oom_bytes"] == 20 * MiB
    assert "would have held the failed" in frag.summary
    (oom,) = [f for f in report.findings if f.kind == "oom"]
    assert "fragmentation" in oom.recommendation


def test_oom_that_no_defragmentation_could_have_avoided_is_not_fragmentation() -> None:
    b = TraceBuilder()
    for _ in range(4):
        b.alloc(10 * MiB)
    b.add_free_space(*([1 * MiB] * 4))  # 4 MiB cached + 2 MiB free: far from the 64 MiB asked
    b.oom(64 * MiB, device_free=2 * MiB)
    report = analyze(b.snapshot())
    assert _frag(report) == []
    assert [f.kind for f in report.findings if f.kind == "oom"] == ["oom"]
