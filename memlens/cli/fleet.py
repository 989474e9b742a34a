"""``memlens triage`` with several files: the fleet of ranks (``memlens.fleet``), in parallel.

  memlens triage runs/*/rank*.pickle                    # a process per CPU
  memlens triage runs/*/rank*.pickle --jobs 8
  memlens triage runs/*/rank*.pickle --dask tcp://scheduler:8786
  memlens triage runs/*/rank*.pickle --json
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import click

from memlens.fleet import Progress


@contextmanager
def _progress(files: int) -> Iterator[Progress | None]:
    """A stderr bar counting files, only on a terminal (never in pipes, logs or --json captures)."""
    if not sys.stderr.isatty():
        yield None
        return
    from memlens.cli.common import progress_bar

    with progress_bar(f"{files:,} files") as update:
        yield lambda done, total: update(f"{done:,} analysed", done / total)


def triage_fleet_command(snapshots: Sequence[str], *, jobs: int | None, dask: str | None, capacity: int | None,
                         device: int | None, cache: bool | None, as_json: bool, width: int | None,
                         color: bool | None, fail_on: Sequence[str], exit_finding: int) -> None:
    """Analyse ``snapshots`` as a fleet, print the table and verdict (or the JSON), honour --fail-on."""
    from memlens.fleet import triage_fleet

    with _progress(len(snapshots)) as progress:
        # The JSON keeps every file's report under "reports", as ``triage --json`` always has.
        fleet = triage_fleet(snapshots, jobs=jobs, dask=dask, capacity=capacity, device=device, cache=cache,
                             keep_reports=as_json, progress=progress)
    if as_json:
        from memlens.cli.common import json_text

        click.echo(json_text(fleet.to_json()))
    else:
        from memlens.reporters.fleet import render_fleet
        from memlens.reporters.terminal import make_console

        render_fleet(make_console(width=width, color=color), fleet)
    if len(fleet.failed) == len(fleet.rows):
        click.echo("memlens: error: none of the files could be analysed (see the table)", err=True)
        sys.exit(2)
    found = {finding.kind for row in fleet.rows for finding in row.findings}
    hits = [kind for kind in fail_on if kind in found]
    if hits:
        click.echo(f"memlens: found {', '.join(hits)} (--fail-on)", err=True)
        sys.exit(exit_finding)
