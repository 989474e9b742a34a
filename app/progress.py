"""How far each analysis has got, for the page's progress bar.

The analysis runs in a child process (``memlens_app.worker``); the stages it goes through are the
ones the terminal's progress bar shows (``memlens.ops.triage.analyse``'s ``progress(stage,
fraction)``: reading, building timeline, analysing, done). The child writes its latest stage into
a small file of its own (``ProgressWriter``: one fixed-size record, rewritten in place), and the
server reads that file when the page asks (``ProgressBoard.state``), so no thread waits on the
child for it and a child that dies leaves nothing to clean up but the file. Before the child
starts a job is ``queued`` (waiting for a worker); after it, ``done`` or ``failed`` with the
error's one line. Nothing here imports Dash: the analysis child imports this module (the bar
itself is ``memlens_app.panels.progress``).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass

QUEUED = "queued"
STARTING = "starting"
DONE = "done"
FAILED = "failed"
# One record: the stage's JSON padded with spaces, rewritten at offset 0 (a read sees a whole
# record or, rarely, a torn one, which is ignored: the previous state stands).
RECORD_BYTES = 160


@dataclass(frozen=True)
class Progress:
    """One analysis' state: ``stage`` (the terminal's names, or queued / done / failed), how far
    (0..1) and, when it failed, why in one line."""

    stage: str
    fraction: float = 0.0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.stage in (DONE, FAILED)

    def as_json(self) -> dict[str, object]:
        return {
            "stage": self.stage,
            "fraction": round(self.fraction, 3),
            "error": self.error,
            "finished": self.finished,
        }


class ProgressWriter:
    """The child's side: ``writer(stage, fraction)`` records the latest stage in ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, stage: str, fraction: float) -> None:
        record = json.dumps({"stage": stage[:60], "fraction": min(max(float(fraction), 0.0), 1.0)})
        data = record.encode()[:RECORD_BYTES].ljust(RECORD_BYTES)
        with contextlib.suppress(OSError):  # a progress report must never fail the analysis
            fd = os.open(self.path, os.O_WRONLY)
            try:
                os.pwrite(fd, data, 0)
            finally:
                os.close(fd)


def read_record(path: str) -> Progress | None:
    """The stage last written to ``path``; None when there is none yet (or the read was torn)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(RECORD_BYTES)
        record = json.loads(data.decode().strip() or "null")
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("stage"), str):
        return None
    fraction = record.get("fraction")
    return Progress(record["stage"], float(fraction) if isinstance(fraction, (int, float)) else 0.0)


class ProgressBoard:
    """The server's side: the state of every analysis it has run or is running, by source id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[str, str] = {}  # source id -> the running child's progress file
        self._states: dict[str, Progress] = {}

    def queued(self, source_id: str) -> None:
        with self._lock:
            self._states[source_id] = Progress(QUEUED)

    @contextlib.contextmanager
    def running(self, source_id: str) -> Iterator[str]:
        """A fresh progress file for the child analysing ``source_id``, removed afterwards."""
        fd, path = tempfile.mkstemp(prefix="memlens-progress-")
        os.close(fd)
        with self._lock:
            self._files[source_id] = path
            self._states[source_id] = Progress(STARTING)
        try:
            yield path
        finally:
            with self._lock:
                if self._files.get(source_id) == path:
                    del self._files[source_id]
            with contextlib.suppress(OSError):
                os.unlink(path)

    def finished(self, source_id: str, error: str | None = None) -> None:
        with self._lock:
            self._states[source_id] = Progress(DONE, 1.0) if error is None else Progress(FAILED, 0.0, error)

    def forget(self, source_id: str) -> None:
        with self._lock:
            self._states.pop(source_id, None)

    def state(self, source_id: str) -> Progress | None:
        """Where the analysis of ``source_id`` is; None when none was ever asked for."""
        with self._lock:
            path = self._files.get(source_id)
            known = self._states.get(source_id)
        if path is not None:
            written = read_record(path)
            if written is not None:
                return written
        return known
