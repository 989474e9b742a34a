"""A file's triage report, kept so that asking again costs a hash, not a scan and an analysis.

The report is what every face shows (``memlens.ops.triage``), and it is a function of a few
things only; an entry is named by the SHA-256 of all of them, so a change to any one is another
entry, never a stale answer:

* the snapshot's bytes (their SHA-256) and the name the report gives the file (``source``);
* the sidecar beside it: the SHA-256 of its bytes, or the one-line reason it cannot be read;
* the capacity asked for (the one analysis option a triage passes);
* memlens itself: the SHA-256 of every one of its modules' source and of both native extensions,
  the engine in use, numpy's version file and the Python version. An edited checkout, another
  release or the other engine never reads another's reports.

The folder, its trust rules and its MAC key are the snapshot cache's (``memlens.cache_folder``):
an entry holds an HMAC-SHA256 over its name and its report, keyed with this user's key, so that
only this user's memlens can have written it; a copied, edited or torn entry fails the MAC and
is ignored. The report is then decoded by ``Report.from_json``, which checks every field. Anything
that fails is ignored (logged at debug level) and the file analysed again: a cache never changes
an answer. An entry is written only if neither the snapshot nor its sidecar changed while it was
analysed. This module imports neither numpy nor the analysis, so a cached triage needs neither.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING

from memlens import cache_folder
from memlens.files import OpenedFile, trusted_file
from memlens.sidecar import sidecar_bytes_beside

if TYPE_CHECKING:
    from memlens.analysis.report import Report

log = cache_folder.QuietLog(__name__)

ENTRY_KIND = "r"
# A report is a few hundred KiB; an entry past this was not written by memlens.
MAX_ENTRY_BYTES = 256 << 20
MAC_BYTES = 32
# The native extensions whose code decides answers (their source is in src/native/).
_EXTENSIONS = ("memlens._native", "memlens.snapshot._kernels", "memlens._scan")


class ReportSlot:
    """The cache slot of one snapshot file's triage report, for one capacity.

    Made, it starts hashing the file on a thread of its own (through the file's descriptor, with
    ``pread``: the bytes hashed are the bytes the reader parses; hashlib releases the GIL), so
    the caller can import what it needs meanwhile. ``read`` returns the stored report if a valid
    entry exists; ``write`` stores one, unless the file or its sidecar changed since.
    """

    def __init__(self, opened: OpenedFile, capacity: int | None) -> None:
        self._opened = opened
        self._capacity = capacity
        self._sidecar_key = _sidecar_key(opened)
        self._hash = cache_folder.hash_opened(opened)  # the snapshot cache entry, if any, shares it

    @classmethod
    def for_opened(cls, opened: OpenedFile, capacity: int | None) -> ReportSlot | None:
        """The slot of a snapshot already opened and checked; ``None`` where no cache is kept
        (a system without the folder's checks, or ``MEMLENS_CACHE_MAX_BYTES=0``)."""
        if not cache_folder.SUPPORTED or cache_folder.size_limit() <= 0:
            return None
        return cls(opened, capacity)

    @functools.cached_property
    def name(self) -> str | None:
        """The entry's file name (waits for the hash); ``None`` when the file could not be hashed."""
        hashed = self._hash.result()
        if hashed is None:
            return None
        material = json.dumps(["memlens report", cache_folder.ENTRY_VERSIONS[ENTRY_KIND], code_identity(),
                               self._opened.name, hashed[0], self._sidecar_key, self._capacity])
        return cache_folder.entry_name(ENTRY_KIND, hashlib.sha256(material.encode()).hexdigest())

    def answer_expected(self) -> bool:
        """Whether a stored report is all but sure to be found: the file's digest was remembered
        (``cache_folder.remembered_digest``: nothing to hash) and an entry of that name exists. A
        triage that expects none scans the file at once, beside the hash, instead of after it."""
        if not self._hash.known or self.name is None:
            return False
        with cache_folder.keyed_folder() as keyed:
            if keyed is None:
                return False
            try:
                os.stat(self.name, dir_fd=keyed[0].fd, follow_symlinks=False)
            except OSError:
                return False
            return True

    def read_if_hashed_before(self, other_done: Callable[[], bool]) -> Report | None:
        """``read()``, if the file is hashed before ``other_done()`` turns true; else ``None`` at
        once (a first triage's scan done before the hash goes on to the analysis without
        waiting for it: the report is written, under the digest, after the answer)."""
        return self.read() if self._hash.done_before(other_done) else None

    def close(self) -> None:
        """Wait for the hashing thread (it reads the caller's descriptor, which may close next)."""
        self._hash.result()

    def read(self) -> Report | None:
        """The stored report, or ``None`` (no entry, or one that fails a check)."""
        if self.name is None:
            return None
        return cache_folder.read_signed(self.name, self._read, self._opened.name)

    def _read(self, folder: cache_folder.CacheFolder, key: bytes) -> Report:
        from memlens.analysis.report import Report

        assert self.name is not None
        fd = os.open(self.name, cache_folder.OPEN_TO_READ, dir_fd=folder.fd)
        with open(fd, "rb", buffering=0) as handle:
            st = os.fstat(fd)
            if not trusted_file(st) or not MAC_BYTES < st.st_size <= MAX_ENTRY_BYTES:
                raise ValueError("not a regular file owned by this user and private to it, of a report's size")
            data = handle.read(MAX_ENTRY_BYTES + 1)
            stored, payload = data[:MAC_BYTES], data[MAC_BYTES:]
            if not hmac.compare_digest(stored, _mac(key, self.name, payload)):
                raise ValueError("MAC mismatch (not written by this user's memlens, or edited since)")
            report = Report.from_json(payload, source=self.name)
            with contextlib.suppress(OSError):
                os.utime(fd)  # the least recently used entries are pruned first
        return report

    def write(self, report: Report) -> Path | None:
        """Store ``report`` as the answer for the hashed bytes; the entry's path, or ``None``
        when nothing was stored (a cache that cannot be written costs speed only)."""
        try:
            return self._write(report)
        except Exception as error:
            log.debug("memlens report cache: %s not cached: %s: %s", self._opened.name, type(error).__name__, error)
            return None

    def _write(self, report: Report) -> Path | None:
        name = self.name
        hashed = self._hash.result()
        if name is None or hashed is None:
            return None
        if self._opened.identity() != hashed[1] or _sidecar_key(self._opened) != self._sidecar_key:
            log.debug("memlens report cache: %s or its sidecar changed while it was read; not cached",
                      self._opened.name)
            return None
        payload = report.to_json_str(indent=None).encode()

        def signed(key: bytes) -> Callable[[IO[bytes]], int]:
            mac = _mac(key, name, payload)
            return lambda handle: handle.write(mac + payload)

        return cache_folder.write_signed(name, signed, suffix="json")


def _mac(key: bytes, name: str, payload: bytes) -> bytes:
    """HMAC-SHA256 over the entry's name (which names what it answers) and its report."""
    digest = hmac.new(key, digestmod=hashlib.sha256)
    encoded = name.encode()
    digest.update(len(encoded).to_bytes(8, "little"))
    digest.update(encoded)
    digest.update(payload)
    return digest.digest()


def _sidecar_key(opened: OpenedFile) -> str:
    """What the sidecar beside ``opened`` contributes to the answer: its bytes' SHA-256, the
    reason it cannot be read, or nothing."""
    data, problem = sidecar_bytes_beside(opened)
    if data is not None:
        return "sha256:" + hashlib.sha256(data).hexdigest()
    return "problem:" + problem if problem is not None else "none"


@functools.cache
def code_identity() -> str:
    """The SHA-256 of what decides memlens's answers here: every module's source, the native
    extensions' bytes, the engine in use, numpy's version file and the Python version (about
    5 ms; once per process)."""
    from memlens.allocator.engine import engine_name

    digest = hashlib.sha256()

    def add(label: str, data: bytes) -> None:
        encoded = label.encode()
        digest.update(len(encoded).to_bytes(8, "little") + encoded + len(data).to_bytes(8, "little"))
        digest.update(data)

    for relative, path in _sources(os.path.dirname(os.path.realpath(__file__))):
        with open(path, "rb") as source:
            add(relative, source.read())
    for module in (*_EXTENSIONS, "numpy"):
        try:
            spec = importlib.util.find_spec(module)  # finds, does not import
        except (ImportError, ValueError):
            spec = None
        origin = spec.origin if spec is not None else None
        if module == "numpy" and origin:  # its version file: the release and its git revision
            origin = os.path.join(os.path.dirname(origin), "version.py")
        add(module, Path(origin).read_bytes() if origin and os.path.isfile(origin) else b"<absent>")
    add("engine", engine_name().encode())
    add("python", sys.version.encode())
    return digest.hexdigest()


def _sources(package: str) -> list[tuple[str, str]]:
    """Every ``.py`` file under ``package``, as (its path from there with ``/``, its path), in that
    order (a walk with ``os.scandir``: ``Path.rglob`` took 4 of the 11 ms of ``code_identity``)."""
    found: list[tuple[str, str]] = []
    pending = [(package, "")]
    while pending:
        folder, prefix = pending.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    pending.append((entry.path, f"{prefix}{entry.name}/"))
                elif entry.name.endswith(".py") and entry.is_file():
                    found.append((prefix + entry.name, entry.path))
    return sorted(found)


__all__ = ["ReportSlot", "code_identity"]
