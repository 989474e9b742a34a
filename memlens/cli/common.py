"""Pieces several subcommands share: size options, progress bars, help text, the --json text."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, TextIO

import click

from memlens.errors import MemlensUsageError
from memlens.reporters.jsontext import json_text as json_text  # ``--json``: the text the MCP tools return
from memlens.units import MAX_WHOLE, parse_bytes, parse_capacity, parse_real, parse_whole, shown


def option_name(param: click.Parameter | None, fallback: str = "the value") -> str:
    """How a usage error names the option (``--heads``)."""
    return (param.opts[0] if param is not None and param.opts else None) or fallback


class ByteSize(click.ParamType):
    """A click type for sizes such as 80GiB, 24GB or 1.5e9, at least ``minimum`` bytes."""

    name = "SIZE"

    def __init__(self, minimum: int = 0) -> None:
        self.minimum = minimum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        # Usage errors of numbers are memlens' one line (``memlens: error: --capacity ...``, exit
        # 2), parsed where the MCP tools and the dashboard parse them (memlens.units).
        try:
            size = value if isinstance(value, int) and not isinstance(value, bool) else parse_bytes(value)
        except MemlensUsageError as exc:
            raise MemlensUsageError(f"{option_name(param)}: {exc}") from None
        if size < self.minimum:
            raise MemlensUsageError(f"{option_name(param)}: {shown(value)} is too small: it must be at least "
                                    f"{self.minimum:,} B")
        return size


class Whole(click.ParamType):
    """A click type for a whole number in ``minimum``..``maximum`` (``memlens.units.parse_whole``):
    ``--heads 0``, ``1e400``, ``nan`` and 5,000-digit numbers are one-line usage errors."""

    name = "INTEGER"

    def __init__(self, minimum: int | None = None, maximum: int | None = MAX_WHOLE) -> None:
        self.minimum = minimum
        self.maximum = maximum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        return parse_whole(value, option_name(param), self.minimum, self.maximum)


class Real(click.ParamType):
    """A click type for a finite number in ``minimum``..``maximum`` (never inf or nan)."""

    name = "FLOAT"

    def __init__(self, minimum: float | None = None, maximum: float | None = None) -> None:
        self.minimum = minimum
        self.maximum = maximum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        return parse_real(value, option_name(param), self.minimum, self.maximum)


class DeviceCapacity(click.ParamType):
    """A click type for a device's memory (``memlens.units.parse_capacity``, as the MCP tools and
    the dashboard read it): a unit is required, so ``--capacity 80`` asks for one, and 0 B is refused."""

    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):  # a default already in bytes
            return value
        return parse_capacity(value, option_name(param, "--capacity"))


BYTE_SIZE = ByteSize()
CAPACITY = DeviceCapacity()
COUNT = Whole(minimum=1)  # sizes of a model or a batch: 0 divides or means nothing
DEVICE = Whole(minimum=0, maximum=1023)  # a device ordinal (memlens reads devices 0 to 1023)
INDEX = Whole(minimum=0)


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


# How often a status line is redrawn: often enough to see it move, rarely enough to cost nothing.
STATUS_SECONDS = 0.5


@contextmanager
def status_line(stream: TextIO | None, text: Callable[[float], str]) -> Iterator[None]:
    """One line on ``stream`` (stderr when it is a terminal, else None: nothing is drawn) redrawn
    every ``STATUS_SECONDS`` from ``text(elapsed seconds)`` while the body runs, then cleared."""
    if stream is None:
        yield
        return
    started = time.monotonic()
    done = threading.Event()

    def draw() -> None:
        while not done.wait(STATUS_SECONDS):
            with suppress(OSError, ValueError):  # a script may have closed the stream
                stream.write(f"\r\x1b[K{text(time.monotonic() - started)}")
                stream.flush()

    drawer = threading.Thread(target=draw, name="memlens-status-line", daemon=True)
    drawer.start()
    try:
        yield
    finally:
        done.set()
        drawer.join()
        with suppress(OSError, ValueError):
            stream.write("\r\x1b[K")  # gone before the figures are printed
            stream.flush()

