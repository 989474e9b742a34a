"""Compare the ranks of one job: a snapshot per rank, analysed in parallel, the outlier named.

Each file is analysed in its own child process under time and memory limits (a process per
CPU, --jobs N, or a Dask cluster with --dask ADDRESS); one table row per rank (peaks, steps,
findings; a file that cannot be analysed is its row's error), then the outlier rank(s) against
the median rank, with what accounts for the difference, in bytes. With two ranks, how the higher
one differs from the other.

  memlens fleet runs/exp1/rank*.pickle
  memlens fleet runs/exp1/rank*.pickle --jobs 8
  memlens fleet runs/*/rank*.pickle --dask tcp://scheduler:8786
  memlens fleet runs/exp1/rank*.pickle --json > fleet.json
  memlens fleet runs/exp1/rank*.pickle --fail-on leak   # exit 1 if any rank has a leak (for CI)
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import click

from memlens.cli.common import CAPACITY, DEVICE, Whole, help_text, json_text
from memlens.errors import MemlensUsageError
from memlens.ops.fleet import Progress
from memlens.ops.vocab import FINDING_KINDS, parse_kinds

EXIT_FINDING = 1
EXIT_NOTHING_ANALYSED = 2


@contextmanager
def _progress(files: int) -> Iterator[Progress | None]:
    """A stderr bar counting files, only on a terminal (never in pipes, logs or --json captures)."""
    if not sys.stderr.isatty():
        yield None
        return
    from memlens.cli.common import progress_bar

    with progress_bar(f"{files:,} files") as update:
        yield lambda done, total: update(f"{done:,} analysed", done / total)


def _kinds(values: tuple[str, ...]) -> list[str]:
    try:
        return parse_kinds(values)
    except MemlensUsageError as exc:
        raise click.BadParameter(str(exc), param_hint="--fail-on") from None


@click.command(help=help_text(__doc__))
@click.argument("snapshots", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--jobs", type=Whole(1, 1024), default=None,
              help="Ranks analysed at once, each in its own process (default: the CPUs, at most one per file).")
@click.option("--dask", "dask_address", default=None, metavar="ADDRESS",
              help="Analyse the files on the Dask cluster at ADDRESS (pip install 'memlens[dask]').")
@click.option("--json", "as_json", is_flag=True,
              help="Print the fleet as JSON: the rows, the outliers, and every file's report.")
@click.option("--fail-on", "fail_on", multiple=True, metavar="KIND",
              help=f"Exit 1 if any rank has a finding of this kind (repeat or comma-separate): "
                   f"{', '.join(FINDING_KINDS)}; 'activations' and 'optimizer' name the plateau and the spike.")
@click.option("--device", type=DEVICE, default=None, help="Device index (default: each file's busiest).")
@click.option("--capacity", type=CAPACITY, default=None,
              help="Device memory, e.g. 80GiB (default: each recorder's sidecar, if any).")
@click.option("--cache/--no-cache", default=None,
              help="Keep a fast columnar copy of each file for the next open (default: for files of 8 MiB or more).")
@click.option("--width", type=Whole(20, 10_000), default=None,
              help="Terminal width (default: detected; piped output: 80).")
@click.option("--color/--no-color", default=None, help="Force colour on or off (default: only on a terminal).")
def fleet(snapshots: tuple[str, ...], jobs: int | None, dask_address: str | None, as_json: bool,
          fail_on: tuple[str, ...], device: int | None, capacity: int | None, cache: bool | None,
          width: int | None, color: bool | None) -> None:
    run_fleet(snapshots, jobs=jobs, dask=dask_address, capacity=capacity, device=device, cache=cache,
              as_json=as_json, width=width, color=color, fail_on=_kinds(fail_on))


def run_fleet(snapshots: Sequence[str], *, jobs: int | None, dask: str | None, capacity: int | None,
              device: int | None, cache: bool | None, as_json: bool, width: int | None, color: bool | None,
              fail_on: Sequence[str]) -> None:
    """Analyse ``snapshots`` as a fleet, print the table and verdict (or the JSON), honour --fail-on."""
    from memlens.ops.fleet import triage_fleet

    with _progress(len(snapshots)) as progress:
        # The JSON keeps every file's report under "reports", each as ``memlens triage --json``.
        result = triage_fleet(snapshots, jobs=jobs, dask=dask, capacity=capacity, device=device,
                              cache=cache, keep_reports=as_json, progress=progress)
    if as_json:
        click.echo(json_text(result.to_json()))
    else:
        from memlens.reporters.fleet import render_fleet
        from memlens.reporters.terminal import make_console

        render_fleet(make_console(width=width, color=color), result)
    if len(result.failed) == len(result.rows):
        click.echo("memlens: error: none of the files could be analysed (see the table)", err=True)
        sys.exit(EXIT_NOTHING_ANALYSED)
    hits = [kind for kind in fail_on if kind in result.finding_kinds()]
    if hits:
        click.echo(f"memlens: found {', '.join(hits)} (--fail-on)", err=True)
        sys.exit(EXIT_FINDING)
