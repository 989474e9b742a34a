"""Analyse one snapshot in a separate process that can be stopped: the app's only door to memlens.

A hostile or simply enormous file can keep the unpickler busy in C code for ever or swallow the
machine's memory, so each analysis runs through ``memlens.sandbox`` (a child forked from a
``forkserver``, its address space capped, killed at a wall-clock deadline); the server's threads
only wait on a pipe meanwhile, so every other request is answered. The MCP server runs its tool
calls through the same sandbox, under the same limits.

What comes back is the ``Analysis`` (the report with its snapshot's numpy columns), pickled through
the pipe: on a 1,000,000-event file that is ~76 MiB and well under a tenth of a second each way,
next to ~2 s of analysis, so a plainer copy of the report would save little.
"""

from __future__ import annotations

import logging
from typing import Any

from memlens.sandbox import DEFAULT_PRELOAD, DEFAULT_TIMEOUT_S, Crashed, Limits, ProcessGroup, Stopped, run_limited
from memlens.sandbox import default_memory_limit as default_memory_limit

log = logging.getLogger("memlens.app")

DEFAULT_ANALYSIS_TIMEOUT_S = DEFAULT_TIMEOUT_S
# Modules the forkserver imports once, so that each forked child starts with them loaded.
_PRELOAD = [*DEFAULT_PRELOAD, "memlens_app.worker"]

# The sandbox's names, as the app has always called them.
AnalysisLimits = Limits
AnalysisStopped = Stopped
AnalysisCrashed = Crashed
WorkerGroup = ProcessGroup


def analyse_in_worker(path: str, *, uploaded: bool, limits: AnalysisLimits, workers: WorkerGroup) -> Any:
    """Load and analyse ``path`` in a child process under ``limits``; the ``Analysis`` it built.

    Raises ``MemlensError`` for a file memlens cannot read (the reader's own message),
    ``AnalysisStopped`` when a limit was hit, ``AnalysisCrashed`` for a bug in memlens.
    """
    return run_limited(analyze_file, (path, uploaded), limits=limits, group=workers, what="analysis",
                       preload=_PRELOAD)


def analyze_file(path: str, uploaded: bool = False) -> Any:
    """Load with the safe reader and analyse (what each child runs)."""
    import memlens

    # An upload lives in a temporary folder: a cache file beside it would only cost disk.
    snapshot = memlens.load(path, cache=False if uploaded else None)
    from memlens.analysis import analyze_snapshot

    return analyze_snapshot(snapshot)
