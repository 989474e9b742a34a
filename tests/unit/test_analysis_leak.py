"""Leak: allocations from one stack that outlive their step and pile up, never a hand-over,
the warm-up step or a flat run; no floor on the bytes."""

from __future__ import annotations

from collections.abc import Callable

from memlens.analysis import Finding, Report, analyze
from memlens.analysis.settings import LEAK_HIGH_SEVERITY_STEPS_LEFT, LEAK_MEDIUM_SEVERITY_STEPS_LEFT
from memlens.units import GiB
from tests.unit.tracebuilder import LEAKY, MODEL, OPTIM, MiB, TraceBuilder, frame, training_run

HANDOVER = [frame("train", "/work/proj/train.py", 60)]


def _leaks(report: Report) -> list[Finding]:
    return [f for f in report.findings if f.kind == "leak"]


def _loop(steps: int, after_step: Callable[[TraceBuilder, int], None]) -> TraceBuilder:
    """A marked training loop; ``after_step(builder, step)`` runs at the end of each step."""
    b = TraceBuilder()
    params = [b.ghost(32 * MiB, MODEL) for _ in range(4)]
    grads: list[int] = []
    state: list[int] = []
    for step in range(1, steps + 1):
        with b.scope(f"memlens.step#{step}"):
            b.train_step([64 * MiB] * 4, params, grads, state, 16 * MiB)
            after_step(b, step)
    return b


def test_leak_reports_bytes_per_step_stacks_and_steps_left() -> None:
    report = analyze(training_run(6, leak=8 * MiB).snapshot(), capacity=4 * GiB)
    (leak,) = _leaks(report)
    assert leak.evidence["bytes_per_step"] == 8 * MiB
    assert leak.evidence["kept_steps"] == 5  # steps 2-6: step 1 is the warm-up
    assert leak.bytes == 5 * 8 * MiB  # held at the end of step 6
    assert leak.top_stacks[0].frames == ["train (/work/proj/train.py:50)"]
    peak = report.device(0).peak_allocated_bytes
    assert leak.evidence["steps_until_full"] == (4 * GiB - peak) // (8 * MiB)
    assert leak.severity == "high"
    assert leak.estimated_saving_bytes == leak.bytes
    assert leak.evidence["level_rise_per_step_bytes"] == 8 * MiB  # the level corroborates


def test_evidence_names_where_it_was_measured() -> None:
    snapshot = training_run(6, leak=8 * MiB).snapshot()
    report = analyze(snapshot)
    (leak,) = _leaks(report)
    steps = report.device(0).steps
    assert (leak.evidence["first_step"], leak.evidence["last_step"]) == (2, 6)
    last_row = steps[-1].end_event - 1
    assert leak.evidence["last_step_end_event"] == last_row
    assert leak.evidence["last_step_end_us"] == int(snapshot.device(0).time_us[last_row])
    assert leak.evidence["level_at_last_step_end_bytes"] == int(snapshot.device(0).allocated[last_row])
    assert leak.evidence["severity_basis"] == "peak"  # capacity unknown
    assert leak.evidence["steps_until_peak_doubles"] == report.device(0).peak_allocated_bytes // (8 * MiB)


def test_a_512_byte_leak_is_found_exactly_and_rated_by_steps_left() -> None:
    def keep_loss(b: TraceBuilder, step: int) -> None:
        b.alloc(4, LEAKY)  # a 0-d float32 loss kept in a list

    snapshot = _loop(6, keep_loss).snapshot()
    (leak,) = _leaks(analyze(snapshot, capacity=80 * GiB))
    assert leak.evidence["bytes_per_step"] == 512  # the allocator's block: no floor
    assert leak.evidence["requested_bytes_per_step"] == 4
    assert int(leak.evidence["steps_until_full"]) > LEAK_MEDIUM_SEVERITY_STEPS_LEFT
    assert leak.severity == "low"
    peak = analyze(snapshot).device(0).peak_allocated_bytes
    (tight,) = _leaks(analyze(snapshot, capacity=peak + 512 * 500))
    assert int(tight.evidence["steps_until_full"]) == 500 < LEAK_HIGH_SEVERITY_STEPS_LEFT
    assert tight.severity == "high"


