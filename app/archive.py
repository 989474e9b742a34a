"""A ``.zip`` of a run folder, uploaded: which of its entries to unpack, and unpacking them safely.

An archive is untrusted input like any upload, so before anything is written it is read as a
table of contents and refused whole, in one line. First its end-of-central-directory record (the
last 22 bytes to 64 KiB of the file, or its zip64 form) is read on its own (``open_archive``): an
archive that declares more than ``MAX_ENTRIES`` entries, or a central directory larger than those
entries can need, is refused before Python's ``zipfile`` reads and parses the directory (500,000
listed entries took it 6-11 s and 170 MiB). Then the table is refused when it holds an entry
whose name climbs out of the folder (``../``, an absolute path, a drive), one that is not a
regular file (a link, a device: the Unix mode the zip records), an encrypted one, entries whose
data overlap (one deflated member listed a hundred times inflates a hundred times), or when what
it declares it inflates to is over the upload limit (a compressed upload counts against
``--max-upload`` by what it inflates to, as a gzip does), or beyond ``GZIP_MAX_RATIO`` times the
archive's size (the gzip upload's bound, applied to the whole archive and to each entry: real
snapshots compress 4-36x). Unpacking counts the bytes actually inflated, so an entry that lies
about its size is cut off at its declared size.

Only snapshots and sidecars are unpacked; whatever else a run folder holds (logs, lock files,
macOS resource forks) is listed as skipped.
"""

from __future__ import annotations

import os
import stat
import struct
import zipfile
from dataclasses import dataclass
from typing import IO

from memlens.errors import MemlensError, one_line
from memlens.snapshot.reader import GZIP_MAX_RATIO, GZIP_MIN_LIMIT
from memlens.units import format_bytes
from memlens_app.sidecars import is_sidecar_name

MAX_ENTRIES = 1_000
# A central directory record is 46 bytes, the entry's path and its extra fields (zip64 sizes,
# timestamps: tens of bytes); a run folder's paths are far shorter than this per entry.
CENTRAL_RECORD_MAX_BYTES = 1024
MAX_FOLDER_DEPTH = 8
SNAPSHOT_SUFFIXES = (".pickle", ".pkl", ".pickle.gz", ".pkl.gz")
CHUNK_BYTES = 1 << 20
_ZIP_UNIX = 3  # ZipInfo.create_system of an archive made on Unix: external_attr holds st_mode
_ENCRYPTED = 0x1
# The zip format's records (APPNOTE 4.3): the end of central directory (22 bytes, then a comment
# of at most 64 KiB), the zip64 locator just before it and the zip64 record before that, and
# each entry's local header (30 bytes, then its name and extra field, then its data).
_END = struct.Struct("<4s4H2LH")
_END_SIGNATURE = b"PK\x05\x06"
_MAX_COMMENT = 0xFFFF
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_LOCATOR_SIGNATURE = b"PK\x06\x07"
_ZIP64_END = struct.Struct("<4sQ2H2L4Q")
_ZIP64_END_SIGNATURE = b"PK\x06\x06"
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")
_LOCAL_HEADER_SIGNATURE = b"PK\x03\x04"


class ArchiveRefused(MemlensError):
    """A zip the dashboard will not unpack; the message says why in one line."""


@dataclass(frozen=True)
class ArchiveEntry:
    """One entry to unpack: its folder inside the archive, its file name, and what it is."""

    folder: str
    name: str
    kind: str  # "snapshot" | "sidecar"
    info: zipfile.ZipInfo


@dataclass(frozen=True)
class CentralDirectory:
    """What an archive's end-of-central-directory record declares of its central directory."""

    entries: int
    size: int


