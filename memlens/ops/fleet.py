"""The fleet service: many snapshots of one job (one per rank) analysed in parallel, a per-rank
table, and the outlier rank(s) named with the reason they differ, as typed results.

    fleet = triage_fleet(sorted(glob("runs/*/rank*.pickle")), jobs=8)        # child processes
    fleet = triage_fleet(paths, dask="tcp://scheduler:8786")                 # an existing Dask cluster
    fleet.to_json()                                                          # what --json prints

Each rank is analysed by ``rank_job``: the one per-file analysis (``memlens.ops.triage.
analyse``) and its table row (``rank_row``), built from the typed report. Here each runs in
its own child process under the runner's time and memory limits (``memlens.ops.runner.run_each``),
at most ``jobs`` at once; on a Dask cluster, in the workers (which have their own memory limits).
Only the row (and, when asked, the report) comes back, never the snapshot. Results come back in
input order, and a file that cannot be analysed (unreadable, hostile, past a limit, a child that
died on it) is one row with its error, worded by ``memlens.ops.errors``, never the fleet's end.

The outlier analysis compares every rank with the fleet's median using a robust z-score (the
deviation over 1.4826 x the median absolute deviation, which is the standard deviation for normal
data but is not dragged along by the outliers themselves), on the peak allocated, the peak
reserved and each category at the peak. Identical ranks (deterministic data-parallel replicas)
have a spread of zero, so the spread is floored at a small share of the fleet's median peak, and
a deviation must also be a noticeable share of that peak to count: a rank is never an outlier
for a few bytes. For each outlier the category deltas at the peak and the findings it has and
the others do not (or in other amounts) say why, in bytes.

The dashboard's ranks tab builds the same rows from the reports it already has (``rank_row``) and
the same verdicts (``fleet_of_rows``, ``no_outlier_verdict``, ``side_by_side``).
"""

from __future__ import annotations

import os
import re
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec

from memlens.analysis.datatypes import CATEGORIES
from memlens.analysis.report import Finding, Report, Step
from memlens.errors import MemlensUsageError
from memlens.ops.errors import describe
from memlens.ops.runner import DEFAULT_PRELOAD, Limits, run_each
from memlens.ops.triage import TriageOptions, analyse
from memlens.printable import printable
from memlens.units import format_bytes

FLEET_SCHEMA_VERSION = 1

# Iglewicz and Hoaglin's cut-off for the modified z-score: beyond 3.5 a value is an outlier.
OUTLIER_Z = 3.5
# 1.4826 x MAD estimates the standard deviation of normally distributed values.
MAD_TO_SIGMA = 1.4826
# Spread floor, as a share of the metric's base (the fleet's median peak): with identical replicas
# the MAD is 0 and any byte would be infinitely far; with this floor a rank must be 3.5% off.
SPREAD_FLOOR_SHARE = 0.01
# A deviation, a category delta or a finding difference smaller than this share of the median
# peak is not a reason: it is noise in the explanation.
SIGNIFICANT_SHARE = 0.05
# Fewer ranks than this have no majority to differ from (with two, each is as far from the median).
MIN_RANKS_FOR_OUTLIERS = 3
# Each rank's analysis may take this long in its child: a fleet runs unattended, on files as
# large as PyTorch writes (the analysis reads ~10 MiB of pickle a second on a busy core).
RANK_TIMEOUT_S = 900.0

# What each rank's child starts with (the forkserver imports it once): the runner's, and this.
PRELOAD = (*DEFAULT_PRELOAD, "memlens.ops.fleet")

_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)

Executor = Literal["processes", "dask", "dashboard"]
Progress = Callable[[int, int], None]


# --------------------------------------------------------------------------- typed results


class FindingSummary(msgspec.Struct, frozen=True):
    kind: str
    severity: str
    bytes: int
    summary: str
    where: str  # the top stack's innermost frame, "" without stacks
    held_by: str = ""  # a leak's holder, as the recorder named it ("`kept`, stored at train.py:40")


