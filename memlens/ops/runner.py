"""The one sandboxed child-process runner: a function run in a separate process that can be
stopped, under time and memory limits.

A hostile or simply enormous file can keep the unpickler (or an analysis) busy in C code for ever
(a hash bomb holds the GIL, so in-process it froze every request and even ignored SIGTERM) or
swallow the machine's memory. The dashboard's analyses, the MCP server's tool calls and the
fleet's per-rank analyses therefore run that work here: in a child process forked from a
``forkserver`` (the modules named in ``preload`` are imported there once, so a child starts in
milliseconds and inherits none of the server's threads or sockets). The child caps its own
address space (``RLIMIT_AS``), never above the limits this process inherited (``ulimit -v`` on an
HPC login node: the lower one is taken, and said once); the caller waits for the answer on a pipe with a wall-clock
deadline and kills the child when the deadline passes. The caller's thread only waits on a pipe
meanwhile, so every other request is answered.

``run_limited(function, args, limits=...)`` returns what ``function(*args)`` returned (pickled
back through the pipe); ``function`` must be importable by name (a module-level function).
Descriptors travel as ``multiprocessing.reduction.DupFd`` in ``args`` (the child calls
``detach()``). A ``MemlensError`` raised in the child is raised again here with its message;
a limit reached, or the input running the child out of stack depth, is ``Stopped``; anything else
is ``Crashed`` (with the child's traceback), told apart by ``memlens.ops.errors.describe``.
The one per-file analysis a child runs for a face is ``memlens.ops.triage.analyse``.

``run_each(function, argument_tuples, jobs=N, ...)`` runs many such calls, at most ``N`` at once
(the fleet's ranks): each its own child under the limits, each failure that item's one line.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import resource
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from memlens.errors import MemlensError
from memlens.ops.errors import Crashed, describe
from memlens.printable import MAX_SHOWN_CHARS
from memlens.units import GiB, format_bytes

DEFAULT_TIMEOUT_S = 120.0
# Modules every forked child should start with. memlens.cli.main too: a child re-runs the
# ``memlens`` console script (as __mp_main__), which imports it.
# The reader's cache and numpy.ma are imported by every analysis: loaded once there, a child
# starts analysing ~0.1 s sooner (most of a small rank's time in a fleet).
DEFAULT_PRELOAD = ("memlens", "memlens.analysis.run", "memlens.snapshot.reader", "memlens.snapshot.cache", "numpy.ma",
                   "memlens.ops.runner", "memlens.ops.triage", "memlens.cli.main")
_PR_SET_PDEATHSIG = 1
# How long a killed child may take to be reaped before we stop waiting for it.
_REAP_S = 10.0


def default_memory_limit() -> int:
    """Half the memory this process may use (the machine's physical memory, or its cgroup's limit
    where that is lower: a container, a Slurm job), at least 1 GiB: an analysis needs ~6x its
    file's size."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 * GiB
    limited = cgroup_memory_limit()
    if limited is not None:
        total = min(total, limited)
    return max(GiB, total // 2)


# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit number, not "max".
_CGROUP_V1_UNLIMITED = 1 << 62


def cgroup_memory_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The lowest memory limit on this process's cgroup path (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``), from its own group up to the root; None where there is none, or
    nothing can be read (not Linux, no cgroup file system mounted)."""
    try:
        with open(proc_cgroup, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    candidates: list[tuple[str, str]] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # v2, mounted at the root, or at unified/ beside v1's controllers
            hybrid = not os.path.exists(os.path.join(root, "cgroup.controllers"))
            candidates.append((os.path.join(root, "unified") if hybrid else root, path))
        elif "memory" in controllers.split(","):
            candidates.append((os.path.join(root, "memory"), path))
    limits = [limit for base, path in candidates for limit in _limits_up_the_path(base, path)]
    return min(limits) if limits else None


def _limits_up_the_path(base: str, path: str) -> list[int]:
    """The limits set on ``path`` and each folder above it under ``base`` (a path that is not
    there, as inside a cgroup namespace, counts from ``base`` itself)."""
    folder = os.path.normpath(os.path.join(base, path.lstrip("/")))
    if not os.path.isdir(folder):
        folder = base
    found = []
    while True:
        for name in ("memory.max", "memory.limit_in_bytes"):
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(folder, name), encoding="ascii") as handle:
                    text = handle.read().strip()
                if text != "max" and int(text) < _CGROUP_V1_UNLIMITED:
                    found.append(int(text))
        if os.path.normpath(folder) == os.path.normpath(base) or folder == os.path.dirname(folder):
            return found
        folder = os.path.dirname(folder)


def _finite(value: int) -> int | None:
    return None if value == resource.RLIM_INFINITY or value < 0 else value


def inherited_limit(which: int) -> int | None:
    """The lower of this process's soft and hard ``which`` limits; None when neither is set."""
    soft, hard = resource.getrlimit(which)
    finite = [value for value in (_finite(soft), _finite(hard)) if value is not None]
    return min(finite) if finite else None


def within_inherited(which: int, soft: int, hard: int) -> tuple[int, int]:
    """``(soft, hard)`` lowered to what this process inherited: an unprivileged process cannot
    raise its hard limit ("ValueError: not allowed to raise maximum limit"), and a soft limit
    above the inherited soft one would lift the cap whoever started us chose."""
    current_soft, current_hard = (_finite(value) for value in resource.getrlimit(which))
    if current_hard is not None:
        hard = min(hard, current_hard)
    if current_soft is not None:
        soft = min(soft, current_soft)
    return min(soft, hard), hard


_said_lock = threading.Lock()
_said: set[str] = set()


def _say_once(line: str) -> None:
    """``line`` as one warning on the log (stderr unless the program set logging up), the first
    time only: every child of a fleet or MCP server would otherwise repeat it."""
    with _said_lock:
        if line in _said:
            return
        _said.add(line)
    import logging  # only when there is something to say: a triage's start does not pay for it

    logging.getLogger("memlens").warning("memlens: %s", line)


@dataclass(frozen=True)
class Limits:
    """What one run may use before it is stopped: wall-clock seconds and address space."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    memory_bytes: int | None = None  # None: default_memory_limit()

    def memory_limit(self) -> int:
        """The address space a child gets: what was asked for (or the default), lowered to the
        limit this process inherited, which it says once."""
        wanted = self.memory_bytes if self.memory_bytes is not None else default_memory_limit()
        inherited = inherited_limit(resource.RLIMIT_AS)
        if inherited is None or inherited >= wanted:
            return wanted
        _say_once(f"the analysis processes get {format_bytes(inherited)} of address space, the limit this "
                  f"process inherited (ulimit -v), not {format_bytes(wanted)}")
        return inherited


class Stopped(MemlensError):
    """The run went past a limit and its process was stopped (the input, not a bug)."""


class Abandoned(Stopped):
    """The run was stopped because whoever asked for it has gone (``abandoned()`` turned true)."""


class Died(Crashed):
    """The child process ended without an answer, not stopped by us (a crash in native code, an
    ``os._exit``): that one call's failure."""


class ProcessGroup:
    """The live child processes of one server, so that shutdown kills them instead of waiting."""

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


def _forkserver(preload: Sequence[str]) -> Any:
    """The forkserver context; the first caller's ``preload`` is what the forkserver imports."""
    global _context
    with _context_lock:
        if _context is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(list(preload))
            _context = context
        return _context


def start_forkserver(preload: Sequence[str] = DEFAULT_PRELOAD) -> None:
    """Start the forkserver now (it imports ``preload``, on its own core, about a second), so that
    the first run does not wait for it: ``memlens serve`` calls it as it starts."""
    _forkserver(preload)
    from multiprocessing import forkserver

    forkserver.ensure_running()


def run_limited(function: Callable[..., Any], args: tuple[Any, ...] = (), *, limits: Limits,
                group: ProcessGroup | None = None, what: str = "analysis",
                preload: Sequence[str] = DEFAULT_PRELOAD, abandoned: Callable[[], bool] | None = None) -> Any:
    """``function(*args)`` run in a child process under ``limits``; what it returned.

    Raises ``MemlensError`` with the child's message for one the function raised, ``Stopped``
    ("{what} stopped: ...") when a limit was hit or ``group`` is shutting down, ``Abandoned``
    (a ``Stopped``) as soon as ``abandoned()`` turns true, ``Crashed`` for a bug.
    """
    context = _forkserver(preload)
    group = group if group is not None else ProcessGroup()
    receiver, sender = context.Pipe(duplex=False)
    memory = limits.memory_limit()
    _say_if_cpu_lowered(limits.timeout_s)
    process = context.Process(target=_child_main, args=(sender, function, args, memory, limits.timeout_s),
                              name=f"memlens-{what.replace(' ', '-')}", daemon=True)
    try:
        if not group.add(process):
            raise Stopped(f"{what} stopped: the server is shutting down")
        process.start()
        sender.close()  # the child holds the only writer: EOF on the pipe means it is gone
        if not _wait_for_answer(receiver, limits.timeout_s, abandoned):
            if abandoned is not None and abandoned():
                raise Abandoned(f"{what} stopped: whoever asked for it has gone")
            raise Stopped(f"{what} stopped: took over {_seconds(limits.timeout_s)}")
        try:
            outcome, detail = receiver.recv()
        except (EOFError, OSError):
            outcome, detail = "died", None
    finally:
        _kill(process)
        group.discard(process)
        receiver.close()
        sender.close()
    if outcome == "ok":
        return detail
    if outcome == "error":
        raise MemlensError(detail)
    if outcome == "memory":
        raise Stopped(f"{what} stopped: needed over {format_bytes(memory)}")
    if outcome == "exhausted":  # the input ran the child out of stack depth: the input, not a bug
        raise Stopped(f"{what} stopped: {detail}")
    if outcome == "died":
        code = process.exitcode
        if group.closed:
            raise Stopped(f"{what} stopped: the server is shutting down")
        if code == -signal.SIGXCPU:  # the CPU-time backstop, reached before our deadline
            raise Stopped(f"{what} stopped: took over {_seconds(limits.timeout_s)}")
        if code == -signal.SIGKILL:  # not ours (those are handled above): the OOM killer
            raise Stopped(f"{what} stopped: the {what} process was killed (out of memory?)")
        raise Died(f"the {what} process died (exit code {code}: a crash, or killed)")
    raise Crashed(str(detail))


# How often a waiting run checks whether whoever asked for it is still there.
_ABANDON_POLL_S = 0.5


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


def caused_by_memory_error(exc: BaseException) -> bool:
    """Whether ``exc`` is, or was raised while handling, a ``MemoryError``."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, MemoryError):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


def cpu_backstop_s(timeout_s: float) -> int:
    """The CPU seconds a child may use: twice the wall-clock limit and a margin, which one thread
    cannot reach before the deadline, so only a child whose parent is gone meets it."""
    return int(2 * timeout_s) + 10


def _say_if_cpu_lowered(timeout_s: float) -> None:
    inherited = inherited_limit(resource.RLIMIT_CPU)
    wanted = cpu_backstop_s(timeout_s)
    if inherited is not None and inherited < wanted:
        _say_once(f"the analysis processes get {inherited:,} s of CPU time, the limit this process inherited "
                  f"(ulimit -t), not {wanted:,} s")


def _die_with_parent() -> None:
    """prctl(PR_SET_PDEATHSIG, SIGKILL) where Linux offers it; elsewhere the CPU limit remains."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _child_main(sender: Connection, function: Callable[..., Any], args: tuple[Any, ...], memory_bytes: int,
                timeout_s: float) -> None:
    """Runs in the child: cap the address space, run, send back one (outcome, detail) pair."""
    resource.setrlimit(resource.RLIMIT_AS, within_inherited(resource.RLIMIT_AS, memory_bytes, memory_bytes))
    # Backstops for a parent that dies without killing us (SIGKILL, OOM killer): the kernel
    # kills this child when the forkserver exits (it does when the parent goes), and when its
    # CPU time passes twice the wall-clock limit (a single thread cannot reach that in time).
    cpu_s = cpu_backstop_s(timeout_s)
    resource.setrlimit(resource.RLIMIT_CPU, within_inherited(resource.RLIMIT_CPU, cpu_s, cpu_s + 5))
    _die_with_parent()
    # Ctrl-C in the terminal reaches the whole process group; the parent decides what stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        message: tuple[str, Any] = ("ok", function(*args))
    except Exception as exc:
        # The reader turns a MemoryError into its own "too large" message; under our cap the
        # cap is the reason, and the user should hear which limit stopped the file.
        line = describe(exc, MAX_SHOWN_CHARS)
        if caused_by_memory_error(exc):
            message = ("memory", None)
        elif line.kind == "mistake":
            message = ("error", str(exc))
        elif line.kind == "exhausted":
            message = ("exhausted", line.text)
        else:  # a bug (a simulated out-of-memory that escaped among them): the parent logs where
            message = ("crash", traceback.format_exc())
    try:
        sender.send(message)
    except MemoryError:  # pickling the answer is one more copy of it
        sender.send(("memory", None))
    sender.close()


