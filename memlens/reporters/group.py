"""The lens answers on the terminal: ``memlens group``, ``stages`` and ``lines``, and the lines of
one source file that ``memlens diff --file`` compares. Each takes its ``memlens.ops.group`` result
(or the diff's ``FileDiff``) and only shapes and prints it. The results are typed here by what is
read of them (``GroupAnswer``, ``LinesAnswer``, ``StagesAnswer``), so a renderer never imports the
service layer that builds them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from memlens.analysis.lenses.labels import PLACEHOLDER_GROUPS
from memlens.printable import printable
from memlens.units import format_bytes

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from memlens.analysis.lenses.groups import GroupBreakdown
    from memlens.analysis.lenses.lines import FileBreakdown, FileDiff
    from memlens.analysis.lenses.moments import Moment
    from memlens.analysis.lenses.stages import StageSummary

__all__ = ["EMPTY_LENS_HINTS", "TABLE_ROWS", "GroupAnswer", "LinesAnswer", "StagesAnswer", "render_file_diff",
           "render_group", "render_lines", "render_stages"]

# Rows a table shows before folding the rest into one "… N more" row (the JSON has them all).
TABLE_ROWS = 25
# What to do when a lens finds nothing of its kind (every block in a placeholder group).
EMPTY_LENS_HINTS = {
    "module": "no block here was allocated inside a module scope (memlens.record(model=...) and `memlens "
              "record` write them: memlens.forward#NAME, memlens.backward#NAME)",
    "annotation": "no block here was allocated inside a record_function scope",
    "compile_context": "no block here has a compile_context (PyTorch records one for torch.compile'd code)",
}



class _LensAnswer(Protocol):
    """What every lens answer says of itself: the file, the device and its first row's time."""

    @property
    def source(self) -> str: ...

    @property
    def device(self) -> int: ...


class GroupAnswer(_LensAnswer, Protocol):
    """``memlens.ops.group.GroupResult``, as ``render_group`` reads it."""

    @property
    def start_us(self) -> int | None: ...

    @property
    def groups(self) -> GroupBreakdown: ...


class LinesAnswer(_LensAnswer, Protocol):
    """``memlens.ops.group.LinesResult``, as ``render_lines`` reads it."""

    @property
    def start_us(self) -> int | None: ...

    @property
    def file(self) -> FileBreakdown: ...


class StagesAnswer(_LensAnswer, Protocol):
    """``memlens.ops.group.StagesResult``, as ``render_stages`` reads it."""

    @property
    def by_name(self) -> list[StageSummary]: ...


def _table() -> Table:
    from rich.table import Table

    return Table(box=None, header_style="bold", pad_edge=False)


def _dim(text: str) -> Any:
    from rich.text import Text

    return Text(text, style="dim")


def _plain(text: str) -> Any:
    from rich.text import Text

    return Text(text)


def _bold(text: str) -> Any:
    from rich.text import Text

    return Text(text, style="bold")


def _title(console: Console, command: str, source: str) -> None:
    console.print(_bold(f"memlens {command}") + _plain(f"  {printable(source)}"))


def _when(moment: Moment, time_us: int | None, start_us: int | None) -> str:
    parts = [moment.text]
    if moment.event is not None and moment.event >= 0 and moment.how != "event":
        parts.append(f"event {moment.event:,}")
    if time_us is not None and start_us is not None:
        parts.append(f"+{(time_us - start_us) / 1e6:.3f} s")
    if moment.window:
        parts.append(f"rows {moment.window[0]:,}-{moment.window[1]:,}")
    return parts[0] + (f" ({', '.join(parts[1:])})" if parts[1:] else "")


def _share(part: int, total: int) -> str:
    return f"{100 * part / total:.0f}%" if total else "-"


def _signed(n: int) -> str:
    return ("+" if n > 0 else "-" if n < 0 else "") + format_bytes(abs(n)) if n else "0"


def _label(name: str, group_by: str, width: int) -> str:
    """A group's name in ``width`` columns, losing what matters least: a file's folders, a
    stack's outer frames, anything else's middle."""
    from memlens.reporters.terminal import elide_middle, short_frame

    shown = printable(name)
    if len(shown) <= width:
        return shown
    if group_by == "file":
        return "…" + shown[len(shown) - width + 1:]
    if group_by == "stack":
        shown = " ← ".join(short_frame(part) for part in shown.split(" ← "))
        return shown if len(shown) <= width else shown[:width - 1] + "…"
    if group_by == "frame":
        shown = short_frame(shown)
    return elide_middle(shown, width)


