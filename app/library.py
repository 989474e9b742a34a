"""The server-side state of the app: which snapshots it knows and the reports it has analysed.

Reports stay on the server (a million-event trace is tens of megabytes of numpy columns); the
browser only ever holds an id. Analysed reports are an LRU map bounded in count and in bytes
(``Analysis.held_bytes``), so a long-running
server's memory returns to its resting level as sessions end. Uploaded files live in one
private folder per server (``memlens-upload-<pid>-*``, mode 0700) that is deleted when the
server stops; within it, analysed uploads are evicted once they exceed a byte budget (those
the page has already shown first, least recently used first), and an upload is never evicted
before its first analysis has finished.
Every analysis runs in a child process with time and memory limits (``memlens_app.worker``),
when its browser session's turn comes (``memlens_app.scheduler``).

Uploads belong to the browser session that made them (``memlens_app.session``): every lookup by
id names the session asking, and another session's upload is answered as if it did not exist.
Files named on the command line and the samples belong to nobody and are seen by everyone.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import hashlib
import logging
import os
import re
import secrets
import shutil
import tempfile
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from time import monotonic
from typing import Any

from memlens.errors import MemlensError
from memlens.files import process_alive
from memlens.units import GiB
from memlens_app.progress import Progress, ProgressBoard
from memlens_app.scheduler import DEFAULT_PER_ADDRESS, DEFAULT_WAIT_S, AddressBusy, FairQueue, QueueState, ServerBusy
from memlens_app.session import SERVER_SESSION, current_address
from memlens_app.sidecars import expected_sidecar, paired_path
from memlens_app.worker import (
    AnalysisLimits,
    AnalysisStopped,
    WhatIfAnswer,
    WorkerGroup,
    analyse_in_worker,
    check_sidecars_in_worker,
    whatif_in_worker,
)

log = logging.getLogger("memlens.app")

# Analysed reports kept in memory: at most this many, and together at most
# DEFAULT_REPORT_CACHE_BYTES as ``analysis_bytes`` estimates them (a report holds its snapshot's
# columns, ~60 bytes per event: a 1.9 MB gzip of 4.36 M tiny events is a 270 MB report, and six
# of them held 1.6 GB). The most recent report is kept whatever its size (the page is showing it).
DEFAULT_REPORT_CACHE = 6
DEFAULT_REPORT_CACHE_BYTES = 1 * GiB
UNKNOWN_REPORT_BYTES = 1 << 20  # what the worker sent is not an Analysis (tests' stand-ins)
# Bytes of analysed uploads kept on disk (their reports can be rebuilt after eviction from the
# cache); the least recently used go first once the total is over it.
DEFAULT_UPLOAD_BUDGET = 4 * GiB
# Analyses running at once: each holds the raw pickle's Python objects (several times the file
# size), so 50 simultaneous uploads must queue rather than all unpickle together.
DEFAULT_CONCURRENT_ANALYSES = 2
# Sidecars a session may have waiting for their snapshot (each at most SIDECAR_MAX_BYTES), and
# all sessions together (a client without a cookie is a new session each time): past that, the
# oldest waiting is deleted, as when they are over the upload budget.
MAX_PENDING_SIDECARS = 16
MAX_PENDING_SIDECARS_IN_ALL = 1024
# Uploads streaming in or being analysed at once: from one network address (a client that drops
# its cookie is a new session with every upload; the queue's share per address), and in all
# (each holds a server thread and a file growing on disk).
DEFAULT_UPLOADS_PER_ADDRESS = DEFAULT_PER_ADDRESS
DEFAULT_MAX_UPLOADS = 32
# A browser session the server has heard nothing from for this long has gone (the page sends a
# request with every click, and an upload in flight counts as heard from): the sidecars it left
# waiting for their snapshots are deleted then.
SESSION_IDLE_S = 30 * 60.0
SNAPSHOT_SUFFIXES = (".pickle", ".pkl", ".pickle.gz", ".pkl.gz")
UPLOAD_DIR_PREFIX = "memlens-upload-"
_UPLOAD_DIR_PATTERN = re.compile(re.escape(UPLOAD_DIR_PREFIX) + r"(\d+)-")


@dataclass(frozen=True)
class Source:
    """A snapshot the app can open: from the command line, the bundled samples, or an upload."""

    id: str
    name: str
    path: str
    kind: str  # "cli" | "sample" | "upload"
    bytes: int = 0
    owner: str | None = None  # the browser session of an upload; None: seen by everyone
    # The folder an upload came from (a dropped folder's, or inside a .zip), cleaned for its label.
    folder: str = ""
    # That folder as the page or the archive named it (never shown, never a path): a sidecar pairs
    # with the snapshot of its own folder only, which the cleaned names cannot tell ("run a" and
    # "run_a" both clean to "run_a"). None: ``folder``.
    origin_folder: str | None = None

    @property
    def label(self) -> str:
        """The name shown for the source: an upload's folder and name."""
        return f"{self.folder}/{self.name}" if self.folder else self.name

    def visible_to(self, session: str | None) -> bool:
        return self.owner is None or self.owner == session

    @property
    def pairing_folder(self) -> str:
        return self.folder if self.origin_folder is None else self.origin_folder


