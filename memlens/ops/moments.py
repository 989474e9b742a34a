"""Moments from text: what ``--at``, ``--window`` and ``--step`` (and the MCP tools' ``at``,
``window`` and ``step``) say, as the typed values of ``memlens.analysis.lenses.moments``.

A point is ``1234`` (an event index), ``1234567us`` (the trace's own clock; ``ms`` and ``s``
too), ``+1.5s`` (since the first row) or ``step3`` (step 3); a window is ``A:B`` of points,
either side left out for the first or the last row. Each error names the option as the
caller spells it (``option=``), so the CLI's say ``--at`` and the MCP server's say ``at``.

The rows a moment names, for a face that keeps an analysis (the dashboard's zoomed window):
``rows_window`` (trace rows first..last, as ``--window FIRST:LAST`` reads them), ``peak_of`` (the
row a moment resolves to and the bytes allocated after it) and ``timeline_between`` (the curves
of rows [start, end) at full resolution).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal
from typing import TYPE_CHECKING

from memlens.analysis.lenses.moments import MAX_MOMENT, Moment, MomentSpec, Point, Row, StepNumber, Time, Window
from memlens.errors import MemlensUsageError
from memlens.units import MAX_NUMBER_CHARS, parse_whole, shown

if TYPE_CHECKING:
    from memlens.analysis.analysis import Analysis
    from memlens.analysis.datatypes import Timeline

__all__ = ["MomentPeak", "moment_from_text", "parse_point", "parse_window", "peak_of", "rows_window",
           "timeline_between"]

TIME_UNITS_US = {"us": 1, "ms": 1_000, "s": 1_000_000}
_TIME = re.compile(r"^(?P<plus>\+)?(?P<number>\d+(?:\.\d*)?)(?P<unit>us|µs|ms|s)$")


def parse_point(text: str, option: str = "--at") -> Point:
    """``1234`` (an event), ``1234567us`` (the trace's own clock; ``ms``/``s`` too), ``+1.5s``
    (since the first row), ``step3``."""
    raw = text.strip().lower().replace(" ", "")
    what = f"{option}: the moment {shown(text)}"
    if len(raw) > MAX_NUMBER_CHARS:  # no moment is a 5,000-digit number
        raise MemlensUsageError(f"{what} is {len(raw):,} characters long: not an event, a time or a step")
    if re.fullmatch(r"\d+", raw):
        return Row(parse_whole(raw, what, 0, MAX_MOMENT))
    step = re.fullmatch(r"step#?(\d+)", raw)
    if step:
        return StepNumber(parse_whole(step.group(1), what, 0, MAX_MOMENT))
    time = _TIME.match(raw)
    if time:
        unit = time.group("unit").replace("µs", "us")
        micros = Decimal(time.group("number")) * TIME_UNITS_US[unit]  # exact: no float overflow
        if micros > MAX_MOMENT:
            raise MemlensUsageError(f"{what} is later than any trace's clock (at most {MAX_MOMENT:,} µs)")
        value = int(micros.to_integral_value(rounding=ROUND_HALF_EVEN))
        return Time(value, since_start=bool(time.group("plus")))
    raise MemlensUsageError(f"{option}: cannot read the moment {shown(text)}: use an event index (1234), a time "
                            "(1234567us, +1.5s since the first row) or a step (step3)")


def parse_window(text: str, option: str = "--window") -> Window:
    """``A:B`` of points (``parse_point``), either side left out: from the first / to the last row."""
    start_text, sep, end_text = text.partition(":")
    if not sep:
        raise MemlensUsageError(f"{option}: cannot read the window {shown(text)}: use A:B (events, times or "
                                "steps; either side may be left out)")
    start = parse_point(start_text, option) if start_text.strip() else None
    end = parse_point(end_text, option) if end_text.strip() else None
    return Window(start, end)


def moment_from_text(at: str | None = None, window: str | None = None, step: int | None = None, *,
                     names: tuple[str, str, str] = ("--at", "--window", "--step")) -> MomentSpec | None:
    """The moment at most one of ``at`` (a point), ``window`` (``A:B``) and ``step`` (a number)
    names; None (the peak) when none does. ``names``: the three options as the caller spells them."""
    at_name, window_name, step_name = names
    given = [name for name, value in ((at_name, at), (window_name, window), (step_name, step)) if value is not None]
    if len(given) > 1:
        raise MemlensUsageError(f"give one of {at_name}, {window_name} and {step_name}, not {' and '.join(given)}")
    if at is not None:
        return parse_point(at, at_name)
    if window is not None:
        return parse_window(window, window_name)
    if step is not None:
        return StepNumber(step)
    return None


def rows_window(first: int, last: int) -> Window:
    """Trace rows ``first..last`` (both included), as ``--window FIRST:LAST`` reads them."""
    return Window(Row(first), Row(last))


@dataclass(frozen=True)
class MomentPeak:
    """The row a moment resolves to (a window's or a step's: its peak) and the bytes allocated
    after it, as ``torch.cuda.memory_allocated`` would have said then."""

    moment: Moment
    allocated_bytes: int


def peak_of(analysis: Analysis, device: int, spec: MomentSpec | None) -> MomentPeak:
    """Where ``spec`` falls on ``device`` (None: the peak), found as ``memlens group --at/--window``
    finds it, and how much was allocated then."""
    from memlens.analysis.lenses.inputs import allocated_at, lens_inputs_of
    from memlens.analysis.lenses.moments import resolve_moment

    moment = resolve_moment(lens_inputs_of(analysis, device), spec)
    return MomentPeak(moment, allocated_at(analysis.trace(device), moment.event))


def timeline_between(analysis: Analysis, device: int, start: int = 0, end: int | None = None) -> Timeline:
    """The allocated and reserved curves of ``device``'s trace rows ``[start, end)`` (None: to the
    last), cut from the trace at full resolution with the report's point budget: a one-row spike
    inside a zoomed window still shows."""
    from memlens.analysis.views import timeline_of

    return timeline_of(analysis.trace(device), analysis.device(device).steps, start=start, end=end)
