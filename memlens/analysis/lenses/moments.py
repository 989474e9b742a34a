"""Moments and windows as typed values, and how one resolves to a trace row.

A moment is a ``Row`` (an event index), a ``Time`` (µs on the trace's clock, or since its first
row), a ``StepNumber`` (the peak of that step) or a ``Window`` between two of them (its peak);
``None`` is the whole run's peak. ``resolve_moment`` turns one into a ``Moment``: the row to
look at and how it was chosen. The values are tagged msgspec structs, so one travels as JSON
(``{"type": "row", "event": 1234}``) and decodes back as ``MomentSpec``. Faces build them (the
dashboard from its zoomed rows, the CLI and the MCP server from text: ``memlens.ops.moments``);
the errors here name the moment, never the option that gave it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import msgspec
import numpy as np

from memlens.analysis.datatypes import Step
from memlens.analysis.lenses.inputs import I64, LensInputs
from memlens.analysis.live import BEFORE_FIRST_ROW
from memlens.errors import MemlensUsageError
from memlens.snapshot.model import DeviceTrace

MAX_MOMENT = (1 << 62) - 1  # an event index, a step or µs: beyond it, no trace (int64 columns) reaches


class Row(msgspec.Struct, frozen=True, tag="row"):
    """The state after trace row ``event``."""

    event: int

    @property
    def text(self) -> str:
        return f"event {self.event:,}"


class Time(msgspec.Struct, frozen=True, tag="time"):
    """A time in µs: on the trace's own clock, or ``since_start`` of its first row."""

    us: int
    since_start: bool = False

    @property
    def text(self) -> str:
        return f"{'+' if self.since_start else ''}{self.us:,} µs"


class StepNumber(msgspec.Struct, frozen=True, tag="step"):
    """Step ``number`` (``Step.index``): as a moment, its peak; as a window's end, its rows."""

    number: int

    @property
    def text(self) -> str:
        return f"step {self.number}"


Point: TypeAlias = Row | Time | StepNumber


class Window(msgspec.Struct, frozen=True, tag="window"):
    """The rows from ``start`` to ``end``, both included (None: from the first / to the last row)."""

    start: Point | None = None
    end: Point | None = None

    @property
    def text(self) -> str:
        if isinstance(self.start, Row) and isinstance(self.end, Row):
            return f"events {self.start.event:,}–{self.end.event:,}"
        start = self.start.text if self.start is not None else "the first row"
        end = self.end.text if self.end is not None else "the last row"
        return f"{start} – {end}"


MomentSpec: TypeAlias = Row | Time | StepNumber | Window


@dataclass(frozen=True)
class Moment:
    """One trace row to look at, and how it was chosen (for labels and the JSON)."""

    event: int | None  # -1: when the history began; None: a trace without rows (the dump)
    how: str  # "peak", "event", "time", "step", "window"
    text: str  # as people read it: "the peak", "event 1,234", "the peak of step 3", ...
    window: tuple[int, int] | None = None  # [first, last] rows searched for a peak

    def record(self, time_us: int | None) -> MomentRecord:
        """The moment as its JSON form's struct, with the row's time (``time_of``)."""
        return MomentRecord(self.event, self.how, self.text, list(self.window) if self.window else None, time_us)


class MomentRecord(msgspec.Struct, frozen=True):
    """A resolved moment in the lens results' JSON (``Moment.record``)."""

    event: int | None
    how: str
    text: str
    window: list[int] | None  # [first, last] (a list: what to_builtins gives is what JSON reads back)
    time_us: int | None


def event_text(event: int | None) -> str:
    if event is None:
        return "the dump (no trace rows)"
    if event < 0:
        return "when the history began"
    return f"event {event:,}"


def sorted_times(trace: DeviceTrace) -> I64:
    """The rows' times made non-decreasing (searches need a sorted array)."""
    if not trace.has_time:
        raise MemlensUsageError(f"device {trace.device}'s trace has no times: give an event index or a step")
    # Clocks of different streams can step back a little.
    return np.maximum.accumulate(trace.time_us)


def _absolute_us(trace: DeviceTrace, point: Time) -> int:
    return point.us + int(sorted_times(trace)[0]) if point.since_start else point.us


