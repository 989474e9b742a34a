"""The timeline's envelope: the native kernel gives the rows its numpy reference gives, every
column's drawn maximum is the curve's true peak in that column, and a figure of a 1M-entry trace
draws a bounded number of points whatever the file's size."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memlens.analysis.datatypes import Timeline
from memlens.analysis.report import DeviceReport
from memlens.errors import MemlensUsageError
from memlens.figures.timeline import MAX_POINTS_PER_CURVE, timeline_figure
from memlens.ops.triage import TriageOptions, analyse
from memlens.snapshot.engine import native_kernels
from memlens.snapshot.envelope import column_envelope, column_envelope_reference, envelope_rows
from tests.conftest import SAMPLE_SNAPSHOTS_DIR

needs_native = pytest.mark.skipif(native_kernels() is None, reason="the native kernels are not built")

curves = st.lists(st.integers(min_value=-(2**62), max_value=2**62), min_size=1, max_size=400).map(
    lambda xs: np.asarray(xs, dtype=np.int64)
)


def _columns(start: int, end: int, width: int) -> list[tuple[int, int]]:
    return [(first, min(first + width, end)) for first in range(start, end, width)]


@settings(max_examples=300, deadline=None)
@given(curves, st.data())
def test_every_column_keeps_its_true_minimum_and_maximum(values: npt.NDArray[np.int64], data: st.DataObject) -> None:
    n = values.shape[0]
    start = data.draw(st.integers(0, n))
    end = data.draw(st.integers(start, n))
    width = data.draw(st.integers(1, max(1, n)))
    lows, highs = column_envelope(values, start, end, width)
    columns = _columns(start, end, width)
    assert len(lows) == len(highs) == len(columns)
    for (first, last), low, high in zip(columns, lows.tolist(), highs.tolist(), strict=True):
        assert first <= low < last and first <= high < last
        part = values[first:last]
        assert values[high] == part.max() and values[low] == part.min()  # the true peak of the column
        assert high == first + int(np.argmax(part)) and low == first + int(np.argmin(part))  # its first row
    reference = column_envelope_reference(values, start, end, width)
    assert np.array_equal(lows, reference[0]) and np.array_equal(highs, reference[1])


@needs_native
def test_the_native_kernel_is_built_and_matches_the_reference_on_a_large_curve() -> None:
    kernels = native_kernels()
    assert kernels is not None and hasattr(kernels, "column_envelope"), "the extension predates the envelope"
    rng = np.random.default_rng(7)
    values = np.cumsum(rng.integers(-1000, 1000, 1_000_003)).astype(np.int64)
    values[123_457] = values.max() + 1  # a one-row spike
    for start, end, width in ((0, values.shape[0], 500), (17, 999_001, 333), (5, 6, 1), (9, 9, 4)):
        native = kernels.column_envelope(values, start, end, width)
        reference = column_envelope_reference(values, start, end, width)
        assert np.array_equal(native[0], reference[0]) and np.array_equal(native[1], reference[1])
    rows = envelope_rows(values, 4000)
    assert 123_457 in rows.tolist() and len(rows) <= 4000


@needs_native
def test_rows_out_of_range_are_a_usage_error() -> None:
    kernels = native_kernels()
    assert kernels is not None
    values = np.arange(10, dtype=np.int64)
    with pytest.raises(MemlensUsageError):
        kernels.column_envelope(values, 0, 11, 2)
    with pytest.raises(MemlensUsageError):
        kernels.column_envelope(values, 0, 10, 0)
    with pytest.raises(MemlensUsageError):
        column_envelope_reference(values, 4, 3, 2)


def _device(events: int) -> DeviceReport:
    """The leak sample's device, as a report of ``events`` rows with nothing else to draw."""
    device = analyse(str(SAMPLE_SNAPSHOTS_DIR / "leak.pickle"), TriageOptions(cache=False)).report.devices[0]
    return dataclasses.replace(
        device, events=events, steps=[], findings=[], peak_allocated_event=None, capacity_bytes=None
    )


def test_a_figure_of_a_million_points_draws_a_bounded_envelope_that_keeps_the_peak() -> None:
    rng = np.random.default_rng(3)
    rows = 1_000_000
    allocated = np.cumsum(rng.integers(-4096, 4097, rows)).astype(np.int64) + 10**9
    allocated[654_321] += 5 * 10**8  # a one-row spike: the peak
    reserved = np.maximum.accumulate(allocated) + 2**21
    timeline = Timeline(events=rows, event=list(range(rows)), allocated=allocated.tolist(), reserved=reserved.tolist())
    fig = timeline_figure(_device(rows), timeline)
    drawn = fig.layout.meta["points_per_trace"]
    assert len(drawn) == 2 and all(count <= MAX_POINTS_PER_CURVE for count in drawn), drawn
    curves_drawn = {t.name: t for t in fig.data[:2]}
    for name, values in (("allocated", allocated), ("reserved", reserved)):
        trace = curves_drawn[name]
        rows_drawn = np.asarray(trace.customdata, dtype=np.int64)
        assert np.all(np.diff(rows_drawn) > 0)
        # Each pixel column's peak is drawn: the drawn points' values are the curve's at those
        # rows, and the greatest of them is the curve's true peak.
        scale = values[rows_drawn].max() / max(trace.y)
        assert np.allclose(np.asarray(trace.y) * scale, values[rows_drawn])
        assert values[rows_drawn].max() == values.max()
    assert 654_321 in curves_drawn["allocated"].customdata


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_timeline_of_a_one_million_entry_file_is_bounded(tmp_path: Path) -> None:
    from memlens.synthetic import synthetic_snapshot, write_pickle

    path = tmp_path / "million.pickle"
    write_pickle(synthetic_snapshot(1_000_000, seed=5), path)
    analysis = analyse(str(path), TriageOptions(cache=False))
    device = analysis.report.devices[0]
    assert device.events >= 1_000_000
    fig = timeline_figure(device)
    assert all(count <= MAX_POINTS_PER_CURVE for count in fig.layout.meta["points_per_trace"])
    trace = analysis.trace(0)
    allocated = next(t for t in fig.data if t.name == "allocated")
    assert int(trace.allocated[np.asarray(allocated.customdata)].max()) == int(trace.allocated.max())
