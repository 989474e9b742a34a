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
