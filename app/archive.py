"""A ``.zip`` of a run folder, uploaded: which of its entries to unpack, and unpacking them safely.

An archive is untrusted input like any upload, so before anything is written it is read as a
table of contents and refused whole, in one line, when it holds more than ``MAX_ENTRIES``
entries, an entry whose name climbs out of the folder (``../``, an absolute path, a drive), one
that is not a regular file (a link, a device: the Unix mode the zip records), an encrypted one, or
when what it declares it inflates to is over the upload limit (a compressed upload counts
against ``--max-upload`` by what it inflates to, as a gzip does) or an entry inflates beyond
``GZIP_MAX_RATIO`` times its compressed size (real snapshots compress 4-36x). Unpacking counts
the bytes actually inflated, so an entry that lies about its size is cut off at its declared size.

Only snapshots and sidecars are unpacked; whatever else a run folder holds (logs, lock files,
macOS resource forks) is listed as skipped.
"""

from __future__ import annotations

import stat
import zipfile
from dataclasses import dataclass

from memlens.errors import MemlensError, one_line
from memlens.snapshot.reader import GZIP_MAX_RATIO, GZIP_MIN_LIMIT
from memlens.units import format_bytes
from memlens_app.sidecars import is_sidecar_name

MAX_ENTRIES = 1_000
MAX_FOLDER_DEPTH = 8
SNAPSHOT_SUFFIXES = (".pickle", ".pkl", ".pickle.gz", ".pkl.gz")
CHUNK_BYTES = 1 << 20
_ZIP_UNIX = 3  # ZipInfo.create_system of an archive made on Unix: external_attr holds st_mode
_ENCRYPTED = 0x1


class ArchiveRefused(MemlensError):
    """A zip the dashboard will not unpack; the message says why in one line."""


@dataclass(frozen=True)
class ArchiveEntry:
    """One entry to unpack: its folder inside the archive, its file name, and what it is."""

    folder: str
    name: str
    kind: str  # "snapshot" | "sidecar"
    info: zipfile.ZipInfo


def entry_kind(name: str) -> str | None:
    """What an entry's file name says it is; None for anything else (skipped)."""
    if name.startswith("."):  # a recorder's lock or temporary file, a macOS resource fork
        return None
    if is_sidecar_name(name):
        return "sidecar"
    if name.lower().endswith(SNAPSHOT_SUFFIXES):
        return "snapshot"
    return None


def _parts(archive_name: str, raw: str) -> list[str]:
    """The folders and file name of an entry, refused if it climbs out of the archive's folder."""
    name = raw.replace("\\", "/")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if name.startswith("/") or ".." in parts or (parts and ":" in parts[0]) or "\x00" in name:
        raise ArchiveRefused(one_line(f"{archive_name}: entry {raw!r} points outside the archive's folder; "
                                      "refused"))
    return parts


def run_folder_entries(archive: zipfile.ZipFile, archive_name: str, max_bytes: int
                       ) -> tuple[list[ArchiveEntry], list[str]]:
    """The snapshots and sidecars of ``archive`` to unpack, and the names of the entries skipped;
    ``ArchiveRefused`` for an archive not to unpack at all (see the module docstring)."""
    infos = archive.infolist()
    if len(infos) > MAX_ENTRIES:
        raise ArchiveRefused(f"{archive_name}: {len(infos):,} entries, more than a run folder's "
                             f"{MAX_ENTRIES:,} accepted here")
    entries: list[ArchiveEntry] = []
    skipped: list[str] = []
    total = 0
    for info in infos:
        parts = _parts(archive_name, info.filename)
        if info.is_dir() or not parts:
            continue
        mode = info.external_attr >> 16
        # No file type at all (Python's writestr) is a plain file; a link or a device says so.
        if info.create_system == _ZIP_UNIX and stat.S_IFMT(mode) and not stat.S_ISREG(mode):
            raise ArchiveRefused(one_line(f"{archive_name}: entry {info.filename!r} is not a regular file "
                                          "(a link or a device); refused"))
        if info.flag_bits & _ENCRYPTED:
            raise ArchiveRefused(one_line(f"{archive_name}: entry {info.filename!r} is encrypted; refused"))
        kind = entry_kind(parts[-1])
        if kind is None or "__MACOSX" in parts[:-1] or len(parts) - 1 > MAX_FOLDER_DEPTH:
            skipped.append("/".join(parts))
            continue
        total += info.file_size
        if total > max_bytes:
            raise ArchiveRefused(f"{archive_name} inflates to more than {format_bytes(max_bytes)}, this "
                                 "server's upload limit; open the run from the command line (memlens serve "
                                 "FILE) or raise --max-upload")
        if info.file_size > max(GZIP_MIN_LIMIT, GZIP_MAX_RATIO * info.compress_size):
            raise ArchiveRefused(one_line(f"{archive_name}: entry {info.filename!r} inflates "
                                          f"{info.file_size / max(info.compress_size, 1):,.0f} times its size "
                                          f"(more than {GZIP_MAX_RATIO}x: no snapshot compresses so well); "
                                          "refused"))
        entries.append(ArchiveEntry("/".join(parts[:-1]), parts[-1], kind, info))
    return entries, skipped


def unpack(archive: zipfile.ZipFile, entry: ArchiveEntry, path: str) -> int:
    """Inflate ``entry`` into a new file at ``path``; the bytes written. An entry that inflates
    past its declared size is refused (``ArchiveRefused``) and its file removed by the caller."""
    written = 0
    limit = entry.info.file_size
    with archive.open(entry.info) as source, open(path, "xb") as target:
        while True:
            chunk = source.read(CHUNK_BYTES)
            if not chunk:
                break
            written += len(chunk)
            if written > limit:
                raise ArchiveRefused(one_line(f"entry {entry.info.filename!r} inflates past the size it "
                                              "declares; refused"))
            target.write(chunk)
    return written
