"""What grew between two snapshots: the peak, each category at the peak, and which code.

Stacks are matched by their Python frames, so the same line of code lines up across runs.

  memlens diff before.pickle after.pickle
  memlens diff rank0.pickle rank1.pickle --json
  memlens diff before.pickle after.pickle --file model.py   # which lines of model.py grew
"""

from __future__ import annotations

import click

from memlens.cli.common import DEVICE, Whole, help_text, json_text, progress_bar
from memlens.ops.diff import DiffOptions
from memlens.ops.diff import diff as diff_files


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
    from memlens.reporters.diff import render_diff
    from memlens.reporters.terminal import make_console

    with progress_bar("comparing") as update:
        answer = diff_files(before, after, DiffOptions(device=device, top=top, file=file_path), progress=update)
    if as_json:
        click.echo(json_text(answer.to_json()))
        return
    render_diff(make_console(width=width, color=color), answer, before, after, top)
