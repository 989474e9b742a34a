"""File and process facts several parts of memlens rely on, written once.

* ``write_atomic`` / ``atomic_stream``: readers see the old file or the new one, never a part of
  it (the recorder's snapshots and sidecars, the HTML export, streamed JSON-lines/CSV exports).
* ``current_umask``: the mode a new file of the user's would get (``mkstemp`` makes 0600).
* ``process_alive``: whether a temporary file's writer still runs (stale files of killed
  recorders, cache writers and dashboard servers are removed by the next one).
* ``owned_by_me`` / ``trusted_folder`` / ``trusted_file``: what may be trusted from disk (the
  snapshot cache's entries, the library ``memlens predict`` loads into the process).
* ``open_regular`` / ``open_beneath`` -> ``OpenedFile``: a file opened once and checked through its
  descriptor (a regular file, within a size), so what is read is what was checked. Opening never
  blocks (a FIFO would wait for a writer for ever) and ``open_beneath`` follows no symbolic link
  on its way down from a folder descriptor (``memlens mcp --root``).
* ``check_stdout`` / ``stdout_failure`` / ``stdout_reader_gone`` / ``discard_stdout``: the
  program's standard output written whole or failed loudly (a full disk is a one-line error and
  a non-zero exit, not a truncated report and exit 0; a reader that went away, a quiet 141).

A leaf: imports nothing from memlens.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from memlens.errors import MemlensFormatError


@contextlib.contextmanager
def atomic_stream(path: Path, temp_prefix: str | None = None, buffering: int = -1) -> Iterator[IO[bytes]]:
    """A binary handle whose bytes appear at ``path`` only when the block ends without error.

    A temporary file in the same folder (``temp_prefix``, default ``.NAME.PID.``; the recorder
    puts its host and pid there, so the next run can tell a killed writer's file), ``fsync``,
    ``os.replace``; the file gets the user's usual mode. On any exception (Ctrl-C included) the
    temporary file is removed and ``path`` is left as it was.

    Only a regular file (or nothing) is ever replaced. A symbolic link is followed: its target is
    what gets written, the link stays. A FIFO or a character device (``/dev/stdout``,
    ``/dev/null``) is written in place, as a shell's ``>`` would; anything else (a folder, a
    socket, a block device) is refused with an ``OSError`` that says so."""
    in_place = _open_in_place(path)  # by the name given: /dev/stdout resolves to no real path
    if in_place is not None:
        with os.fdopen(in_place, "wb", buffering=buffering) as handle:
            yield handle
        return
    path = _write_target(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = temp_prefix if temp_prefix is not None else f".{path.name}.{os.getpid()}."
    import tempfile  # here: its imports (shutil, random) are 8 ms that reading never needs

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


def _write_target(path: Path) -> Path:
    """Where writing ``path`` lands: the file a symbolic link (or a chain of them) points to."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def _open_in_place(path: Path) -> int | None:
    """A descriptor to write ``path`` in place when it is a FIFO or a character device; None
    when it is a regular file or nothing (written atomically); ``OSError`` for anything else."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISREG(st.st_mode):
        return None
    if not (stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode)):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file, a FIFO or a character device"
        raise OSError(errno.EEXIST, f"it is {kind}; it was not replaced")
    # Opening a FIFO to write waits for its reader, which is what writing into one means.
    fd = os.open(path, os.O_WRONLY | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    opened = os.fstat(fd)
    if not (stat.S_ISFIFO(opened.st_mode) or stat.S_ISCHR(opened.st_mode)):  # swapped meanwhile
        os.close(fd)
        raise OSError(errno.EEXIST, "it changed while it was opened; it was not replaced")
    return fd


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


# --------------------------------------------------------------------------- opening to read

# O_NONBLOCK: opening a FIFO for reading otherwise waits for a writer (for ever, if none comes);
# it is cleared again once the descriptor is known to be a regular file. O_NOCTTY: a terminal
# named as a file must not become the controlling one.
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_FOLDER_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0) | _NOFOLLOW


class FileRefused(Exception):
    """A path that names no regular file this process may read; ``reason`` says why, in a few
    words that follow the path in a message ("no such file", "a folder", ...)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class OpenedFile:
    """A regular file opened once: its descriptor, the name it was asked by (for messages and
    reports) and its ``fstat``. Everything about it is read through the descriptor, so replacing
    the path afterwards changes nothing. ``sibling`` opens a file of the same folder the same
    way (beneath the same folder descriptor when this one was opened beneath a root)."""

    def __init__(self, fd: int, name: str, folder_fd: int | None = None) -> None:
        self.fd = fd
        self.name = name
        self._folder_fd = folder_fd
        self.stat = os.fstat(fd)

    @property
    def folder_fd(self) -> int | None:
        """The descriptor of the folder it was opened beneath (siblings are opened there), if any."""
        return self._folder_fd

    @property
    def size(self) -> int:
        return self.stat.st_size

    def identity(self) -> tuple[int, ...]:
        """Which file, in which version: device, inode, size and modification times (now)."""
        st = os.fstat(self.fd)
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def reader(self) -> IO[bytes]:
        """A binary handle at the start of the file; closing it leaves this descriptor open."""
        handle = open(self.fd, "rb", closefd=False)  # noqa: SIM115 - the caller closes it
        handle.seek(0)
        return handle

    def read_bytes(self, max_bytes: int) -> bytes:
        """The whole file, refused (``FileRefused``) if it holds more than ``max_bytes``."""
        chunks = []
        offset = 0
        while offset <= max_bytes:
            chunk = os.pread(self.fd, min(1 << 20, max_bytes + 1 - offset), offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
        if offset > max_bytes:
            raise FileRefused(f"larger than {max_bytes:,} bytes")
        return b"".join(chunks)

    def sibling(self, file_name: str, max_bytes: int | None = None) -> OpenedFile:
        """``file_name`` in this file's folder, opened as this file was."""
        name = os.path.join(os.path.dirname(self.name), file_name)
        if self._folder_fd is None:
            return open_regular(name, max_bytes=max_bytes)
        return _open_file_at(self._folder_fd, file_name, name, max_bytes, keep_folder=False)

    def close(self) -> None:
        for fd in (self.fd, self._folder_fd):
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.fd, self._folder_fd = -1, None

    def __enter__(self) -> OpenedFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@contextlib.contextmanager
def opened_snapshot(path: str | os.PathLike[str] | OpenedFile) -> Iterator[OpenedFile]:
    """A snapshot file ``path`` opened once and checked (a regular file), or the caller's
    ``OpenedFile`` as it is (left open: it is the caller's). Everything after reads this
    descriptor, never the path again. A path that is no regular file: ``MemlensFormatError``."""
    if isinstance(path, OpenedFile):
        yield path
        return
    source = str(path)
    try:
        opened = open_regular(source)
    except FileRefused as refused:
        problem = {"a folder": "is a directory, not a snapshot file"}.get(refused.reason, refused.reason)
        raise MemlensFormatError(source, problem) from None
    with opened:
        yield opened


def open_regular(path: str | os.PathLike[str], *, follow_links: bool = True,
                 max_bytes: int | None = None) -> OpenedFile:
    """``path`` opened to read, if it is a regular file (of at most ``max_bytes``); else
    ``FileRefused``. Never blocks, whatever the path names."""
    try:
        fd = os.open(path, _READ_FLAGS | (0 if follow_links else _NOFOLLOW))
    except OSError as exc:
        raise FileRefused(_open_failure(exc)) from None
    return _checked(fd, os.fspath(path), max_bytes)


def open_beneath(folder_fd: int, relative: str, name: str, *, max_bytes: int | None = None) -> OpenedFile:
    """``relative`` (``a/b/run.pickle``) opened beneath the folder open as ``folder_fd``, one
    component at a time and following no symbolic link, so nothing outside that folder can be
    reached whatever is renamed meanwhile; ``name`` is how messages and reports call it."""
    parts = [part for part in relative.split("/") if part and part != "."]
    if not parts or ".." in parts:
        raise FileRefused("not a file beneath the folder")
    current = os.dup(folder_fd)
    try:
        for part in parts[:-1]:
            try:
                below = os.open(part, _FOLDER_FLAGS, dir_fd=current)
            except OSError as exc:
                raise FileRefused(_open_failure(exc, folder=True)) from None
            os.close(current)
            current = below
    except BaseException:
        os.close(current)
        raise
    return _open_file_at(current, parts[-1], name, max_bytes, keep_folder=True)


def _open_file_at(folder_fd: int, file_name: str, name: str, max_bytes: int | None, keep_folder: bool) -> OpenedFile:
    """Open ``file_name`` in ``folder_fd`` without following a link; with ``keep_folder`` the
    folder descriptor becomes the file's (for its siblings), closed with it or on failure."""
    try:
        try:
            fd = os.open(file_name, _READ_FLAGS | _NOFOLLOW, dir_fd=folder_fd)
        except OSError as exc:
            raise FileRefused(_open_failure(exc)) from None
        opened = _checked(fd, name, max_bytes, os.dup(folder_fd))
    finally:
        if keep_folder:
            os.close(folder_fd)
    return opened


def _checked(fd: int, name: str, max_bytes: int | None, folder_fd: int | None = None) -> OpenedFile:
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise FileRefused("a folder")
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused("not a regular file")
        if max_bytes is not None and st.st_size > max_bytes:
            raise FileRefused(f"larger than {max_bytes:,} bytes")
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~getattr(os, "O_NONBLOCK", 0))
        return OpenedFile(fd, name, folder_fd)
    except BaseException:
        os.close(fd)
        if folder_fd is not None:
            os.close(folder_fd)
        raise


