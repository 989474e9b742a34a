"""Activation plateau: rise through forward, fall through backward; any meaningful height, rated by share."""

from __future__ import annotations

from memlens.analysis import Finding, analyze
from memlens.analysis.settings import (
    ACTIVATION_HIGH_SEVERITY_FRACTION,
    ACTIVATION_MEDIUM_SEVERITY_FRACTION,
    ACTIVATION_MIN_FRACTION_OF_PEAK,
    FULL_CHECKPOINT_KEEP_FRACTION,
)
from memlens.units import GiB
from tests.unit.tracebuilder import BACKWARD, MODEL, MiB, TraceBuilder, training_run


def test_plateau_height_stacks_and_checkpointing_saving() -> None:
    report = analyze(training_run(3).snapshot())
    (plateau,) = [f for f in report.findings if f.kind == "activation_plateau"]
    assert plateau.bytes == 8 * 64 * MiB
    assert plateau.top_stacks[0].frames[0] == "forward (/work/proj/model.py:10)"
    assert plateau.top_stacks[0].bytes == 8 * 64 * MiB
    assert plateau.estimated_saving_bytes == int(8 * 64 * MiB * (1 - FULL_CHECKPOINT_KEEP_FRACTION))
    assert plateau.evidence["selective_checkpointing_saving_bytes"] < plateau.estimated_saving_bytes
    assert "estimate" in str(plateau.evidence["saving_basis"])
    assert plateau.step in (1, 2, 3)


def test_small_activations_are_not_a_plateau() -> None:
    report = analyze(training_run(3, activations=(1 * MiB,) * 4, params=(256 * MiB,) * 4).snapshot())
    assert not [f for f in report.findings if f.kind == "activation_plateau"]


def test_forward_only_rise_and_fall_is_not_a_plateau() -> None:
    b = TraceBuilder()
    acts = [b.alloc(64 * MiB, MODEL) for _ in range(8)]
    for address in acts:  # inference frees as it goes, from Python, with no backward
        b.free(address)
    assert not [f for f in analyze(b.snapshot()).findings if f.kind == "activation_plateau"]


def _plateau(builder: TraceBuilder) -> list[Finding]:
    return [f for f in analyze(builder.snapshot()).findings if f.kind == "activation_plateau"]


def test_a_plateau_a_tenth_of_the_peak_is_reported_as_low() -> None:
    (plateau,) = _plateau(training_run(3, activations=(64 * MiB,) * 8, params=(256 * MiB,) * 4))
    assert plateau.bytes == 8 * 64 * MiB
    share = float(plateau.evidence["share_of_peak"])
    assert ACTIVATION_MIN_FRACTION_OF_PEAK <= share < ACTIVATION_MEDIUM_SEVERITY_FRACTION
    assert plateau.severity == "low"


def test_severity_follows_the_share_of_the_peak() -> None:
    (medium,) = _plateau(training_run(3, activations=(64 * MiB,) * 8, params=(64 * MiB,) * 4))
    share = float(medium.evidence["share_of_peak"])
    assert ACTIVATION_MEDIUM_SEVERITY_FRACTION <= share < ACTIVATION_HIGH_SEVERITY_FRACTION
    assert medium.severity == "medium"
    (high,) = _plateau(training_run(3, params=(16 * MiB,) * 4))
    assert float(high.evidence["share_of_peak"]) >= ACTIVATION_HIGH_SEVERITY_FRACTION and high.severity == "high"


def test_forward_ends_at_the_first_autograd_row_when_backward_is_higher() -> None:
    b = TraceBuilder()
    with b.scope("memlens.step#1"):
        acts = [b.alloc(64 * MiB, MODEL) for _ in range(4)]
        scratch = b.alloc(1 * GiB, BACKWARD)  # backward's own buffer tops the step
        for address in reversed(acts):
            b.free(address)
        b.free(scratch)
    (plateau,) = _plateau(b)
    assert plateau.bytes == 4 * 64 * MiB
    assert plateau.evidence["forward_end_source"] == "first autograd row"
    assert plateau.evidence["forward_end_event"] == 3  # the last forward row, before the 1 GiB buffer
    assert plateau.evidence["allocated_at_forward_end_bytes"] == 4 * 64 * MiB
    assert plateau.evidence["forward_end_us"] == int(b.snapshot().device(0).time_us[3])
    assert plateau.evidence["step"] == 1
