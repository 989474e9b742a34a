"""The outlier ranks of a fleet, and the sentences that say why.

Every rank is compared with the fleet's median using a robust z-score (the deviation over 1.4826 x
the median absolute deviation, which is the standard deviation for normal data but is not dragged
along by the outliers themselves), on the peak allocated, the peak reserved and each category at
the peak. Identical ranks (deterministic data-parallel replicas) have a spread of zero, so the
spread is floored at a small share of the fleet's median peak, and a deviation must also be a
noticeable share of that peak to count: a rank is never an outlier for a few bytes. For each
outlier the category deltas at the peak and the findings it has and the others do not (or in
other amounts) say why, in bytes. ``fleet_of_rows`` puts it together, for ``memlens fleet`` and the
dashboard's ranks tab alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from memlens.analysis.datatypes import CATEGORIES
from memlens.analysis.report import Report
from memlens.fleet.rows import Deviation, Difference, Executor, FleetReport, Outlier, RankRow
from memlens.units import format_bytes

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


__all__ = [
    "MIN_RANKS_FOR_OUTLIERS",
    "OUTLIER_Z",
    "explain",
    "find_outliers",
    "fleet_of_rows",
    "no_outlier_verdict",
    "pair_difference",
    "robust_z",
    "verdict_line",
]
