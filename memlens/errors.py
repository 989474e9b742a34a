"""The one exception hierarchy memlens raises on purpose, one meaning per class.

::

    MemlensError                  base: anything memlens raises deliberately
    ├── MemlensFormatError        a mistake: a file that is not a readable memory snapshot
    ├── MemlensUsageError         a mistake: a setting or argument that cannot be honoured
    │                             (also a ``ValueError``, so ``except ValueError`` keeps working)
    ├── GuardBuildError           the environment: memlens.predict's CUDA guard cannot be built
    └── MemlensOutOfMemory        a *result*: a simulated allocation did not fit the capacity
        └── SimulatedOOM          raised by ``CachingAllocatorSimulator.malloc``

Mistakes are the user's to fix: the CLI prints them as one line and exits with ``exit_code`` (2);
anything else that escapes a command is a bug and says so (``--debug`` for the traceback).

An out-of-memory is what a simulation found, not a mistake, and the code that simulates reports
it in its result instead of letting it escape: ``whatif`` -> ``WhatIfResult.simulated.oom``
(``memlens whatif`` prints "out of memory: yes" and exits 0), ``predict`` ->
``PredictResult.oom``, and the CPU recorder raises ``torch.OutOfMemoryError`` inside the user's
loop, as a real device would. ``MemlensOutOfMemory`` therefore never reaches the CLI as a
mistake; if a command lets one escape, the CLI reports an internal error.
"""

from __future__ import annotations


class MemlensError(Exception):
    """Base class of every exception memlens raises on purpose (see the module docstring).

    ``exit_code`` is what the CLI exits with when this is a mistake the user can fix."""

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


class MemlensUsageError(MemlensError, ValueError):
    """A setting or argument that cannot be honoured (bad size string, unknown option, a name
    that is not in a budget). Also a ``ValueError``: code written before this class existed
    (``except ValueError``) still catches it."""


class MemlensOutOfMemory(MemlensError):
    """A simulated allocation did not fit in the configured capacity: a finding of a
    simulation, not a mistake. Callers that simulate turn it into their result."""