def _open_failure(exc: OSError, folder: bool = False) -> str:
    if exc.errno == errno.ENOENT:
        return "no such file"
    if exc.errno == errno.ELOOP:
        return "a symbolic link (not followed here)"
    if exc.errno == errno.ENOTDIR:
        return "a symbolic link or a file where a folder should be" if folder else "no such file"
    if exc.errno == errno.EACCES:
        return "not readable by this process"
    return f"cannot be opened ({exc.strerror or type(exc).__name__})"


# --------------------------------------------------------------------------- standard output


class WholeWrites(io.RawIOBase):
    """A descriptor as a raw stream that writes every byte it is given or raises, and keeps the
    error (``failure``) so that it can be told from any other ``OSError``.

    Python's unbuffered standard output (``PYTHONUNBUFFERED=1``, ``-u``: common in containers
    and batch jobs) hands each write to the descriptor once and drops whatever a short write
    left: a disk that fills mid-report gave a truncated JSON file and exit 0. A reader that went
    away (``BrokenPipeError``: ``| head``) is no failure; it is noted as ``reader_gone``.
    """

    def __init__(self, fd: int, name: str) -> None:
        super().__init__()
        self._fd = fd
        self.name = name
        self.failure: OSError | None = None
        self.reader_gone = False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return os.isatty(self._fd)

    def write(self, data: object) -> int:
        view = memoryview(data).cast("B")  # type: ignore[arg-type]
        done = 0
        while done < len(view):
            try:
                done += os.write(self._fd, view[done:])
            except BrokenPipeError:
                self.reader_gone = True
                raise
            except OSError as exc:
                self.failure = exc
                raise
        return done


