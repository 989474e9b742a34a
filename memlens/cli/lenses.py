"""The lens options of ``memlens triage``: group what was live at any moment, per source file,
per annotation stage (the engine is ``memlens.analysis.lenses``; this prints it).

  memlens triage snapshot.pickle --group-by annotation
  memlens triage snapshot.pickle --group-by file --step 3
  memlens triage snapshot.pickle --rules teams.toml --window 1200:5000
  memlens triage snapshot.pickle --file model.py --at +1.5s --json
  memlens triage snapshot.pickle --stages
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from memlens.analysis.lenses import (
    BEFORE_HISTORY,
    GROUP_BYS,
    NO_ANNOTATION,
    NO_COMPILE_CONTEXT,
    NO_MODULE,
    NO_TIMES,
    UNACCOUNTED,
)
from memlens.cli.common import INDEX, json_text
from memlens.printable import printable
from memlens.units import format_bytes

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from memlens.analysis.lenses import (
        FileBreakdown,
        FileDiff,
        GroupBreakdown,
        LensInputs,
        Moment,
        StageRuns,
        StageSummary,
    )

# Rows a table shows before folding the rest into one "… N more" row (the JSON has them all).
TABLE_ROWS = 25
PLACEHOLDER_GROUPS = {BEFORE_HISTORY, NO_ANNOTATION, NO_COMPILE_CONTEXT, NO_MODULE, NO_TIMES, UNACCOUNTED}
# What to do when a lens finds nothing of its kind (every block in a placeholder group).
EMPTY_LENS_HINTS = {
    "module": "no block here was allocated inside a module scope (memlens.record(model=...) and `memlens "
              "record` write them: memlens.forward#NAME, memlens.backward#NAME)",
    "annotation": "no block here was allocated inside a record_function scope",
    "compile_context": "no block here has a compile_context (PyTorch records one for torch.compile'd code)",
}
LENS_OPTION_NAMES = ("group_by", "rules_path", "at", "window", "step", "file_path", "stages")


def lens_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add the lens options to a click command (``memlens triage``)."""
    options = [
        click.option("--group-by", "group_by", type=click.Choice(GROUP_BYS), default=None,
                     help="Group the blocks live at the moment (default: the peak) by this; 'rules' needs "
                          "--rules."),
        click.option("--rules", "rules_path", type=click.Path(dir_okay=False), default=None, metavar="FILE",
                     help="Group by your own names: a JSON or TOML file of ordered name/pattern rules (regular "
                          "expressions over the stack's frames; first match wins, the rest is 'other')."),
        click.option("--at", "at", default=None, metavar="MOMENT",
                     help="The moment to look at: an event index (1234), a time (1234567us, or +1.5s since the "
                          "first row) or stepN (the peak of step N)."),
        click.option("--window", "window", default=None, metavar="A:B",
                     help="The peak within rows A..B (events, times or steps; either side may be left out)."),
        click.option("--step", "step", type=INDEX, default=None, metavar="N", help="The peak within step N."),
        click.option("--file", "file_path", default=None, metavar="PATH",
                     help="Bytes by line of one source file (matched on the end of its path), at the moment."),
        click.option("--stages", "stages", is_flag=True,
                     help="Memory per record_function scope: what each added while it ran, and its peak."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def lenses_requested(lens: dict[str, Any]) -> bool:
    return any(lens.get(name) not in (None, False) for name in LENS_OPTION_NAMES)


def run_lenses(paths: list[str], device: int | None, cache: bool | None, as_json: bool, width: int | None,
               color: bool | None, lens: dict[str, Any]) -> None:
    """Print the lenses ``lens`` asks for (the options above) for each file."""
    from memlens.analysis.lenses import lens_inputs, load_rules
    from memlens.cli.common import load_with_progress
    from memlens.reporters.terminal import make_console

    rules = load_rules(lens["rules_path"]) if lens.get("rules_path") else []
    group_by = lens.get("group_by") or ("rules" if rules else None)
    if group_by is None and not lens.get("file_path") and not lens.get("stages"):
        group_by = "category"  # a moment alone: what was live then, by category
    payloads = []
    console = None if as_json else make_console(width=width, color=color)
    for position, path in enumerate(paths):
        inputs = lens_inputs(load_with_progress(path, cache=cache), device)
        payload = lens_payload(inputs, path, group_by, rules, lens)
        if console is None:
            payloads.append(payload.to_json())
            continue
        if position:
            console.rule()
        render_lenses(console, payload)
    if as_json:
        click.echo(json_text(payloads[0] if len(payloads) == 1 else {"lenses": payloads}))


@dataclass(frozen=True)
class LensPayload:
    """What one file's lenses found: plain data, printed by ``render_lenses`` or as JSON."""

    source: str
    device: int
    moment: Moment
    groups: GroupBreakdown | None
    file: FileBreakdown | None
    stages: list[StageSummary] | None
    stage_runs: StageRuns | None
    start_us: int | None  # the first row's time, to print "+1.234 s"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "device": self.device}
        if self.groups is not None:
            out["groups"] = self.groups.to_json()
        if self.file is not None:
            out["file"] = self.file.to_json()
        if self.stages is not None:
            out["stages"] = {"by_name": [s.to_json() for s in self.stages],
                             "runs": self.stage_runs.to_json() if self.stage_runs is not None else []}
        return out


def lens_payload(inputs: LensInputs, source: str, group_by: str | None, rules: list[Any],
                 lens: dict[str, Any]) -> LensPayload:
    from memlens.analysis.lenses import annotation_stages, file_lines, group_live, resolve_moment, summarize_stages

    moment = resolve_moment(inputs, at=lens.get("at"), window=lens.get("window"), step=lens.get("step"))
    groups = group_live(inputs, group_by, moment.event, rules, moment) if group_by else None
    file = file_lines(inputs, lens["file_path"], moment) if lens.get("file_path") else None
    runs = annotation_stages(inputs) if lens.get("stages") else None
    stages = summarize_stages(runs) if runs is not None else None
    trace = inputs.trace
    start_us = int(trace.time_us[0]) if trace.has_time and len(trace) else None
    return LensPayload(source, inputs.device, moment, groups, file, stages, runs, start_us)


# --------------------------------------------------------------------------- terminal


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


def _when(payload: LensPayload, time_us: int | None) -> str:
    moment = payload.moment
    parts = [moment.text]
    if moment.event is not None and moment.event >= 0 and moment.how != "event":
        parts.append(f"event {moment.event:,}")
    if time_us is not None and payload.start_us is not None:
        parts.append(f"+{(time_us - payload.start_us) / 1e6:.3f} s")
    if moment.window:
        parts.append(f"rows {moment.window[0]:,}-{moment.window[1]:,}")
    return parts[0] + (f" ({', '.join(parts[1:])})" if parts[1:] else "")


def _share(part: int, total: int) -> str:
    return f"{100 * part / total:.0f}%" if total else "-"


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


def render_lenses(console: Console, payload: LensPayload) -> None:
    console.print(_bold("memlens triage") + _plain(f"  {printable(payload.source)}"))
    if payload.groups is not None:
        render_groups(console, payload, payload.groups)
    if payload.file is not None:
        render_file(console, payload, payload.file)
    if payload.stages is not None:
        render_stages(console, payload.stages)


def render_groups(console: Console, payload: LensPayload, result: GroupBreakdown) -> None:
    total = result.allocated_bytes
    console.print(_bold(f"\nLive by {result.group_by} on device {payload.device} at "
                        f"{_when(payload, result.time_us)}, {format_bytes(total)} in all"))
    label_width = max(console.width - 34, 20)
    table = _table()
    table.add_column(result.group_by, no_wrap=True, overflow="ellipsis", max_width=label_width)
    for column in ("bytes", "share", "blocks"):
        table.add_column(column, justify="right", no_wrap=True)
    shown, rest = result.groups[:TABLE_ROWS], result.groups[TABLE_ROWS:]
    for group in shown:
        table.add_row(_label(group.name, result.group_by, label_width), format_bytes(group.bytes),
                      _share(group.bytes, total), f"{group.blocks:,}")
    if rest:
        rest_bytes = sum(g.bytes for g in rest)
        table.add_row(f"… {len(rest):,} more (--json lists them)", format_bytes(rest_bytes),
                      _share(rest_bytes, total), f"{sum(g.blocks for g in rest):,}")
    console.print(table)
    hint = EMPTY_LENS_HINTS.get(result.group_by)
    if hint and {g.name for g in result.groups} <= PLACEHOLDER_GROUPS:
        console.print(_dim(f"  {hint}"))


def render_file(console: Console, payload: LensPayload, result: FileBreakdown) -> None:
    total = result.allocated_bytes
    names = ", ".join(printable(f) for f in result.files[:3]) + (" …" if len(result.files) > 3 else "")
    console.print(_bold(f"\n{names} at {_when(payload, result.time_us)}: {format_bytes(result.file_bytes)} "
                       f"of {format_bytes(total)} ({_share(result.file_bytes, total)})"))
    if result.file_peak_event is not None and result.file_peak_event != result.moment.event:
        where = f"event {result.file_peak_event:,}" if result.file_peak_event >= 0 else "when the history began"
        console.print(_dim(f"  this file's own peak: {format_bytes(result.file_peak_bytes)} at {where} "
                           f"(--at {max(result.file_peak_event, 0)})"))
    if not result.lines:
        console.print("  nothing allocated from this file was live then")
        return
    table = _table()
    for column in ("line", "function", "bytes", "share", "blocks"):
        table.add_column(column, justify="left" if column == "function" else "right", no_wrap=True,
                         overflow="ellipsis")
    for row in result.lines[:TABLE_ROWS]:
        table.add_row(f"{row.line:,}", printable(row.function), format_bytes(row.bytes), _share(row.bytes, total),
                      f"{row.blocks:,}")
    rest = result.lines[TABLE_ROWS:]
    if rest:
        rest_bytes = sum(r.bytes for r in rest)
        table.add_row("", f"… {len(rest):,} more lines", format_bytes(rest_bytes), _share(rest_bytes, total),
                      f"{sum(r.blocks for r in rest):,}")
    table.add_row("", "elsewhere", format_bytes(result.elsewhere_bytes), _share(result.elsewhere_bytes, total), "")
    console.print(table)


def render_stages(console: Console, stages: list[StageSummary]) -> None:
    console.print(_bold("\nMemory per annotation stage  added while each scope ran (END minus START), "
                       "and its peak inside"))
    if not stages:
        console.print("  no record_function scope with both a START and an END on this device (or no times)")
        return
    table = _table()
    table.add_column("scope", no_wrap=True, overflow="ellipsis", max_width=max(console.width - 48, 20))
    for column in ("runs", "added", "most in one run", "peak inside"):
        table.add_column(column, justify="right", no_wrap=True)
    for stage in stages[:TABLE_ROWS]:
        table.add_row(printable(stage.name), f"{stage.runs:,}", _signed(stage.added_bytes),
                      _signed(stage.max_added_bytes), format_bytes(stage.peak_bytes))
    if len(stages) > TABLE_ROWS:
        table.add_row(f"… {len(stages) - TABLE_ROWS:,} more scopes (--json lists them)", "", "", "", "")
    console.print(table)


def _signed(n: int) -> str:
    return ("+" if n > 0 else "-" if n < 0 else "") + format_bytes(abs(n)) if n else "0"


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