def declared_directory(handle: IO[bytes]) -> CentralDirectory | None:
    """The entry count and central directory size that ``zipfile`` will believe, read from the end
    of the file as it reads them (the record with no comment at the very end, else the last
    signature in the last 64 KiB; the zip64 record when a locator precedes it); None when there is
    no such record (``zipfile`` then says it is not a zip)."""
    end = handle.seek(0, os.SEEK_END)
    start = max(0, end - _END.size - _MAX_COMMENT)
    handle.seek(start)
    tail = handle.read(end - start)
    at = len(tail) - _END.size
    if at < 0 or tail[at:at + 4] != _END_SIGNATURE or tail[-2:] != b"\0\0":
        at = tail.rfind(_END_SIGNATURE)
        if at < 0 or len(tail) - at < _END.size:
            return None
    _, _, _, _, entries, size, _, _ = _END.unpack_from(tail, at)
    locator = at - _ZIP64_LOCATOR.size
    if locator < 0 or tail[locator:locator + 4] != _ZIP64_LOCATOR_SIGNATURE:
        return CentralDirectory(entries, size)
    record = locator - _ZIP64_END.size
    if record < 0 or tail[record:record + 4] != _ZIP64_END_SIGNATURE:
        return CentralDirectory(entries, size)
    fields = _ZIP64_END.unpack_from(tail, record)
    return CentralDirectory(fields[7], fields[8])


def open_archive(path: str, archive_name: str) -> zipfile.ZipFile:
    """The zip at ``path``, opened only once its end record declares no more entries, and no larger
    a central directory, than a run folder's (``ArchiveRefused`` otherwise, before ``zipfile``
    reads a byte of the directory: it reads and parses all of it, whatever it holds)."""
    with open(path, "rb") as handle:
        declared = declared_directory(handle)
    if declared is not None:
        if declared.entries > MAX_ENTRIES:
            raise ArchiveRefused(_too_many_entries(archive_name, declared.entries))
        if declared.size > MAX_ENTRIES * CENTRAL_RECORD_MAX_BYTES:
            raise ArchiveRefused(f"{archive_name}: a central directory of {format_bytes(declared.size)}, more "
                                 f"than a run folder's {MAX_ENTRIES:,} entries need; refused")
    return zipfile.ZipFile(path)


def _too_many_entries(archive_name: str, count: int) -> str:
    return f"{archive_name}: {count:,} entries, more than a run folder's {MAX_ENTRIES:,} accepted here"


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
        raise ArchiveRefused(_too_many_entries(archive_name, len(infos)))
    _refuse_shared_data(archive, archive_name, infos)
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
    archive_bytes = _archive_bytes(archive)
    if total > max(GZIP_MIN_LIMIT, GZIP_MAX_RATIO * archive_bytes):
        raise ArchiveRefused(f"{archive_name} inflates to {format_bytes(total)}, {total / max(archive_bytes, 1):,.0f} "
                             f"times its size (more than {GZIP_MAX_RATIO}x: no run folder compresses so well); "
                             "refused")
    return entries, skipped


def _archive_bytes(archive: zipfile.ZipFile) -> int:
    """The size of the archive's file (where the central directory ends)."""
    handle = archive.fp
    if handle is None:
        raise ValueError("the archive is closed")
    return handle.seek(0, os.SEEK_END)


def _refuse_shared_data(archive: zipfile.ZipFile, archive_name: str, infos: list[zipfile.ZipInfo]) -> None:
    """``ArchiveRefused`` when two entries' local headers and data overlap, or one runs into the
    central directory: a real archive stores each entry once, in its own stretch of the file."""
    handle = archive.fp
    if handle is None:
        raise ValueError("the archive is closed")
    directory_start = archive.start_dir  # where ZipFile found the central directory
    previous_end, previous_name = 0, ""
    for info in sorted(infos, key=lambda i: i.header_offset):
        handle.seek(info.header_offset)
        header = handle.read(_LOCAL_HEADER.size)
        if len(header) < _LOCAL_HEADER.size or header[:4] != _LOCAL_HEADER_SIGNATURE:
            raise ArchiveRefused(one_line(f"{archive_name}: entry {info.filename!r} has no local header where the "
                                          "directory says; not a readable zip archive"))
        fields = _LOCAL_HEADER.unpack(header)
        end = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10] + info.compress_size
        if info.header_offset < previous_end or end > directory_start:
            other = repr(previous_name) if info.header_offset < previous_end else "the central directory"
            raise ArchiveRefused(one_line(f"{archive_name}: entry {info.filename!r} shares its data with {other}; "
                                          "refused"))
        previous_end, previous_name = end, info.filename


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
