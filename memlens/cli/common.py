"""Pieces several subcommands share: loading with a progress bar, size options, consoles."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click

from memlens.errors import MemlensUsageError
from memlens.units import parse_bytes

if TYPE_CHECKING:
    from memlens.analysis.analysis import Analysis
    from memlens.analysis.report import Report
    from memlens.snapshot import Snapshot


class ByteSize(click.ParamType):
    """A click type for sizes such as 80GiB, 24GB or 1.5e9, at least ``minimum`` bytes."""

    name = "SIZE"

    def __init__(self, minimum: int = 0) -> None:
        self.minimum = minimum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            size = value
        else:
            try:
                size = parse_bytes(value)
            except MemlensUsageError as exc:
                self.fail(str(exc), param, ctx)
        if size < self.minimum:
            self.fail(f"{value!r} is too small: it must be at least {self.minimum:,} B", param, ctx)
        return size


BYTE_SIZE = ByteSize()
CAPACITY = ByteSize(minimum=1)  # a device of 0 B answers every question with "no": refuse it


def help_text(doc: str | None) -> str:
    """A command's docstring as click help: example lines (indented) kept verbatim, not reflowed.

    click rewraps every paragraph unless it starts with a ``\\b`` line; the examples in our
    docstrings are the paragraphs whose lines are all indented.
    """
    paragraphs = (doc or "").strip("\n").split("\n\n")
    shaped = []
    for paragraph in paragraphs:
        lines = paragraph.split("\n")
        verbatim = all(line.startswith("  ") for line in lines if line.strip())
        shaped.append("\b\n" + paragraph if verbatim else paragraph.replace("``", "`"))
    return "\n\n".join(shaped)


@contextmanager
def progress_bar(label: str, enabled: bool | None = None) -> Iterator[Any]:
    """A stderr progress bar, drawn only when stderr is a terminal (never in pipes or logs)."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield lambda stage, fraction: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=1.0)

        def update(stage: str, fraction: float) -> None:
            bar.update(task, completed=fraction, description=f"{label}: {stage}")

        yield update


def load_with_progress(path: str, progress: bool | None = None, cache: bool | None = None) -> Snapshot:
    import memlens

    with progress_bar(path.rsplit("/", 1)[-1], progress) as update:
        return memlens.load(path, progress=update, cache=cache)


def analyze_paths(paths: list[str], capacity: int | None, device: int | None,
                  progress: bool | None = None, cache: bool | None = None) -> list[Report]:
    """The plain-data report of each file, in order."""
    return [analysis.report for analysis in analyses_of_paths(paths, capacity, device, progress, cache)]


def analyses_of_paths(paths: list[str], capacity: int | None, device: int | None,
                      progress: bool | None = None, cache: bool | None = None) -> list[Analysis]:
    """Each file's report with its snapshot and per-allocation index: for commands that ask more
    of a run than the report says (diff, a moment other than the peak, group-by)."""
    from memlens.analysis import analyze_snapshot

    analyses = []
    for path in paths:
        snapshot = load_with_progress(path, progress, cache)
        with progress_bar("analysing", progress) as update:
            update("analysing", 0.5)
            analyses.append(analyze_snapshot(snapshot, capacity=capacity, device=device))
    return analyses
