"""A snapshot's native scan begun ahead of its load, on a thread of its own.

The native scanner (``memlens._scan``) runs without the GIL: a third of a second for a 1M-entry
file in which this process can do anything else. The faces know what that is (importing the
analysis modules, click, the renderer: 100-200 ms that otherwise come before or after the scan),
so they ``start`` the scan of a file they are about to load, and the reader ``take``\\ s it
instead of scanning the file itself. The scan reads the opened descriptor with positional reads,
so it reads exactly what the load would; a scan nobody takes costs that thread's time, never an
answer.

Numpy-free and light (the scanner's module and the standard library), so that ``memlens`` can
start a scan before importing anything else (``memlens.cli.head_start``).
"""

from __future__ import annotations

import os
import threading
import weakref
from types import ModuleType
from typing import Any

from memlens.allocator.engine import pure_python_requested
from memlens.files import OpenedFile
from memlens.snapshot.formats import looks_like_pickle

_native_scan: ModuleType | None
try:
    from memlens import _scan as _native_scan
except ImportError:  # not built (a checkout run without pip install): the Python path reads every file
    _native_scan = None

# The scanner's reads: a megabyte at a time into a window it refills (the file is never held whole).
SCAN_CHUNK = 1 << 20


class ScanAhead:
    """``memlens._scan.scan_file`` of an opened file on a thread of its own; ``result()`` waits
    for the scanner's raw answer, ``(ok, result)``, as ``memlens.snapshot.native_scan`` reads it.
    The descriptor must stay open until ``result()`` has returned."""

    def __init__(self, module: ModuleType, opened: OpenedFile) -> None:
        self._module = module
        self._fd = opened.fd
        self._size = opened.size
        self._result: list[tuple[bool, Any]] = []
        self._error: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="memlens-scan-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result.append(self._module.scan_file(self._fd, self._size, SCAN_CHUNK))
        except BaseException as error:  # raised where the scan is taken, as the call's own would be
            self._error.append(error)

    def result(self) -> tuple[bool, Any]:
        self._thread.join()
        if self._error:
            raise self._error[0]
        return self._result[0]


# The scan begun for each opened file, until the reader takes it (weak keys: it goes with the file).
_SCANS: weakref.WeakKeyDictionary[OpenedFile, ScanAhead] = weakref.WeakKeyDictionary()


def start(opened: OpenedFile) -> bool:
    """Begin scanning ``opened`` on another thread, if the native scanner would read it (it is on,
    and the file starts as a plain pickle: a gzip is inflated first, by the reader). Whether a
    scan is now running (or already was); whoever starts one makes sure the file stays open until
    it is taken or waited for (``wait``)."""
    if opened in _SCANS:
        return True
    module = scanner()
    if module is None or not looks_like_pickle(os.pread(opened.fd, 4, 0)):
        return False
    _SCANS[opened] = ScanAhead(module, opened)
    return True


def take(opened: OpenedFile) -> ScanAhead | None:
    """The scan begun for ``opened`` (now the caller's), if any."""
    return _SCANS.pop(opened, None)


def wait(opened: OpenedFile) -> None:
    """Wait for a scan of ``opened`` nobody took, so that its descriptor can be closed."""
    ahead = _SCANS.pop(opened, None)
    if ahead is not None:
        ahead._thread.join()  # its answer or error is nobody's now


def scanner() -> ModuleType | None:
    """``memlens._scan``, or None when the Python path reads snapshots (asked for, or not built)."""
    return None if pure_python_requested() else _native_scan


__all__ = ["SCAN_CHUNK", "ScanAhead", "scanner", "start", "take", "wait"]
