"""The one-screen triage report for the terminal (``memlens triage``).

A reporter only shapes and prints what the analysis computed; it never analyses. It writes
through a ``rich.console.Console``: colour on a terminal, plain text when piped, and a
pinned width in tests so the golden files compare line by line.
"""

from __future__ import annotations

import bisect
import io
import itertools
import os
import re
import sys
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING, cast

from rich.console import Console
from rich.table import Table
from rich.text import Text

from memlens.analysis.report import finding_rank, no_findings_text
from memlens.printable import printable
from memlens.reporters.evidence import format_value, terminal_items
from memlens.units import counted, format_bytes

if TYPE_CHECKING:
    from memlens.analysis.report import BudgetCheck, DeviceReport, Finding, Report

SPARK_LEVELS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 48
MIN_SPARK_WIDTH = 16
# label, value and "max ▲ peak" around a timeline row's sparkline: the row fits the console.
TIMELINE_ROW_EXTRA = 34
MEMORY_VIZ = "https://pytorch.org/memory_viz"
BAR_WIDTH, MIN_BAR_WIDTH = 30, 8
CATEGORY_ROW_EXTRA = 36  # name, bytes and share before a category's bar
MIN_STACK_ROOM = 30  # enough for "name (file.py:123) ← …"
MAX_STEP_ROWS = 12  # more steps than this are summarised: the screen is the budget
MAX_FINDINGS = 6
MAX_STACK_FRAMES = 3
SEVERITY_STYLE = {"high": "bold red", "medium": "yellow", "low": "cyan"}
KIND_LABEL = {
    "leak": "LEAK",
    "activation_plateau": "ACTIVATIONS",
    "optimizer_spike": "OPTIMIZER",
    "fragmentation": "FRAGMENTATION",
    "idle_cache": "IDLE CACHE",
    "oom": "OOM",
}


class _TrimmedLines(io.TextIOBase):
    """Drops the spaces rich pads table cells with at line ends: piped output and golden files
    stay clean, and nothing changes on screen."""

    def __init__(self, target: IO[str]) -> None:
        self._target = target
        self._pending = ""

    def write(self, text: str) -> int:
        lines = (self._pending + text).split("\n")
        self._pending = lines.pop()
        if lines:
            self._target.write("\n".join(line.rstrip(" ") for line in lines) + "\n")
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self._target.write(self._pending)
            self._pending = ""
        self._target.flush()

    def isatty(self) -> bool:
        return self._target.isatty()

    def fileno(self) -> int:
        return self._target.fileno()


def make_console(file: IO[str] | None = None, width: int | None = None, color: bool | None = None) -> Console:
    """Colour only on a real terminal (and never with ``NO_COLOR``); ``width`` pins the layout."""
    if color is None:
        color = None if not os.environ.get("NO_COLOR") else False
    target = file if file is not None else sys.stdout
    return Console(
        file=cast(IO[str], _TrimmedLines(target)),
        width=width,
        color_system="auto" if color is not False else None,
        force_terminal=color if color else None,
        no_color=color is False,
        highlight=False,
        # Snapshot strings are data: never rich markup ('[link=...]', '[/]') or emoji codes.
        markup=False,
        emoji=False,
        soft_wrap=False,
    )


def when(device: DeviceReport, event: int | None, time_us: int | None = None) -> str:
    """``event 1,145, +0.001 s, step 1``: where an event sits in the trace, its time (given as
    ``time_us``, the report's own record of it) and its step."""
    if event is None or event < 0:
        return ""
    text = f"event {event:,}"
    if time_us is not None and device.start_time_us is not None:
        text += f", +{(time_us - device.start_time_us) / 1e6:.3f} s"
    step = step_of_event(device, event)
    if step is not None:
        text += f", step {step}"
    return text


