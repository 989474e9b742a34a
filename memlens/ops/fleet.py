"""The fleet service: many snapshots of one job (one per rank) analysed in parallel, a per-rank
table, and the outlier rank(s) named with the reason they differ, as typed results.

    fleet = triage_fleet(sorted(glob("runs/*/rank*.pickle")), jobs=8)        # child processes
    fleet = triage_fleet(paths, dask="tcp://scheduler:8786")                 # an existing Dask cluster
    fleet.to_json()                                                          # what --json prints

Each rank is analysed by ``rank_job``: the one per-file analysis (``memlens.ops.triage.
analyse``) and its table row (``memlens.fleet.rows.rank_row``), built from the typed report.
Here each runs in its own child process under the runner's time and memory limits
(``memlens.ops.runner.run_each``), at most ``jobs`` at once; on a Dask cluster, in the workers
(which have their own memory limits). Only the row (and, when asked, the report) comes back, never
the snapshot. Results come back in input order, and a file that cannot be analysed (unreadable,
hostile, past a limit, a child that died on it) is one row with its error, worded by
``memlens.ops.errors``, never the fleet's end. The outliers and their verdicts are
``memlens.fleet.outliers``'.

The faces take the fleet's typed values from here: the rows and the report (``memlens.fleet.rows``)
and the verdicts (``memlens.fleet.outliers``), which the dashboard's ranks tab builds from the
reports it already has (``rank_row``, ``fleet_of_rows``, ``no_outlier_verdict``).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from memlens.errors import MemlensUsageError
from memlens.fleet.cluster import run_on_dask
from memlens.fleet.outliers import fleet_of_rows, no_outlier_verdict
from memlens.fleet.rows import Executor, FleetReport, RankResult, RankRow, failed_row, rank_from_name, rank_of, rank_row
from memlens.ops.errors import describe
from memlens.ops.runner import DEFAULT_PRELOAD, Limits, run_each
from memlens.ops.triage import TriageOptions, analyse

# Each rank's analysis may take this long in its child: a fleet runs unattended, on files as
# large as PyTorch writes (the analysis reads ~10 MiB of pickle a second on a busy core).
RANK_TIMEOUT_S = 900.0

# What each rank's child starts with (the forkserver imports it once): the runner's, and this.
PRELOAD = (*DEFAULT_PRELOAD, "memlens.ops.fleet")

Progress = Callable[[int, int], None]


def rank_job(path: str, capacity: int | None = None, device: int | None = None, cache: bool | None = None,
             keep_report: bool = False) -> RankResult:
    """What one rank's child (or Dask task) runs: the one per-file analysis, and its row."""
    started = time.perf_counter()
    report = analyse(path, TriageOptions(cache=cache, capacity=capacity)).report
    row = rank_row(path, report, device, seconds=time.perf_counter() - started)
    return RankResult(row, report if keep_report else None)


def rank_task(path: str, capacity: int | None = None, device: int | None = None, cache: bool | None = None,
              keep_report: bool = False) -> RankResult:
    """``rank_job`` where no runner stands around it (a Dask worker): a failure is the row's
    error, worded by the one rule, never the task's end."""
    started = time.perf_counter()
    try:
        return rank_job(path, capacity, device, cache, keep_report)
    except Exception as exc:  # one file's failure must not end a 512-rank fleet
        return RankResult(failed_row(path, describe(exc).text, time.perf_counter() - started))


def run_in_children(paths: Sequence[str], jobs: int, *, capacity: int | None = None, device: int | None = None,
                    cache: bool | None = None, keep_reports: bool = False, limits: Limits | None = None,
                    progress: Progress | None = None) -> list[RankResult]:
    """``rank_job`` for each path, each in its own child under ``limits`` (``memlens.ops.runner``),
    at most ``jobs`` at once; in input order, a failure as its row's error."""
    outcomes = run_each(rank_job, [(path, capacity, device, cache, keep_reports) for path in paths], jobs=jobs,
                        limits=limits if limits is not None else Limits(timeout_s=RANK_TIMEOUT_S),
                        what="analysis", preload=PRELOAD, progress=progress)
    return [outcome.value if outcome.ok else RankResult(failed_row(path, str(outcome.error), outcome.seconds))
            for path, outcome in zip(paths, outcomes, strict=True)]