def test_capacity_from_the_sidecar() -> None:
    snapshot = training_run(6, leak=8 * MiB).snapshot(sidecar={"device": {"total_memory": 4 * GiB}})
    (leak,) = _leaks(analyze(snapshot))
    assert leak.evidence["capacity_bytes"] == 4 * GiB


def test_flat_run_is_not_a_leak_even_with_state_created_in_step_one() -> None:
    report = analyze(training_run(6).snapshot())
    assert _leaks(report) == []


def test_one_step_is_too_few_to_compare() -> None:
    assert _leaks(analyze(training_run(2, leak=8 * MiB).snapshot())) == []


def test_a_short_run_needs_two_steps_kept_together() -> None:
    (leak,) = _leaks(analyze(training_run(3, leak=8 * MiB).snapshot()))
    assert leak.evidence["kept_steps"] == 2 and leak.evidence["comparable_steps"] == 2


def test_a_tensor_handed_to_the_next_step_is_not_a_leak() -> None:
    kept: list[int] = []

    def hand_over(b: TraceBuilder, step: int) -> None:  # prev = out: the old one freed next step
        kept.append(b.alloc((1 + step % 3) * MiB, HANDOVER))
        if len(kept) > 1:
            b.free(kept.pop(0))

    assert _leaks(analyze(_loop(8, hand_over).snapshot())) == []


def test_a_two_step_prefetch_queue_is_not_a_leak() -> None:
    queue: list[int] = []

    def prefetch(b: TraceBuilder, step: int) -> None:
        queue.append(b.alloc(4 * MiB, HANDOVER))
        if len(queue) > 2:
            b.free(queue.pop(0))

    assert _leaks(analyze(_loop(8, prefetch).snapshot())) == []


def test_a_list_freed_when_the_script_ends_is_still_a_leak() -> None:
    kept: list[int] = []

    def keep(b: TraceBuilder, step: int) -> None:
        kept.append(b.alloc(300_000, LEAKY))
        if step == 6:  # the script returns: its list goes, inside the last recorded step
            for address in kept:
                b.free(address)

    (leak,) = _leaks(analyze(_loop(6, keep).snapshot()))
    assert leak.evidence["bytes_per_step"] == 300_032  # 300,000 bytes in 512-byte blocks
    assert leak.evidence["requested_bytes_per_step"] == 300_000
    assert leak.evidence["last_step"] == 5
    assert leak.bytes == 4 * 300_032  # held at the end of step 5 (steps 2-5: step 1 is the warm-up)


def test_a_leak_every_other_step_is_a_leak() -> None:
    def every_other(b: TraceBuilder, step: int) -> None:
        if step % 2 == 0:
            b.alloc(2 * MiB, LEAKY)

    (leak,) = _leaks(analyze(_loop(9, every_other).snapshot()))
    assert leak.evidence["kept_steps"] == 4
    # 2 MiB kept in steps 2, 4, 6 and 8: averaged over the 7 steps it spans, not 2 MiB a step.
    assert leak.evidence["bytes_per_step"] == round(4 * 2 * MiB / 7)


def test_optimizer_state_made_lazily_over_several_steps_is_not_a_leak() -> None:
    def late_experts(b: TraceBuilder, step: int) -> None:  # an expert's first gradient: its Adam state
        with b.scope("Optimizer.step#AdamW.step"):
            b.alloc(8 * MiB, OPTIM)
            b.alloc(8 * MiB, OPTIM)

    assert _leaks(analyze(_loop(6, late_experts).snapshot())) == []


def test_half_a_mebibyte_over_ten_steps_and_exactly_one_mebibyte_are_leaks() -> None:
    (half,) = _leaks(analyze(training_run(10, leak=512 * 1024).snapshot()))
    assert half.evidence["bytes_per_step"] == 512 * 1024 and half.evidence["kept_steps"] == 9
    for markers in ("memlens", "metadata"):  # steps from annotations or from user_metadata: one verdict
        (one,) = _leaks(analyze(training_run(6, leak=1 * MiB, markers=markers).snapshot()))
        assert one.evidence["bytes_per_step"] == 1 * MiB
