"""Stages: what each ``record_function`` scope added while it ran, and its peak inside.

``annotation_stages(inputs)`` is every complete START/END pair on one device (allocated at its
END minus at its START, and the peak in between); ``summarize_stages`` puts the runs of one
scope name together (step markers lose their number: ``memlens.step#N``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import numpy as np
import numpy.typing as npt

from memlens.analysis.lenses.inputs import I64, LensInputs, exact_bincount
from memlens.analysis.lenses.labels import label_table
from memlens.analysis.lenses.moments import sorted_times
from memlens.snapshot.model import Annotation, DeviceTrace


@dataclass(frozen=True)
class Stage:
    """One run of a ``record_function`` scope: what was allocated when it began and ended."""

    name: str
    start_us: int
    end_us: int
    start_event: int  # the last row before the scope began (-1: before the first row)
    end_event: int  # the last row at or before its END
    bytes_at_start: int
    bytes_at_end: int
    peak_bytes: int
    peak_event: int

    @property
    def added_bytes(self) -> int:
        return self.bytes_at_end - self.bytes_at_start

    def record(self) -> StageRecord:
        """The run as its JSON form's struct (``memlens stages --json``)."""
        return StageRecord(self.name, self.start_us, self.end_us, self.start_event, self.end_event,
                           self.bytes_at_start, self.bytes_at_end, self.added_bytes, self.peak_bytes,
                           self.peak_event)


class StageRecord(msgspec.Struct, frozen=True):
    """One run of a scope in the JSON (``Stage`` with its ``added_bytes``)."""

    name: str
    start_us: int
    end_us: int
    start_event: int
    end_event: int
    bytes_at_start: int
    bytes_at_end: int
    added_bytes: int
    peak_bytes: int
    peak_event: int


@dataclass(frozen=True)
class StageRuns:
    """Every run of every scope on one device, as columns (module scopes make hundreds of
    thousands of runs: objects are made only for the runs someone reads). Oldest first."""

    names: tuple[str, ...]  # distinct scope names
    name_code: I64  # per run: index into names
    start_us: I64
    end_us: I64
    start_event: I64
    end_event: I64
    bytes_at_start: I64
    bytes_at_end: I64
    peak_bytes: I64
    peak_event: I64

    def __len__(self) -> int:
        return int(self.name_code.size)

    def __getitem__(self, i: int) -> Stage:
        return Stage(self.names[int(self.name_code[i])], int(self.start_us[i]), int(self.end_us[i]),
                     int(self.start_event[i]), int(self.end_event[i]), int(self.bytes_at_start[i]),
                     int(self.bytes_at_end[i]), int(self.peak_bytes[i]), int(self.peak_event[i]))

    def __iter__(self) -> Iterator[Stage]:
        return (self[i] for i in range(len(self)))

    def records(self) -> list[StageRecord]:
        return [stage.record() for stage in self]

    @classmethod
    def empty(cls) -> StageRuns:
        none = np.zeros(0, dtype=np.int64)
        return cls((), none, none, none, none, none, none, none, none, none)


class StageSummary(msgspec.Struct, frozen=True):
    """Every run of one scope name together (its JSON form as it is)."""

    name: str
    runs: int
    added_bytes: int  # summed over the runs
    max_added_bytes: int
    peak_bytes: int  # the highest peak inside any run


def _levels(trace: DeviceTrace, rows: I64) -> I64:
    """``allocated_at`` for many rows at once (-1: when the history began)."""
    return np.where(rows >= 0, trace.allocated[np.maximum(rows, 0)], trace.baseline_allocated)


