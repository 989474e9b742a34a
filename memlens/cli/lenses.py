"""``memlens triage``'s old lens options, kept only until triage loses them (issue 22: the lens
questions are their own commands now, ``memlens group``, ``memlens stages`` and ``memlens lines``,
in ``memlens.cli.group``). Each option is answered by the same service (``memlens.ops.group``)
and printed by the same renderers; delete this module with the options.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from memlens.analysis.lenses.labels import GROUP_BYS
from memlens.cli.common import INDEX, analyses_of_paths, json_text

LENS_OPTION_NAMES = ("group_by", "rules_path", "at", "window", "step", "file_path", "stages")


def lens_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add the lens options to a click command (``memlens triage``)."""
    options = [
        click.option("--group-by", "group_by", type=click.Choice(GROUP_BYS), default=None,
                     help="As `memlens group --by`."),
        click.option("--rules", "rules_path", type=click.Path(dir_okay=False), default=None, metavar="FILE",
                     help="As `memlens group --rules`."),
        click.option("--at", "at", default=None, metavar="MOMENT", help="As `memlens group --at`."),
        click.option("--window", "window", default=None, metavar="A:B", help="As `memlens group --window`."),
        click.option("--step", "step", type=INDEX, default=None, metavar="N", help="As `memlens group --step`."),
        click.option("--file", "file_path", default=None, metavar="PATH", help="As `memlens lines`."),
        click.option("--stages", "stages", is_flag=True, help="As `memlens stages`."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def lenses_requested(lens: dict[str, Any]) -> bool:
    return any(lens.get(name) not in (None, False) for name in LENS_OPTION_NAMES)


def run_lenses(paths: list[str], device: int | None, cache: bool | None, as_json: bool, width: int | None,
               color: bool | None, lens: dict[str, Any]) -> None:
    """Print the lenses ``lens`` asks for (the options above) for each file."""
    from memlens.cli.group import load_rules_option, moment_of, render_group, render_lines, render_stages
    from memlens.ops.group import GroupOptions, LinesOptions, group, lines, stages
    from memlens.reporters.terminal import make_console

    rules = load_rules_option(lens.get("rules_path"))
    group_by = lens.get("group_by") or ("rules" if rules else None)
    if group_by is None and not lens.get("file_path") and not lens.get("stages"):
        group_by = "category"  # a moment alone: what was live then, by category
    moment = moment_of(lens.get("at"), lens.get("window"), lens.get("step"))
    payloads = []
    console = None if as_json else make_console(width=width, color=color)
    for position, analysis in enumerate(analyses_of_paths(paths, None, device, cache=cache)):
        payload: dict[str, Any] = {"source": analysis.report.source}
        answers: list[tuple[Any, Callable[..., None]]] = []
        if group_by:
            answers.append((group(analysis, GroupOptions(by=group_by, moment=moment, rules=rules, device=device)),
                            render_group))
        if lens.get("file_path"):
            answers.append((lines(analysis, LinesOptions(path=lens["file_path"], moment=moment, device=device)),
                            render_lines))
        if lens.get("stages"):
            answers.append((stages(analysis, device), render_stages))
        for answer, render in answers:
            payload.update(answer.to_json())
            if console is not None:
                if position or answer is not answers[0][0]:
                    console.rule()
                render(console, answer, "triage")
        payloads.append(payload)
    if as_json:
        click.echo(json_text(payloads[0] if len(payloads) == 1 else {"lenses": payloads}))