_checked_stdout: WholeWrites | None = None


def check_stdout() -> None:
    """Put ``sys.stdout`` over a ``WholeWrites`` of descriptor 1, as buffered as it was (line
    buffering, encoding and errors kept). Only for the program's own standard output (not a
    test's capture), and only once."""
    global _checked_stdout
    stream = sys.stdout
    if _checked_stdout is not None or stream is not sys.__stdout__ or not isinstance(stream, io.TextIOWrapper):
        return
    try:
        fd = stream.fileno()
        unbuffered = isinstance(stream.buffer, io.FileIO)
        stream.flush()
    except (AttributeError, OSError, ValueError):  # not a real descriptor: leave it as it is
        return
    raw = WholeWrites(fd, getattr(stream, "name", "<stdout>"))
    binary: io.RawIOBase | io.BufferedWriter = raw if unbuffered else io.BufferedWriter(raw)
    sys.stdout = io.TextIOWrapper(binary, encoding=stream.encoding, errors=stream.errors,
                                  line_buffering=stream.line_buffering, write_through=unbuffered)
    _checked_stdout = raw


def stdout_failure(exc: BaseException) -> OSError | None:
    """The error that kept standard output from being written, when ``exc`` is it (or was raised
    while it was); None for any other exception."""
    failure = _checked_stdout.failure if _checked_stdout is not None else None
    if failure is None or not isinstance(exc, OSError):
        return None
    return failure if exc is failure or exc.errno == failure.errno else None


def stdout_reader_gone(exc: BaseException) -> bool:
    """Whether ``exc`` is standard output's reader having gone away (``memlens triage | head``)."""
    return isinstance(exc, BrokenPipeError) and _checked_stdout is not None and _checked_stdout.reader_gone


def discard_stdout() -> None:
    """Point descriptor 1 at /dev/null: what is still buffered for a disk that is full is lost
    either way, and the interpreter's last flush must not fail again ("Exception ignored")."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)


# What a shell reports for a writer killed by SIGPIPE (128 + 13): how a command ends, quietly,
# when the reader of its output went away (``| head``), as ``memlens export`` always has.
EXIT_READER_GONE = 141


def cannot_write_stdout(failure: OSError) -> str:
    """The one line a failed standard output is reported with (as ``memlens export`` says it)."""
    return f"cannot write standard output: {failure.strerror or type(failure).__name__}"
