"""Leak: a staircase across steps, never a flat run or the warm-up step."""

from __future__ import annotations

from memlens.analysis import Finding, Report, analyze
from memlens.units import GiB
from tests.unit.tracebuilder import MiB, training_run


def _leaks(report: Report) -> list[Finding]:
    return [f for f in report.findings if f.kind == "leak"]


def test_leak_reports_bytes_per_step_stacks_and_steps_left() -> None:
    report = analyze(training_run(6, leak=8 * MiB).snapshot(), capacity=4 * GiB)
    (leak,) = _leaks(report)
    assert leak.evidence["bytes_per_step"] == 8 * MiB
    assert leak.bytes == 8 * MiB * 4  # five comparable steps after warm-up: four rises
    assert leak.top_stacks[0].frames == ["train (/work/proj/train.py:50)"]
    peak = report.device(0).peak_allocated_bytes
    assert leak.evidence["steps_until_full"] == (4 * GiB - peak) // (8 * MiB)
    assert leak.severity == "high"
    assert leak.estimated_saving_bytes == leak.bytes


def test_capacity_from_the_sidecar() -> None:
    snapshot = training_run(6, leak=8 * MiB).snapshot(sidecar={"device": {"total_memory": 4 * GiB}})
    (leak,) = _leaks(analyze(snapshot))
    assert leak.evidence["capacity_bytes"] == 4 * GiB


def test_flat_run_is_not_a_leak_even_with_state_created_in_step_one() -> None:
    report = analyze(training_run(6).snapshot())
    assert _leaks(report) == []


def test_too_few_steps_is_not_a_leak() -> None:
    assert _leaks(analyze(training_run(3, leak=8 * MiB).snapshot())) == []
