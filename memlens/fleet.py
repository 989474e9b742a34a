"""Fleets of ranks: many snapshots (one per rank) analysed in parallel, a per-rank table, and the
outlier rank(s) named with the reason they differ.

    fleet = triage_fleet(sorted(glob("runs/*/rank*.pickle")), jobs=8)        # a process pool
    fleet = triage_fleet(paths, dask="tcp://scheduler:8786")                 # an existing Dask cluster
    fleet.to_json()                                                          # plain data

Each file is analysed by ``analyse_file`` (a module-level function, so a process pool or a Dask
worker can import it by name), which returns the report's plain JSON, never a live object: the
workers hand back only numbers and text. Results come back in input order, and a file that cannot
be analysed (unreadable, hostile, a worker that died on it) is one row with its error, never a
crash of the whole triage.

The outlier analysis compares every rank with the fleet's median using a robust z-score (the
deviation over 1.4826 x the median absolute deviation, which is the standard deviation for normal
data but is not dragged along by the outliers themselves), on the peak allocated, the peak
reserved and each category at the peak. Identical ranks (deterministic data-parallel replicas)
have a spread of zero, so the spread is floored at a small share of the fleet's median peak, and
a deviation must also be a noticeable share of that peak to count: a rank is never an outlier
for a few bytes. For each outlier the category deltas at the peak and the findings it has and
the others do not (or in other amounts) say why, in bytes.
"""

from __future__ import annotations

import os
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from memlens.analysis.datatypes import CATEGORIES
from memlens.errors import MemlensError, MemlensUsageError
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

_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)


# --------------------------------------------------------------------------- the worker


def analyse_file(path: str, capacity: int | None = None, device: int | None = None,
                 cache: bool | None = None) -> dict[str, Any]:
    """Load and analyse one snapshot; return plain JSON: the report, the rank, or the error.

    Runs in a worker process or on a Dask worker: it never raises for a bad file (the error is
    the result), and returns builtins only (``Report.to_json()``), so nothing live is pickled
    back. Keys: ``path``, ``report`` (or None), ``device`` (the one the table shows), ``rank`` and
    ``world_size`` (from the recorder's sidecar, None without one), ``error`` (None when it
    worked) and ``seconds`` (the time the analysis took there).
    """
    from memlens.analysis import analyze
    from memlens.snapshot.reader import load

    started = time.perf_counter()
    result: dict[str, Any] = {"path": path, "report": None, "device": None, "rank": None, "world_size": None,
                              "error": None, "seconds": 0.0}
    try:
        report = analyze(load(path, cache=cache), capacity=capacity)
        result["device"] = report.device(device).device
        if report.sidecar is not None:  # its reader checked them: non-negative ints or None
            result["rank"], result["world_size"] = report.sidecar.rank, report.sidecar.world_size
        result["report"] = report.to_json()
    except MemlensError as exc:
        result["error"] = printable(exc, 300)
    except (MemoryError, RecursionError) as exc:
        # What a crafted file does to a reader with no defence left: that file's row, not the fleet's end.
        result["error"] = f"ran out of {'memory' if isinstance(exc, MemoryError) else 'stack depth'} on this input"
    except Exception as exc:  # one file's bug of ours must not end a 512-rank triage
        result["error"] = f"internal error: {type(exc).__name__}: {printable(exc, 300)}"
    result["seconds"] = time.perf_counter() - started
    return result


# --------------------------------------------------------------------------- executors

Task = Callable[[str], dict[str, Any]]
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class _Bound:
    """``analyse_file`` with its options bound: picklable (a module-level class), unlike a lambda."""

    capacity: int | None
    device: int | None
    cache: bool | None

    def __call__(self, path: str) -> dict[str, Any]:
        return analyse_file(path, self.capacity, self.device, self.cache)


def _died(path: str, why: str) -> dict[str, Any]:
    return {"path": path, "report": None, "device": None, "rank": None, "world_size": None,
            "error": why, "seconds": 0.0}


def run_sequential(paths: Sequence[str], task: Task, progress: Progress | None = None) -> list[dict[str, Any]]:
    results = []
    for done, path in enumerate(paths, 1):
        results.append(task(path))
        if progress:
            progress(done, len(paths))
    return results


# What a worker needs, imported once by the fork server: each worker forked from it starts with
# them loaded (on a loaded 2-core machine a pool then starts in ~1 s instead of ~2 s, and a
# second pool in the same process in ~0.1 s).
_WORKER_MODULES = ["memlens.fleet", "memlens.analysis", "memlens.snapshot.reader", "memlens.snapshot.cache",
                   "numpy.ma"]


