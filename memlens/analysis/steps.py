"""Training-step boundaries and optimizer.step windows, from the most trusted source there is.

Order of trust: memlens's own ``memlens.step#N`` markers (record_function annotations, then
``user_metadata``), ``ProfilerStep#N`` annotations, ``Optimizer.step``/``Optimizer.zero_grad``
annotations, other ``user_metadata``, recurring optimizer frames, and last the periodic shape
of the allocated curve. Annotation times map to rows with ``np.searchsorted`` on ``time_us``.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from memlens.analysis.datatypes import OptimizerWindowSource, Step, StepSource
from memlens.analysis.settings import PERIODIC_BINS, PERIODIC_MIN_AUTOCORR, PERIODIC_MIN_STEPS
from memlens.analysis.stacks import StackFacts, reduce_per_stack
from memlens.snapshot.model import Annotation, DeviceTrace, true_runs

MEMLENS_STEP = re.compile(r"^memlens\.step#(\d+)$")
PROFILER_STEP = re.compile(r"^ProfilerStep#(\d+)$")
OPTIMIZER_STEP = re.compile(r"^Optimizer\.step#")
OPTIMIZER_ZERO_GRAD = re.compile(r"^Optimizer\.zero_grad#")
# A step with this share fewer rows than its siblings, opening before the first row, was cut
# by the ring buffer: the window began inside it.
PARTIAL_STEP_EVENT_SHARE = 0.9


@dataclass
class StepDetection:
    steps: list[Step]
    source: StepSource
    notes: list[str] = field(default_factory=list)


def device_annotations(annotations: list[Annotation], device: int) -> list[Annotation]:
    """Annotations for ``device`` (negative devices mean "all"), oldest first."""
    return sorted((a for a in annotations if a.device in (device, -1) or a.device < 0), key=lambda a: a.time_us)


def _search_times(trace: DeviceTrace) -> npt.NDArray[np.int64]:
    # searchsorted needs a sorted array; clocks of different streams can step back a little.
    return np.maximum.accumulate(trace.time_us) if len(trace) else trace.time_us


def _scopes(annotations: list[Annotation], pattern: re.Pattern[str]) -> list[tuple[str, int | None, int | None]]:
    """(name, start_us, end_us) for each START/END pair of matching names (None: edge missing)."""
    open_scopes: dict[str, list[int]] = {}
    out: list[tuple[str, int | None, int | None]] = []
    for ann in annotations:
        if not pattern.search(ann.name):
            continue
        if ann.stage == "START":
            open_scopes.setdefault(ann.name, []).append(ann.time_us)
        elif ann.stage == "END":
            starts = open_scopes.get(ann.name)
            out.append((ann.name, starts.pop() if starts else None, ann.time_us))
    out.extend((name, start, None) for name, starts in open_scopes.items() for start in starts)
    return sorted(out, key=lambda s: s[1] if s[1] is not None else (s[2] or 0))


def _rows_of_scopes(
    times: npt.NDArray[np.int64], scopes: list[tuple[str, int | None, int | None]], n: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """First row at/after each START and one past the last row at/before each END (one search each)."""
    start_us = np.array([-1 if s is None else s for _, s, _ in scopes], dtype=np.int64)
    end_us = np.array([-1 if e is None else e for _, _, e in scopes], dtype=np.int64)
    starts = np.searchsorted(times, start_us, side="left").astype(np.int64)
    ends = np.searchsorted(times, end_us, side="right").astype(np.int64)
    starts[[s is None for _, s, _ in scopes]] = 0
    ends[[e is None for _, _, e in scopes]] = n
    return starts, ends


def _time_of(trace: DeviceTrace, event: int) -> int | None:
    if not trace.has_time or len(trace) == 0:
        return None
    return int(trace.time_us[min(max(event, 0), len(trace) - 1)])


def _steps_from_scopes(
    trace: DeviceTrace, scopes: list[tuple[str, int | None, int | None]], pattern: re.Pattern[str]
) -> list[Step]:
    times = _search_times(trace)
    n = len(trace)
    raw: list[tuple[int, int, int, int | None, int | None, bool]] = []
    starts, ends = _rows_of_scopes(times, scopes, n)
    for position, (name, start_us, end_us) in enumerate(scopes):
        match = pattern.search(name)
        index = int(match.group(1)) if match and match.groups() else position
        start, end = int(starts[position]), int(ends[position])
        if end <= start:
            continue
        # memlens' own steps open where its recorder (or predict) starts the history: one that
        # opens before the first row of a history that saw every live byte was not cut.
        recorded_whole = pattern is MEMLENS_STEP and trace.window_complete
        cut_start = start_us is None or (n > 0 and start_us < int(times[0]) and not recorded_whole)
        raw.append((index, start, end, start_us, end_us, cut_start or end_us is None))
    counts = sorted(end - start for _, start, end, _, _, _ in raw)  # sorted once: not per step
    steps: list[Step] = []
    for index, start, end, start_us, end_us, suspicious in raw:
        partial = False
        if suspicious:
            if end_us is None:
                partial = True  # the window ended inside it
            elif len(counts) > 1:
                partial = (end - start) < PARTIAL_STEP_EVENT_SHARE * _median_without(counts, end - start)
        steps.append(Step(index, start, end, start_us, end_us, partial))
    return steps


def _median_without(sorted_values: list[int], value: int) -> float:
    """The median of ``sorted_values`` less one occurrence of ``value`` (which it holds)."""
    removed = bisect.bisect_left(sorted_values, value)
    count = len(sorted_values) - 1

    def at(position: int) -> int:
        return sorted_values[position if position < removed else position + 1]

    if count % 2:
        return float(at(count // 2))
    return (at(count // 2 - 1) + at(count // 2)) / 2


def _steps_from_boundaries(trace: DeviceTrace, boundaries: list[int]) -> list[Step]:
    """Segments between boundaries; the head and the tail are partial (the window cut them)."""
    n = len(trace)
    cuts = sorted({b for b in boundaries if 0 < b < n})
    # A trace that ends exactly on a boundary has a whole last step; otherwise the tail is cut.
    ends_on_boundary = any(b >= n for b in boundaries)
    edges = [0, *cuts, n]
    steps: list[Step] = []
    for i in range(len(edges) - 1):
        start, end = edges[i], edges[i + 1]
        if end <= start:
            continue
        partial = i == 0 or (i == len(edges) - 2 and not ends_on_boundary)
        steps.append(Step(len(steps), start, end, _time_of(trace, start), _time_of(trace, end - 1), partial))
    return steps


def _steps_from_metadata(trace: DeviceTrace, memlens_only: bool) -> list[Step]:
    ids = trace.metadata_id
    if ids.size == 0 or not (ids >= 0).any():
        return []
    names = trace.user_metadata
    if memlens_only:
        wanted = np.array([bool(MEMLENS_STEP.match(v)) for v in names], dtype=bool)
    else:
        wanted = np.ones(len(names), dtype=bool)
    if not wanted.any():
        return []
    change = np.flatnonzero(np.diff(ids) != 0) + 1
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [ids.size]])
    steps: list[Step] = []
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        mid = int(ids[start])
        if mid < 0 or not wanted[mid]:
            continue
        match = MEMLENS_STEP.match(names[mid])
        index = int(match.group(1)) if match else len(steps)
        steps.append(Step(index, start, end, _time_of(trace, start), _time_of(trace, end - 1), False))
    if not memlens_only and len(steps) < 2:
        return []
    return steps


def _zero_grad_stacks(facts: StackFacts) -> npt.NDArray[np.bool_]:
    """Per stack (+1 slot for stack id -1): is ``zero_grad`` one of its frames?"""
    frames = facts.table.frames
    named = np.fromiter((frame.name == "zero_grad" for frame in frames), dtype=bool, count=len(frames))
    return reduce_per_stack(facts.table, named)


def optimizer_windows(
    trace: DeviceTrace, annotations: list[Annotation], facts: StackFacts
) -> tuple[list[tuple[int, int]], OptimizerWindowSource]:
    """``[start, end)`` rows of each optimizer.step: from annotations, else from stack frames."""
    n = len(trace)
    if n == 0:
        return [], "none"
    if trace.has_time:
        scopes = _scopes(annotations, OPTIMIZER_STEP)
        if scopes:
            starts, ends = _rows_of_scopes(_search_times(trace), scopes, n)
            windows = [(a, b) for a, b in zip(starts.tolist(), ends.tolist(), strict=True) if b > a]
            if windows:
                return windows, "annotations"
    stacked = trace.stack_id >= 0
    if not stacked.any():
        return [], "none"
    # optimizer.zero_grad() lives in torch/optim too, but it is not optimizer.step: its frees
    # (set_to_none) would join the step's window and pass for state being replaced.
    optimizer_step = facts.optimizer & ~_zero_grad_stacks(facts)  # per stack
    every_row = bool(stacked.all())  # the rule, not the exception: no index of the stacked rows needed
    flags = optimizer_step[trace.stack_id if every_row else trace.stack_id[stacked]]
    if not flags.any():
        return [], "none"
    # Runs of optimizer-framed rows; rows without any stack do not break a run.
    run_starts, run_ends = true_runs(flags)
    run_ends -= 1  # the last row of each run
    with_stack = None if every_row else np.flatnonzero(stacked)  # the row of each stacked row
    windows = [
        (int(a if with_stack is None else with_stack[a]), int(b if with_stack is None else with_stack[b]) + 1)
        for a, b in zip(run_starts.tolist(), run_ends.tolist(), strict=True)
        if b > a  # a lone optimizer-framed row is not a phase
    ]
    return windows, ("frames" if windows else "none")


def _periodic_boundaries(allocated: npt.NDArray[np.int64]) -> list[int]:
    """Step boundaries from the repeating shape of the curve (autocorrelation + minima)."""
    n = int(allocated.size)
    if n < PERIODIC_MIN_STEPS * 16:
        return []
    bins = min(PERIODIC_BINS, n)
    edges = np.linspace(0, n, bins + 1).astype(np.int64)
    series = np.maximum.reduceat(allocated.astype(np.float64), edges[:-1])
    series -= series.mean()
    if not series.any():
        return []
    spectrum = np.fft.rfft(series, 2 * bins)
    acf = np.fft.irfft(spectrum * np.conj(spectrum))[:bins]
    acf = acf / acf[0] * bins / (bins - np.arange(bins))  # unbiased: later lags overlap less
    max_lag = bins // PERIODIC_MIN_STEPS
    negative = np.flatnonzero(acf[1 : max_lag + 1] < 0)
    if negative.size == 0:
        return []
    first = int(negative[0]) + 1
    window = acf[first : max_lag + 1]
    if window.size == 0 or window.max() < PERIODIC_MIN_AUTOCORR:
        return []
    # The smallest lag nearly as good as the best: the period, not one of its multiples.
    lag = first + int(np.flatnonzero(window >= 0.9 * window.max())[0])
    folded = np.array([series[offset::lag].mean() for offset in range(lag)])
    phase = int(np.argmin(folded))
    period_events = lag * n / bins
    reach = max(1, int(period_events / 4))
    boundaries = []
    centre = edges[phase] + 0.0
    while centre < n:
        lo, hi = max(0, int(centre) - reach), min(n, int(centre) + reach + 1)
        boundaries.append(lo + int(np.argmin(allocated[lo:hi])))
        centre += period_events
    return boundaries


def detect_steps(trace: DeviceTrace, annotations: list[Annotation], facts: StackFacts) -> StepDetection:
    n = len(trace)
    if n == 0:
        return StepDetection([], "none", ["no trace entries: steps cannot be told"])
    if trace.has_time:
        scopes = _scopes(annotations, MEMLENS_STEP)
        if scopes:
            steps = _steps_from_scopes(trace, scopes, MEMLENS_STEP)
            if steps:
                return StepDetection(steps, "memlens")
    steps = _steps_from_metadata(trace, memlens_only=True)
    if steps:
        return StepDetection(steps, "memlens")
    if trace.has_time:
        scopes = _scopes(annotations, PROFILER_STEP)
        if scopes:
            steps = _steps_from_scopes(trace, scopes, PROFILER_STEP)
            if steps:
                return StepDetection(steps, "profiler")
        times = _search_times(trace)
        step_scopes = _scopes(annotations, OPTIMIZER_STEP)
        if step_scopes:
            cuts = [int(np.searchsorted(times, end, side="right")) for _, _, end in step_scopes if end is not None]
            if cuts:
                return StepDetection(
                    _steps_from_boundaries(trace, cuts),
                    "optimizer_annotations",
                    ["steps end where Optimizer.step ends"],
                )
        zero_grads = _scopes(annotations, OPTIMIZER_ZERO_GRAD)
        if zero_grads:
            cuts = [int(np.searchsorted(times, start, side="left")) for _, start, _ in zero_grads if start is not None]
            if cuts:
                return StepDetection(
                    _steps_from_boundaries(trace, cuts),
                    "optimizer_annotations",
                    ["steps start where Optimizer.zero_grad starts"],
                )
    steps = _steps_from_metadata(trace, memlens_only=False)
    if steps:
        return StepDetection(steps, "user_metadata")
    windows, _source = optimizer_windows(trace, [], facts)
    if len(windows) >= 2:
        return StepDetection(
            _steps_from_boundaries(trace, [end for _, end in windows]),
            "optimizer_frames",
            ["steps end where the optimizer's frames (torch/optim) stop"],
        )
    cuts = _periodic_boundaries(trace.allocated)
    if len(cuts) >= PERIODIC_MIN_STEPS:
        return StepDetection(
            _steps_from_boundaries(trace, cuts),
            "periodic",
            ["steps inferred from the repeating shape of the allocated curve (no markers in the file)"],
        )
    if windows:
        return StepDetection(
            _steps_from_boundaries(trace, [end for _, end in windows]),
            "optimizer_frames",
            ["one optimizer.step seen (torch/optim frames): steps around it are partial"],
        )
    return StepDetection([], "none", ["no step markers, optimizer frames or repeating shape found"])