class RankRow(msgspec.Struct, frozen=True):
    """One file of the fleet, as the table shows it; ``error`` set when it could not be analysed."""

    path: str
    rank: int | None
    world_size: int | None
    device: int | None
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    steps: int
    step_time_ms: float | None  # median of the complete steps
    categories_at_peak: dict[str, int]
    findings: list[FindingSummary]
    seconds: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def label(self) -> str:
        return f"rank {self.rank}" if self.rank is not None else os.path.basename(self.path)


class Deviation(msgspec.Struct, frozen=True):
    """One metric on which a rank stands out: its value, the fleet's median, the robust z-score."""

    metric: str  # "peak_allocated", "peak_reserved" or a category name ("activations")
    value: int
    median: float
    delta: float
    robust_z: float


class Difference(msgspec.Struct, frozen=True):
    """One reason a rank differs: a category at the peak, or a finding, in bytes against the median."""

    what: Literal["category", "finding"]
    name: str
    value: int
    median: float
    delta: float
    detail: str = ""  # a finding's severity, where it comes from and who holds it


class Outlier(msgspec.Struct, frozen=True):
    index: int  # the row's place in the table
    rank: int | None
    path: str
    deviations: list[Deviation]
    reasons: list[Difference]
    verdict: str


class FleetReport(msgspec.Struct):
    rows: list[RankRow]
    outliers: list[Outlier]
    medians: dict[str, float]
    executor: Executor
    workers: int | None
    wall_seconds: float
    # Two ranks have no majority to differ from: how the higher one differs from the other.
    pair: str | None = None
    # Each file's report (None for a failed file), kept only when asked for.
    reports: list[Report | None] | None = None

    @property
    def failed(self) -> list[RankRow]:
        return [row for row in self.rows if not row.ok]

    def finding_kinds(self) -> set[str]:
        """The kinds of finding any analysed rank has (what ``--fail-on`` checks)."""
        return {finding.kind for row in self.rows for finding in row.findings}

    def to_json(self) -> dict[str, Any]:
        """What ``memlens fleet --json`` prints (schema ``FLEET_SCHEMA_VERSION``)."""
        payload: dict[str, Any] = {
            "fleet_schema_version": FLEET_SCHEMA_VERSION,
            "executor": self.executor,
            "workers": self.workers,
            "wall_seconds": self.wall_seconds,
            "ranks": msgspec.to_builtins(self.rows),
            "medians": dict(self.medians),
            "outliers": msgspec.to_builtins(self.outliers),
            "pair": self.pair,
        }
        if self.reports is not None:
            payload["reports"] = [None if report is None else report.to_json() for report in self.reports]
        return payload


class RankResult(msgspec.Struct, frozen=True):
    """What ``rank_job`` hands back from its child: the row, and the report when it was asked for."""

    row: RankRow
    report: Report | None = None


# --------------------------------------------------------------------------- rows


def rank_from_name(path: str) -> int | None:
    """``rank12.pickle``, ``ddp_rank3.pickle``, ``rank_7/...`` -> the number; else None."""
    matches = _RANK_IN_NAME.findall(path)
    return int(matches[-1]) if matches else None


def _rank_of(path: str, sidecar_rank: int | None, world_size: int | None) -> int | None:
    # The sidecar's rank only when the job had ranks: a single-process recording says rank 0.
    rank = sidecar_rank if world_size is not None and world_size > 1 else None
    return rank if rank is not None else rank_from_name(path)


def _job_place(report: Report) -> tuple[int | None, int | None]:
    """(rank, world size) as the recorder's sidecar has them; (None, None) without one."""
    sidecar = report.sidecar  # its reader checked them: non-negative ints or None
    return (sidecar.rank, sidecar.world_size) if sidecar is not None else (None, None)


def _holder(finding: Finding) -> str:
    """A leak's holder, as the recorder named it, with where it was stored; "" without one."""
    holder = finding.evidence.get("held_by")
    if not isinstance(holder, str) or not holder:
        return ""
    line = finding.evidence.get("held_by_line")
    return f"{holder}, stored at {line}" if isinstance(line, str) and line else holder