# --------------------------------------------------------------------------- many calls


# After this many children in a row each died on its own item, the rest are not started: children
# that die whatever the input (no memory left to start one, a broken interpreter) would each cost
# a start to learn the same.
DEATHS_BEFORE_GIVING_UP = 3


@dataclass(frozen=True)
class Outcome:
    """One call of ``run_each``: what the function returned, or the one line saying why not."""

    value: Any = None
    error: str | None = None
    seconds: float = 0.0  # the call's wall-clock time, its child's start included

    @property
    def ok(self) -> bool:
        return self.error is None


Progress = Callable[[int, int], None]


def run_each(function: Callable[..., Any], argument_tuples: Sequence[tuple[Any, ...]], *, jobs: int,
             limits: Limits, group: ProcessGroup | None = None, what: str = "analysis",
             preload: Sequence[str] = DEFAULT_PRELOAD, progress: Progress | None = None) -> list[Outcome]:
    """``function(*args)`` for every ``args``, each in its own child under ``limits`` (``run_limited``),
    at most ``jobs`` at once; the outcomes in input order, never an exception for one item.

    A child that dies costs its own item only. After ``DEATHS_BEFORE_GIVING_UP`` children in a
    row died (none answered between them), the items not yet started are not started.
    """
    group = group if group is not None else ProcessGroup()
    lock = threading.Lock()
    state = {"deaths_in_a_row": 0, "done": 0}
    total = len(argument_tuples)

    def one(args: tuple[Any, ...]) -> Outcome:
        with lock:
            given_up = state["deaths_in_a_row"] >= DEATHS_BEFORE_GIVING_UP
        if given_up:
            return _counted(Outcome(error=f"not {_done_word(what)}: {DEATHS_BEFORE_GIVING_UP} {what} processes "
                                          "in a row died, each on its own input"))
        started = time.perf_counter()
        died = False
        try:
            outcome = Outcome(run_limited(function, args, limits=limits, group=group, what=what, preload=preload))
        except Exception as exc:  # that item's failure, as every face words it
            died = isinstance(exc, Died)
            outcome = Outcome(error=describe(exc).text)
        outcome = Outcome(outcome.value, outcome.error, time.perf_counter() - started)
        with lock:
            state["deaths_in_a_row"] = state["deaths_in_a_row"] + 1 if died else 0
        return _counted(outcome)

    def _counted(outcome: Outcome) -> Outcome:
        with lock:
            state["done"] += 1
            done = state["done"]
        if progress is not None:
            progress(done, total)
        return outcome

    if not argument_tuples:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, total)), thread_name_prefix="memlens-runner") as pool:
        return list(pool.map(one, argument_tuples))


def _done_word(what: str) -> str:
    return "analysed" if what == "analysis" else "run"


__all__ = [
    "DEATHS_BEFORE_GIVING_UP",
    "DEFAULT_PRELOAD",
    "DEFAULT_TIMEOUT_S",
    "Abandoned",
    "Crashed",
    "Died",
    "Limits",
    "Outcome",
    "ProcessGroup",
    "Stopped",
    "caused_by_memory_error",
    "default_memory_limit",
    "run_each",
    "run_limited",
]