def _step(inputs: LensInputs, number: int) -> Step:
    for step in inputs.steps:
        if step.index == number:
            if step.end_event <= step.start_event:
                raise MemlensUsageError(f"step {number} has no trace rows")
            return step
    known = ", ".join(str(s.index) for s in inputs.steps[:20])
    more = ", …" if len(inputs.steps) > 20 else ""
    raise MemlensUsageError(f"no step {number} on device {inputs.device} "
                            f"({'steps: ' + known + more if known else 'no steps were found'})")


def _check_event(trace: DeviceTrace, event: int) -> int:
    if not 0 <= event < len(trace):
        span = f"0..{len(trace) - 1}" if len(trace) else "it has no rows"
        raise MemlensUsageError(f"event {event:,} is outside the trace of device {trace.device} ({span})")
    return event


def _check_time(trace: DeviceTrace, point: Time) -> None:
    times = sorted_times(trace)
    if len(times) and _absolute_us(trace, point) > int(times[-1]):
        ends = (int(times[-1]) - int(times[0])) / 1e6
        raise MemlensUsageError(f"time {point.text} is past the end of the trace of device {trace.device} "
                                f"(it ends at +{ends:.3f} s, event {len(trace) - 1:,})")


def _first_row(inputs: LensInputs, point: Point) -> int:
    """The first row a window starting at ``point`` covers."""
    trace = inputs.trace
    if isinstance(point, Row):
        return _check_event(trace, point.event)
    if isinstance(point, StepNumber):
        return _step(inputs, point.number).start_event
    return int(np.searchsorted(sorted_times(trace), _absolute_us(trace, point), side="left"))


def _last_row(inputs: LensInputs, point: Point) -> int:
    """The last row a window ending at ``point`` covers (-1: before the first row)."""
    trace = inputs.trace
    if isinstance(point, Row):
        return _check_event(trace, point.event)
    if isinstance(point, StepNumber):
        return _step(inputs, point.number).end_event - 1
    return int(np.searchsorted(sorted_times(trace), _absolute_us(trace, point), side="right")) - 1


def peak_in(trace: DeviceTrace, first: int, last: int) -> int:
    """The row with the most allocated in ``[first, last]`` (the first such row on ties)."""
    return first + int(np.argmax(trace.allocated[first:last + 1]))


def whole_peak(trace: DeviceTrace) -> int | None:
    """The allocated peak as ``analyze`` finds it (-1 when the history began at it; None: no rows)."""
    if not len(trace):
        return None
    event = int(np.argmax(trace.allocated))
    return event if int(trace.allocated[event]) >= trace.baseline_allocated else BEFORE_FIRST_ROW


def resolve_moment(inputs: LensInputs, spec: MomentSpec | None = None) -> Moment:
    """The trace row ``spec`` names (None: the peak)."""
    trace = inputs.trace
    if spec is None:
        return Moment(whole_peak(trace), "peak", "the peak")
    if isinstance(spec, Row):
        return Moment(_check_event(trace, spec.event), "event", spec.text)
    if isinstance(spec, StepNumber):
        chosen = _step(inputs, spec.number)
        first, last = chosen.start_event, chosen.end_event - 1
        return Moment(peak_in(trace, first, last), "step", f"the peak of step {spec.number}", (first, last))
    if isinstance(spec, Time):
        # What was live then, i.e. after the last row at or before it; a time past the last row is
        # refused as an event past it is (it once answered with the last row, as if it were then).
        _check_time(trace, spec)
        event = _last_row(inputs, spec)
        return Moment(event, "time", f"{spec.text} ({event_text(event)})")
    if not len(trace):
        raise MemlensUsageError(f"device {trace.device} has no trace rows to take a window of")
    first = _first_row(inputs, spec.start) if spec.start is not None else 0
    last = _last_row(inputs, spec.end) if spec.end is not None else len(trace) - 1
    if last < first:
        raise MemlensUsageError(f"the window {spec.text} holds no trace rows")
    return Moment(peak_in(trace, first, last), "window", f"the peak of {spec.text}", (first, last))
