"""The server-side state of the app: which snapshots it knows and the reports it has analysed.

Reports stay on the server (a million-event trace is tens of megabytes of numpy columns); the
browser only ever holds an id. Both the list of uploads and the analysed reports are bounded
LRU maps, so a long-running server's memory returns to its resting level as sessions end.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import hashlib
import os
import shutil
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import memlens
from memlens.errors import MemlensError

# Analysed reports kept in memory. Each holds a snapshot's columns (~60 bytes per event), so
# 6 reports of a million events is well under a gigabyte.
DEFAULT_REPORT_CACHE = 6
# Uploaded files kept on disk (their reports can be rebuilt after eviction from the cache).
DEFAULT_MAX_UPLOADS = 32
# Analyses running at once: each briefly holds the raw pickle's Python objects (several times
# the file size), so 20 simultaneous uploads must queue rather than all unpickle together.
DEFAULT_CONCURRENT_ANALYSES = 2
SNAPSHOT_SUFFIXES = (".pickle", ".pkl", ".pickle.gz", ".pkl.gz")


@dataclass(frozen=True)
class Source:
    """A snapshot the app can open: from the command line, the bundled samples, or an upload."""

    id: str
    name: str
    path: str
    kind: str  # "cli" | "sample" | "upload"
    upload_dir: str | None = None


def _release_memory() -> None:
    """Give freed heap back to the OS so RSS follows the cache, not its high-water mark."""
    gc.collect()
    # Not glibc (no malloc_trim): the memory is still reusable by this process.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class Library:
    """Thread-safe registry of sources plus a bounded LRU cache of their reports."""

    def __init__(
        self,
        report_cache: int = DEFAULT_REPORT_CACHE,
        max_uploads: int = DEFAULT_MAX_UPLOADS,
        concurrent_analyses: int = DEFAULT_CONCURRENT_ANALYSES,
    ) -> None:
        self.report_cache = max(1, report_cache)
        self.max_uploads = max(1, max_uploads)
        self._sources: OrderedDict[str, Source] = OrderedDict()
        self._reports: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.RLock()
        self._building: dict[str, threading.Lock] = {}
        self._analysis_slots = threading.BoundedSemaphore(max(1, concurrent_analyses))
        atexit.register(self.close)

    def close(self) -> None:
        """Delete every uploaded file (called at exit): uploads never outlive the server."""
        with self._lock:
            uploads = [s for s in self._sources.values() if s.kind == "upload"]
            for source in uploads:
                del self._sources[source.id]
                self._reports.pop(source.id, None)
        for source in uploads:
            self._remove_upload_files(source)

    # ----------------------------------------------------------------- sources

    def add_path(self, path: str | os.PathLike[str], kind: str = "cli") -> Source:
        resolved = os.path.abspath(os.fspath(path))
        source_id = f"{kind[0]}-{hashlib.sha1(resolved.encode()).hexdigest()[:12]}"
        source = Source(source_id, os.path.basename(resolved), resolved, kind)
        with self._lock:
            self._sources.setdefault(source_id, source)
        return self._sources[source_id]

    def add_directory(self, directory: str | os.PathLike[str], kind: str = "sample") -> list[Source]:
        folder = Path(directory)
        if not folder.is_dir():
            return []
        files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(SNAPSHOT_SUFFIXES))
        return [self.add_path(p, kind) for p in files]

    def add_upload(self, source_id: str, name: str, path: str, upload_dir: str) -> Source:
        source = Source(source_id, name, path, "upload", upload_dir)
        evicted: list[Source] = []
        with self._lock:
            self._sources[source_id] = source
            uploads = [s for s in self._sources.values() if s.kind == "upload"]
            for old in uploads[: max(0, len(uploads) - self.max_uploads)]:
                del self._sources[old.id]
                self._reports.pop(old.id, None)
                evicted.append(old)
        for old in evicted:
            self._remove_upload_files(old)
        return source

    def forget(self, source_id: str) -> None:
        """Drop a source (an upload that failed to load: its file is deleted)."""
        with self._lock:
            source = self._sources.pop(source_id, None)
            self._reports.pop(source_id, None)
        if source is not None:
            self._remove_upload_files(source)

    def _remove_upload_files(self, source: Source) -> None:
        if source.kind == "upload" and source.upload_dir:
            shutil.rmtree(source.upload_dir, ignore_errors=True)

    def source(self, source_id: str) -> Source:
        with self._lock:
            found = self._sources.get(source_id)
        if found is None:
            raise MemlensError("this snapshot is no longer on the server (uploads are kept for a while "
                               "only): upload it again")
        return found

    def sources(self) -> list[Source]:
        with self._lock:
            return list(self._sources.values())

    # ----------------------------------------------------------------- reports

    def report(self, source_id: str) -> Any:
        """The analysed report of a source, from the cache or analysed now (one build per id)."""
        with self._lock:
            cached = self._reports.get(source_id)
            if cached is not None:
                self._reports.move_to_end(source_id)
                return cached
            build_lock = self._building.setdefault(source_id, threading.Lock())
        with build_lock:
            with self._lock:
                cached = self._reports.get(source_id)
                if cached is not None:
                    return cached
            source = self.source(source_id)
            with self._analysis_slots:
                report = analyze_file(source.path, uploaded=source.kind == "upload")
            self._store(source_id, report)
        with self._lock:
            self._building.pop(source_id, None)
        return report

    def _store(self, source_id: str, report: Any) -> None:
        evicted = False
        with self._lock:
            self._reports[source_id] = report
            self._reports.move_to_end(source_id)
            while len(self._reports) > self.report_cache:
                self._reports.popitem(last=False)
                evicted = True
        if evicted:
            _release_memory()

    def cached_ids(self) -> list[str]:
        with self._lock:
            return list(self._reports)

    def clear_reports(self) -> None:
        with self._lock:
            self._reports.clear()
        _release_memory()


def analyze_file(path: str, uploaded: bool = False) -> Any:
    """Load with the safe reader and analyse: the one place the app calls into memlens."""
    # An upload lives in a temporary folder: a cache file beside it would only cost disk.
    snapshot = memlens.load(path, cache=False if uploaded else None)
    return memlens.analyze(snapshot)
