"""How the recorder writes its files: atomically, under a name reserved for the run.

Files are written atomically: a temporary name in the same directory, ``fsync``, then
``os.replace``. A crash (or an OOM kill) mid-write leaves the previous file or none, never a
0-byte or half-written pickle. Snapshots use pickle protocol 4, which PyTorch's web viewer reads.

Names are reserved: a run holds an exclusive ``flock`` on ``.NAME.pickle.reserved`` from its
start to its last write, so two runs started at once into one folder never pick the same name
(the second sees the lock, or the first's finished file, and takes ``NAME-2.pickle``). The kernel
drops the lock when its process dies, however it dies. Temporary files are named
``.NAME.pickle.HOST.PID.XXXXXXXX.tmp``; ``remove_stale_files`` deletes those whose process (on this
host) is gone and reservation files nobody holds: what a ``kill -9`` leaves behind.

The sidecar, ``<name>.memlens.json`` next to ``<name>.pickle``, is built and encoded by
``memlens.sidecar.writer``; ``write_sidecar`` writes it here, as atomically as the snapshot.

Rolling snapshots (``dump_every``): each periodic dump is its own file in the ``rolling`` folder
beside the snapshot, ``rolling/<name>.step000050.pickle`` (the step is the last one completed, six
digits or more; a folder of their own, so that ``rank*.pickle`` still lists one file per rank)
with its sidecar ``rolling/<name>.step000050.memlens.json``, written sidecar first, then the
snapshot: whoever sees the
snapshot (``memlens triage --follow``, ``memlens serve --follow``) finds its sidecar there. The
run's own name, ``<name>.pickle``, is then pointed at the newest one (a hard link put in place by
``os.replace``; a copy where the file system has no links), so a run killed between dumps still
leaves its last snapshot under the name its final dump would have. Only the newest ``keep`` of a
name's rolling files stay (``prune_rolling``). ``<name>`` carries the rank and the run suffix
(``rolling/rank1.step000050.pickle``, ``rolling/snapshot-2.step000050.pickle``), so ranks and runs sharing one
folder never replace or prune each other's files.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickle
import re
import secrets
import socket
from pathlib import Path
from typing import Any

from memlens import files
from memlens.sidecar import Sidecar
from memlens.sidecar.writer import encode_sidecar, sidecar_path

PICKLE_PROTOCOL = 4  # protocol 5 (the default) is not readable by the pytorch.org viewer


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a part;
    the temporary file names this host and process, for ``remove_stale_files``."""
    files.write_atomic(path, data, temp_prefix=f".{path.name}.{_host_tag()}.{os.getpid()}.")


