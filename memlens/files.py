"""File and process facts several parts of memlens rely on, written once.

* ``write_atomic`` / ``atomic_stream``: readers see the old file or the new one, never a part of
  it (the recorder's snapshots and sidecars, the HTML export, streamed JSON-lines/CSV exports).
* ``current_umask``: the mode a new file of the user's would get (``mkstemp`` makes 0600).
* ``process_alive``: whether a temporary file's writer still runs (stale files of killed
  recorders, cache writers and dashboard servers are removed by the next one).
* ``owned_by_me`` / ``trusted_folder`` / ``trusted_file``: what may be trusted from disk (the
  snapshot cache's entries, the library ``memlens predict`` loads into the process).

A leaf: imports nothing from memlens.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


@contextlib.contextmanager
def atomic_stream(path: Path, temp_prefix: str | None = None, buffering: int = -1) -> Iterator[IO[bytes]]:
    """A binary handle whose bytes appear at ``path`` only when the block ends without error.

    A temporary file in the same folder (``temp_prefix``, default ``.NAME.PID.``; the recorder
    puts its host and pid there, so the next run can tell a killed writer's file), ``fsync``,
    ``os.replace``; the file gets the user's usual mode. On any exception (Ctrl-C included) the
    temporary file is removed and ``path`` is left as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = temp_prefix if temp_prefix is not None else f".{path.name}.{os.getpid()}."
    fd, temp_name = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp makes 0600; these files are the user's to share
        with os.fdopen(fd, "wb", buffering=buffering) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp_name)
        raise
    _fsync_directory(path.parent)


def write_atomic(path: Path, data: bytes, temp_prefix: str | None = None) -> None:
    """Write ``data`` to ``path`` whole or not at all (``atomic_stream`` with one write)."""
    with atomic_stream(path, temp_prefix) as handle:
        handle.write(data)


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # not every platform can open a directory
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (``os.umask`` can only
    set it, which races with other threads creating files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def process_alive(pid: int) -> bool:
    """True while process ``pid`` of this host exists (also when it is not ours to signal)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, but is not ours to signal
    return True


def owned_by_me(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid()


def trusted_folder(st: os.stat_result) -> bool:
    """A folder only this user (and root) can add, rename or remove files in."""
    return stat.S_ISDIR(st.st_mode) and owned_by_me(st) and not st.st_mode & 0o022


def trusted_file(st: os.stat_result, forbidden_bits: int = 0o022) -> bool:
    """A regular file of this user's that nobody else can write (``forbidden_bits`` may add more)."""
    return stat.S_ISREG(st.st_mode) and owned_by_me(st) and not st.st_mode & forbidden_bits
