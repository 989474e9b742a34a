"""``memlens diff`` on the terminal: the peaks and each category before and after, the stacks
that changed most, the findings of each, and (``--file``) one source file's lines. It takes the
``memlens.ops.diff`` answer (typed here by what is read of it, ``DiffAnswer``, so a renderer never
imports the service layer) and only shapes and prints it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from rich.table import Table
from rich.text import Text

from memlens.printable import printable
from memlens.reporters.group import render_file_diff
from memlens.reporters.terminal import elide_apart, short_frame
from memlens.units import format_bytes

if TYPE_CHECKING:
    from rich.console import Console

    from memlens.analysis.lenses.lines import FileDiff
    from memlens.compare import SnapshotDiff

__all__ = ["DiffAnswer", "render_diff"]


class DiffAnswer(Protocol):
    """``memlens.ops.diff.DiffAnswer``, as ``render_diff`` reads it."""

    @property
    def snapshots(self) -> SnapshotDiff: ...

    @property
    def file(self) -> FileDiff | None: ...


def _delta(before: int, after: int) -> Text:
    change = after - before
    if change == 0:
        return Text("0", style="dim")
    style = "red" if change > 0 else "green"
    return Text(("+" if change > 0 else "-") + format_bytes(abs(change)), style=style)


def render_diff(console: Console, answer: DiffAnswer, before: str, after: str, top: int) -> None:
    """The diff of the files named ``before`` and ``after`` (as the user gave them), ``top``
    lines of ``--file``'s table at most."""
    result, file_diff = answer.snapshots, answer.file
    # Two long names cut where they agree (run-a/snapshot.pickle and run-b/... keep a and b).
    half = max((console.width - len("memlens diff  ->  ")) // 2, 12)
    names = elide_apart([printable(before), printable(after)], half)
    console.print(Text("memlens diff", style="bold") + Text(f"  {names[0]} -> {names[1]}"))
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("", "before", "after", "change"):
        table.add_column(column, justify="left" if not column else "right")
    table.add_row("peak allocated", format_bytes(result.peak_allocated[0]), format_bytes(result.peak_allocated[1]),
                  _delta(*result.peak_allocated))
    table.add_row("peak reserved", format_bytes(result.peak_reserved[0]), format_bytes(result.peak_reserved[1]),
                  _delta(*result.peak_reserved))
    for name, (a, b) in result.categories.items():
        if a or b:
            table.add_row(f"  {printable(name)}", format_bytes(a), format_bytes(b), _delta(a, b))
    console.print(table)
    console.print(Text("\nStacks live at the peak that changed most", style="bold"))
    if not result.stacks:
        console.print("  none: the same code holds the same bytes at both peaks")
    leads = [Text.assemble("  ", _delta(change.before_bytes, change.after_bytes),
                           f"  ({format_bytes(change.before_bytes)} -> {format_bytes(change.after_bytes)})  ")
             for change in result.stacks]
    # Stacks that share their first frames are cut where they differ, not all at the same end.
    room = max(console.width - max((len(lead) for lead in leads), default=0), 20)
    wheres = elide_apart([" ← ".join(short_frame(f) for f in change.frames[:3]) for change in result.stacks], room)
    for lead, where in zip(leads, wheres, strict=True):
        console.print(lead + Text(where), overflow="ellipsis", no_wrap=True)
    if result.findings_before != result.findings_after:
        console.print(f"\nfindings: {', '.join(result.findings_before) or 'none'} -> "
                      f"{', '.join(result.findings_after) or 'none'}")
    if file_diff is not None:
        render_file_diff(console, file_diff, top)
