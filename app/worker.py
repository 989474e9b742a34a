"""Analyse one snapshot in a separate process that can be stopped: the app's only door to memlens.

A hostile or simply enormous file can keep the unpickler busy in C code for ever (a hash bomb
holds the GIL, so in-process it froze every request and even ignored SIGTERM) or swallow the
machine's memory. Each analysis therefore runs in a child process forked from a
``forkserver`` (memlens and numpy are imported there once, so a child starts in milliseconds
and inherits none of the server's threads or sockets). The child caps its own address space
(``RLIMIT_AS``); the server waits for the answer on a pipe with a wall-clock deadline and kills
the child when the deadline passes. The server's threads only wait on a pipe meanwhile, so
every other request is answered.

What comes back is the ``Analysis`` (the report with its snapshot's numpy columns), pickled through
the pipe: on a 1,000,000-event file that is ~76 MiB and well under a tenth of a second each way,
next to ~2 s of analysis, so a plainer copy of the report would save little.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import resource
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from memlens.errors import MemlensError
from memlens.units import GiB, format_bytes

log = logging.getLogger("memlens.app")

DEFAULT_ANALYSIS_TIMEOUT_S = 120.0
# Modules the forkserver imports once, so that each forked child starts with them loaded.
# memlens.cli.main too: a child re-runs the ``memlens`` console script (as __mp_main__), which
# imports it.
_PRELOAD = ["memlens", "memlens.analysis", "memlens.snapshot.reader", "memlens.cli.main", "memlens_app.worker",
            "memlens.allocator"]  # the what-if job's simulator
_PR_SET_PDEATHSIG = 1
# How long a killed child may take to be reaped before we stop waiting for it.
_REAP_S = 10.0


def default_memory_limit() -> int:
    """Half the machine's physical memory, at least 1 GiB: an analysis needs ~6x its file's size."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 * GiB
    return max(GiB, total // 2)


@dataclass(frozen=True)
class AnalysisLimits:
    """What one analysis may use before it is stopped: wall-clock seconds and address space."""

    timeout_s: float = DEFAULT_ANALYSIS_TIMEOUT_S
    memory_bytes: int | None = None  # None: default_memory_limit()

    def memory_limit(self) -> int:
        return self.memory_bytes if self.memory_bytes is not None else default_memory_limit()


class AnalysisStopped(MemlensError):
    """The analysis went past a limit and its process was stopped (the file, not a bug)."""


class JobAbandoned(AnalysisStopped):
    """The job was stopped because whoever asked for it has gone (its page closed the connection)."""


class AnalysisCrashed(Exception):
    """The analysis process failed for a reason that is memlens' fault (logged with its traceback)."""


class WorkerGroup:
    """The live analysis processes of one library, so that shutdown kills them instead of waiting."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[Any] = set()
        self._closed = False

    def add(self, process: Any) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._live.add(process)
            return True

    def discard(self, process: Any) -> None:
        with self._lock:
            self._live.discard(process)

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    def kill_all(self) -> None:
        with self._lock:
            self._closed = True
            live = list(self._live)
        for process in live:
            _kill(process)


_context_lock = threading.Lock()
_context: Any = None


def _forkserver() -> Any:
    global _context
    with _context_lock:
        if _context is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(_PRELOAD)
            _context = context
        return _context


def analyse_in_worker(path: str, *, uploaded: bool, limits: AnalysisLimits, workers: WorkerGroup) -> Any:
    """Load and analyse ``path`` in a child process under ``limits``; the ``Analysis`` it built.

    Raises ``MemlensError`` for a file memlens cannot read (the reader's own message),
    ``AnalysisStopped`` when a limit was hit, ``AnalysisCrashed`` for a bug in memlens.
    """
    return run_job_in_worker(analyze_file, (path, uploaded), limits=limits, workers=workers)


@dataclass(frozen=True)
class WhatIfAnswer:
    """The what-if replays, as plain dicts: the recorded run, it with expandable segments, and it
    on a device with more memory (None when the capacity is unknown)."""

    recorded: dict[str, Any]
    expandable: dict[str, Any]
    more_memory: dict[str, Any] | None
    notes: tuple[str, ...]


def whatif_in_worker(snapshot: Any, device: int, capacity: int | None, extra: int, *, limits: AnalysisLimits,
                     workers: WorkerGroup, abandoned: Callable[[], bool] | None = None) -> WhatIfAnswer:
    """Replay ``device`` of ``snapshot`` through the allocator simulator in a child process, under
    the same limits as an analysis (a replay is as long as the trace, and a crafted trace can
    make the simulator slow): with expandable segments, and with ``extra`` more bytes than
    ``capacity`` when it is known. Stopped early when ``abandoned()`` turns true (the page that
    asked has gone)."""
    return run_job_in_worker(whatif_job, (snapshot, device, capacity, extra), limits=limits, workers=workers,
                             abandoned=abandoned, what="simulation")


def whatif_job(snapshot: Any, device: int, capacity: int | None, extra: int) -> WhatIfAnswer:
    """What the what-if child runs."""
    from memlens.allocator import AllocatorSettings, whatif

    recorded_settings = AllocatorSettings.from_snapshot_dict(snapshot.allocator_settings)
    expandable = whatif(snapshot, AllocatorSettings(expandable_segments=True), capacity=capacity, device=device)
    more = None
    if capacity:
        more = whatif(snapshot, recorded_settings, capacity=capacity + extra, device=device).simulated
    return WhatIfAnswer(dict(expandable.recorded), dict(expandable.simulated), more, tuple(expandable.notes))


# How often a waiting job checks whether whoever asked for it is still there.
_ABANDON_POLL_S = 0.5


def run_job_in_worker(job: Callable[..., Any], job_args: tuple[Any, ...], *, limits: AnalysisLimits,
                      workers: WorkerGroup, abandoned: Callable[[], bool] | None = None,
                      what: str = "analysis") -> Any:
    """``job(*job_args)`` (a module-level function) in a limited child process; what it returned.

    Errors as for ``analyse_in_worker``; ``AnalysisStopped`` also when ``abandoned()`` turns true.
    """
    context = _forkserver()
    receiver, sender = context.Pipe(duplex=False)
    memory = limits.memory_limit()
    process = context.Process(target=_child_main, args=(sender, job, job_args, memory, limits.timeout_s),
                              name=f"memlens-{what}", daemon=True)
    try:
        if not workers.add(process):
            raise AnalysisStopped(f"{what} stopped: the server is shutting down")
        process.start()
        sender.close()  # the child holds the only writer: EOF on the pipe means it is gone
        if not _wait_for_answer(receiver, limits.timeout_s, abandoned):
            if abandoned is not None and abandoned():
                raise JobAbandoned(f"{what} stopped: the page that asked for it has gone")
            raise AnalysisStopped(f"{what} stopped: took over {_seconds(limits.timeout_s)}")
        try:
            outcome, detail = receiver.recv()
        except (EOFError, OSError):
            outcome, detail = "died", None
    finally:
        _kill(process)
        workers.discard(process)
        receiver.close()
        sender.close()
    if outcome == "ok":
        return detail
    if outcome == "error":
        raise MemlensError(detail)
    if outcome == "memory":
        raise AnalysisStopped(f"{what} stopped: needed over {format_bytes(memory)}")
    if outcome == "died":
        code = process.exitcode
        if workers.closed:
            raise AnalysisStopped(f"{what} stopped: the server is shutting down")
        if code == -signal.SIGXCPU:  # the CPU-time backstop, reached before our deadline
            raise AnalysisStopped(f"{what} stopped: took over {_seconds(limits.timeout_s)}")
        if code == -signal.SIGKILL:  # not ours (those are handled above): the OOM killer
            raise AnalysisStopped(f"{what} stopped: the {what} process was killed (out of memory?)")
        raise AnalysisCrashed(f"the {what} process exited with code {code}")
    raise AnalysisCrashed(str(detail))


def _wait_for_answer(receiver: Connection, timeout_s: float, abandoned: Callable[[], bool] | None) -> bool:
    """Whether the child answered (or died) within ``timeout_s``; False early once abandoned."""
    if abandoned is None:
        return bool(receiver.poll(timeout_s))
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if receiver.poll(min(left, _ABANDON_POLL_S)):
            return True
        if abandoned():
            return False


def _seconds(value: float) -> str:
    return f"{value:g} s"


def _kill(process: Any) -> None:
    """Stop a child for certain (SIGKILL: a hash bomb never returns to run a SIGTERM handler)."""
    if process.pid is None:  # never started
        return
    if process.exitcode is None:
        process.kill()
    process.join(_REAP_S)


def analyze_file(path: str, uploaded: bool = False) -> Any:
    """Load with the safe reader and analyse (what each child runs)."""
    import memlens

    # An upload lives in a temporary folder: a cache file beside it would only cost disk.
    snapshot = memlens.load(path, cache=False if uploaded else None)
    from memlens.analysis import analyze_snapshot

    return analyze_snapshot(snapshot)


def _caused_by_memory_error(exc: BaseException) -> bool:
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, MemoryError):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


def _die_with_parent() -> None:
    """prctl(PR_SET_PDEATHSIG, SIGKILL) where Linux offers it; elsewhere the CPU limit remains."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _child_main(sender: Connection, job: Callable[..., Any], job_args: tuple[Any, ...], memory_bytes: int,
                timeout_s: float) -> None:
    """Runs in the child: cap the address space, run the job, send back one (outcome, detail) pair."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    # Backstops for a server that dies without killing us (SIGKILL, OOM killer): the kernel
    # kills this child when the forkserver exits (it does when the server goes), and when its
    # CPU time passes twice the wall-clock limit (a single thread cannot reach that in time).
    cpu_s = int(2 * timeout_s) + 10
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 5))
    _die_with_parent()
    # Ctrl-C in the terminal reaches the whole process group; the server decides what stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        message: tuple[str, Any] = ("ok", job(*job_args))
    except MemoryError:
        message = ("memory", None)
    except MemlensError as exc:
        # The reader turns a MemoryError into its own "too large" message; under our cap the
        # cap is the reason, and the user should hear which limit stopped the file.
        message = ("memory", None) if _caused_by_memory_error(exc) else ("error", str(exc))
    except Exception:
        message = ("crash", traceback.format_exc())
    try:
        sender.send(message)
    except MemoryError:  # pickling the report is one more copy of it
        sender.send(("memory", None))
    sender.close()
