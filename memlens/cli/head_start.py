"""A head start for the commands that read one big snapshot (``triage``, ``whatif``).

Before such a command reads its file it either looks it up in the cache, keyed by the file's
SHA-256 (40-60 ms for a 70 MB file), or scans it (300 ms for a 1M-entry one). Both run without
the GIL, and both could start at once but for the 100 ms of importing click, numpy and the
command's modules. ``start`` runs first, before those imports, and begins the hash or the scan
on another thread (both, for a file whose digest the cache does not remember: a first triage);
the command then takes the file opened here (``snapshot_source``) instead of
opening it again, and the cache or the reader takes what was begun on it.

``start`` reads the raw command line, before click has parsed it, so it guesses: the one token
after the command's name that names a regular file starting as a snapshot does. A wrong guess (an
option's value that is such a file) costs work on the other core and is never taken, so it never
changes what the command reads or answers; when there is any doubt (two candidates), nothing is
started and the command reads its file itself, as it always could.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memlens.files import OpenedFile

# The modules that open, hash and scan a file are imported only for the commands below: every
# other command (``memlens --help``, ``record``, ``serve``) starts without them.

# The commands that hash their snapshot before reading it, and whether each has --cache/--no-cache.
HASHED_COMMANDS = {"triage": True, "whatif": False}
# The commands whose next step is reading the snapshot's cached columns (triage reads its cached
# report first, which a hit answers without them): read on the hashing thread once it has hashed.
READS_COLUMNS_AHEAD = frozenset(("whatif",))

# The file opened by ``start``, by the token that named it (at most one), until a command takes it.
_started: dict[str, OpenedFile] = {}


def start(args: Sequence[str]) -> None:
    """Begin reading the snapshot that ``args`` (the command line after the program's name) gives
    to ``triage`` or ``whatif``, if exactly one token can be it: hashing it when the cache will
    look it up, else scanning it (``memlens.snapshot.ahead``). Never fails: anything
    unexpected leaves the command to open and read its file itself."""
    command = command_word(args)
    if command not in HASHED_COMMANDS:
        return
    from memlens.cache_folder import caches, hash_opened
    from memlens.errors import MemlensError
    from memlens.files import FileRefused
    from memlens.snapshot import ahead

    with contextlib.suppress(OSError, MemlensError, FileRefused):
        candidate = _candidate([arg for arg in args if not arg.startswith("-")], args)
        if candidate is None:
            return
        token, opened, asked = candidate
        if caches(opened.size, asked):
            # Waited for by whoever takes the file; one not taken is waited for by ``finish``.
            hashed = hash_opened(opened, read_ahead=command in READS_COLUMNS_AHEAD)
            if not hashed.known and command not in READS_COLUMNS_AHEAD:
                # A file whose digest is not remembered is most likely new to the cache (a first
                # triage): its scan begins now too, beside the hash, not once the hash has missed.
                ahead.start_scan(opened)
        elif not ahead.start_scan(opened):
            opened.close()
            return
        _started[token] = opened


def command_word(args: Sequence[str]) -> str | None:
    """The command ``args`` name: their first word that is not an option (the group's own
    options, ``--debug`` and ``--version``, take no value)."""
    return next((arg for arg in args if not arg.startswith("-")), None)


def _candidate(words: list[str], args: Sequence[str]) -> tuple[str, OpenedFile, bool | None] | None:
    """The one word after a hashed command's name (``words``: ``args`` but the options) that
    names a regular file starting as a snapshot does (a pickle or a gzip), opened, with what
    ``--cache/--no-cache`` asked."""
    from memlens.files import FileRefused, open_regular
    from memlens.snapshot.formats import GZIP_MAGIC, looks_like_pickle

    asked: bool | None = None
    if HASHED_COMMANDS[words[0]]:
        flags = [arg for arg in args if arg in ("--cache", "--no-cache")]
        asked = flags[-1] == "--cache" if flags else None  # the last one given wins, as in click
    found: list[tuple[str, OpenedFile]] = []
    for token in dict.fromkeys(words[1:]):
        try:
            opened = open_regular(token)
        except FileRefused:
            continue
        head = os.pread(opened.fd, 4, 0)
        if looks_like_pickle(head) or head.startswith(GZIP_MAGIC):
            found.append((token, opened))
        else:
            opened.close()
    if len(found) == 1:
        return (*found[0], asked)
    for _, opened in found:
        opened.close()
    return None


def finish() -> None:
    """Let go of what ``start`` began and no command took (a guess that was no snapshot, a command
    that stopped before its file): scans stopped, hashes waited for, files closed. The program
    calls it before the interpreter shuts down, which a thread still in the scanner would not
    survive."""
    while _started:
        _, opened = _started.popitem()
        _let_go(opened)


def _let_go(opened: OpenedFile) -> None:
    from memlens.cache_folder import entry_read_ahead, hash_started
    from memlens.snapshot import ahead

    # The hashing or scanning thread reads the descriptor: let it finish first.
    ahead.wait(opened)
    hashed = hash_started(opened)
    if hashed is not None:
        hashed.result()
    entry_read_ahead(opened)  # a cached copy read ahead and not taken goes now, not at exit
    opened.close()


@contextlib.contextmanager
def snapshot_source(path: str) -> Iterator[str | OpenedFile]:
    """The file ``start`` opened for ``path``, its hash or scan running (closed when the block
    ends, once that is done), or ``path`` itself when it opened none."""
    opened = _started.pop(path, None)
    if opened is None:
        yield path
        return
    try:
        yield opened
    finally:
        _let_go(opened)
