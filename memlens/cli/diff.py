"""What grew between two snapshots: the peak, each category at the peak, and which code.

Stacks are matched by their Python frames, so the same line of code lines up across runs.

  memlens diff before.pickle after.pickle
  memlens diff rank0.pickle rank1.pickle --json
  memlens diff before.pickle after.pickle --file model.py   # which lines of model.py grew
"""

from __future__ import annotations

import click
from rich.table import Table
from rich.text import Text

from memlens.cli.common import DEVICE, Whole, help_text, json_text, progress_bar
from memlens.ops.diff import DiffOptions
from memlens.ops.diff import diff as diff_files
from memlens.printable import printable
from memlens.units import format_bytes


def _delta(before: int, after: int) -> Text:
    change = after - before
    if change == 0:
        return Text("0", style="dim")
    style = "red" if change > 0 else "green"
    return Text(("+" if change > 0 else "-") + format_bytes(abs(change)), style=style)


@click.command(help=help_text(__doc__))
@click.argument("before", type=click.Path(dir_okay=False))
@click.argument("after", type=click.Path(dir_okay=False))
@click.option("--device", type=DEVICE, default=None, help="Device index in both files.")
@click.option("--top", type=Whole(1, 100), default=10, show_default=True, help="Stacks to show.")
@click.option("--json", "as_json", is_flag=True, help="Print the diff as JSON.")
@click.option("--file", "file_path", default=None, metavar="PATH",
              help="Also: bytes by line of this source file at each peak, and the change (matched on the end "
                   "of the frames' paths).")
@click.option("--width", type=Whole(20, 10_000), default=None, help="Terminal width (default: detected).")
@click.option("--color/--no-color", default=None, help="Force colour on or off.")
def diff(before: str, after: str, device: int | None, top: int, as_json: bool, width: int | None,
         color: bool | None, file_path: str | None = None) -> None:
    from memlens.reporters.terminal import elide_apart, make_console, short_frame

    with progress_bar("comparing") as update:
        answer = diff_files(before, after, DiffOptions(device=device, top=top, file=file_path), progress=update)
    if as_json:
        click.echo(json_text(answer.to_json()))
        return
    result, file_diff = answer.snapshots, answer.file
    console = make_console(width=width, color=color)
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
        from memlens.cli.group import render_file_diff

        render_file_diff(console, file_diff, top)
