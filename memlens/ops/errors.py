"""The one rule that turns an exception into a one-line message, for every face.

Three kinds of failure, told apart once here:

- ``mistake``: a ``MemlensError`` memlens raised on purpose (a file that is not a snapshot, a
  setting that cannot be honoured): its own message, printable, on one line; the user fixes it.
- ``exhausted``: ``MemoryError`` or ``RecursionError`` escaping a reader or an analysis, what a
  crafted file does to code with no defence left: "ran out of memory/stack depth on this input".
- ``bug``: anything else, ours to fix: a named internal error. A simulated out-of-memory
  (``MemlensOutOfMemory``) is a *result* the code that simulates reports; one that escapes is a
  bug too, not the user's mistake.

The faces decide what follows (the CLI's exit code and its ``--debug`` hint, the MCP server's
tool error, the fleet's row, the dashboard's log); the words are these.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from memlens.errors import MemlensError, MemlensOutOfMemory
from memlens.printable import printable

ErrorKind = Literal["mistake", "exhausted", "bug"]

# What a mistake's message is cut to (its path and the problem; a hostile file can make it long).
MESSAGE_CHARS = 500
# What a bug's own message is cut to after its exception's name.
BUG_MESSAGE_CHARS = 300
# The exit code of a failure that is not a mistake with its own ``exit_code``.
EXIT_ERROR = 2


class Crashed(Exception):
    """A child process (``memlens.ops.runner``) failed for a reason that is memlens' fault: the
    message is its traceback (or what ended it), its last line the exception it died of."""

    @property
    def last_line(self) -> str:
        lines = [line for line in str(self).strip().splitlines() if line.strip()]
        return lines[-1].strip() if lines else "?"


class ErrorLine(msgspec.Struct, frozen=True):
    """An exception as the faces show it: its kind, the one line, and the CLI's exit code."""

    kind: ErrorKind
    text: str
    exit_code: int = EXIT_ERROR


def describe(exc: BaseException, limit: int = MESSAGE_CHARS) -> ErrorLine:
    """The one line ``exc`` is shown as (see the module docstring); ``limit``: the characters a
    mistake's message may take on this face (a terminal shows more than an assistant's context)."""
    if isinstance(exc, MemlensError) and not isinstance(exc, MemlensOutOfMemory):
        return ErrorLine("mistake", printable(exc, limit), exc.exit_code)
    if isinstance(exc, MemoryError | RecursionError):
        what = "memory" if isinstance(exc, MemoryError) else "stack depth"
        return ErrorLine("exhausted", f"ran out of {what} on this input ({type(exc).__name__})")
    if isinstance(exc, Crashed):  # a child's bug: the exception it died of, named as in-process
        return ErrorLine("bug", f"internal error: {printable(exc.last_line, BUG_MESSAGE_CHARS)}")
    return ErrorLine("bug", f"internal error: {type(exc).__name__}: {printable(exc, BUG_MESSAGE_CHARS)}")


def one_line_error(exc: BaseException, limit: int = MESSAGE_CHARS) -> str:
    """``describe(exc, limit).text``: the line alone."""
    return describe(exc, limit).text


__all__ = ["BUG_MESSAGE_CHARS", "EXIT_ERROR", "MESSAGE_CHARS", "Crashed", "ErrorKind", "ErrorLine", "describe",
           "one_line_error"]
