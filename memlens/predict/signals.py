"""How a predicted run ends on a signal, and the exit status it earns.

``StopSignals``: while a script runs against the simulated GPU, SIGTERM and Ctrl-C end it with
its ``finally`` blocks run (never inside a finalizer or torch's own Python, where the exception
would be lost or abort the process); once the files are being written, a signal waits for them.
``exit_status``: the status ``memlens predict`` exits with (128 + the signal's number after one).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

# How long a signal that landed where it cannot be raised waits before it is sent again
# (StopSignals), and how many times it waits before it is raised wherever it lands (1 s in all; a
# script is back in its own code, or memlens', within microseconds to milliseconds).
SIGNAL_RETRY_SECONDS = 0.005
SIGNAL_RETRIES = 200
# torch's own Python, which the fake tensors' C++ dispatcher calls back into (a dispatch rule's
# lookup, the fake mode's handlers): an exception raised there by a signal handler can meet a C++
# frame that cannot pass it on, and the process aborts ("terminate called after throwing an
# instance of 'pybind11::error_already_set' ... KeyboardInterrupt"), writing nothing.


def _inside_torch(frame: Any) -> bool:
    """Whether the interrupted ``frame`` is torch's own Python (see above)."""
    torch = sys.modules.get("torch")
    torch_file = getattr(torch, "__file__", None)
    if frame is None or not torch_file:
        return False
    return frame.f_code.co_filename.startswith(os.path.dirname(torch_file) + os.sep)


# What a shell reports for a process ended by SIGINT / SIGTERM (128 + the signal's number), as
# ``memlens record`` exits.
_SIGNAL_STATUS = {"interrupted": 128 + signal.SIGINT, "terminated": 128 + signal.SIGTERM}
SIGNAL_WORDS = {"interrupted": "interrupted (Ctrl-C)", "terminated": "terminated (SIGTERM)"}


def exit_status(result: Any, pending_signal: int | None = None) -> int:
    """0: the run completed within the capacity. 1: it did not fit (out of memory), or it did not
    get to the end (the script failed, or stopped needing a real value or a missing kernel), so
    no fit can be claimed. 143 / 130: SIGTERM / Ctrl-C stopped it (the prediction up to there is
    written). Usage and input errors exit 2 before anything runs."""
    if result.interrupted:
        return _SIGNAL_STATUS[result.interrupted]
    if pending_signal is not None:
        return 128 + pending_signal
    return 0 if result.fits else 1


def reopen_closed_streams() -> None:
    """The script may have closed ``sys.stdout``/``sys.stderr`` (python then still exits 0):
    the prediction is written to file descriptors 1 and 2, which closing the objects leaves open."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        if stream is not None and not getattr(stream, "closed", False):
            continue
        try:
            replacement = open(os.dup(fd), "w", encoding="utf-8", errors="replace")  # noqa: SIM115
        except OSError:  # the descriptor itself is gone: nothing can be shown there
            replacement = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115
        setattr(sys, name, replacement)


class StopSignals:
    """While predicting, SIGTERM raises ``Terminated`` and Ctrl-C ``KeyboardInterrupt`` in the
    script (its ``finally`` blocks run; the prediction up to there is a result); once ``hold``
    is called, a signal waits until the files are written and sets the exit status (``pending``).
    Only over the default handlers, in the main thread, as ``memlens record`` does."""

    def __init__(self) -> None:
        self.pending: int | None = None
        self._held = False
        self._retries = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            defaults = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}
            for signum, default in defaults.items():
                if signal.getsignal(signum) is default:
                    self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def hold(self) -> None:
        self._held = True

    def _on_signal(self, signum: int, frame: Any) -> None:
        from memlens.recorder import Terminated
        from memlens.recorder.session import inside_finalizer

        if self._held:
            self.pending = self.pending or signum
            return
        if inside_finalizer(frame) or (_inside_torch(frame) and self._retries < SIGNAL_RETRIES):
            # Python runs the handler at the next bytecode, which can be inside a finalizer (the
            # simulated device's, as a tensor is freed): raised there, the exception is printed as
            # "ignored" and lost, and the script would run on. Or inside torch's Python called from
            # C++, where it can abort the process. The script has no step the signal could wait
            # for, so it is sent again in a moment, once that frame has returned.
            self._retries += 1
            again = threading.Timer(SIGNAL_RETRY_SECONDS, os.kill, (os.getpid(), signum))
            again.daemon = True
            again.start()
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum)

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()


__all__ = ["SIGNAL_RETRIES", "SIGNAL_RETRY_SECONDS", "SIGNAL_WORDS", "StopSignals", "exit_status",
           "reopen_closed_streams"]