def _where(finding: Finding) -> str:
    top = finding.top_stacks[0].frames if finding.top_stacks else []
    return top[0] if top else ""


def _median_step_ms(steps: Sequence[Step]) -> float | None:
    durations = [(s.end_us - s.start_us) / 1000 for s in steps
                 if not s.partial and s.start_us is not None and s.end_us is not None]
    return statistics.median(durations) if durations else None


def rank_row(path: str, report: Report, device: int | None = None, seconds: float = 0.0) -> RankRow:
    """The fleet table's row for one analysed snapshot (``device``: None for the report's main one;
    an unknown one is a ``MemlensUsageError``)."""
    dev = report.device(device)
    sidecar_rank, world = _job_place(report)
    findings = [FindingSummary(kind=f.kind, severity=f.severity, bytes=int(f.bytes), summary=f.summary,
                               where=_where(f), held_by=_holder(f)) for f in dev.findings]
    return RankRow(
        path=path, rank=_rank_of(path, sidecar_rank, world), world_size=world, device=dev.device,
        peak_allocated_bytes=int(dev.peak_allocated_bytes), peak_reserved_bytes=int(dev.peak_reserved_bytes),
        steps=len(dev.steps), step_time_ms=_median_step_ms(dev.steps),
        categories_at_peak={name: int(dev.categories_at_peak.get(name, 0)) for name in CATEGORIES},
        findings=findings, seconds=seconds,
    )


def failed_row(path: str, error: str, seconds: float = 0.0) -> RankRow:
    """The row of a file that could not be analysed: shown with its error, never dropped."""
    return RankRow(path, rank_from_name(path), None, None, 0, 0, 0, None, {}, [], seconds, error=error)


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


# --------------------------------------------------------------------------- outliers


def robust_z(values: Sequence[float], floor: float) -> tuple[float, list[float]]:
    """The median of ``values`` and each value's robust z-score against it.

    z = (x - median) / max(1.4826 x MAD, floor): the MAD is the median of the absolute deviations,
    so up to half the values may be outliers without moving it; ``floor`` (> 0) keeps identical
    values from making every difference infinite.
    """
    median = statistics.median(values)
    mad = statistics.median(abs(v - median) for v in values)
    scale = max(MAD_TO_SIGMA * mad, floor)
    return median, [(v - median) / scale for v in values]


def find_outliers(rows: Sequence[RankRow]) -> tuple[list[Outlier], dict[str, float]]:
    """The outlier ranks among ``rows`` (failed ones left out) and the fleet's medians per metric."""
    good = [(index, row) for index, row in enumerate(rows) if row.ok]
    if not good:
        return [], {}
    metrics: dict[str, list[float]] = {
        "peak_allocated": [row.peak_allocated_bytes for _, row in good],
        "peak_reserved": [row.peak_reserved_bytes for _, row in good],
    }
    for category in CATEGORIES:
        metrics[category] = [row.categories_at_peak.get(category, 0) for _, row in good]
    medians = {name: float(statistics.median(values)) for name, values in metrics.items()}
    if len(good) < MIN_RANKS_FOR_OUTLIERS:
        return [], medians
    # Categories are parts of the allocated peak: they are measured against it, so a category
    # going from 0 B to 4 KiB in a 10 GiB job is no outlier.
    base = {name: medians["peak_reserved" if name == "peak_reserved" else "peak_allocated"] for name in metrics}
    flagged: dict[int, list[Deviation]] = {}
    for name, values in metrics.items():
        significant = max(SIGNIFICANT_SHARE * base[name], 1.0)
        median, scores = robust_z(values, floor=max(SPREAD_FLOOR_SHARE * base[name], 1.0))
        for (index, _), value, z in zip(good, values, scores, strict=True):
            if abs(z) >= OUTLIER_Z and abs(value - median) >= significant:
                flagged.setdefault(index, []).append(Deviation(name, int(value), median, value - median, z))
    finding_medians = _finding_medians([row for _, row in good])
    outliers = []
    for index in sorted(flagged):
        row = rows[index]
        reasons = explain(row, medians, finding_medians)
        outliers.append(Outlier(index, row.rank, row.path, flagged[index], reasons,
                                verdict_line(row, flagged[index], reasons)))
    return outliers, medians


