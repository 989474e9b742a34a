"""What every lens reads: one device of an analysed snapshot, built one way.

``LensInputs`` is the snapshot, one device's trace, the per-allocation ``LiveIndex`` that
``analyze_snapshot`` builds and the steps it found. It is made only from an ``Analysis``
(``lens_inputs_of``), so a lens sees the device, lifetimes, categories and steps the report
shows, never a second reading of the file with other defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from memlens.analysis.datatypes import Step
from memlens.analysis.live import LiveIndex
from memlens.analysis.stacks import StackFacts
from memlens.snapshot.model import Annotation, DeviceTrace, Snapshot

I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]


@dataclass(frozen=True)
class LensInputs:
    """What every lens reads: one device of a loaded snapshot and its per-allocation index."""

    snapshot: Snapshot
    trace: DeviceTrace
    index: LiveIndex
    steps: tuple[Step, ...] = ()

    @property
    def facts(self) -> StackFacts:
        return self.index.facts

    @property
    def device(self) -> int:
        return self.trace.device

    def annotations(self) -> list[Annotation]:
        """This device's ``external_annotations`` (and those of no device), oldest first."""
        device = self.device
        return sorted((a for a in self.snapshot.annotations if a.device == device or a.device < 0),
                      key=lambda a: a.time_us)

    @property
    def start_us(self) -> int | None:
        """The first row's time (to print "+1.234 s"); None without rows or times."""
        trace = self.trace
        return int(trace.time_us[0]) if trace.has_time and len(trace) else None


class _HasSteps(Protocol):
    @property
    def steps(self) -> list[Step]: ...


class AnalysisLike(Protocol):
    """What the lenses read of a ``memlens.analysis.Analysis`` (snapshot, trace, index, steps)."""

    @property
    def snapshot(self) -> Snapshot: ...

    def trace(self, device: int | None = None) -> DeviceTrace: ...

    def live_index(self, device: int | None = None) -> LiveIndex: ...

    def device(self, device: int | None = None) -> _HasSteps: ...


def lens_inputs_of(analysis: AnalysisLike, device: int | None = None) -> LensInputs:
    """The lens inputs of ``device`` (None: the one the report details) of an ``Analysis``."""
    return LensInputs(analysis.snapshot, analysis.trace(device), analysis.live_index(device),
                      tuple(analysis.device(device).steps))


# --------------------------------------------------------------------------- reading the trace


def exact_bincount(codes: npt.NDArray[np.integer[Any]], sizes: I64, length: int) -> I64:
    """Bytes summed per code, exactly, as int64.

    ``np.bincount`` sums weights in float64, which rounds above 2**53 bytes in all. Splitting each
    size into its high and low 26 bits keeps both partial sums exact (the reader refuses files
    holding more than 2**56 bytes, and the low parts stay exact below 2**27 blocks).
    """
    low = np.bincount(codes, weights=(sizes & ((1 << 26) - 1)).astype(np.float64), minlength=length)
    high = np.bincount(codes, weights=(sizes >> 26).astype(np.float64), minlength=length)
    return (high.astype(np.int64) << 26) + low.astype(np.int64)


def allocated_at(trace: DeviceTrace, event: int | None) -> int:
    """``torch.cuda.memory_allocated`` after row ``event`` (-1: when the history began; None: a
    trace without rows, i.e. the dump)."""
    if event is None or event < 0:
        return trace.baseline_allocated
    return int(trace.allocated[event])


def time_of(trace: DeviceTrace, event: int | None) -> int | None:
    """The time of row ``event`` in µs (None: before the history, no rows, or no times)."""
    if event is None or event < 0 or not trace.has_time or not len(trace):
        return None
    return int(trace.time_us[event])