def sparkline(values: Sequence[int], low: float, top: float, width: int = SPARK_WIDTH) -> str:
    """Max per bucket (a spike inside a bucket still shows), scaled from ``low`` to ``top``.

    Plain Python (a report's timeline is a few thousand points): the terminal renders a cached
    report without importing numpy. The buckets split as ``numpy.array_split`` does: the first
    ``len % buckets`` one longer."""
    if not values:
        return ""
    count = min(width, len(values))
    size, longer = divmod(len(values), count)
    span = max(top - low, 1.0)
    levels = len(SPARK_LEVELS) - 1
    line = []
    start = 0
    for bucket in range(count):
        end = start + size + (1 if bucket < longer else 0)
        scaled = round((float(max(values[start:end])) - low) / span * levels)  # half to even, as numpy
        line.append(SPARK_LEVELS[min(max(scaled, 0), levels)])
        start = end
    return "".join(line)


def _indented(console: Console, text: Text | str, indent: int = 5) -> None:
    """Wrap to the console width with a hanging indent, and no trailing padding (for pipes)."""
    body = text if isinstance(text, Text) else Text(text)
    for line in body.wrap(console, max(console.width - indent, 20)):
        line.rstrip()
        console.print(Text(" " * indent) + line, soft_wrap=True)


def step_of_event(report: DeviceReport, event: int | None) -> int | None:
    if event is None:
        return None
    for step in report.steps:
        if step.start_event <= event < step.end_event:
            return step.index
    return None


def render_header(console: Console, report: Report, device: DeviceReport) -> None:
    console.print(Text(f"memlens triage  {elide_middle(printable(report.source), console.width - 16)}",
                       style="bold"))
    steps = f"{counted(len(device.steps), 'step')} ({device.step_source})" if device.steps else "no steps found"
    capacity = f"capacity {format_bytes(device.capacity_bytes)}" if device.capacity_bytes else "capacity unknown"
    window = "complete history" if device.window_complete else "history starts mid-run"
    console.print(f"  torch {report.format_guess} format · device {device.device} · {capacity}")
    if device.events:
        events = f"{device.events:,} event" + ("s" if device.events != 1 else "")
        console.print(f"  {events} ({window}) · {steps}")
    else:
        console.print("  no recorded history: only the state at dump time")
    for label, size, event, time_us in (
            ("allocated", device.peak_allocated_bytes, device.peak_allocated_event, device.peak_time_us),
            ("reserved ", device.peak_reserved_bytes, device.peak_reserved_event, device.peak_reserved_time_us)):
        where = when(device, event, time_us) if event is not None or not device.events else "when the history began"
        console.print(Text.assemble(f"  peak {label} ", (f"{format_bytes(size):>10}", "bold"),
                                    f"  ({where})" if where else ""))
    requested = device.peak_requested_bytes
    if requested is not None and format_bytes(requested) != format_bytes(device.peak_allocated_bytes):
        console.print(f"  {format_bytes(requested)} requested in the {format_bytes(device.peak_allocated_bytes)} "
                      "of blocks live at the peak")
    if device.outside_pytorch_bytes is not None:
        console.print(f"  outside PyTorch {format_bytes(device.outside_pytorch_bytes):>10}  (CUDA context, NCCL, "
                      "libraries, other processes on this GPU: the most at a step boundary)")
    if device.baseline_allocated_bytes and device.events:
        console.print(f"  {format_bytes(device.baseline_allocated_bytes)} was already live when the history began")
    for note in device.notes:
        lines = Text(printable(note), style="dim").wrap(console, max(console.width - 8, 20))
        for number, line in enumerate(lines):
            line.rstrip()
            console.print(Text("  note: " if number == 0 else " " * 8, style="dim") + line, soft_wrap=True)


def render_devices(console: Console, report: Report, shown: DeviceReport) -> None:
    """A snapshot with memory on several devices: one line each, so none is missed."""
    holding = [d for _, d in sorted(report.devices.items())
               if d.events or d.peak_allocated_bytes or d.peak_reserved_bytes]
    if len(holding) < 2:
        return
    console.print(Text("\nDevices", style="bold") + Text(f"  {len(holding)} hold memory; details below for "
                                                          f"device {shown.device} (--device N for another)"))
    for dev in holding:
        kinds = ", ".join(sorted({f.kind for f in dev.findings})) or "no findings"
        marker = "  ◀ shown" if dev.device == shown.device else ""
        allocated, reserved = format_bytes(dev.peak_allocated_bytes), format_bytes(dev.peak_reserved_bytes)
        console.print(f"  device {dev.device:<3} {dev.events:>10,} events  peak allocated {allocated:>10}"
                      f"  reserved {reserved:>10}  {kinds}{marker}")