def _pool_context() -> Any:
    """forkserver where the platform has it (a clean, small parent to fork from: the CLI's own
    state, threads and open files are not copied into the workers), else spawn."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_WORKER_MODULES)  # takes effect when the server starts
    return context


# Files go to the pool in chunks, about this many per worker: one round trip per chunk rather
# than per file (on a busy machine each trip waits for a time slice), still balanced.
CHUNKS_PER_WORKER = 4


# After this many files in a row each killed the worker analysing it alone, stop retrying.
DEATHS_BEFORE_GIVING_UP = 3


def _run_chunk(task: Task, paths: Sequence[str]) -> list[dict[str, Any]]:
    return [task(path) for path in paths]


def _chunks(count: int, workers: int) -> list[list[int]]:
    """Indices 0..count-1 in consecutive chunks, about ``CHUNKS_PER_WORKER`` per worker."""
    size = max(1, -(-count // (workers * CHUNKS_PER_WORKER)))
    return [list(range(start, min(start + size, count))) for start in range(0, count, size)]


def run_processes(paths: Sequence[str], task: Task, jobs: int,
                  progress: Progress | None = None) -> list[dict[str, Any]]:
    """``task`` over ``paths`` in a pool of ``jobs`` processes; results in input order.

    A worker that dies (killed for memory, a crash in native code) breaks the whole pool and
    every chunk still in it. Those files are retried one at a time, each in a pool of one, so the
    file that kills its worker is named and the others still get analysed.
    """
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    results: list[dict[str, Any] | None] = [None] * len(paths)
    chunks = _chunks(len(paths), jobs)
    done = 0
    retry: list[int] = []
    with ProcessPoolExecutor(max_workers=jobs, mp_context=_pool_context()) as pool:
        futures = {pool.submit(_run_chunk, task, [paths[i] for i in chunk]): chunk for chunk in chunks}
        for future in as_completed(futures):
            chunk = futures[future]
            try:
                for index, result in zip(chunk, future.result(), strict=True):
                    results[index] = result
            except BrokenProcessPool:
                retry.extend(chunk)
                continue
            done += len(chunk)
            if progress:
                progress(done, len(paths))
    deaths_in_a_row = 0
    for index in sorted(retry):
        if deaths_in_a_row >= DEATHS_BEFORE_GIVING_UP:
            # Workers that die whatever the file cannot start at all (no memory left, a broken
            # interpreter): the rest would each cost a pool start to learn the same.
            results[index] = _died(paths[index], f"not analysed: {DEATHS_BEFORE_GIVING_UP} worker processes "
                                                 "in a row died, each on its own file")
        else:
            with ProcessPoolExecutor(max_workers=1, mp_context=_pool_context()) as alone:
                try:
                    results[index] = alone.submit(task, paths[index]).result()
                    deaths_in_a_row = 0
                except BrokenProcessPool:
                    deaths_in_a_row += 1
                    results[index] = _died(paths[index], "the worker process analysing this file died "
                                                         "(killed for memory, or a crash)")
        done += 1
        if progress:
            progress(done, len(paths))
    return [r if r is not None else _died(p, "no result") for r, p in zip(results, paths, strict=True)]


def run_dask(paths: Sequence[str], task: Task, address: str,
             progress: Progress | None = None) -> list[dict[str, Any]]:
    """``task`` over ``paths`` on the Dask cluster at ``address``; results in input order.

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
    try:
        threads = max(1, sum(client.nthreads().values()))
        chunks = _chunks(len(paths), threads)
        # pure=False: two files with equal paths are still two tasks, and a rerun reanalyses.
        futures = [client.submit(_run_chunk, task, [paths[i] for i in chunk], pure=False) for chunk in chunks]
        results: list[dict[str, Any]] = []
        for chunk, future in zip(chunks, futures, strict=True):
            try:
                results.extend(future.result())
            except Exception:  # KilledWorker and the like: the chunk's files one by one, to name the culprit
                for index in chunk:
                    one = client.submit(task, paths[index], pure=False)
                    try:
                        results.append(one.result())
                    except Exception as exc:
                        results.append(_died(paths[index], f"the Dask task failed: {type(exc).__name__}: "
                                                           f"{printable(exc, 200)}"))
            if progress:
                progress(len(results), len(paths))
        return results
    finally:
        client.close()  # ours to close; the cluster is not ours to stop


# Below this many bytes of snapshots in all, the default is to analyse them here: starting the
# workers (~1 s) costs more than they would save (the analysis reads ~10 MiB of pickle a second).
IN_PROCESS_BYTES = 16 << 20


