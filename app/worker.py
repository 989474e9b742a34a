"""Analyse one snapshot in a separate process that can be stopped: the app's only door to memlens.

A hostile or simply enormous file can keep the unpickler busy in C code for ever or swallow the
machine's memory, so each analysis runs through ``memlens.ops.runner`` (a child forked from a
``forkserver``, its address space capped, killed at a wall-clock deadline); the server's threads
only wait on a pipe meanwhile, so every other request is answered. The child runs the one
load-and-analyse of every face, ``memlens.ops.triage.analyse``, and uploaded sidecars are read there too
(``check_sidecars_in_worker``). The MCP server runs its tool calls, and
``memlens fleet`` its ranks, through the same runner, under the same limits.

What comes back is the ``Analysis`` (the report with its snapshot's numpy columns), pickled through
the pipe: on a 1,000,000-event file that is ~76 MiB and well under a tenth of a second each way,
next to ~2 s of analysis, so a plainer copy of the report would save little.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memlens.allocator.replay import RunFigures, SimulatedFigures
from memlens.ops.runner import (
    DEFAULT_PRELOAD,
    DEFAULT_TIMEOUT_S,
    Abandoned,
    Crashed,
    Limits,
    ProcessGroup,
    Stopped,
    run_limited,
    start_forkserver,
)
from memlens.ops.runner import default_memory_limit as default_memory_limit
from memlens.ops.triage import TriageOptions, analyse
from memlens_app.progress import ProgressWriter
from memlens_app.sidecars import check_uploaded_sidecars

log = logging.getLogger("memlens.app")

DEFAULT_ANALYSIS_TIMEOUT_S = DEFAULT_TIMEOUT_S
# Modules the forkserver imports once, so that each forked child starts with them loaded.
_PRELOAD = [*DEFAULT_PRELOAD, "memlens_app.worker", "memlens.allocator"]  # the what-if job's simulator
# Where the page's bar stands while the analysis proper runs: the terminal's bar reports
# "analysing" at 1.0 as the analysis begins; the page's keeps the rest for it and the answer's trip.
ANALYSING_FRACTION = 0.85

# The runner's names, as the app has always called them.
AnalysisLimits = Limits
AnalysisStopped = Stopped
JobAbandoned = Abandoned  # the page that asked for the job has gone
AnalysisCrashed = Crashed
WorkerGroup = ProcessGroup


def start_workers() -> None:
    """Start the analyses' forkserver now, with the app's modules preloaded (``memlens serve``
    does as it starts, so that its first analysis does not wait about a second for it)."""
    start_forkserver(_PRELOAD)


def analyse_in_worker(path: str, *, uploaded: bool, limits: AnalysisLimits, workers: WorkerGroup,
                      max_content_bytes: int | None = None, progress_path: str | None = None) -> Any:
    """Load and analyse ``path`` in a child process under ``limits``; the ``Analysis`` it built.
    ``progress_path``: a file the child writes its stages into (``memlens_app.progress``).

    Raises ``MemlensError`` for a file memlens cannot read (the reader's own message),
    ``AnalysisStopped`` when a limit was hit, ``AnalysisCrashed`` for a bug in memlens.
    """
    # An upload gets no cache file beside it in the upload folder: it would only cost disk.
    options = TriageOptions(cache=False) if uploaded else TriageOptions()
    if progress_path is None:
        return run_limited(analyse, (path, options, None, max_content_bytes), limits=limits, group=workers,
                           what="analysis", preload=_PRELOAD)
    return run_limited(analyse_reporting, (path, options, max_content_bytes, progress_path), limits=limits,
                       group=workers, what="analysis", preload=_PRELOAD)


def analyse_reporting(path: str, options: TriageOptions, max_content_bytes: int | None, progress_path: str) -> Any:
    """What the analysis child runs when the page follows it: ``analyse`` with its stages (the
    terminal's) written to ``progress_path``."""
    writer = ProgressWriter(progress_path)

    def report(stage: str, fraction: float) -> None:
        if stage == "done":  # the reader's own end: the analysis is still to come
            return
        writer(stage, ANALYSING_FRACTION if stage == "analysing" else fraction)

    writer("reading", 0.0)
    return analyse(path, options, report, max_content_bytes)


def check_sidecars_in_worker(sidecars: list[tuple[str, str]], *, limits: AnalysisLimits,
                             workers: WorkerGroup) -> list[str | None]:
    """Read each uploaded sidecar ``(path, name)`` in one child process under ``limits``: for each,
    None when it can be used, else why not in one line (``check_uploaded_sidecars``). The server
    never parses an uploaded sidecar itself: a 16 MiB one of empty objects is half a gigabyte of
    Python objects."""
    problems: list[str | None] = run_limited(check_uploaded_sidecars, (sidecars,), limits=limits,
                                             group=workers, what="sidecar check", preload=_PRELOAD)
    return problems


@dataclass(frozen=True)
class WhatIfAnswer:
    """The what-if replays' figures: the recorded run, it with expandable segments, and it on a
    device with more memory (None when the capacity is unknown)."""

    recorded: RunFigures
    expandable: SimulatedFigures
    more_memory: SimulatedFigures | None
    notes: tuple[str, ...]


def whatif_in_worker(snapshot: Any, device: int, capacity: int | None, extra: int, *, limits: AnalysisLimits,
                     workers: WorkerGroup, abandoned: Callable[[], bool] | None = None) -> WhatIfAnswer:
    """Replay ``device`` of ``snapshot`` through the allocator simulator in a child process, under
    the same limits as an analysis (a replay is as long as the trace, and a crafted trace can
    make the simulator slow): with expandable segments, and with ``extra`` more bytes than
    ``capacity`` when it is known. Stopped early when ``abandoned()`` turns true (the page that
    asked has gone)."""
    return run_limited(whatif_job, (snapshot, device, capacity, extra), limits=limits, group=workers,
                       what="simulation", preload=_PRELOAD, abandoned=abandoned)


def whatif_job(snapshot: Any, device: int, capacity: int | None, extra: int) -> WhatIfAnswer:
    """What the what-if child runs."""
    from memlens.ops.whatif import WhatIfOptions, whatif
    from memlens.units import format_bytes

    # The replays `memlens whatif --expandable-segments` and `--capacity` make: the recorded
    # settings with that one change.
    expandable = whatif(snapshot, WhatIfOptions(expandable_segments=True, capacity=capacity, device=device))
    more, notes = None, list(expandable.notes)
    if capacity:
        bigger = whatif(snapshot, WhatIfOptions(capacity=capacity + extra, device=device))
        more = bigger.simulated
        stopped = bigger.stopped_note()
        if stopped is not None:
            notes.append(f"On the {format_bytes(capacity + extra)} device, {stopped}")
    # Where the expandable replay stopped at its OOM, the recorded column covers the same events.
    return WhatIfAnswer(expandable.recorded_compared(), expandable.simulated, more, tuple(notes))