def _host_tag() -> str:
    """This host's name as it appears in temporary file names (no dots, no odd characters)."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


RESERVATION_SUFFIX = ".reserved"


def reservation_path(path: Path) -> Path:
    return path.with_name(f".{path.name}{RESERVATION_SUFFIX}")


class Reservation:
    """A claim on one snapshot name, held until ``release`` (or until the process dies)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        """Give the name up: its snapshot, if any, is written and stands for itself from now on."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(reservation_path(self.path))
        os.close(self._fd)  # closing drops the lock
        self._fd = None


def reserve(path: Path) -> Reservation | None:
    """Claim ``path`` for this run: None when another run holds it or its files exist already.

    The lock is taken on ``.NAME.reserved`` (never on the snapshot itself, which stays absent
    until its first complete write). Raises ``OSError`` when the folder cannot be written.
    """
    marker = reservation_path(path)
    while True:
        fd = os.open(marker, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None  # a running recorder has this name
        except BaseException:
            os.close(fd)
            raise
        if not _still_named(fd, marker):
            os.close(fd)  # its holder released (unlinked) it between our open and our lock: again
            continue
        if path.exists() or sidecar_path(path).exists() or rolling_paths(path):
            os.unlink(marker)
            os.close(fd)
            return None  # an earlier run's files
        os.ftruncate(fd, 0)
        os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
        return Reservation(path, fd)


def _still_named(fd: int, marker: Path) -> bool:
    try:
        return os.stat(marker).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


_TEMP_NAME = re.compile(r"^\..+\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.[A-Za-z0-9_]+\.tmp$")


def remove_stale_files(directory: Path) -> list[Path]:
    """Delete what killed recorders left in ``directory``; returns what was removed.

    A temporary file goes when its writer, a process of this host, no longer exists (a writer
    on another host sharing the folder cannot be checked and is left alone). A reservation goes
    when nobody holds its lock.
    """
    removed: list[Path] = []
    host = _host_tag()
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    if ROLLING_FOLDER in names and (directory / ROLLING_FOLDER).is_dir():
        removed += remove_stale_files(directory / ROLLING_FOLDER)  # a killed periodic dump's
    for name in names:
        candidate = directory / name
        temp = _TEMP_NAME.match(name)
        if temp is not None and temp["host"] == host and not files.process_alive(int(temp["pid"])):
            with contextlib.suppress(FileNotFoundError):
                candidate.unlink()
                removed.append(candidate)
        elif name.startswith(".") and name.endswith(RESERVATION_SUFFIX) and _unheld(candidate):
            removed.append(candidate)
    return removed


def _unheld(marker: Path) -> bool:
    """Remove ``marker`` if no process holds its lock; True if it was removed."""
    try:
        fd = os.open(marker, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if not _still_named(fd, marker):
            return False
        os.unlink(marker)
        return True
    except OSError:
        return False  # held by a running recorder
    finally:
        os.close(fd)


def write_snapshot(path: Path, snapshot: dict[str, Any]) -> None:
    write_atomic(path, pickle.dumps(snapshot, protocol=PICKLE_PROTOCOL))


def write_json(path: Path, payload: dict[str, Any]) -> None:
    write_atomic(path, (json.dumps(payload, indent=2, sort_keys=True) + "\n").encode())


def write_sidecar(path: Path, sidecar: Sidecar) -> None:
    write_atomic(path, encode_sidecar(sidecar))


# ----------------------------------------------------------------------------- rolling snapshots
STEP_DIGITS = 6  # zero-padded, so that a folder listed by name lists a run's dumps in step order
ROLLING_FOLDER = "rolling"
ROLLING_NAME = re.compile(r"^(?P<series>[^.].*?)\.step(?P<step>\d{6,})\.pickle$")


def rolling_path(path: Path, step: int) -> Path:
    """The periodic dump after ``step`` of the run whose snapshot is ``path`` (``<name>.pickle``):
    ``rolling/<name>.step000050.pickle`` beside it (the folder is made by whoever writes it)."""
    return path.parent / ROLLING_FOLDER / f"{path.stem}.step{step:0{STEP_DIGITS}d}.pickle"


def rolling_paths(path: Path) -> list[Path]:
    """The rolling snapshots of ``path``'s name in its ``rolling`` folder, by step (oldest first)."""
    folder = path.parent / ROLLING_FOLDER
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found: list[tuple[int, Path]] = []
    for name in names:
        match = ROLLING_NAME.match(name)
        if match is not None and match["series"] == path.stem:
            found.append((int(match["step"]), folder / name))
    return [rolled for _, rolled in sorted(found)]


def publish_rolled(rolled: Path, path: Path) -> None:
    """Point ``path`` (and its sidecar) at the rolling snapshot ``rolled``, each replaced whole:
    a hard link where the file system has them (no bytes copied), else a copy. The sidecar goes
    first, as for every snapshot: a reader that finds the new snapshot finds its sidecar."""
    for source, target in ((sidecar_path(rolled), sidecar_path(path)), (rolled, path)):
        if not _link_atomic(source, target):
            write_atomic(target, source.read_bytes())


def _link_atomic(source: Path, target: Path) -> bool:
    """Replace ``target`` by a hard link to ``source``; False where it cannot be (no links on
    this file system, or ``target`` is not a plain file: a symbolic link, a FIFO)."""
    if target.is_symlink() or (target.exists() and not target.is_file()):
        return False
    temp = target.with_name(f".{target.name}.{_host_tag()}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        os.link(source, temp)
    except OSError:
        return False
    try:
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    return True


def prune_rolling(path: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` rolling snapshots of ``path``'s name (each snapshot
    before its sidecar, so no reader finds a snapshot without one); returns the snapshots removed.
    A reader that has one open goes on reading it: an open file outlives its name."""
    removed = rolling_paths(path)[:-keep] if keep > 0 else rolling_paths(path)
    for rolled in removed:
        for each in (rolled, sidecar_path(rolled)):
            with contextlib.suppress(FileNotFoundError):
                each.unlink()
    return removed


__all__ = [
    "PICKLE_PROTOCOL",
    "ROLLING_FOLDER",
    "ROLLING_NAME",
    "Reservation",
    "prune_rolling",
    "publish_rolled",
    "remove_stale_files",
    "reservation_path",
    "reserve",
    "rolling_path",
    "rolling_paths",
    "write_atomic",
    "write_json",
    "write_sidecar",
    "write_snapshot",
]