def default_jobs(paths: Sequence[str]) -> int:
    """The CPUs this process may use, capped by the number of files; 1 for a small fleet."""
    sizes = [os.path.getsize(p) if os.path.isfile(p) else 0 for p in paths]
    if sum(sizes) < IN_PROCESS_BYTES:
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, len(paths)))


# --------------------------------------------------------------------------- plain data


@dataclass(frozen=True)
class FindingSummary:
    kind: str
    severity: str
    bytes: int
    summary: str
    where: str  # the top stack's innermost frame, "" without stacks
    held_by: str = ""  # a leak's holder, as the recorder named it ("`kept`, appended at train.py:40")


@dataclass(frozen=True)
class RankRow:
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


@dataclass(frozen=True)
class Deviation:
    """One metric on which a rank stands out: its value, the fleet's median, the robust z-score."""

    metric: str  # "peak_allocated", "peak_reserved" or a category name ("activations")
    value: int
    median: float
    delta: float
    robust_z: float


@dataclass(frozen=True)
class Difference:
    """One reason, in bytes: a category at the peak, or a finding kind, against the fleet's median."""

    what: str  # "category" or "finding"
    name: str
    value: int
    median: float
    delta: float
    detail: str = ""  # for a finding: severity, its summary and where


@dataclass(frozen=True)
class Outlier:
    index: int  # position of the row in FleetReport.rows
    rank: int | None
    path: str
    deviations: list[Deviation]
    reasons: list[Difference]
    verdict: str


@dataclass
class FleetReport:
    rows: list[RankRow]
    outliers: list[Outlier]
    medians: dict[str, float]
    executor: str  # "sequential", "processes" or "dask"
    workers: int | None
    wall_seconds: float
    # Two ranks have no majority to differ from: how the higher one differs from the other.
    pair: str | None = None
    # The per-file reports' JSON (None for a failed file), kept only when asked for.
    reports: list[dict[str, Any] | None] | None = field(default=None, repr=False)

    @property
    def failed(self) -> list[RankRow]:
        return [row for row in self.rows if not row.ok]

    def to_json(self) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "fleet_schema_version": FLEET_SCHEMA_VERSION,
            "executor": self.executor,
            "workers": self.workers,
            "wall_seconds": self.wall_seconds,
            "ranks": [asdict(row) for row in self.rows],
            "medians": dict(self.medians),
            "outliers": [asdict(outlier) for outlier in self.outliers],
            "pair": self.pair,
        }
        if self.reports is not None:
            payload["reports"] = list(self.reports)
        return payload


# --------------------------------------------------------------------------- rows


def rank_from_name(path: str) -> int | None:
    """``rank12.pickle``, ``ddp_rank3.pickle``, ``rank_7/...`` -> the number; else None."""
    matches = _RANK_IN_NAME.findall(path)
    return int(matches[-1]) if matches else None


def row_from_result(result: dict[str, Any]) -> RankRow:
    """A table row from what ``analyse_file`` returned (a failed file: a row with its error)."""
    path = str(result.get("path", ""))
    # The sidecar's rank only when the job had ranks: a single-process recording says rank 0.
    world = result.get("world_size")
    rank = result.get("rank") if isinstance(world, int) and world > 1 else None
    if rank is None:
        rank = rank_from_name(path)
    report = result.get("report")
    if result.get("error") is not None or not isinstance(report, dict):
        return RankRow(path, rank, world, None, 0, 0, 0, None, {}, [], float(result.get("seconds", 0.0)),
                       error=str(result.get("error") or "no report"))
    device = result.get("device")
    dev = report["devices"][str(device)]
    findings = [
        FindingSummary(kind=f["kind"], severity=f["severity"], bytes=int(f["bytes"]), summary=f["summary"],
                       where=f["top_stacks"][0]["frames"][0] if f["top_stacks"] and f["top_stacks"][0]["frames"]
                       else "", held_by=_holder(f["evidence"]))
        for f in dev["findings"]
    ]
    return RankRow(
        path=path, rank=rank, world_size=world, device=device,
        peak_allocated_bytes=int(dev["peak_allocated_bytes"]), peak_reserved_bytes=int(dev["peak_reserved_bytes"]),
        steps=len(dev["steps"]), step_time_ms=_median_step_ms(dev["steps"]),
        categories_at_peak={name: int(dev["categories_at_peak"].get(name, 0)) for name in CATEGORIES},
        findings=findings, seconds=float(result.get("seconds", 0.0)),
    )


def _holder(evidence: dict[str, Any]) -> str:
    holder = evidence.get("held_by")
    if not isinstance(holder, str) or not holder:
        return ""
    line = evidence.get("held_by_line")
    return f"{holder}, stored at {line}" if isinstance(line, str) and line else holder