def run_dask(paths: Sequence[str], address: str, *, capacity: int | None = None, device: int | None = None,
             cache: bool | None = None, keep_reports: bool = False,
             progress: Progress | None = None) -> list[RankResult]:
    """``rank_task`` for each path on the Dask cluster at ``address`` (``memlens.fleet.cluster``);
    results in input order. The paths must name the same files on the workers."""
    task = functools.partial(rank_task, capacity=capacity, device=device, cache=cache, keep_report=keep_reports)
    return run_on_dask(paths, address, task, _dask_failure, progress)


def _dask_failure(path: str, exc: BaseException) -> RankResult:
    """The row of a file whose Dask task failed even on its own, worded by the one rule."""
    return RankResult(failed_row(path, f"the Dask task failed: {describe(exc).text}"))


def default_jobs(paths: Sequence[str]) -> int:
    """The CPUs this process may use, capped by the number of files."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, len(paths)))


def _as_typed(result: RankResult, name: str, full: str) -> RankResult:
    """A result under the path as the user typed it, not the absolute form the workers were given
    (errors name it too): a Dask worker, or a child forked from a server started in another
    folder, resolves a relative path elsewhere."""
    row = result.row
    error = row.error
    if error is not None and error.startswith(full + ": "):
        error = name + error[len(full):]
    return RankResult(msgspec.structs.replace(row, path=name, error=error, rank=rank_of(
        name, row.rank if row.world_size is not None and row.world_size > 1 else None, row.world_size)),
        result.report)


# --------------------------------------------------------------------------- entry point


def triage_fleet(paths: Sequence[str | os.PathLike[str]], *, jobs: int | None = None, dask: str | None = None,
                 capacity: int | None = None, device: int | None = None, cache: bool | None = None,
                 keep_reports: bool = False, limits: Limits | None = None,
                 progress: Progress | None = None) -> FleetReport:
    """Analyse every snapshot in ``paths`` and compare the ranks.

    ``jobs``: ranks analysed at once, each in its own child process (default: the CPUs, capped
    by the files); ``dask``: the address of a running Dask scheduler (then ``jobs`` is unused);
    ``capacity``, ``device``, ``cache``: as for one ``memlens.analyze``/``memlens.load``;
    ``keep_reports``: keep each file's report in ``FleetReport.reports``; ``limits``: each
    child's time and memory (default: ``RANK_TIMEOUT_S`` and half the machine's memory).
    """
    names = [os.fspath(p) for p in paths]
    if not names:
        raise MemlensUsageError("no snapshots to compare")
    if jobs is not None and jobs < 1:
        raise MemlensUsageError(f"--jobs must be at least 1, got {jobs}")
    options: dict[str, Any] = {"capacity": capacity, "device": device, "cache": cache, "keep_reports": keep_reports}
    started = time.perf_counter()
    absolute = [os.path.abspath(n) for n in names]
    executor: Executor
    if dask is not None:
        executor, workers = "dask", None
        ran = run_dask(absolute, dask, progress=progress, **options)
    else:
        executor, workers = "processes", min(jobs, len(names)) if jobs is not None else default_jobs(names)
        ran = run_in_children(absolute, workers, limits=limits, progress=progress, **options)
    results = [_as_typed(result, name, full) for result, name, full in zip(ran, names, absolute, strict=True)]
    wall = time.perf_counter() - started
    return fleet_of_rows([result.row for result in results], executor, workers, wall,
                         reports=[result.report for result in results] if keep_reports else None)


__all__ = [
    "RANK_TIMEOUT_S",
    "FleetReport",
    "Progress",
    "RankResult",
    "RankRow",
    "default_jobs",
    "failed_row",
    "fleet_of_rows",
    "no_outlier_verdict",
    "rank_from_name",
    "rank_job",
    "rank_row",
    "rank_task",
    "run_dask",
    "run_in_children",
    "triage_fleet",
]
