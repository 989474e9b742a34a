"""The processes a plan starts, and how they end with it.

Each configuration runs in a process of its own (``memlens.plan.child``), forked from a fork
server, and leads a process group of its own, so that whatever the script starts (DataLoader
workers, a ``subprocess``) is in that group too. When ``memlens plan`` is told to stop (SIGTERM from
a scheduler, Ctrl-C), ``stop_on_signals`` turns the signal into ``PlanStopped`` in the main thread
(exit status 128 + the signal's number, as a shell reports a process killed by it), and
``ConfigurationProcesses.stop`` passes the signal on to every group, waits a moment for them
to end, kills what is left, and stops the fork server: nothing the plan started goes on running
the script after it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

# How long configuration processes get to end after the signal is passed on, before SIGKILL.
STOP_GRACE_S = 3.0
_POLL_S = 0.05


class PlanStopped(SystemExit):
    """SIGTERM or SIGINT reached ``memlens plan``: unwinds it (``except Exception`` does not catch
    it) and ends the program with 128 + the signal's number (143, 130)."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """While planning, SIGTERM and SIGINT raise ``PlanStopped`` in the main thread (once: a
    second signal while the processes are being stopped does not cut that short). Only over the
    default handlers, and only in the main thread, where Python runs handlers; elsewhere nothing
    changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        if raised.is_set():
            return
        raised.set()
        raise PlanStopped(signum)

    defaults = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}
    previous = {signum: signal.signal(signum, on_signal)
                for signum, default in defaults.items() if signal.getsignal(signum) is default}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def lead_own_group() -> None:
    """In a configuration's process, first thing: a process group of its own, which the plan can
    signal whole."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)


class ConfigurationProcesses:
    """The configuration processes running now; once ``stop`` is called, none starts again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[Any] = set()
        self._stopping = False

    @property
    def stopping(self) -> bool:
        with self._lock:
            return self._stopping

    def started(self, process: Any) -> None:
        """``process`` has started. If the plan is stopping meanwhile, it is ended at once (it
        began after ``stop`` took its list)."""
        with self._lock:
            stopping = self._stopping
            if not stopping:
                self._live.add(process)
        if stopping:
            _end([process], signal.SIGKILL)

    def finished(self, process: Any) -> None:
        with self._lock:
            self._live.discard(process)

    @contextlib.contextmanager
    def stopped_on_the_way_out(self) -> Iterator[None]:
        """Around the wait for the configurations: whatever ends it early (``PlanStopped``, a bug)
        stops them first, with the plan's signal or SIGKILL, before a pool waits for its threads."""
        try:
            yield
        except BaseException as exc:
            self.stop(exc.signum if isinstance(exc, PlanStopped) else signal.SIGKILL)
            raise

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Pass ``signum`` on to every live configuration's process group, SIGKILL what is left
        after ``STOP_GRACE_S``, reap them, then stop the fork server they came from."""
        with self._lock:
            self._stopping = True
            live = list(self._live)
        _end(live, signum)
        _stop_fork_server()


def _end(processes: list[Any], signum: int) -> None:
    for process in processes:
        _signal_group(process.pid, signum)
    deadline = time.monotonic() + (STOP_GRACE_S if signum != signal.SIGKILL else 0.0)
    while time.monotonic() < deadline and any(process.is_alive() for process in processes):
        time.sleep(_POLL_S)
    for process in processes:
        # The group as well as the process: what the script started may outlive its leader.
        _signal_group(process.pid, signal.SIGKILL)
        process.join(STOP_GRACE_S)


def _signal_group(pid: int | None, signum: int) -> None:
    if pid is None:
        return
    try:
        os.killpg(pid, signum)
    except OSError:  # not (yet) a group leader, or gone: the process alone
        with contextlib.suppress(OSError):
            os.kill(pid, signum)


def _stop_fork_server() -> None:
    """End the fork server (which may still be importing torch, deaf to its closed pipe for
    seconds) and reap it. Python has no public call for this; without one the server ends by
    itself when this process exits, a moment later."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(Exception):  # a private method: gone in some release, the exit still ends it
        server._stop()  # type: ignore[union-attr]


__all__ = ["STOP_GRACE_S", "ConfigurationProcesses", "PlanStopped", "lead_own_group", "stop_on_signals"]
