"""A fleet of ranks in the terminal: the per-rank table, then the outlier verdict.

Reads a ``memlens.fleet.rows.FleetReport`` and nothing else; every number and sentence comes from it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from memlens.printable import printable
from memlens.reporters.terminal import elide_apart
from memlens.units import format_bytes

if TYPE_CHECKING:
    from memlens.fleet.rows import FleetReport, RankRow

# Peak allocated, how far from the median rank's, peak reserved; then the rank's findings.
COLUMNS = ("rank", "file", "allocated", "±median", "reserved", "steps", "step time", "findings")
# An error is one line of the table, cut to this; the JSON (--json) has it whole.
ERROR_CELL_CHARS = 60
MIN_LAST_COLUMN = 12
MIN_FILE_COLUMN = 10


def _findings_cell(row: RankRow) -> str:
    kinds: dict[str, int] = {}
    for finding in row.findings:
        kinds[finding.kind] = kinds.get(finding.kind, 0) + finding.bytes
    return ", ".join(f"{kind} {format_bytes(size)}" for kind, size in sorted(kinds.items())) or "-"


def render_fleet(console: Console, fleet: FleetReport) -> None:
    rows = fleet.rows
    failed = len(fleet.failed)
    # No timings or worker counts here: the same files print the same text on any machine (the
    # JSON has executor, workers and wall_seconds).
    console.print(Text(f"memlens fleet  {len(rows):,} files · {len(rows) - failed:,} analysed"
                       + (f" · {failed:,} failed" if failed else ""), style="bold"))
    outlying = {outlier.index for outlier in fleet.outliers}
    median_peak = fleet.medians.get("peak_allocated", 0.0)
    cells: list[list[str]] = []
    for row in rows:
        name = printable(os.path.basename(row.path))
        rank = "-" if row.rank is None else str(row.rank)
        if not row.ok:
            error = row.error or ""
            if error.startswith(row.path + ": "):  # the file column already names it
                error = error[len(row.path) + 2:]
            cells.append([rank, name, "", "", "", "", "", f"error: {printable(error, ERROR_CELL_CHARS)}"])
            continue
        versus = f"{(row.peak_allocated_bytes - median_peak) / median_peak:+.0%}" if median_peak else "-"
        step_time = "-" if row.step_time_ms is None else f"{row.step_time_ms:,.1f} ms"
        cells.append([rank, name, format_bytes(row.peak_allocated_bytes), versus,
                      format_bytes(row.peak_reserved_bytes), str(row.steps), step_time, _findings_cell(row)])
    # The last column gets what the others leave, and its cells are cut to that here: left to
    # rich, a long error shrinks the rank column to nothing instead.
    # rank{N}.pickle for rank N says nothing the rank column does not: the file column goes.
    shown = [i for i, column in enumerate(COLUMNS)
             if column != "file" or any(line[1] != f"rank{line[0]}.pickle" for line in cells)]
    widths = {i: max([len(COLUMNS[i])] + [len(line[i]) for line in cells]) for i in shown[:-1]}
    over = sum(widths.values()) + 2 * len(shown) + MIN_LAST_COLUMN - console.width
    if over > 0 and 1 in widths:  # too narrow: long file names give way first, cut in the middle
        widths[1] = max(widths[1] - over, MIN_FILE_COLUMN)
        # Cut where the names agree: job-...-rank17.pickle and job-...-rank18.pickle stay apart.
        for line, name in zip(cells, elide_apart([line[1] for line in cells], widths[1]), strict=True):
            line[1] = name
    room = max(console.width - sum(widths.values()) - 2 * len(shown), MIN_LAST_COLUMN)
    table = Table(title="Ranks  peak memory per rank", title_justify="left", box=None, header_style="bold")
    for i in shown:
        table.add_column(COLUMNS[i], justify="left" if COLUMNS[i] in ("file", "findings") else "right", no_wrap=True)
    cut_errors: list[tuple[str, str]] = []
    for index, (row, line) in enumerate(zip(rows, cells, strict=True)):
        last = line[-1] if len(line[-1]) <= room else line[-1][: room - 1] + "…"
        if not row.ok and last != line[-1]:
            cut_errors.append((row.path, row.error or ""))
        table.add_row(*[line[i] for i in shown[:-1]], last,
                      style="red" if not row.ok else "bold" if index in outlying else "")
    console.print(table)
    if cut_errors:  # a reason the table had to cut is given whole, one line a file
        console.print(Text("Not analysed", style="bold"))
        for path, reason in cut_errors:
            reason = reason.removeprefix(path + ": ")
            console.print(Text(f"  {printable(os.path.basename(path))}: {printable(reason)}", style="red"),
                          soft_wrap=True)
    if fleet.outliers:
        console.print(Text("Outliers  against the median rank (robust z-score on the peaks and each category)",
                           style="bold"))
        for outlier in fleet.outliers:
            console.print(Text(f"  {printable(outlier.verdict, 2000)}"))
            console.print(Text(f"    details: memlens triage {printable(outlier.path)}", style="dim"))
    else:
        from memlens.fleet.outliers import no_outlier_verdict  # the one verdict the dashboard shows too

        console.print(Text(f"Outliers  {no_outlier_verdict(fleet)}"))
        if fleet.pair:
            console.print(Text(f"  {printable(fleet.pair, 2000)}"))