@dataclass(frozen=True)
class PendingSidecar:
    """An uploaded sidecar waiting for its snapshot: its spooled file and size."""

    path: str
    bytes: int


def analysis_bytes(analysis: Any) -> int:
    """The memory a cached analysis holds, as ``Analysis.held_bytes`` estimates it."""
    held = getattr(analysis, "held_bytes", None)
    return int(held()) if callable(held) else UNKNOWN_REPORT_BYTES


def _release_memory() -> None:
    """Give freed heap back to the OS so RSS follows the cache, not its high-water mark."""
    gc.collect()
    # Not glibc (no malloc_trim): the memory is still reusable by this process.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def remove_stale_upload_dirs(root: str | None = None) -> list[str]:
    """Delete upload folders left by memlens servers that were killed (their pid is gone)."""
    root = root or tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            match = _UPLOAD_DIR_PATTERN.match(entry.name)
            if not match or not entry.is_dir(follow_symlinks=False):
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                    continue
            pid = int(match.group(1))
            if not process_alive(pid):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
    return removed


class Library:
    """Thread-safe registry of sources plus a bounded LRU cache of their reports."""

    def __init__(
        self,
        report_cache: int = DEFAULT_REPORT_CACHE,
        upload_budget_bytes: int = DEFAULT_UPLOAD_BUDGET,
        report_cache_bytes: int = DEFAULT_REPORT_CACHE_BYTES,
        concurrent_analyses: int = DEFAULT_CONCURRENT_ANALYSES,
        limits: AnalysisLimits | None = None,
        queue: FairQueue | None = None,
        max_upload_bytes: int | None = None,
        uploads_per_address: int = DEFAULT_UPLOADS_PER_ADDRESS,
        max_uploads: int = DEFAULT_MAX_UPLOADS,
    ) -> None:
        self.report_cache = max(1, report_cache)
        self.report_cache_bytes = max(1, report_cache_bytes)
        self.upload_budget_bytes = max(1, upload_budget_bytes)
        self.limits = limits or AnalysisLimits()
        # An upload's limit also bounds what a compressed upload inflates to.
        self.max_upload_bytes = max_upload_bytes
        self._sources: OrderedDict[str, Source] = OrderedDict()
        self._reports: OrderedDict[str, Any] = OrderedDict()
        self._report_bytes: dict[str, int] = {}  # analysis_bytes of each cached report
        self._lock = threading.RLock()
        self._building: dict[str, threading.Lock] = {}
        # The workers' turns, shared fairly by the browser sessions.
        self.queue = queue or FairQueue(concurrent_analyses, wait_s=DEFAULT_WAIT_S)
        self._uploading: Counter[str] = Counter()  # uploads in flight, by session
        self._uploading_from: Counter[str] = Counter()  # ... by network address
        self.uploads_per_address = max(1, uploads_per_address)
        self.max_uploads = max(1, max_uploads)
        self._workers = WorkerGroup()
        # Uploads in least-recently-used order; those not yet analysed once, or being
        # analysed now, are never evicted (their file is still needed).
        self._upload_lru: OrderedDict[str, None] = OrderedDict()
        self._unanalysed: set[str] = set()
        self._unshown: set[str] = set()  # analysed by the upload, not yet asked for by the page
        self._busy: Counter[str] = Counter()
        # Uploaded sidecars: those paired (snapshot id -> the sidecar's name, and its bytes, which
        # count in the upload budget with the snapshot's), and those waiting for their snapshot
        # ((session, origin folder, sidecar name) -> the spooled file, oldest first), which count
        # in the budget too and go when their session goes quiet (``SESSION_IDLE_S``).
        self._paired: dict[str, str] = {}
        self._paired_bytes: dict[str, int] = {}
        self._pending_sidecars: OrderedDict[tuple[str, str, str], PendingSidecar] = OrderedDict()
        # When each session with a sidecar waiting was last heard from.
        self._heard_from: dict[str, float] = {}
        # Bumped when an upload's sidecar arrives: an analysis begun before is not cached.
        self._generation: Counter[str] = Counter()
        self._upload_dir: str | None = None
        self._closed = False
        # How far each analysis has got (the page's progress bar).
        self._progress = ProgressBoard()
        # The sources ``point`` moves from file to file (a followed folder's): their file and its token.
        self._pointed: dict[str, tuple[str, object]] = {}
        atexit.register(self.close)

    def close(self) -> None:
        """Stop running analyses and delete every uploaded file: uploads never outlive the server."""
        with self._lock:
            self._closed = True
            for source_id in list(self._upload_lru):
                self._sources.pop(source_id, None)
                self._drop_report(source_id)
            self._upload_lru.clear()
            self._unanalysed.clear()
            self._unshown.clear()
            self._paired.clear()
            self._paired_bytes.clear()
            self._pending_sidecars.clear()
            self._heard_from.clear()
            upload_dir, self._upload_dir = self._upload_dir, None
        self._workers.kill_all()
        if upload_dir is not None:
            shutil.rmtree(upload_dir, ignore_errors=True)

    @property
    def upload_dir(self) -> str | None:
        """This server's private upload folder (created by the first upload)."""
        return self._upload_dir

    # ----------------------------------------------------------------- sources

    def add_path(self, path: str | os.PathLike[str], kind: str = "cli") -> Source:
        resolved = os.path.abspath(os.fspath(path))
        source_id = f"{kind[0]}-{hashlib.sha1(resolved.encode()).hexdigest()[:12]}"
        source = Source(source_id, os.path.basename(resolved), resolved, kind)
        with self._lock:
            self._sources.setdefault(source_id, source)
        return self._sources[source_id]

    def point(self, source_id: str, name: str, path: str | os.PathLike[str], token: object, *, kind: str = "follow",
              folder: str = "") -> bool:
        """Point the public source ``source_id`` at ``path``: a followed folder's newest snapshot of
        one name, whose file changes as the run writes (``memlens_app.follow``). ``token`` tells one
        file from the next under one path (its size and time). A new file drops the previous one's
        report, and an analysis of it still running is not cached; True when it changed."""
        resolved = os.path.abspath(os.fspath(path))
        with self._lock:
            if self._pointed.get(source_id) == (resolved, token):
                return False
            self._pointed[source_id] = (resolved, token)
            self._sources[source_id] = Source(source_id, name, resolved, kind, folder=folder)
            self._drop_report(source_id)
            self._generation[source_id] += 1
        return True

    def add_directory(self, directory: str | os.PathLike[str], kind: str = "sample") -> list[Source]:
        folder = Path(directory)
        if not folder.is_dir():
            return []
        files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(SNAPSHOT_SUFFIXES))
        return [self.add_path(p, kind) for p in files]

    @contextlib.contextmanager
    def upload_turn(self, session: str, address: str = "") -> Iterator[None]:
        """Hold one of ``session``'s places while its upload streams in and is analysed: a session
        has at most as many uploads in flight as it may have analyses queued, and so has a network
        ``address`` as many as ``uploads_per_address`` whatever sessions it claims (``AddressBusy``),
        and the server ``max_uploads`` in all (``ServerBusy``)."""
        with self._lock:
            if self._uploading[session] >= self.queue.per_session:
                raise ServerBusy(f"busy: you already have {self._uploading[session]} uploads in progress "
                                 f"(at most {self.queue.per_session} at once); try again when they are done")
            if address and self._uploading_from[address] >= self.uploads_per_address:
                raise AddressBusy(f"busy: your network address already has {self._uploading_from[address]} "
                                  f"uploads in progress (at most {self.uploads_per_address} at once); try "
                                  "again when they are done")
            in_flight = sum(self._uploading.values())
            if in_flight >= self.max_uploads:
                raise ServerBusy(f"the server is busy ({in_flight} uploads in progress): try again in a moment")
            self._uploading[session] += 1
            self._uploading_from[address] += 1
            self._hear_from(session)
        try:
            yield
        finally:
            with self._lock:
                for counter, key in ((self._uploading, session), (self._uploading_from, address)):
                    counter[key] -= 1
                    if counter[key] <= 0:
                        del counter[key]
                self._hear_from(session)

    def session_seen(self, session: str) -> None:
        """A request from ``session`` came (its waiting sidecars wait on); sidecars of sessions
        not heard from for ``SESSION_IDLE_S`` are deleted now."""
        with self._lock:
            self._hear_from(session)
            expired = self._expire_quiet_sessions(monotonic())
        for path in expired:
            _remove_file(path)

    def _hear_from(self, session: str) -> None:
        """Note ``session`` as active, if it has sidecars waiting (caller holds the lock): only
        those sessions are remembered, so a flood of cookie-less requests costs nothing here."""
        if session in self._heard_from:
            self._heard_from[session] = monotonic()

    def _expire_quiet_sessions(self, now: float) -> list[str]:
        """Forget the waiting sidecars of sessions quiet for ``SESSION_IDLE_S`` (or with an upload
        in flight: never quiet); the files to delete (caller holds the lock)."""
        quiet = {s for s, heard in self._heard_from.items()
                 if now - heard > SESSION_IDLE_S and not self._uploading[s]}
        if not quiet:
            return []
        expired = [key for key in self._pending_sidecars if key[0] in quiet]
        for session in quiet:
            del self._heard_from[session]
        return [self._pending_sidecars.pop(key).path for key in expired]

    def pending_sidecar_bytes(self) -> int:
        """What the sidecars waiting for their snapshots hold on disk."""
        with self._lock:
            return sum(p.bytes for p in self._pending_sidecars.values())

    def check_sidecars(self, sidecars: list[tuple[str, str]], session: str) -> list[str | None]:
        """For each uploaded sidecar ``(path, name)``: None when it can be used, else why not in
        one line. Read in an analysis worker, in ``session``'s turn and under the analyses' limits
        (a 16 MiB sidecar of empty objects took the server itself 6.7 s and 500 MiB to parse)."""
        if not sidecars:
            return []
        names = ", ".join(name for _, name in sidecars[:3]) + (", ..." if len(sidecars) > 3 else "")
        try:
            with self.queue.turn(session, f"the check of {names}", current_address()):
                problems: list[str | None] = check_sidecars_in_worker(sidecars, limits=self.limits,
                                                                      workers=self._workers)
        except AnalysisStopped as exc:
            return [f"{name}: {exc}" for _, name in sidecars]
        return problems

    def queue_state(self, session: str) -> QueueState:
        return self.queue.state(session)

    def new_upload_file(self, name: str) -> tuple[str, str]:
        """A fresh, unguessable upload id and the path to spool its body to, inside this server's folder."""
        source_id = f"u-{secrets.token_urlsafe(18)}"
        with self._lock:
            if self._closed:
                raise MemlensError("the server is shutting down: upload again once it is back")
            if self._upload_dir is None:
                remove_stale_upload_dirs()
                self._upload_dir = tempfile.mkdtemp(prefix=f"{UPLOAD_DIR_PREFIX}{os.getpid()}-")
            # The id keeps names unique; the user's name stays readable in the folder.
            return source_id, os.path.join(self._upload_dir, f"{source_id}-{name}")

    def add_upload(self, source_id: str, name: str, path: str, size: int, owner: str, folder: str = "",
                   origin_folder: str | None = None) -> Source:
        """Register a spooled upload of session ``owner``; kept at least until its first analysis is over.

        A sidecar of the same session and folder (``origin_folder``, the folder as it was named;
        None: ``folder``) already waiting for it is paired with it now."""
        source = Source(source_id, name, path, "upload", size, owner, folder, origin_folder)
        with self._lock:
            if self._closed:
                _remove_file(path)
                raise MemlensError("the server is shutting down: upload again once it is back")
            self._sources[source_id] = source
            self._upload_lru[source_id] = None
            self._unanalysed.add(source_id)
            self._unshown.add(source_id)
            waiting = self._pending_sidecars.pop((owner, source.pairing_folder, expected_sidecar(name)), None)
            if waiting is not None:
                os.replace(waiting.path, paired_path(path))
                self._paired[source_id] = expected_sidecar(name)
                self._paired_bytes[source_id] = waiting.bytes
                self._forget_quiet_check(owner)
        return source

    def add_sidecar(self, name: str, path: str, owner: str, folder: str = "",
                    origin_folder: str | None = None) -> Source | None:
        """Pair the sidecar spooled at ``path`` with ``owner``'s newest upload of its snapshot in
        the same folder (``origin_folder``, as it was named; None: ``folder``; the loader's
        pairing: ``run.memlens.json`` with ``run.pickle``), replacing a sidecar it had: that
        upload's analysis is then redone. None: no such upload yet; the sidecar waits for it (at
        most ``MAX_PENDING_SIDECARS`` per session, counted in the upload budget, deleted when its
        session goes quiet)."""
        pairing_folder = folder if origin_folder is None else origin_folder
        size = _file_bytes(path)
        with self._lock:
            if self._closed:
                _remove_file(path)
                raise MemlensError("the server is shutting down: upload again once it is back")
            for source in reversed(self._sources.values()):
                if (source.kind == "upload" and source.owner == owner and source.pairing_folder == pairing_folder
                        and expected_sidecar(source.name) == name):
                    os.replace(path, paired_path(source.path))
                    self._paired[source.id] = name
                    self._paired_bytes[source.id] = size
                    self._generation[source.id] += 1
                    self._drop_report(source.id)
                    self._unanalysed.add(source.id)
                    return source
            key = (owner, pairing_folder, name)
            replaced = self._pending_sidecars.pop(key, None)
            if replaced is None and sum(1 for k in self._pending_sidecars if k[0] == owner) >= MAX_PENDING_SIDECARS:
                _remove_file(path)
                raise MemlensError(f"{name}: {MAX_PENDING_SIDECARS} sidecars are already waiting for their "
                                   "snapshots; upload the snapshots first")
            self._pending_sidecars[key] = PendingSidecar(path, size)
            self._heard_from[owner] = monotonic()
        if replaced is not None:
            _remove_file(replaced.path)
        self._evict_uploads()
        return None

    def _forget_quiet_check(self, session: str) -> None:
        """Stop watching ``session`` for quiet once it has no sidecar waiting (caller holds the lock)."""
        if not any(key[0] == session for key in self._pending_sidecars):
            self._heard_from.pop(session, None)

    def detach_sidecar(self, source_id: str) -> str | None:
        """Unpair (and delete) the uploaded sidecar of ``source_id``, whose analysis with it failed:
        the snapshot is analysed again without it. The sidecar's name, or None if it had none."""
        with self._lock:
            name = self._paired.pop(source_id, None)
            source = self._sources.get(source_id)
            if name is None or source is None:
                return None
            self._paired_bytes.pop(source_id, None)
            self._generation[source_id] += 1
            self._drop_report(source_id)
            self._unanalysed.add(source_id)
        _remove_file(paired_path(source.path))
        return name

    def sidecar_of(self, source_id: str) -> str | None:
        """The name of the uploaded sidecar paired with upload ``source_id``, if any."""
        with self._lock:
            return self._paired.get(source_id)

    def forget(self, source_id: str) -> None:
        """Drop a source (an upload that failed to load: its file is deleted)."""
        with self._lock:
            source = self._sources.pop(source_id, None)
            self._drop_report(source_id)
            self._upload_lru.pop(source_id, None)
            self._unanalysed.discard(source_id)
            self._unshown.discard(source_id)
            self._paired.pop(source_id, None)
            self._paired_bytes.pop(source_id, None)
        self._progress.forget(source_id)
        if source is not None and source.kind == "upload":
            _remove_upload_files(source)

    def upload_bytes(self) -> int:
        """What the uploads hold on disk, as the budget counts it: the snapshots, their paired
        sidecars and the sidecars waiting for theirs."""
        with self._lock:
            return self._upload_bytes()

    def _upload_bytes(self) -> int:
        return (sum(self._sources[i].bytes for i in self._upload_lru) + sum(self._paired_bytes.values())
                + sum(p.bytes for p in self._pending_sidecars.values()))

    def _evict_uploads(self) -> None:
        """Delete uploads until the rest fit the byte budget: sidecars still waiting for their
        snapshots first, oldest first, then the analysed uploads the page has shown, least
        recently used first, then those it has not shown yet. Uploads not yet analysed, or being
        analysed, stay whatever the total."""
        evicted: list[Source] = []
        dropped_sidecars: list[str] = []
        with self._lock:
            total = self._upload_bytes()
            while self._pending_sidecars and (total > self.upload_budget_bytes
                                              or len(self._pending_sidecars) > MAX_PENDING_SIDECARS_IN_ALL):
                (owner, _, _), pending = self._pending_sidecars.popitem(last=False)
                self._forget_quiet_check(owner)
                total -= pending.bytes
                dropped_sidecars.append(pending.path)
            evictable = [i for i in self._upload_lru if i not in self._unanalysed and not self._busy[i]]
            shown_first = sorted(evictable, key=lambda i: i in self._unshown)  # stable: LRU within each
            for source_id in shown_first:
                if total <= self.upload_budget_bytes:
                    break
                source = self._sources.pop(source_id)
                del self._upload_lru[source_id]
                self._drop_report(source_id)
                self._progress.forget(source_id)
                self._unshown.discard(source_id)
                self._paired.pop(source_id, None)
                total -= source.bytes + self._paired_bytes.pop(source_id, 0)
                evicted.append(source)
        for path in dropped_sidecars:
            _remove_file(path)
        for source in evicted:
            _remove_upload_files(source)

    def source(self, source_id: str, session: str | None = None) -> Source:
        """The source ``source_id`` as ``session`` may see it (None: the public files only)."""
        with self._lock:
            found = self._sources.get(source_id)
        if found is None or not found.visible_to(session):
            # Another session's upload reads exactly like one that is gone: ids reveal nothing.
            raise MemlensError("this snapshot is no longer on the server (uploads are kept for a while "
                               "only): upload it again")
        return found

    def sources(self, session: str | None = None) -> list[Source]:
        """The files ``session`` may open: the public ones and its own uploads (None: public only)."""
        with self._lock:
            return [s for s in self._sources.values() if s.visible_to(session)]

    # ----------------------------------------------------------------- reports

    def analysis(self, source_id: str, session: str | None = None, *, showing: bool = True) -> Any:
        """The analysis (report and snapshot) of a source ``session`` may see, from the cache or
        analysed now in ``session``'s turn (one build per id).

        ``showing=False``: the upload route's own first analysis, not the page asking to show it.
        """
        self.source(source_id, session)  # another session's upload is not there for this one
        with self._lock:
            if showing:
                self._unshown.discard(source_id)
            cached = self._cached(source_id)
            if cached is not None:
                return cached
            build_lock = self._building.setdefault(source_id, threading.Lock())
        try:
            with build_lock:
                with self._lock:
                    cached = self._cached(source_id)
                    if cached is not None:
                        return cached
                    source = self.source(source_id, session)
                    self._busy[source_id] += 1
                    generation = self._generation[source_id]
                self._progress.queued(source_id)
                try:
                    with (self.queue.turn(session or SERVER_SESSION, f"the analysis of {source.name}",
                                          current_address()),
                          self._progress.running(source_id) as progress_path):
                        uploaded = source.kind == "upload"
                        report = analyse_in_worker(source.path, uploaded=uploaded, limits=self.limits,
                                                   workers=self._workers,
                                                   max_content_bytes=self.max_upload_bytes if uploaded else None,
                                                   progress_path=progress_path)
                except AnalysisStopped as exc:
                    self._progress.finished(source_id, f"{source.name}: {exc}")
                    raise AnalysisStopped(f"{source.name}: {exc}") from None
                except Exception as exc:
                    self._progress.finished(source_id, _one_line(exc, source))
                    raise
                finally:
                    with self._lock:
                        self._busy[source_id] -= 1
                        if self._busy[source_id] <= 0:
                            del self._busy[source_id]
                self._store(source_id, report, generation)
                self._progress.finished(source_id)
        finally:
            with self._lock:
                self._building.pop(source_id, None)
        self._evict_uploads()
        return report

    def progress(self, source_id: str, session: str | None = None) -> Progress | None:
        """How far the analysis of a source ``session`` may see has got (``memlens_app.progress``):
        done once its report is cached; None when no analysis of it was asked for yet."""
        self.source(source_id, session)
        with self._lock:
            if source_id in self._reports:
                return Progress("done", 1.0)
        return self._progress.state(source_id)

    def whatif(self, source_id: str, session: str | None, device: int, capacity: int | None, extra: int,
               abandoned: Callable[[], bool] | None = None) -> WhatIfAnswer:
        """The what-if replays of ``device`` (``memlens_app.worker.whatif_in_worker``), in the
        analysis workers, in ``session``'s turn and under the analyses' limits."""
        analysis = self.analysis(source_id, session)
        source = self.source(source_id, session)
        try:
            with self.queue.turn(session or SERVER_SESSION, "the simulation", current_address()):
                return whatif_in_worker(analysis.snapshot, device, capacity, extra, limits=self.limits,
                                        workers=self._workers, abandoned=abandoned)
        except AnalysisStopped as exc:
            raise type(exc)(f"{source.name}: {exc}") from None

    def _cached(self, source_id: str) -> Any:
        """The cached report, marked as just used (caller holds the lock)."""
        cached = self._reports.get(source_id)
        if cached is not None:
            self._reports.move_to_end(source_id)
        if source_id in self._upload_lru:
            self._upload_lru.move_to_end(source_id)
        return cached

    def _drop_report(self, source_id: str) -> None:
        """Forget a cached report (caller holds the lock)."""
        self._reports.pop(source_id, None)
        self._report_bytes.pop(source_id, None)

    def cached_bytes(self) -> int:
        """What the cached reports hold, as ``analysis_bytes`` estimates it."""
        with self._lock:
            return sum(self._report_bytes.values())

    def _store(self, source_id: str, report: Any, generation: int = 0) -> None:
        evicted = False
        size = analysis_bytes(report)
        with self._lock:
            if source_id not in self._sources:  # forgotten (or the server closed) meanwhile
                return
            if self._generation[source_id] != generation:  # its sidecar came meanwhile: not this report
                return
            self._unanalysed.discard(source_id)
            self._reports[source_id] = report
            self._report_bytes[source_id] = size
            self._reports.move_to_end(source_id)
            # Oldest first, by count and by bytes; the newest stays, whatever its size.
            while len(self._reports) > 1 and (len(self._reports) > self.report_cache
                                              or sum(self._report_bytes.values()) > self.report_cache_bytes):
                oldest, _ = self._reports.popitem(last=False)
                self._report_bytes.pop(oldest, None)
                evicted = True
        if evicted:
            _release_memory()

    def cached_ids(self) -> list[str]:
        with self._lock:
            return list(self._reports)

    def clear_reports(self) -> None:
        with self._lock:
            self._reports.clear()
            self._report_bytes.clear()
        _release_memory()


def _one_line(error: Exception, source: Source) -> str:
    """What the page's progress bar says of a failed analysis: the error's line, or (a bug) that
    memlens failed, never a traceback."""
    if isinstance(error, MemlensError):
        return str(error).replace(source.path, source.name).splitlines()[0] if str(error) else source.name
    return f"{source.name}: memlens failed to analyse this file (an internal error; see the server log)"


def _file_bytes(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _remove_upload_files(source: Source) -> None:
    """An upload's file and the sidecar paired with it."""
    _remove_file(source.path)
    _remove_file(paired_path(source.path))