def render_group(console: Console, result: GroupAnswer, command: str = "group") -> None:
    _title(console, command, result.source)
    breakdown = result.groups
    total = breakdown.allocated_bytes
    console.print(_bold(f"\nLive by {breakdown.group_by} on device {result.device} at "
                        f"{_when(breakdown.moment, breakdown.time_us, result.start_us)}, {format_bytes(total)} in all"))
    label_width = max(console.width - 34, 20)
    table = _table()
    table.add_column(breakdown.group_by, no_wrap=True, overflow="ellipsis", max_width=label_width)
    for column in ("bytes", "share", "blocks"):
        table.add_column(column, justify="right", no_wrap=True)
    shown, rest = breakdown.groups[:TABLE_ROWS], breakdown.groups[TABLE_ROWS:]
    for item in shown:
        table.add_row(_label(item.name, breakdown.group_by, label_width), format_bytes(item.bytes),
                      _share(item.bytes, total), f"{item.blocks:,}")
    if rest:
        rest_bytes = sum(g.bytes for g in rest)
        table.add_row(f"… {len(rest):,} more (--json lists them)", format_bytes(rest_bytes),
                      _share(rest_bytes, total), f"{sum(g.blocks for g in rest):,}")
    console.print(table)
    hint = EMPTY_LENS_HINTS.get(breakdown.group_by)
    if hint and {g.name for g in breakdown.groups} <= PLACEHOLDER_GROUPS:
        console.print(_dim(f"  {hint}"))


def render_lines(console: Console, result: LinesAnswer, command: str = "lines") -> None:
    _title(console, command, result.source)
    breakdown = result.file
    total = breakdown.allocated_bytes
    names = ", ".join(printable(f) for f in breakdown.files[:3]) + (" …" if len(breakdown.files) > 3 else "")
    when = _when(breakdown.moment, breakdown.time_us, result.start_us)
    console.print(_bold(f"\n{names} at {when}: {format_bytes(breakdown.file_bytes)} "
                        f"of {format_bytes(total)} ({_share(breakdown.file_bytes, total)})"))
    if breakdown.file_peak_event is not None and breakdown.file_peak_event != breakdown.moment.event:
        where = (f"event {breakdown.file_peak_event:,}" if breakdown.file_peak_event >= 0
                 else "when the history began")
        console.print(_dim(f"  this file's own peak: {format_bytes(breakdown.file_peak_bytes)} at {where} "
                           f"(--at {max(breakdown.file_peak_event, 0)})"))
    if not breakdown.lines:
        console.print("  nothing allocated from this file was live then")
        return
    table = _table()
    for column in ("line", "function", "bytes", "share", "blocks"):
        table.add_column(column, justify="left" if column == "function" else "right", no_wrap=True,
                         overflow="ellipsis")
    for row in breakdown.lines[:TABLE_ROWS]:
        table.add_row(f"{row.line:,}", printable(row.function), format_bytes(row.bytes), _share(row.bytes, total),
                      f"{row.blocks:,}")
    rest = breakdown.lines[TABLE_ROWS:]
    if rest:
        rest_bytes = sum(r.bytes for r in rest)
        table.add_row("", f"… {len(rest):,} more lines", format_bytes(rest_bytes), _share(rest_bytes, total),
                      f"{sum(r.blocks for r in rest):,}")
    table.add_row("", "elsewhere", format_bytes(breakdown.elsewhere_bytes), _share(breakdown.elsewhere_bytes, total),
                  "")
    console.print(table)


def render_stages(console: Console, result: StagesAnswer, command: str = "stages") -> None:
    _title(console, command, result.source)
    console.print(_bold(f"\nMemory per annotation stage on device {result.device}  added while each scope ran "
                        "(END minus START), and its peak inside"))
    if not result.by_name:
        console.print("  no record_function scope with both a START and an END on this device (or no times)")
        return
    table = _table()
    table.add_column("scope", no_wrap=True, overflow="ellipsis", max_width=max(console.width - 48, 20))
    for column in ("runs", "added", "most in one run", "peak inside"):
        table.add_column(column, justify="right", no_wrap=True)
    for stage in result.by_name[:TABLE_ROWS]:
        table.add_row(printable(stage.name), f"{stage.runs:,}", _signed(stage.added_bytes),
                      _signed(stage.max_added_bytes), format_bytes(stage.peak_bytes))
    if len(result.by_name) > TABLE_ROWS:
        table.add_row(f"… {len(result.by_name) - TABLE_ROWS:,} more scopes (--json lists them)", "", "", "", "")
    console.print(table)


def render_file_diff(console: Console, result: FileDiff, top: int) -> None:
    """``memlens diff --file``: per line of the file, bytes at each peak and the change."""
    before = result.before.file_bytes if result.before else 0
    after = result.after.file_bytes if result.after else 0
    console.print(_bold(f"\nLines of {printable(result.path)} live at the peak that changed most "
                        f"({format_bytes(before)} -> {format_bytes(after)})"))
    for side, name in ((result.before, "before"), (result.after, "after")):
        if side is None:
            console.print(f"  no frame in the {name} snapshot is in this file")
    changed = [c for c in result.lines if c.delta_bytes]
    if not changed:
        console.print("  none: every line of this file holds the same bytes at both peaks")
        return
    table = _table()
    for column in ("line", "function", "before", "after", "change"):
        table.add_column(column, justify="left" if column == "function" else "right", no_wrap=True,
                         overflow="ellipsis")
    for change in changed[:top]:
        table.add_row(f"{change.line:,}", printable(change.function), format_bytes(change.before_bytes),
                      format_bytes(change.after_bytes), _signed(change.delta_bytes))
    console.print(table)
