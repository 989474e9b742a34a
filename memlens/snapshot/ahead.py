"""A snapshot's native scan begun ahead of its load, on a thread of its own.

The native scanner (``memlens._scan``) runs without the GIL: a third of a second for a 1M-entry
file in which this process can do anything else. The faces know what that is (importing the
analysis modules, click, the renderer: 100-200 ms that otherwise come before or after the scan),
so they ``start_scan`` on a file they are about to load, and the reader takes the scan
(``take_scan``) instead of scanning the file itself. The scan reads the opened descriptor with
positional reads, so it reads exactly what the load would; a scan nobody takes costs that
thread's time, never an answer.

Numpy-free and light (the scanner's module and the standard library), so that ``memlens`` can
begin before importing anything else (``memlens.cli.head_start``).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any, Generic, TypeVar

from memlens.files import OpenedFile
from memlens.snapshot.engine import pure_python_requested
from memlens.snapshot.formats import looks_like_pickle
from memlens.snapshot.limits import SCAN_CHUNK

_native_scan: ModuleType | None
try:
    from memlens import _scan as _native_scan
except ImportError:  # not built (a checkout run without pip install): the Python path reads every file
    _native_scan = None


T = TypeVar("T")


class Begun(Generic[T]):
    """``work()`` on a thread of its own; ``result()`` waits for its value, or raises what it raised
    (as the call itself would have, where the result is taken). ``stop``, if given, asks the work
    to end early (``cancel``): for work nobody will take."""

    def __init__(self, work: Callable[[], T], name: str, stop: Callable[[], None] | None = None) -> None:
        self._work = work
        self._stop = stop
        self._value: list[T] = []
        self._error: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value.append(self._work())
        except BaseException as error:
            self._error.append(error)

    def done(self) -> bool:
        """Whether the work has ended (its ``result()`` would not wait)."""
        return not self._thread.is_alive()

    def result(self) -> T:
        self._thread.join()
        if self._error:
            raise self._error[0]
        return self._value[0]

    def cancel(self) -> None:
        """Ask the work to end early (where it can be asked), and wait for it: nobody takes it."""
        if self._stop is not None:
            self._stop()
        self._thread.join()


# The scan begun on each opened file, until the reader takes it (weak keys: it goes with the file).
_SCANS: weakref.WeakKeyDictionary[OpenedFile, Begun[tuple[bool, Any]]] = weakref.WeakKeyDictionary()


def start_scan(opened: OpenedFile) -> bool:
    """Begin ``memlens._scan.scan_file`` of ``opened`` on another thread, if the native scanner
    would read it (it is on, and the file starts as a plain pickle: a gzip is inflated first, by
    the reader). Whether a scan is now running (or already was); whoever starts one makes sure the
    file stays open until it is taken or waited for (``wait``)."""
    if opened in _SCANS:
        return True
    module = scanner()
    if module is None or not looks_like_pickle(os.pread(opened.fd, 4, 0)):
        return False
    fd, size, stop = opened.fd, opened.size, module.StopFlag()
    _SCANS[opened] = Begun(lambda: module.scan_file(fd, size, SCAN_CHUNK, stop), "memlens-scan-ahead", stop.set)
    return True


def scan_done(opened: OpenedFile) -> bool:
    """Whether no scan of ``opened`` is running (none begun, or begun and ended)."""
    begun = _SCANS.get(opened)
    return begun is None or begun.done()


def take_scan(opened: OpenedFile) -> Begun[tuple[bool, Any]] | None:
    """The scan begun for ``opened`` (now the caller's): its ``result()`` is ``scan_file``'s."""
    return _SCANS.pop(opened, None)


def wait(opened: OpenedFile) -> None:
    """Stop a scan of ``opened`` nobody took, and wait for it, so that its descriptor can be
    closed (and no thread is left in the scanner when the process shuts down)."""
    begun = _SCANS.pop(opened, None)
    if begun is not None:
        begun.cancel()


def scanner() -> ModuleType | None:
    """``memlens._scan``, or None when the Python path reads snapshots (asked for, or not built)."""
    return None if pure_python_requested() else _native_scan


__all__ = ["SCAN_CHUNK", "Begun", "scanner", "start_scan", "take_scan", "wait"]
