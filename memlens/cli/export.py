"""Export a snapshot: an HTML report to share, or its rows as JSON lines or CSV to query yourself.

HTML (the default) is self-contained: plotly.js is embedded, so the file opens offline. JSON
lines and CSV hold one table with fixed columns (README: "Export the snapshot as rows"):
`events`, one row per trace event of every device with its frames resolved, its step and its
category, `blocks`, the allocator's segments and blocks when the snapshot was taken, or `stacks`,
each distinct stack once (a cell is cut, and its `frames_omitted` column says so, only when rows
sharing long stacks would make the output outgrow the snapshot's content). Rows are
streamed: memory stays flat however long the trace. `-o -` writes to standard output; a file
appears whole or not at all. The format follows the output's suffix (.jsonl, .ndjson, .csv)
unless --format says otherwise.

  memlens export snapshot.pickle -o report.html
  memlens export snapshot.pickle -o events.jsonl
  memlens export snapshot.pickle --format csv --table blocks -o blocks.csv
  memlens export snapshot.pickle --format jsonl -o - | jq -c 'select(.action == "oom")'
"""

from __future__ import annotations

import os
import sys

import click

from memlens.cli.common import CAPACITY, DEVICE, help_text, progress_bar
from memlens.errors import MemlensUsageError

SUFFIX_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}
EXIT_BROKEN_PIPE = 141  # what a shell reports for a writer killed by SIGPIPE (128 + 13)


def _format_of(output: str | None, given: str | None) -> str:
    if given is not None:
        return given
    suffix = os.path.splitext(output or "")[1].lower()
    return SUFFIX_FORMATS.get(suffix, "html")


def _check_output(output: str, snapshot: str) -> None:
    # Resolved: an output that is a link to the snapshot would be written through to it.
    if os.path.realpath(output) == os.path.realpath(snapshot):
        raise MemlensUsageError("the output would overwrite the snapshot; choose another -o path")
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise MemlensUsageError(f"no such folder for the output: {folder}")
    if os.path.isdir(output):
        raise MemlensUsageError(f"{output} is a folder; -o names the file to write")


def _cannot_write(output: str, exc: OSError) -> MemlensUsageError:
    """A folder this user may not write in, a full disk: the user's to fix, said in one line."""
    reason = exc.strerror or type(exc).__name__
    if output == "-":
        return MemlensUsageError(f"cannot write standard output: {reason}")
    return MemlensUsageError(f"cannot write {output}: {reason} (any file there was left as it was)")


@click.command(help=help_text(__doc__))
@click.argument("snapshot", type=click.Path(dir_okay=False))
@click.option("-o", "--output", default=None, type=click.Path(dir_okay=False, allow_dash=True),
              help="Where to write ('-': standard output; JSON lines and CSV only). Needed for HTML; "
                   "JSON lines and CSV default to standard output.")
@click.option("--format", "fmt", type=click.Choice(["html", "jsonl", "csv"]), default=None,
              help="html, jsonl or csv (default: from the output's suffix, else html).")
@click.option("--table", type=click.Choice(["events", "blocks", "stacks"]), default="events", show_default=True,
              help="JSON lines and CSV: trace events, the segments and blocks at the dump, or each "
                   "distinct stack once (by the stack_id of the other two).")
@click.option("--device", type=DEVICE, default=None,
              help="HTML: the device detailed (default: the busiest). JSON lines and CSV: only this "
                   "device's rows (default: every device).")
@click.option("--capacity", type=CAPACITY, default=None, help="Device memory, e.g. 80GiB.")
@click.option("--analysis/--no-analysis", default=True, show_default=True,
              help="JSON lines and CSV: fill the step and category columns (analyses the snapshot first).")
@click.option("--cache/--no-cache", default=None,
              help="Keep a fast columnar copy for the next open (default: for files of 8 MiB or more).")
def export(snapshot: str, output: str | None, fmt: str | None, table: str, device: int | None,
           capacity: int | None, analysis: bool, cache: bool | None) -> None:
    fmt = _format_of(output, fmt)
    if fmt == "html":
        if output is None or output == "-":
            raise MemlensUsageError("the HTML report needs a file: give -o report.html")
        _check_output(output, snapshot)
        from memlens.ops.triage import TriageOptions, triage
        from memlens.reporters.html import write_html

        with progress_bar(snapshot.rsplit("/", 1)[-1]) as update:
            report = triage(snapshot, TriageOptions(capacity=capacity, device=device, cache=cache), progress=update)
        try:
            write_html(report, output, device)
        except OSError as exc:
            raise _cannot_write(output, exc) from None
        click.echo(f"wrote {output} ({os.path.getsize(output) / 2**20:.1f} MiB)")
        return
    destination = output if output is not None else "-"
    if destination != "-":
        _check_output(destination, snapshot)
    _export_rows(snapshot, destination, fmt, table, device, capacity, analysis, cache)


def _export_rows(snapshot_path: str, destination: str, fmt: str, table: str, device: int | None,
                 capacity: int | None, analysis: bool, cache: bool | None) -> None:
    from memlens.ops.export import RowsOptions, rows_of

    options = RowsOptions(fmt=fmt, table=table, device=device, capacity=capacity, analysis=analysis, cache=cache)
    with progress_bar(snapshot_path.rsplit("/", 1)[-1]) as update:
        rows = rows_of(snapshot_path, options, progress=update)
    try:
        written = rows.write(destination)
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as a command killed by SIGPIPE would,
        # and point stdout at /dev/null so the interpreter's last flush cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(EXIT_BROKEN_PIPE)
    except OSError as exc:
        raise _cannot_write(destination, exc) from None
    if destination != "-":
        size = os.path.getsize(destination)
        click.echo(f"wrote {destination} ({written:,} rows of {table}, {size / 2**20:.1f} MiB)")
