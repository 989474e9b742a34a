"""Everything the finders share about one device, computed once: steps, phases, lifetimes,
categories, the peak. Finders read it and return findings; none of them mutates it except
``findings`` (so the OOM finder can say which earlier finding explains the failure) and the
leak finder, which runs first and gives the blocks of its leak the category ``leaked`` where
nothing else named them (so the categories at the peak, and every later finder, see them so).

The allocator replay the fragmentation and OOM finders both read is held here too: computed
the first time one of them asks (``allocator_evidence``), the same value for the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from memlens.allocator.replay import device_capacity
from memlens.analysis.categories import Phases, build_phases, classify, recorded_roles
from memlens.analysis.datatypes import Finding, OptimizerWindowSource, StackBytes, Step, StepSource
from memlens.analysis.lifetimes import Lifetimes, build_lifetimes
from memlens.analysis.pool_replay import AllocatorEvidence, replay_pool_states
from memlens.analysis.settings import AnalysisSettings
from memlens.analysis.stacks import StackFacts
from memlens.analysis.steps import detect_steps, device_annotations, optimizer_windows
from memlens.snapshot.model import Action, DeviceTrace, Segment, Snapshot
from memlens.units import format_bytes


@dataclass
class DeviceContext:
    snapshot: Snapshot
    trace: DeviceTrace
    settings: AnalysisSettings
    segments: list[Segment]
    facts: StackFacts
    capacity: int | None
    steps: list[Step]
    step_source: StepSource
    optimizer_windows: list[tuple[int, int]]
    optimizer_window_source: OptimizerWindowSource
    lifetimes: Lifetimes
    phases: Phases
    category: npt.NDArray[np.int8]
    peak_event: int | None
    peak_allocated: int
    notes: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    # The replay of this device's trace (``allocator_evidence``); None until a finder asks.
    _allocator_evidence: AllocatorEvidence | None = field(default=None, repr=False)

    def allocator_evidence(self) -> AllocatorEvidence:
        """The caching allocator's pools at the cudaMallocs that could have been blocked and at
        the OOM, from one replay of the trace: made on the first call, the same value after."""
        if self._allocator_evidence is None:
            self._allocator_evidence = replay_pool_states(self.snapshot, self.trace, self.capacity)
        return self._allocator_evidence

    @property
    def device(self) -> int:
        return self.trace.device

    @property
    def events(self) -> int:
        return len(self.trace)

    def time_at(self, event: int) -> int | None:
        if not self.trace.has_time or self.events == 0:
            return None
        return int(self.trace.time_us[min(max(event, 0), self.events - 1)])

    def step_at(self, event: int) -> int | None:
        for step in self.steps:
            if step.start_event <= event < step.end_event:
                return step.index
        return None

    def top_stacks(self, mask: npt.NDArray[np.bool_]) -> list[StackBytes]:
        lt = self.lifetimes
        return self.facts.top_stacks(lt.stack_id[mask], lt.size[mask], self.settings.top_stacks)


def build_context(
    snapshot: Snapshot, trace: DeviceTrace, settings: AnalysisSettings, facts: StackFacts | None = None
) -> DeviceContext:
    segments = snapshot.segments_on(trace.device)
    facts = facts or StackFacts.build(snapshot.stacks)
    annotations = device_annotations(snapshot.annotations, trace.device)
    detection = detect_steps(trace, annotations, facts)
    windows, window_source = optimizer_windows(trace, annotations, facts)
    lifetimes = build_lifetimes(trace, segments)
    phases = build_phases(detection.steps, len(trace), windows, lifetimes)
    has_history = bool((trace.action == Action.ALLOC).any())
    roles = recorded_roles(snapshot.sidecar.tensor_roles if snapshot.sidecar is not None else None,
                           trace.device, trace.time_us)
    category = classify(lifetimes, phases, facts, has_history, roles)
    capacity, capacity_note = device_capacity(snapshot, trace, settings.capacity)
    # The instant before the first row is a moment too: when the history opens on frees (a ring
    # buffer that dropped the allocations), the most memory was live when it began.
    peak_event: int | None = None
    peak_allocated = trace.baseline_allocated
    if len(trace) and int(trace.allocated.max()) >= trace.baseline_allocated:
        peak_event = int(np.argmax(trace.allocated))
        peak_allocated = int(trace.allocated[peak_event])
    notes = list(detection.notes) + list(trace.curve_warnings) + ([capacity_note] if capacity_note else [])
    if snapshot.sidecar_problem:
        notes.append(f"sidecar not used: {snapshot.sidecar_problem}")
    if len(trace) and peak_event is None:
        notes.append("the allocated peak is what was live when the history began, before its first row")
    if trace.pending_free_final:
        notes.append(f"{format_bytes(trace.pending_free_final)} freed but waiting on another stream at the dump "
                     "(active_pending_free): not allocated, still reserved")
    if not has_history:
        notes.append("no allocations recorded: categories and time-based findings need a trace")
    return DeviceContext(
        snapshot=snapshot,
        trace=trace,
        settings=settings,
        segments=segments,
        facts=facts,
        capacity=capacity,
        steps=detection.steps,
        step_source=detection.source,
        optimizer_windows=windows,
        optimizer_window_source=window_source,
        lifetimes=lifetimes,
        phases=phases,
        category=category,
        peak_event=peak_event,
        peak_allocated=peak_allocated,
        notes=notes,
    )
