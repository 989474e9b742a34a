"""The ranks of one job side by side: per-rank peaks and categories, the outlier named and why.

A rank's row is ``memlens.ops.fleet.rank_row`` (a typed ``RankRow``, as ``memlens fleet`` builds
it in each rank's child), built from the report the dashboard already has (so no file is analysed
twice and every analysis still runs in the library's limited worker). The outliers and their
verdicts are ``memlens.ops.fleet.fleet_of_rows``; the chart is ``memlens.figures.ranks.
ranks_figure`` of ``memlens.figures.ranks.side_by_side``. The dashboard shows them; it decides nothing.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import plotly.graph_objects as go
from dash import html

from memlens.figures.ranks import ranks_figure, side_by_side
from memlens.ops.fleet import (
    FleetReport,
    RankRow,
    fleet_of_rows,
    no_outlier_verdict,
    rank_from_name,
)
from memlens.units import format_bytes
from memlens_app.library import Source

MIN_RANKS = 2  # one snapshot has nothing to stand beside
# Where a path names its rank: ``rank3``, ``rank_7``, ``ddp_rank1`` (as ``memlens.ops.fleet.rank_from_name``).
RANK_IN_PATH = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)


def fleet_of(rows: Sequence[RankRow]) -> FleetReport:
    """The fleet report of ``rows``: the outliers, the medians and a pair's difference, as
    ``memlens fleet`` finds them (``memlens.ops.fleet.fleet_of_rows``)."""
    return fleet_of_rows(rows, "dashboard")


def rank_path(source: Source) -> str:
    """The path a source's rank and job are read from: an upload's own name and the folder it came
    from (its file on the server is a spool file named by id), under one common folder; else the
    file's path."""
    return f"(uploaded)/{source.label}" if source.kind == "upload" else source.path


def rank_sources(sources: Sequence[Source]) -> list[tuple[str, str]]:
    return [(source.id, rank_path(source)) for source in sources]


def job_of(path: str) -> str | None:
    """The job a rank's file belongs to: its path with the rank number left out
    (``runs/a/rank3.pickle`` -> ``runs/a/rank*.pickle``, ``ddp_rank1.pickle`` -> ``ddp_rank*.pickle``);
    None for a file whose path names no rank."""
    matches = list(RANK_IN_PATH.finditer(path))
    if not matches or rank_from_name(path) is None:
        return None
    last = matches[-1]
    return path[: last.start(1)] + "*" + path[last.end(1):]


def rank_groups(sources: Sequence[tuple[str, str]]) -> dict[str, list[str]]:
    """``(id, path)`` pairs grouped by job (files that name no rank left out), in the order given.

    An upload's path is the server's spool file; pass its uploaded name under a common prefix
    instead, so the ranks of one upload session group together."""
    groups: dict[str, list[str]] = {}
    for source_id, path in sources:
        job = job_of(path)
        if job is not None:
            groups.setdefault(job, []).append(source_id)
    return groups


def default_rank_sources(sources: Sequence[tuple[str, str]], prefer: str | None = None) -> list[str]:
    """The ranks the ranks tab starts with: those of ``prefer``'s job (an id just uploaded) when it
    has two or more loaded, else the job with the most ranks loaded; [] when no job has two."""
    groups = [ids for ids in rank_groups(sources).values() if len(ids) >= MIN_RANKS]
    preferred = [ids for ids in groups if prefer in ids]
    if preferred:
        return preferred[0]
    return max(groups, key=len) if groups else []


@dataclass(frozen=True)
class RanksPanel:
    figure: go.Figure
    table: Any
    verdicts: Any

    def outputs(self) -> tuple[Any, ...]:
        return self.figure, self.table, self.verdicts


def ranks_table(fleet: FleetReport) -> html.Table:
    """One line per rank: peaks, steps, findings; outliers marked, failed files with their error."""
    outlying = {o.index for o in fleet.outliers}
    head = html.Thead(html.Tr([html.Th(h) for h in ("rank", "peak allocated", "peak reserved", "steps",
                                                   "median step", "findings", "")]))
    body = []
    for index, row in enumerate(fleet.rows):
        if not row.ok:
            body.append(html.Tr(className="rank-failed", children=[
                html.Td(row.label), html.Td(f"could not be analysed: {row.error}", colSpan=6)]))
            continue
        step_ms = f"{row.step_time_ms:,.1f} ms" if row.step_time_ms is not None else "–"
        flagged = index in outlying
        body.append(html.Tr(className="rank-outlier" if flagged else "rank-row", title=row.path, children=[
            html.Td(row.label), html.Td(format_bytes(row.peak_allocated_bytes)),
            html.Td(format_bytes(row.peak_reserved_bytes)), html.Td(f"{row.steps:,}"), html.Td(step_ms),
            html.Td(", ".join(sorted({f.kind.replace("_", " ") for f in row.findings})) or "none"),
            html.Td(html.Span("outlier", className="badge badge-high") if flagged else ""),
        ]))
    return html.Table(className="table ranks-table", children=[head, html.Tbody(body)])


def verdicts_of(fleet: FleetReport) -> Any:
    """The outliers, each named with why it differs (the fleet's verdict line), or why none is:
    ``memlens.ops.fleet.no_outlier_verdict``, the sentence ``memlens fleet`` prints, and with two
    ranks how they differ (``fleet.pair``)."""
    if not fleet.outliers:
        verdict = no_outlier_verdict(fleet)
        children: list[Any] = [html.B("Outliers: "), verdict[0].upper() + verdict[1:] + "."]
        if fleet.pair:
            children += [html.Br(), fleet.pair + "."]
        return html.P(children, className="ranks-agree")
    return html.Ul(className="ranks-verdicts", children=[
        html.Li(className="ranks-verdict", children=[html.B("Outlier: "), o.verdict]) for o in fleet.outliers])


def distinct_labels(labels: Sequence[str], paths: Sequence[str]) -> list[str]:
    """``labels`` with the file's name added where two rows share one (two runs' rank 0): the
    chart's columns are keyed by label, and two ranks must never stack into one bar."""
    seen: dict[str, int] = {}
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
    return [f"{label} · {os.path.basename(path)}" if seen[label] > 1 else label
            for label, path in zip(labels, paths, strict=True)]


def ranks_panel(rows: Sequence[RankRow], source_ids: Sequence[str] | None = None) -> RanksPanel:
    """The ranks view of ``rows`` (in the order picked): chart, table and verdicts. ``source_ids``
    (one per row) let a click on a rank's bar say which snapshot to open."""
    fleet = fleet_of(rows)
    side = side_by_side(fleet)
    side = msgspec.structs.replace(side, labels=distinct_labels(side.labels, side.paths))
    keys = None
    if source_ids is not None:
        keys = [key for key, row in zip(source_ids, rows, strict=True) if row.ok]  # side_by_side's rows
    return RanksPanel(ranks_figure(side, keys=keys), ranks_table(fleet), verdicts_of(fleet))


def source_of_click(click: dict[str, Any] | None) -> str | None:
    """The source id of the rank whose bar was clicked (its ``customdata``); None for anything else."""
    points = (click or {}).get("points") or []
    key = points[0].get("customdata") if points else None
    return key if isinstance(key, str) and key else None
