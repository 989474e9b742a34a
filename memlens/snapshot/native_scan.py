"""The native snapshot scanner (``memlens._scan``, C++17: src/native/pickle_scan.cpp), as the reader uses it.

One pass over the pickle's opcodes builds the snapshot's small part (segments, settings,
annotations) as the plain Python objects the restricted unpickler would build, and fills each
device trace's columns and interning tables directly, never making the millions of per-entry dicts.
``scan_file`` reads the file a megabyte at a time (the scanner's own reads, without the GIL), so a
1 GB snapshot is never held whole; ``scan`` reads bytes already in memory (an inflated gzip).
It runs only the opcodes memory snapshots use and enforces the Python vetting's limits
(``memlens.snapshot.scan``); anything else -- a refusal, a truncation, protocol 0 text, a trace
entry that is not plain -- makes it decline, and the reader reads that file on the Python path,
whose answer or one-line error is the reference. So both paths give the same answer for every
file; the native one only gives it sooner.

``MEMLENS_PURE_PYTHON=1`` (as for every extension: ``memlens.snapshot.engine``) or an extension
that does not import keeps every file on the Python path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from memlens.snapshot.ahead import SCAN_CHUNK, Begun, scanner
from memlens.snapshot.model import constant_column


@dataclass(slots=True)
class NativeTrace:
    """One device's entries as the scanner read them: columns, and the distinct values the reader
    interns (in order of first appearance, so ids are what the Python path gives). A column that
    holds one value throughout is a ``constant_column`` (zero stride, read-only)."""

    device: int
    has_time: bool
    action_local: np.ndarray  # uint8, into ``actions``
    actions: list[str]
    address: np.ndarray
    size: np.ndarray
    stream: np.ndarray
    time_us: np.ndarray
    device_free: np.ndarray  # 0 but on OOM rows
    frames_local: np.ndarray  # into ``frames``
    frames: list[Any]  # each distinct frames object (None, or a list of frame dicts)
    has_user_metadata: bool
    metadata_local: np.ndarray
    metadata: list[str | None]
    has_compile_context: bool
    context_local: np.ndarray
    context: list[str | None]
    first_entry: dict[str, Any]  # for the format guess

    def __len__(self) -> int:
        return len(self.action_local)


# The lazy columns (the scanner hands one that never varied over as (value, rows)) and their dtypes.
_LAZY_COLUMNS = {"stream": np.int64, "time_us": np.int64, "device_free": np.int64, "metadata_local": np.int32,
                 "context_local": np.int32}


def scan(data: bytes) -> tuple[Any, str | None]:
    """``(raw, None)``: the raw snapshot, its natively read traces as ``NativeTrace`` in
    ``raw["device_traces"]``; or ``(None, reason)`` when the scanner declines (or is off)."""
    module = scanner()
    if module is None:
        return None, "the native scanner is off"
    return _answer(module.scan(data))


def scan_file(fd: int, size: int, chunk: int = SCAN_CHUNK) -> tuple[Any, str | None]:
    """``scan`` of the ``size`` bytes of the open file ``fd``, read ``chunk`` bytes at a time from
    its start (positional reads: the descriptor's offset is left as it is). A file shorter now than
    ``size`` is declined as truncated: the Python path then says what it holds."""
    module = scanner()
    if module is None:
        return None, "the native scanner is off"
    return _answer(module.scan_file(fd, size, chunk))


def scanned(begun: Begun[tuple[bool, Any]]) -> tuple[Any, str | None]:
    """``scan_file``'s answer from a scan begun ahead (``memlens.snapshot.ahead``)."""
    return _answer(begun.result())


def _answer(scanned: tuple[bool, Any]) -> tuple[Any, str | None]:
    ok, result = scanned
    if not ok:
        return None, str(result)
    raw, traces = result
    if traces:
        listed = raw["device_traces"]
        for fields in traces:
            for name, dtype in _LAZY_COLUMNS.items():
                if isinstance(fields[name], tuple):
                    value, rows = fields[name]
                    fields[name] = constant_column(value, rows, dtype)
            listed[fields["device"]] = NativeTrace(**fields)
    return raw, None


__all__ = ["NativeTrace", "scan", "scan_file", "scanned", "scanner"]
