"""The lens commands: what was live at any moment grouped any way (``memlens group``), what each
``record_function`` scope added (``memlens stages``), and bytes by line of one source file
(``memlens lines``). The questions are answered by ``memlens.ops.group``; this prints them.

  memlens group snapshot.pickle --by annotation
  memlens group snapshot.pickle --by file --step 3
  memlens group snapshot.pickle --rules teams.toml --window 1200:5000
  memlens stages snapshot.pickle
  memlens lines snapshot.pickle model.py --at +1.5s --json
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import click

from memlens.cli.common import DEVICE, INDEX, Whole, help_text, json_text, progress_bar
from memlens.errors import MemlensUsageError
from memlens.ops.group import GROUP_BYS
from memlens.reporters.group import render_group, render_lines, render_stages

if TYPE_CHECKING:
    from rich.console import Console

    from memlens.analysis.lenses.moments import MomentSpec
    from memlens.analysis.lenses.rules import Rule

GROUP_HELP = """What was live at a moment (default: the peak), or at the peak of a window or a step, grouped
by category, annotation (the innermost record_function scope open when the block was allocated),
compile_context, module (the recorder's module scopes), file (file:line of the first user frame),
frame (the innermost frame), stack, or your own rules. The groups add up to the bytes allocated then.

  memlens group snapshot.pickle --by annotation
  memlens group snapshot.pickle --by file --step 3
  memlens group snapshot.pickle --rules teams.toml --window 1200:5000
  memlens group snapshot.pickle --by module --at +1.5s --json
"""

STAGES_HELP = """Memory per record_function scope: what each added while it ran (allocated at its END minus at
its START), the most one run added, and the peak inside; step markers (memlens.step#N) together.

  memlens stages snapshot.pickle
  memlens stages snapshot.pickle --json
"""

LINES_HELP = """Bytes live at a moment (default: the peak) by line of one source file, matched on the end of
the frames' paths (model.py is /src/model.py, not /src/mymodel.py); each block counts once, at
the innermost frame of the file in its stack.

  memlens lines snapshot.pickle model.py
  memlens lines snapshot.pickle src/model.py --step 3
  memlens lines snapshot.pickle model.py --at +1.5s --json
"""


class _Answer(Protocol):
    def to_json(self) -> dict[str, Any]: ...


Result = TypeVar("Result", bound=_Answer)


# --------------------------------------------------------------------------- shared options


def _common_options(command: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--device", type=DEVICE, default=None, help="Device index (default: the one with the highest "
                                                                  "peak)."),
        click.option("--json", "as_json", is_flag=True, help="Print the result as JSON."),
        click.option("--cache/--no-cache", default=None,
                     help="Keep a fast columnar copy for the next open (default: for files of 8 MiB or more)."),
        click.option("--width", type=Whole(20, 10_000), default=None,
                     help="Terminal width (default: detected; piped output: 80)."),
        click.option("--color/--no-color", default=None, help="Force colour on or off (default: only on a terminal)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _moment_options(command: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--at", "at", default=None, metavar="MOMENT",
                     help="The moment to look at: an event index (1234), a time (1234567us, or +1.5s since the "
                          "first row) or stepN (the peak of step N). Default: the peak."),
        click.option("--window", "window", default=None, metavar="A:B",
                     help="The peak within rows A..B (events, times or steps; either side may be left out)."),
        click.option("--step", "step", type=INDEX, default=None, metavar="N", help="The peak within step N."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def moment_of(at: str | None, window: str | None, step: int | None) -> MomentSpec | None:
    from memlens.ops.moments import moment_from_text

    return moment_from_text(at, window, step, names=("--at", "--window", "--step"))


def _each(paths: Sequence[str], cache: bool | None, answer: Callable[[Any], Result],
          as_json: bool, width: int | None, color: bool | None, render: Callable[[Console, Result], None]) -> None:
    """Answer the question for each file, then print every answer (one JSON object, or a list of
    them under ``snapshots`` for several files)."""
    from memlens.ops.triage import TriageOptions, analyse

    results = []
    for path in paths:
        with progress_bar(str(path).rsplit("/", 1)[-1]) as update:
            results.append(answer(analyse(path, TriageOptions(cache=cache), progress=update)))
    if as_json:
        payloads = [result.to_json() for result in results]
        click.echo(json_text(payloads[0] if len(payloads) == 1 else {"snapshots": payloads}))
        return
    from memlens.reporters.terminal import make_console

    console = make_console(width=width, color=color)
    for position, result in enumerate(results):
        if position:
            console.rule()
        render(console, result)


def load_rules_option(rules_path: str | None) -> tuple[Rule, ...]:
    from memlens.ops.group import rules_from_file

    return rules_from_file(rules_path) if rules_path else ()


# --------------------------------------------------------------------------- commands


@click.command(help=help_text(GROUP_HELP))
@click.argument("snapshots", nargs=-1, required=True, type=click.Path(dir_okay=False), metavar="SNAPSHOT...")
@click.option("--by", "by", type=click.Choice(GROUP_BYS), default=None,
              help="Group the blocks live at the moment by this (default: category; rules when --rules is given).")
@click.option("--rules", "rules_path", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Group by your own names: a JSON or TOML file of ordered name/pattern rules (regular "
                   "expressions over the stack's frames; first match wins, the rest is 'other').")
@_moment_options
@_common_options
def group(snapshots: tuple[str, ...], by: str | None, rules_path: str | None, at: str | None, window: str | None,
          step: int | None, device: int | None, as_json: bool, cache: bool | None, width: int | None,
          color: bool | None) -> None:
    from memlens.ops.group import GroupOptions
    from memlens.ops.group import group as group_of

    if by == "rules" and rules_path is None:
        raise MemlensUsageError("--by rules needs a rules file (--rules FILE)")
    if rules_path is not None and by not in (None, "rules"):
        raise MemlensUsageError(f"--rules goes with --by rules, not --by {by}")
    options = GroupOptions(by=by or ("rules" if rules_path else "category"), moment=moment_of(at, window, step),
                           rules=load_rules_option(rules_path), device=device)
    _each(snapshots, cache, lambda analysis: group_of(analysis, options), as_json, width, color,
          render_group)


@click.command(help=help_text(STAGES_HELP))
@click.argument("snapshots", nargs=-1, required=True, type=click.Path(dir_okay=False), metavar="SNAPSHOT...")
@_common_options
def stages(snapshots: tuple[str, ...], device: int | None, as_json: bool, cache: bool | None, width: int | None,
           color: bool | None) -> None:
    from memlens.ops.group import stages as stages_of

    _each(snapshots, cache, lambda analysis: stages_of(analysis, device), as_json, width, color,
          render_stages)


@click.command(help=help_text(LINES_HELP))
@click.argument("snapshot", type=click.Path(dir_okay=False))
@click.argument("source_file", metavar="SOURCE_FILE")
@_moment_options
@_common_options
def lines(snapshot: str, source_file: str, at: str | None, window: str | None, step: int | None,
          device: int | None, as_json: bool, cache: bool | None, width: int | None, color: bool | None) -> None:
    from memlens.ops.group import LinesOptions
    from memlens.ops.group import lines as lines_of

    options = LinesOptions(path=source_file, moment=moment_of(at, window, step), device=device)
    _each([snapshot], cache, lambda analysis: lines_of(analysis, options), as_json, width, color,
          render_lines)