def _finding_bytes(row: RankRow) -> dict[str, int]:
    totals: dict[str, int] = {}
    for finding in row.findings:
        totals[finding.kind] = totals.get(finding.kind, 0) + finding.bytes
    return totals


def _finding_medians(rows: Sequence[RankRow]) -> dict[str, float]:
    """Per finding kind, the median over ranks of its bytes (0 for a rank without it)."""
    per_rank = [_finding_bytes(row) for row in rows]
    kinds = sorted({kind for totals in per_rank for kind in totals})
    return {kind: float(statistics.median(t.get(kind, 0) for t in per_rank)) for kind in kinds}


def explain(row: RankRow, medians: dict[str, float], finding_medians: dict[str, float]) -> list[Difference]:
    """Why ``row`` differs, in bytes, largest first: the categories at the peak that account for
    the difference, then the findings it has that the fleet has not (or in other amounts)."""
    significant = max(SIGNIFICANT_SHARE * medians.get("peak_allocated", 0.0), 1.0)
    reasons = []
    for name in CATEGORIES:
        value = row.categories_at_peak.get(name, 0)
        delta = value - medians.get(name, 0.0)
        if abs(delta) >= significant:
            reasons.append(Difference("category", name, value, medians.get(name, 0.0), delta))
    totals = _finding_bytes(row)
    for kind in sorted(set(totals) | set(finding_medians)):
        value = totals.get(kind, 0)
        delta = value - finding_medians.get(kind, 0.0)
        if abs(delta) < significant:
            continue
        mine = [f for f in row.findings if f.kind == kind]
        detail = ""
        if mine:
            top = max(mine, key=lambda f: f.bytes)
            detail = ", ".join(part for part in (top.severity, top.where and f"from {top.where}",
                                                 top.held_by and f"held by {top.held_by}") if part)
        reasons.append(Difference("finding", kind, value, finding_medians.get(kind, 0.0), delta, detail))
    reasons.sort(key=lambda r: (r.what != "category", -abs(r.delta)))
    return reasons


def _signed(delta: float) -> str:
    return ("+" if delta >= 0 else "-") + format_bytes(int(abs(delta)))


_METRIC_WORDS = {"peak_allocated": "peak allocated", "peak_reserved": "peak reserved"}


def verdict_line(row: RankRow, deviations: Sequence[Deviation], reasons: Sequence[Difference]) -> str:
    """One sentence per outlier: what stands out, by how much, and what accounts for it."""
    # The peaks first (allocated, then reserved), then a category that moved without the peak.
    peaks = [d for d in deviations if d.metric in _METRIC_WORDS]
    shown = (sorted(peaks, key=lambda d: d.metric != "peak_allocated")
             or [max(deviations, key=lambda d: abs(d.robust_z))])
    parts = []
    for deviation in shown:
        word = _METRIC_WORDS.get(deviation.metric, f"{deviation.metric} at the peak")
        share = f" ({deviation.delta / deviation.median:+.0%})" if deviation.median else ""
        parts.append(f"{word} {format_bytes(deviation.value)}, {_signed(deviation.delta)}{share} against the "
                     f"median {format_bytes(int(deviation.median))} (robust z {deviation.robust_z:+.1f})")
    text = f"{row.label}: " + "; ".join(parts)
    categories = [r for r in reasons if r.what == "category"]
    if categories:
        text += "; at the peak " + ", ".join(f"{r.name} {_signed(r.delta)}" for r in categories)
    findings = [r for r in reasons if r.what == "finding"]
    for reason in findings:
        if reason.median == 0 and reason.value:
            text += f"; only this rank has a {reason.name} finding ({format_bytes(reason.value)}"
        elif reason.value == 0:
            text += f"; no {reason.name} finding here (the median rank: {format_bytes(int(reason.median))}"
        else:
            text += (f"; {reason.name} {format_bytes(reason.value)} against the median "
                     f"{format_bytes(int(reason.median))} ({_signed(reason.delta)}")
        text += f", {reason.detail})" if reason.detail else ")"
    return text


