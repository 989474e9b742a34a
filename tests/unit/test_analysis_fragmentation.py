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
