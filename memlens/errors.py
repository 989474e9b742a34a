"""The one error hierarchy memlens raises for user mistakes and bad input.

The CLI maps every ``MemlensError`` to a one-line message and exit code 2; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations


class MemlensError(Exception):
    """Base class: a problem the user can fix (bad file, bad flag, bad setting)."""

    exit_code = 2


MAX_PROBLEM_CHARS = 500


def one_line(text: str, limit: int = MAX_PROBLEM_CHARS) -> str:
    """``text`` as one printable line: control characters (newlines, escape sequences) shown
    escaped, cut to ``limit`` characters. A problem can quote bytes from a hostile file."""
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class MemlensFormatError(MemlensError):
    """A file that is not a readable, well-formed memory snapshot."""

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = one_line(problem)
        super().__init__(f"{self.path}: {self.problem}")


class MemlensUsageError(MemlensError):
    """A setting or argument that cannot be honoured (bad size string, unknown option)."""


class MemlensOutOfMemory(MemlensError):
    """A simulated allocation did not fit in the configured capacity."""