def pair_difference(rows: Sequence[RankRow]) -> str | None:
    """With exactly two analysed ranks: the higher peak against the other, by category, or None
    when they are within ``SIGNIFICANT_SHARE`` of each other."""
    good = [row for row in rows if row.ok]
    if len(good) != 2:
        return None
    low, high = sorted(good, key=lambda row: row.peak_allocated_bytes)
    delta = high.peak_allocated_bytes - low.peak_allocated_bytes
    if delta < SIGNIFICANT_SHARE * max(low.peak_allocated_bytes, 1):
        return None
    base = {name: float(value) for name, value in low.categories_at_peak.items()}
    base["peak_allocated"] = float(low.peak_allocated_bytes)
    base_findings = {kind: float(size) for kind, size in _finding_bytes(low).items()}
    reasons = explain(high, base, base_findings)
    text = (f"{high.label}: peak allocated {format_bytes(high.peak_allocated_bytes)}, {_signed(delta)} against "
            f"{low.label} ({format_bytes(low.peak_allocated_bytes)})")
    categories = [r for r in reasons if r.what == "category"]
    if categories:
        text += "; at the peak " + ", ".join(f"{r.name} {_signed(r.delta)}" for r in categories)
    kinds = [r for r in reasons if r.what == "finding"]
    if kinds:
        text += "; findings " + ", ".join(f"{r.name} {_signed(r.delta)}" for r in kinds)
    return text


def no_outlier_verdict(fleet: FleetReport) -> str:
    """Why no rank is named an outlier, the one sentence every face prints (``fleet.outliers`` empty).

    Fewer than ``MIN_RANKS_FOR_OUTLIERS`` analysed ranks have no majority to differ from (two
    ranks apart by a third are not "in agreement": ``fleet.pair`` then says how they differ);
    otherwise every rank is near the median.
    """
    good = [row for row in fleet.rows if row.ok]
    if len(good) < MIN_RANKS_FOR_OUTLIERS:
        files = f"{len(good)} analysed file{'' if len(good) == 1 else 's'}"
        return f"none named: {files} {'has' if len(good) == 1 else 'have'} no majority to differ from"
    low = min(row.peak_allocated_bytes for row in good)
    high = max(row.peak_allocated_bytes for row in good)
    return (f"none: every rank's peaks and categories are near the median "
            f"(peak allocated {format_bytes(low)} to {format_bytes(high)})")


def fleet_of_rows(rows: Sequence[RankRow], executor: Executor, workers: int | None = None,
                  wall_seconds: float = 0.0, reports: list[Report | None] | None = None) -> FleetReport:
    """The fleet report of analysed ``rows``: outliers, medians and, for two ranks, the pair's
    difference, as ``triage_fleet`` and the dashboard's ranks tab both build it."""
    outliers, medians = find_outliers(rows)
    return FleetReport(list(rows), outliers, medians, executor, workers, wall_seconds, pair_difference(rows),
                       reports=reports)


# --------------------------------------------------------------------------- executors


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


# Files go to a Dask cluster in chunks, about this many per worker thread: one round trip per
# chunk rather than per file, still balanced.
CHUNKS_PER_WORKER = 4


