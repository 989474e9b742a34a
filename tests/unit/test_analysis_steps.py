"""Step boundaries from each source, in order of trust, and the optimizer windows."""

from __future__ import annotations

import memlens
from memlens.analysis import analyze
from tests.unit.tracebuilder import MODEL, OPTIM_WINDOWS, MiB, TraceBuilder, training_run


def test_memlens_markers_give_numbered_complete_steps() -> None:
    report = analyze(training_run(4, markers="memlens").snapshot())
    device = report.device(0)
    assert device.step_source == "memlens"
    assert [s.index for s in device.steps] == [1, 2, 3, 4]
    assert not any(s.partial for s in device.steps)
    assert all(s.start_us is not None and s.end_us is not None for s in device.steps)
    # Steps tile the trace rows of each loop iteration without overlapping.
    for a, b in zip(device.steps, device.steps[1:], strict=False):
        assert a.end_event <= b.start_event


def test_memlens_metadata_markers_without_annotations() -> None:
    builder = training_run(3, markers="metadata", annotate_optimizer=False)
    device = analyze(builder.snapshot()).device(0)
    assert device.step_source == "memlens"
    assert [s.index for s in device.steps] == [1, 2, 3]


def test_profiler_steps() -> None:
    device = analyze(training_run(3, markers="profiler").snapshot()).device(0)
    assert device.step_source == "profiler"
    assert len(device.steps) == 3


def test_optimizer_annotations_split_steps_where_step_ends() -> None:
    device = analyze(training_run(4, markers="none").snapshot()).device(0)
    assert device.step_source == "optimizer_annotations"
    complete = [s for s in device.steps if not s.partial]
    assert len(complete) == 3  # step 1 is the head: nothing says the window began with it
    assert device.optimizer_window_source == "annotations"
    assert len(device.optimizer_windows) == 4


def test_optimizer_frames_with_windows_paths_when_nothing_is_annotated() -> None:
    builder = training_run(4, markers="none", annotate_optimizer=False, optimizer_frames=OPTIM_WINDOWS)
    device = analyze(builder.snapshot()).device(0)
    assert device.step_source == "optimizer_frames"
    assert device.optimizer_window_source == "frames"
    assert len(device.optimizer_windows) == 4


def test_periodic_shape_when_there_are_no_markers_or_frames() -> None:
    builder = TraceBuilder()
    for _ in range(6):
        acts = [builder.alloc(8 * MiB) for _ in range(20)]
        for address in reversed(acts):
            builder.free(address)
    device = analyze(builder.snapshot()).device(0)
    assert device.step_source == "periodic"
    complete = [s for s in device.steps if not s.partial]
    assert 4 <= len(complete) <= 6
    lengths = {s.end_event - s.start_event for s in complete}
    assert max(lengths) - min(lengths) <= 4  # every period has the same 80 rows, give or take


def test_a_single_forward_backward_has_no_steps() -> None:
    builder = TraceBuilder()
    acts = [builder.alloc(8 * MiB, MODEL) for _ in range(30)]
    for address in reversed(acts):
        builder.free(address)
    device = analyze(builder.snapshot()).device(0)
    assert device.step_source == "none"
    assert device.steps == []


def test_window_starting_mid_step_flags_the_first_step_partial() -> None:
    builder = training_run(4, markers="memlens")
    # Drop the first half of step 1's rows, as a wrapped ring buffer would.
    first_end = next(a["time_us"] for a in builder.annotations if a["name"] == "memlens.step#1" and a["stage"] == "END")
    rows = [i for i, e in enumerate(builder.trace) if e["time_us"] < first_end]
    del builder.trace[: len(rows) // 2]
    device = analyze(builder.snapshot()).device(0)
    assert device.steps[0].index == 1 and device.steps[0].partial
    assert not any(s.partial for s in device.steps[1:])


def test_no_time_stamps_still_finds_steps_from_frames() -> None:
    builder = TraceBuilder(with_time=False)
    params = [builder.ghost(8 * MiB, MODEL)]
    grads: list[int] = []
    state: list[int] = []
    for _ in range(3):
        builder.train_step([16 * MiB] * 4, params, grads, state, 4 * MiB, annotate_optimizer=False)
    snapshot = builder.snapshot()
    assert not snapshot.device(0).has_time
    device = memlens.analyze(snapshot).device(0)
    assert device.step_source == "optimizer_frames"
    assert all(s.start_us is None for s in device.steps)


def test_a_memlens_step_that_opens_the_whole_history_is_not_partial() -> None:
    """memlens record (and predict) begin step 0 where the history begins: its START comes before
    the first row, and a first step does less than the others (the model is moved there, the
    optimizer has no state yet), but nothing was cut when the history saw every live byte."""
    builder = TraceBuilder()
    for index, count in enumerate([6, 10, 10, 10]):
        with builder.scope(f"memlens.step#{index}"):
            blocks = [builder.alloc(MiB) for _ in range(count)]
            for address in reversed(blocks):
                builder.free(address)
    device = analyze(builder.snapshot()).device(0)
    assert device.window_complete
    assert [(s.index, s.partial) for s in device.steps] == [(0, False), (1, False), (2, False), (3, False)]
