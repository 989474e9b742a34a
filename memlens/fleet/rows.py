"""A fleet's typed rows: one ``RankRow`` per file (its peaks, steps, categories at the peak and
findings, or the error that kept it from being analysed), built from the file's typed report
(``rank_row``), and the ``FleetReport`` of them all with its outliers and verdicts
(``memlens.fleet.outliers``), which the faces render as it is."""

from __future__ import annotations

import os
import re
import statistics
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from memlens.analysis.datatypes import CATEGORIES
from memlens.analysis.report import Finding, Report, Step

FLEET_SCHEMA_VERSION = 1

_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)

Executor = Literal["processes", "dask", "dashboard"]


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


def rank_from_name(path: str) -> int | None:
    """``rank12.pickle``, ``ddp_rank3.pickle``, ``rank_7/...`` -> the number; else None."""
    matches = _RANK_IN_NAME.findall(path)
    return int(matches[-1]) if matches else None


def rank_of(path: str, sidecar_rank: int | None, world_size: int | None) -> int | None:
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
        path=path, rank=rank_of(path, sidecar_rank, world), world_size=world, device=dev.device,
        peak_allocated_bytes=int(dev.peak_allocated_bytes), peak_reserved_bytes=int(dev.peak_reserved_bytes),
        steps=len(dev.steps), step_time_ms=_median_step_ms(dev.steps),
        categories_at_peak={name: int(dev.categories_at_peak.get(name, 0)) for name in CATEGORIES},
        findings=findings, seconds=seconds,
    )


def failed_row(path: str, error: str, seconds: float = 0.0) -> RankRow:
    """The row of a file that could not be analysed: shown with its error, never dropped."""
    return RankRow(path, rank_from_name(path), None, None, 0, 0, 0, None, {}, [], seconds, error=error)


__all__ = [
    "FLEET_SCHEMA_VERSION",
    "Deviation",
    "Difference",
    "Executor",
    "FindingSummary",
    "FleetReport",
    "Outlier",
    "RankResult",
    "RankRow",
    "failed_row",
    "rank_from_name",
    "rank_of",
    "rank_row",
]