def render_timeline(console: Console, report: Report, device: DeviceReport) -> None:
    timeline = device.timeline
    if timeline is None or timeline.events < 2:
        console.print("\n  (no timeline: the snapshot has no recorded history to draw)")
        return
    # The report's timeline keeps every step's lowest and highest point and each bucket's, so
    # each row's maximum and the scale's ends are exact; the shape in between is sampled.
    points = list(timeline.event)
    allocated = list(timeline.allocated)
    # Scaled between the lowest and highest allocated level, not from zero: a baseline of
    # parameters would otherwise flatten every step's shape into the top rows.
    low, top = float(min(allocated)), float(max(allocated))
    console.print(Text("\nTimeline", style="bold")
                  + Text(f"  allocated per step, ▁ = {format_bytes(low)}, █ = {format_bytes(top)}"))
    rows: list[tuple[str, int, int]] = []
    if device.steps:
        steps = device.steps
        if len(steps) > MAX_STEP_ROWS:
            keep = [*steps[: MAX_STEP_ROWS // 2], *steps[-MAX_STEP_ROWS // 2:]]
            peak_step = step_of_event(device, device.peak_allocated_event)
            if peak_step is not None and all(s.index != peak_step for s in keep):
                keep[-1] = next(s for s in steps if s.index == peak_step)
            steps = sorted(keep, key=lambda s: s.index)
        if steps[0].start_event > 0:
            rows.append(("before", 0, steps[0].start_event))
        rows += [(f"step {s.index}" + ("*" if s.partial else ""), s.start_event, s.end_event) for s in steps]
        if steps[-1].end_event < timeline.events and steps[-1] is device.steps[-1]:
            rows.append(("after", steps[-1].end_event, timeline.events))
    else:
        rows.append(("all", 0, timeline.events))
    width = max(MIN_SPARK_WIDTH, min(SPARK_WIDTH, console.width - TIMELINE_ROW_EXTRA))
    for label, start, end in rows:
        first, last = bisect.bisect_left(points, start), bisect.bisect_left(points, end)
        if end <= start or last <= first:
            continue
        segment = allocated[first:last]
        peak = device.peak_allocated_event
        marker = " ▲ peak" if peak is not None and start <= peak < end else ""
        console.print(
            f"  {label:>9} {sparkline(segment, low, top, width):<{width}} "
            f"{format_bytes(int(max(segment))):>10} max{marker}"
        )
    if device.steps and any(s.partial for s in device.steps):
        console.print(Text("  * partial step (the window cut it): not compared", style="dim"))


_PATH_IN_FRAME = re.compile(r"\((?:[^()]*[/\\])?([^/\\()]+:\d+)\)")


def short_frame(frame: str) -> str:
    """``step (/home/me/project/optim.py:75)`` -> ``step (optim.py:75)``: the screen is narrow."""
    return _PATH_IN_FRAME.sub(r"(\1)", printable(frame))


def _stack_line(frames: Sequence[str], width: int = 10**6, most: int = MAX_STACK_FRAMES) -> str:
    """Innermost frames first, as many whole frames as fit in ``width`` with a "… N more" tail;
    the innermost frame always shows, losing the middle of its function name (never its
    ``file:line``) when even it is too long."""
    shortened = [short_frame(f) for f in frames[:most]]
    if not shortened:
        return ""
    shown = [elide_frame(shortened[0], width)]
    for frame in shortened[1:]:
        remaining = len(frames) - len(shown) - 1
        tail = len(f" ← … {remaining} more") if remaining else 0
        if len(" ← ".join([*shown, frame])) + tail > width:
            break
        shown.append(frame)
    more = len(frames) - len(shown)
    tail_text = f" ← … {more} more" if more else ""
    line = " ← ".join(shown)
    return line + tail_text if len(line) + len(tail_text) <= width else line


def elide_frame(frame: str, width: int) -> str:
    """``a_very_long_function_name (train.py:12)`` -> ``a_ver…_name (train.py:12)`` in ``width``."""
    if len(frame) <= width:
        return frame
    where = frame.rfind(" (")
    name, place = (frame[:where], frame[where:]) if where > 0 else (frame, "")
    keep = width - len(place) - 1
    if keep < 4:  # no room for a name: the file and line are what the reader needs
        return elide_middle(place.strip(" ()") or frame, width)
    return f"{name[: (keep + 1) // 2]}…{name[len(name) - keep // 2:]}{place}"


def elide_middle(text: str, width: int) -> str:
    """The start and the end of ``text`` with ``…`` between, in ``width`` characters."""
    if len(text) <= width:
        return text
    keep = max(width - 1, 2)
    return f"{text[: (keep + 1) // 2]}…{text[len(text) - keep // 2:]}"


def elide_apart(texts: Sequence[str], width: int) -> list[str]:
    """Each text in ``width`` characters, cut where it agrees with the texts most like it, so that
    texts that differ still differ once cut: ``job-2026-11-30-node0-rank17.pickle`` and
    ``...-rank18.pickle`` keep their 17 and 18 (cut in the middle, both read the same)."""
    distinct = sorted(set(texts))
    if all(len(text) <= width for text in distinct) or len(distinct) < 2:
        return [elide_middle(text, width) for text in texts]
    starts = _shared_with_neighbours(distinct)
    ends = _shared_with_neighbours(sorted(text[::-1] for text in distinct))
    return [_elide_around(text, width, starts[text], ends[text[::-1]]) for text in texts]


def _shared_with_neighbours(ordered: Sequence[str]) -> dict[str, int]:
    """For each of the sorted ``ordered`` texts, the most leading characters it shares with any
    other: the longest such prefix is with a sorted neighbour."""
    def shared(a: str, b: str) -> int:
        length = 0
        while length < min(len(a), len(b)) and a[length] == b[length]:
            length += 1
        return length

    between = [shared(a, b) for a, b in itertools.pairwise(ordered)]
    return {text: max(between[index - 1] if index else 0, between[index] if index < len(between) else 0)
            for index, text in enumerate(ordered)}


def _elide_around(text: str, width: int, prefix: int, suffix: int) -> str:
    """``text`` in ``width``: its part after the shared ``prefix`` and before the shared ``suffix``
    kept whole, the shared parts cut in their middles to the room left."""
    if len(text) <= width:
        return text
    start, end = min(prefix, len(text)), max(len(text) - suffix, min(prefix, len(text)))
    lead, differing, tail = text[:start], text[start:end], text[end:]
    room = width - len(differing)
    if room < 2:
        return elide_middle(differing, width)
    tail_room = min(len(tail), room - min(len(lead), 3))
    lead_room = room - tail_room
    return elide_middle(_cut(lead, lead_room) + differing + _cut(tail, tail_room), width)


def _cut(part: str, room: int) -> str:
    """``part`` in ``room`` characters: cut in its middle, or its end alone when too short for that."""
    if len(part) <= room:
        return part
    return elide_middle(part, room) if room >= 3 else part[len(part) - room:] if room > 0 else ""


def render_finding(console: Console, rank: int, finding: Finding, full_stacks: bool = False) -> None:
    label = KIND_LABEL.get(finding.kind, finding.kind.upper())
    style = SEVERITY_STYLE.get(finding.severity, "")
    step = f" · step {finding.step}" if finding.step is not None else ""
    console.print(
        Text.assemble(
            f"  {rank}. ", (f"{label}", style), (f" {finding.severity}", style),
            f" · {format_bytes(finding.bytes)} · events {finding.start_event:,}-{finding.end_event:,}{step}",
        )
    )
    _indented(console, printable(finding.summary))
    evidence = ", ".join(f"{printable(item.name)}={printable(format_value(item))}"
                         for item in terminal_items(finding.evidence))
    if evidence:
        _indented(console, Text(f"evidence: {evidence}", style="dim"))
    for stack in finding.top_stacks[:2]:
        head = f"     {format_bytes(stack.bytes):>10} × {stack.count:<4} "
        if full_stacks:
            console.print(head.rstrip(), soft_wrap=True)
            for frame in stack.frames:
                console.print(f"         {printable(frame)}", soft_wrap=True)
        else:
            console.print(head + _stack_line(stack.frames, console.width - len(head)), no_wrap=True,
                          overflow="ellipsis")
    _indented(console, Text.assemble("fix: ", (printable(finding.recommendation), "green")))
    if finding.estimated_saving_bytes:
        _indented(console, Text.assemble("would save: ", (f"~{format_bytes(finding.estimated_saving_bytes)}", "green")))


def render_findings(console: Console, device: DeviceReport, top: int = MAX_FINDINGS,
                    full_stacks: bool = False) -> None:
    console.print(Text("\nFindings", style="bold") + Text("  most severe first, then by bytes"))
    if not device.findings:
        console.print(f"  none: {no_findings_text(device)}")
        return
    ranked = sorted(device.findings, key=finding_rank)
    for rank, finding in enumerate(ranked[:top], start=1):
        render_finding(console, rank, finding, full_stacks)
    if len(ranked) > top:
        console.print(Text(f"  … and {len(ranked) - top} more (--top {len(ranked)}, or --json)", style="dim"))


def render_categories(console: Console, device: DeviceReport) -> None:
    total = sum(device.categories_at_peak.values())
    console.print(Text("\nLive at the peak", style="bold") + Text(f"  by category, {format_bytes(total)} in all"))
    if total <= 0:
        console.print("  nothing live")
        return
    # A narrow console shortens the bars before the stacks: the stack says where to look.
    bar_width = max(MIN_BAR_WIDTH, min(BAR_WIDTH, console.width - CATEGORY_ROW_EXTRA - MIN_STACK_ROOM))
    for name, value in sorted(device.categories_at_peak.items(), key=lambda kv: kv[1], reverse=True):
        if value <= 0:
            continue
        share = value / total
        bar = "█" * max(1, round(share * bar_width))
        top = device.top_stacks_by_category.get(name) or []
        head = f"  {printable(name):<16}{format_bytes(value):>11} {share:5.0%} {bar:<{bar_width}}"
        where = f"  {_stack_line(top[0].frames, console.width - len(head) - 2, 2)}" if top and top[0].frames else ""
        console.print(head + where, overflow="ellipsis", no_wrap=True)


def render_budget_check(console: Console, budget: BudgetCheck) -> None:
    """The budget beside the measurement, as the report carries it (``DeviceReport.budget``)."""
    console.print(Text("\nBudget", style="bold") + Text("  theory next to what was measured at the peak"))
    table = Table(box=None, pad_edge=False, show_header=True, header_style="bold")
    for column in ("category", "theory", "measured", "ratio", "note"):
        table.add_column(column, justify="right" if column in ("theory", "measured", "ratio") else "left")
    for row in budget.rows:
        ratio = "" if row.ratio is None else f"{row.ratio:.2f}x"
        measured = "-" if row.measured_bytes is None else format_bytes(row.measured_bytes)
        theory = "n/a" if row.theory_bytes is None else format_bytes(row.theory_bytes)
        table.add_row(printable(row.category), theory, measured, ratio, printable(row.note or ""))
    console.print(table)
    if budget.largest_batch_note:
        console.print(printable(budget.largest_batch_note))


def render_triage(
    console: Console,
    report: Report,
    device: int | None = None,
    top: int = MAX_FINDINGS,
    full_stacks: bool = False,
) -> None:
    """The whole one-screen report for one snapshot and device (its budget, where the report
    carries one: ``memlens.ops.triage``)."""
    device_report = report.device(device)
    render_header(console, report, device_report)
    render_devices(console, report, device_report)
    render_timeline(console, report, device_report)
    render_findings(console, device_report, top, full_stacks)
    render_categories(console, device_report)
    if device_report.budget is not None:
        render_budget_check(console, device_report.budget)
    if report.source and report.source != "<memory>":
        console.print(Text(f"\nSame file in PyTorch's viewer: {MEMORY_VIZ}", style="dim"))