def _chunks(count: int, workers: int) -> list[list[int]]:
    """Indices 0..count-1 in consecutive chunks, about ``CHUNKS_PER_WORKER`` per worker."""
    size = max(1, -(-count // (workers * CHUNKS_PER_WORKER)))
    return [list(range(start, min(start + size, count))) for start in range(0, count, size)]


def _task_chunk(paths: Sequence[str], capacity: int | None, device: int | None, cache: bool | None,
                keep_reports: bool) -> list[RankResult]:
    return [rank_task(path, capacity, device, cache, keep_reports) for path in paths]


def run_dask(paths: Sequence[str], address: str, *, capacity: int | None = None, device: int | None = None,
             cache: bool | None = None, keep_reports: bool = False,
             progress: Progress | None = None) -> list[RankResult]:
    """``rank_task`` for each path on the Dask cluster at ``address``; results in input order.

    The workers read the files themselves, so the paths (made absolute here) must name the same
    files on the workers: a shared filesystem, as a cluster's job output usually is.
    """
    try:
        from distributed import Client
    except ImportError:
        raise MemlensUsageError("--dask needs Dask's distributed scheduler: pip install 'memlens[dask]'") from None
    try:
        client = Client(address, timeout="30s")
    except (OSError, TimeoutError, ValueError) as exc:
        raise MemlensUsageError(f"cannot reach the Dask scheduler at {address!r}: {printable(exc, 200)}") from None
    options = (capacity, device, cache, keep_reports)
    try:
        threads = max(1, sum(client.nthreads().values()))
        chunks = _chunks(len(paths), threads)
        # pure=False: two files with equal paths are still two tasks, and a rerun reanalyses.
        futures = [client.submit(_task_chunk, [paths[i] for i in chunk], *options, pure=False) for chunk in chunks]
        results: list[RankResult] = []
        for chunk, future in zip(chunks, futures, strict=True):
            try:
                results.extend(future.result())
            except Exception:  # KilledWorker and the like: the chunk's files one by one, to name the culprit
                for index in chunk:
                    one = client.submit(rank_task, paths[index], *options, pure=False)
                    try:
                        results.append(one.result())
                    except Exception as exc:
                        results.append(RankResult(failed_row(paths[index], f"the Dask task failed: "
                                                                           f"{describe(exc).text}")))
            if progress:
                progress(len(results), len(paths))
        return results
    finally:
        client.close()  # ours to close; the cluster is not ours to stop


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
    return RankResult(msgspec.structs.replace(row, path=name, error=error, rank=_rank_of(
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


class RanksSideBySide(msgspec.Struct, frozen=True):
    """The ranks side by side as columns, for a chart (the dashboard's per-rank bars): one entry
    per analysed file in table order, the categories at the peak stacked, outliers marked."""

    labels: list[str]
    paths: list[str]
    peak_allocated_bytes: list[int]
    peak_reserved_bytes: list[int]
    categories_at_peak: dict[str, list[int]]
    step_time_ms: list[float | None]
    outlier: list[bool]
    verdicts: list[str]
    failed: list[RankRow]


def side_by_side(fleet: FleetReport) -> RanksSideBySide:
    """``fleet``'s analysed ranks as chart columns (``memlens.figures.ranks.ranks_figure``)."""
    good_indices = [index for index, row in enumerate(fleet.rows) if row.ok]
    good = [fleet.rows[index] for index in good_indices]
    outlying = {o.index for o in fleet.outliers}
    return RanksSideBySide(
        labels=[row.label for row in good],
        paths=[row.path for row in good],
        peak_allocated_bytes=[row.peak_allocated_bytes for row in good],
        peak_reserved_bytes=[row.peak_reserved_bytes for row in good],
        categories_at_peak={name: [row.categories_at_peak.get(name, 0) for row in good] for name in CATEGORIES},
        step_time_ms=[row.step_time_ms for row in good],
        outlier=[index in outlying for index in good_indices],
        verdicts=[o.verdict for o in fleet.outliers],
        failed=[row for row in fleet.rows if not row.ok],
    )


__all__ = [
    "FLEET_SCHEMA_VERSION",
    "RANK_TIMEOUT_S",
    "Deviation",
    "Difference",
    "FindingSummary",
    "FleetReport",
    "Outlier",
    "RankResult",
    "RankRow",
    "RanksSideBySide",
    "default_jobs",
    "explain",
    "failed_row",
    "find_outliers",
    "fleet_of_rows",
    "no_outlier_verdict",
    "pair_difference",
    "rank_from_name",
    "rank_job",
    "rank_row",
    "rank_task",
    "robust_z",
    "run_dask",
    "run_in_children",
    "side_by_side",
    "triage_fleet",
]