def _median_step_ms(steps: list[dict[str, Any]]) -> float | None:
    durations = [(s["end_us"] - s["start_us"]) / 1000 for s in steps
                 if not s.get("partial") and s.get("start_us") is not None and s.get("end_us") is not None]
    return statistics.median(durations) if durations else None


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


def fleet_of_rows(rows: Sequence[RankRow], executor: str, workers: int | None = None, wall_seconds: float = 0.0,
                  reports: list[dict[str, Any] | None] | None = None) -> FleetReport:
    """The fleet report of analysed ``rows``: outliers, medians and, for two ranks, the pair's
    difference, as ``triage_fleet`` and the dashboard's ranks tab both build it."""
    outliers, medians = find_outliers(rows)
    return FleetReport(list(rows), outliers, medians, executor, workers, wall_seconds, pair_difference(rows),
                       reports=reports)


# --------------------------------------------------------------------------- entry point


def triage_fleet(paths: Sequence[str | os.PathLike[str]], *, jobs: int | None = None, dask: str | None = None,
                 capacity: int | None = None, device: int | None = None, cache: bool | None = None,
                 keep_reports: bool = False, progress: Progress | None = None) -> FleetReport:
    """Analyse every snapshot in ``paths`` and compare the ranks.

    ``jobs``: worker processes (default: the CPUs, capped by the files, or none below
    ``IN_PROCESS_BYTES`` of snapshots; 1 analyses here, in this process); ``dask``: the address
    of a running Dask scheduler (then ``jobs`` is unused);
    ``capacity``, ``device``, ``cache``: as for one ``memlens.analyze``/``memlens.load``;
    ``keep_reports``: keep each file's report JSON in ``FleetReport.reports``.
    """
    names = [os.fspath(p) for p in paths]
    if not names:
        raise MemlensUsageError("no snapshots to triage")
    if jobs is not None and jobs < 1:
        raise MemlensUsageError(f"--jobs must be at least 1, got {jobs}")
    task = _Bound(capacity, device, cache)
    started = time.perf_counter()
    if dask is not None:
        absolute = [os.path.abspath(n) for n in names]
        results = run_dask(absolute, task, dask, progress)
        for result, name, full in zip(results, names, absolute, strict=True):
            # As the user typed it, not the absolute form the workers needed (errors name it too).
            result["path"] = name
            if isinstance(result.get("error"), str) and result["error"].startswith(full + ": "):
                result["error"] = name + result["error"][len(full):]
        executor, workers = "dask", None
    else:
        workers = min(jobs, len(names)) if jobs is not None else default_jobs(names)
        if workers == 1:
            executor, results = "sequential", run_sequential(names, task, progress)
        else:
            executor, results = "processes", run_processes(names, task, workers, progress)
    wall = time.perf_counter() - started
    rows = [row_from_result(result) for result in results]
    return fleet_of_rows(rows, executor, workers, wall,
                         reports=[r.get("report") for r in results] if keep_reports else None)


def side_by_side(fleet: FleetReport) -> dict[str, Any]:
    """The ranks side by side as columns, for a chart (the dashboard's per-rank bars): one entry
    per analysed file in table order, the categories at the peak stacked, outliers marked."""
    good_indices = [index for index, row in enumerate(fleet.rows) if row.ok]
    good = [fleet.rows[index] for index in good_indices]
    outlying = {o.index for o in fleet.outliers}
    return {
        "labels": [row.label for row in good],
        "paths": [row.path for row in good],
        "peak_allocated_bytes": [row.peak_allocated_bytes for row in good],
        "peak_reserved_bytes": [row.peak_reserved_bytes for row in good],
        "categories_at_peak": {name: [row.categories_at_peak.get(name, 0) for row in good] for name in CATEGORIES},
        "step_time_ms": [row.step_time_ms for row in good],
        "outlier": [index in outlying for index in good_indices],
        "verdicts": [o.verdict for o in fleet.outliers],
        "failed": [{"path": row.path, "error": row.error} for row in fleet.rows if not row.ok],
    }


__all__ = [
    "FLEET_SCHEMA_VERSION",
    "IN_PROCESS_BYTES",
    "Deviation",
    "Difference",
    "FindingSummary",
    "FleetReport",
    "Outlier",
    "RankRow",
    "analyse_file",
    "default_jobs",
    "explain",
    "find_outliers",
    "fleet_of_rows",
    "no_outlier_verdict",
    "pair_difference",
    "rank_from_name",
    "robust_z",
    "row_from_result",
    "run_dask",
    "run_processes",
    "run_sequential",
    "side_by_side",
    "triage_fleet",
]
