"""Optimizer spike: persistent state vs transient temporaries, from annotations or frames."""

from __future__ import annotations

from memlens.analysis import Finding, Report, analyze
from tests.unit.tracebuilder import OPTIM_WINDOWS, MiB, TraceBuilder, training_run


def _spike(report: Report) -> Finding | None:
    found = [f for f in report.findings if f.kind == "optimizer_spike"]
    assert len(found) <= 1
    return found[0] if found else None


def test_first_step_state_is_persistent_and_later_temps_transient() -> None:
    report = analyze(training_run(3, params=(64 * MiB,) * 4, optimizer_temps=32 * MiB).snapshot())
    spike = _spike(report)
    assert spike is not None
    windows = report.device(0).optimizer_windows
    assert (spike.start_event, spike.end_event) == windows[0]  # the first step makes the state
    assert spike.evidence["persistent_bytes"] == 8 * 64 * MiB
    assert spike.evidence["transient_peak_bytes"] == 2 * 32 * MiB  # two foreach buffers at once
    assert spike.evidence["windows"] == 3
    assert spike.top_stacks[0].frames[0].startswith("train (/work/proj/train.py")


def test_eight_p_comparison_uses_the_sidecar_parameter_count() -> None:
    snapshot = training_run(2, params=(64 * MiB,) * 4).snapshot(sidecar={"model": {"parameters": 64 * MiB}})
    spike = _spike(analyze(snapshot))
    assert spike is not None
    assert spike.evidence["parameters_source"] == "sidecar"
    assert spike.evidence["adam_state_8p_bytes"] == 8 * 64 * MiB
    assert spike.evidence["persistent_bytes"] == 8 * 64 * MiB


def test_window_from_optimizer_frames_on_windows_paths() -> None:
    builder = training_run(
        2, params=(64 * MiB,) * 4, markers="none", annotate_optimizer=False, optimizer_frames=OPTIM_WINDOWS
    )
    report = analyze(builder.snapshot())
    spike = _spike(report)
    assert spike is not None
    assert spike.evidence["window_source"] == "frames"
    assert spike.evidence["persistent_bytes"] == 8 * 64 * MiB


def test_no_optimizer_no_finding() -> None:
    b = TraceBuilder()
    acts = [b.alloc(64 * MiB) for _ in range(4)]
    for address in acts:
        b.free(address)
    assert _spike(analyze(b.snapshot())) is None


def test_tiny_optimizer_is_not_a_finding() -> None:
    report = analyze(training_run(3, params=(1 * MiB,), optimizer_temps=64 * 1024).snapshot())
    assert _spike(report) is None
