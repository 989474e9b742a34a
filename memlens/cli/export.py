"""Write a self-contained HTML report (figures + findings) to share or attach to an issue.

plotly.js is embedded, so the file opens offline in any browser.

  memlens export snapshot.pickle -o report.html
"""

from __future__ import annotations

import os

import click

from memlens.cli.common import CAPACITY, analyze_paths, help_text
from memlens.errors import MemlensUsageError


@click.command(help=help_text(__doc__))
@click.argument("snapshot", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, writable=True),
              help="Where to write the HTML file.")
@click.option("--device", type=int, default=None, help="Device index (default: the one with the most events).")
@click.option("--capacity", type=CAPACITY, default=None, help="Device memory, e.g. 80GiB.")
def export(snapshot: str, output: str, device: int | None, capacity: int | None) -> None:
    from memlens.reporters.html import write_html

    if os.path.abspath(output) == os.path.abspath(snapshot):
        raise MemlensUsageError("the output would overwrite the snapshot; choose another -o path")
    if not os.path.isdir(os.path.dirname(os.path.abspath(output))):
        raise MemlensUsageError(f"no such folder for the output: {os.path.dirname(os.path.abspath(output))}")
    (report,) = analyze_paths([snapshot], capacity, device)
    write_html(report, output, device)
    click.echo(f"wrote {output} ({os.path.getsize(output) / 2**20:.1f} MiB)")
