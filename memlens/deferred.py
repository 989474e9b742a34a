"""Work that can wait until the answer is out: the cache entries a first triage writes.

A user's first ``memlens triage`` of a large file is the run that writes its caches (the columnar
copy of the snapshot and the report): 0.45 s on a 1M-entry file, and nothing of the answer depends
on them. Inside ``holding(held)`` such work is appended to ``held``, and its owner runs it
(``run_all``) after the face has printed and flushed the answer: ``memlens.ops.triage``'s pending
triage does, when it is closed. Outside one it runs at once, as before. Held work that fails costs
speed only, as a cache write that fails at once does.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

_held: contextvars.ContextVar[list[Callable[[], object]] | None] = contextvars.ContextVar(
    "memlens_held_writes", default=None)


@contextlib.contextmanager
def holding(held: list[Callable[[], object]]) -> Iterator[None]:
    """Within the block, ``after_answer`` work is appended to ``held`` for its owner to run
    (``run_all``) once the answer is out."""
    token = _held.set(held)
    try:
        yield
    finally:
        _held.reset(token)


def after_answer(work: Callable[[], object]) -> None:
    """Run ``work`` once the answer is out: by the owner of the enclosing ``holding`` block, or
    now when there is none."""
    held = _held.get()
    if held is None:
        work()
    else:
        held.append(work)


def run_all(held: list[Callable[[], object]]) -> None:
    """Each held piece of work, in order; one that fails does not keep the others from running."""
    while held:
        work = held.pop(0)
        try:
            work()
        except Exception as error:  # a cache that cannot be written costs speed only
            log.debug("memlens: held work %r failed: %s", work, error)


__all__ = ["after_answer", "holding", "run_all"]
