"""Activation plateau: rise through forward, fall through backward."""

from __future__ import annotations

from memlens.analysis import analyze
from memlens.analysis.settings import FULL_CHECKPOINT_KEEP_FRACTION
from tests.unit.tracebuilder import MODEL, MiB, TraceBuilder, training_run


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