def interval_peaks(values: I64, first: I64, last: I64) -> tuple[I64, I64]:
    """For many row ranges ``[first[i], last[i]]`` at once: the largest value in each, and the
    first row holding it. Empty ranges (``last < first``) give the int64 minimum and row -1.

    Module scopes make hundreds of thousands of ranges, nested, and a hostile file can make every
    one of them span the whole trace, so neither a loop of ``argmax`` nor a sum over the ranges'
    rows will do: a segment tree of each node's first maximal row (built level by level) answers
    every range in about 2 log2(n) vectorised steps, O((n + ranges) log n) in all.
    """
    count = first.size
    peak = np.full(count, np.iinfo(np.int64).min, dtype=np.int64)
    row = np.full(count, -1, dtype=np.int64)
    n = values.size
    if not count or not n:
        return peak, row
    size = 1 << max(int(n - 1).bit_length(), 0)
    lowest = np.iinfo(np.int64).min
    padded = np.full(size + 1, lowest, dtype=np.int64)  # slot ``size``: the padding leaves' row
    padded[:n] = values
    # best[node]: the first row holding the maximum under that node; leaves are their own rows.
    best = np.full(2 * size, size, dtype=np.int64)
    best[size:size + n] = np.arange(n, dtype=np.int64)
    for level_start in (1 << k for k in range(max(size.bit_length() - 2, -1), -1, -1)):
        nodes = np.arange(level_start, 2 * level_start)
        left, right = best[2 * nodes], best[2 * nodes + 1]
        best[nodes] = np.where(padded[left] >= padded[right], left, right)  # ties: the left (earlier)
    # Ranges as half-open node bounds; each step takes the odd left node / even right node.
    lo = np.where(last >= first, first, 0).astype(np.int64) + size
    hi = np.where(last >= first, last + 1, first).astype(np.int64) + size
    hi[last < first] = lo[last < first]  # empty: no node is ever taken
    found = np.full(count, size, dtype=np.int64)  # the padding row: value lowest

    def take(candidate_nodes: I64, where: npt.NDArray[np.bool_]) -> None:
        candidate = best[candidate_nodes[where]]
        current = found[where]
        better = (padded[candidate] > padded[current]) | (
            (padded[candidate] == padded[current]) & (candidate < current))
        found[where] = np.where(better, candidate, current)

    while True:
        active = lo < hi
        if not active.any():
            break
        from_left = active & (lo & 1 == 1)
        take(lo, from_left)
        lo = lo + from_left
        from_right = active & (hi & 1 == 1)
        hi = hi - from_right
        take(hi, from_right)
        lo >>= 1
        hi >>= 1
    nonempty = last >= first
    row[nonempty] = found[nonempty]
    peak[nonempty] = padded[found[nonempty]]
    return peak, row


def _scope_pairs(annotations: list[Annotation]) -> tuple[list[str], list[int], list[int]]:
    """(name, start, end) of each START/END pair: an END closes the latest open scope of its name."""
    open_scopes: dict[str, list[int]] = {}
    names: list[str] = []
    starts: list[int] = []
    ends: list[int] = []
    for ann in annotations:
        if ann.stage == "START":
            opened = open_scopes.get(ann.name)
            if opened is None:
                open_scopes[ann.name] = [ann.time_us]
            else:
                opened.append(ann.time_us)
        elif ann.stage == "END":
            opened = open_scopes.get(ann.name)
            if opened:
                names.append(ann.name)
                starts.append(opened.pop())
                ends.append(ann.time_us)
    return names, starts, ends


def annotation_stages(inputs: LensInputs) -> StageRuns:
    """Each complete START/END pair of ``external_annotations`` on this device, oldest first:
    allocated when it began and ended, and the peak inside (the level it began at included)."""
    trace = inputs.trace
    if not trace.has_time or not len(trace):
        return StageRuns.empty()
    pair_names, pair_starts, pair_ends = _scope_pairs(inputs.annotations())
    if not pair_names:
        return StageRuns.empty()
    names, codes = label_table(pair_names)
    starts = np.array(pair_starts, dtype=np.int64)
    ends = np.array(pair_ends, dtype=np.int64)
    order = np.lexsort((ends, starts))
    name_code, starts, ends = codes[order].astype(np.int64), starts[order], ends[order]
    times = sorted_times(trace)
    before = np.searchsorted(times, starts, side="left") - 1  # the state the scope began in
    last = np.maximum(np.searchsorted(times, ends, side="right") - 1, before)  # an END before its START: empty
    at_start, at_end = _levels(trace, before), _levels(trace, last)
    inside_peak, inside_row = interval_peaks(trace.allocated, before + 1, last)
    from_start = at_start >= inside_peak
    return StageRuns(tuple(names), name_code, starts, ends, before, last, at_start, at_end,
                     np.where(from_start, at_start, inside_peak), np.where(from_start, before, inside_row))


# Step markers carry the step's number (``memlens.step#3``, ``ProfilerStep#3``): one stage name for
# all steps. Only these: a module scope's number is part of its name (``memlens.forward#0``).
_NUMBERED_STEP = re.compile(r"^(memlens\.step|ProfilerStep)#\d+$")


def stage_name(name: str) -> str:
    """The name a stage is summarised under: step markers lose their number (``memlens.step#N``)."""
    match = _NUMBERED_STEP.match(name)
    return f"{match.group(1)}#N" if match else name


def summarize_stages(runs: StageRuns) -> list[StageSummary]:
    """Per scope name (steps together: ``stage_name``): runs, bytes added in all and at most, and
    the highest peak; most added first."""
    if not len(runs):
        return []
    summary_names, summary_of_name = label_table([stage_name(n) for n in runs.names])
    code = summary_of_name[runs.name_code]
    count = len(summary_names)
    added = runs.bytes_at_end - runs.bytes_at_start
    total = exact_bincount(code, added, count)
    most = np.full(count, np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(most, code, added)
    peak = np.full(count, np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(peak, code, runs.peak_bytes)
    times = np.bincount(code, minlength=count)
    out = [StageSummary(name, int(times[i]), int(total[i]), int(most[i]), int(peak[i]))
           for i, name in enumerate(summary_names)]
    out.sort(key=lambda s: (-s.added_bytes, -s.peak_bytes, s.name))
    return out

