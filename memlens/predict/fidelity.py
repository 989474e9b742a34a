"""How close a predicted snapshot is to a real GPU's snapshot of the same program.

Both files are read by the same reader and measured the same way (``recorded_figures``: peak
allocated and reserved over the recorded window, with the memory live before it), so the
comparison is like for like. The allocation sequences are compared size for size with
``difflib`` (longest matching blocks): the match rate is the share of the real run's allocations
that the prediction made, in order, with the same requested size.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from memlens.allocator import recorded_figures
from memlens.snapshot.model import Action
from memlens.snapshot.reader import load


@dataclass(frozen=True)
class Fidelity:
    real_peak_allocated_bytes: int
    predicted_peak_allocated_bytes: int
    real_peak_reserved_bytes: int
    predicted_peak_reserved_bytes: int
    real_allocs: int
    predicted_allocs: int
    matched_allocs: int

    @property
    def allocated_error(self) -> float:
        """Relative error of the predicted peak allocated (0.01 = 1%)."""
        return abs(self.predicted_peak_allocated_bytes - self.real_peak_allocated_bytes) / max(
            1, self.real_peak_allocated_bytes
        )

    @property
    def reserved_error(self) -> float:
        return abs(self.predicted_peak_reserved_bytes - self.real_peak_reserved_bytes) / max(
            1, self.real_peak_reserved_bytes
        )

    @property
    def match_rate(self) -> float:
        """Share of the real allocations matched, in order, size for size."""
        return self.matched_allocs / max(1, self.real_allocs)

    def record(self) -> FidelityRecord:
        return FidelityRecord(
            self.real_peak_allocated_bytes, self.predicted_peak_allocated_bytes, round(self.allocated_error, 5),
            self.real_peak_reserved_bytes, self.predicted_peak_reserved_bytes, round(self.reserved_error, 5),
            self.real_allocs, self.predicted_allocs, self.matched_allocs, round(self.match_rate, 4))

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.record())


class FidelityRecord(msgspec.Struct, frozen=True):
    """The JSON form of a ``Fidelity``: a prediction's peaks and allocations against the real run's."""

    real_peak_allocated_bytes: int
    predicted_peak_allocated_bytes: int
    allocated_error: float
    real_peak_reserved_bytes: int
    predicted_peak_reserved_bytes: int
    reserved_error: float
    real_allocs: int
    predicted_allocs: int
    matched_allocs: int
    match_rate: float


def _figures(path: str | Path) -> tuple[int, int, list[int]]:
    snapshot = load(path, cache=False)
    trace = snapshot.device()
    figures = recorded_figures(trace, snapshot.segments_on(trace.device))
    sizes = trace.size[trace.action == int(Action.ALLOC)] if len(trace) else np.zeros(0, dtype=np.int64)
    return figures.peak_allocated_bytes, figures.peak_reserved_bytes, [int(s) for s in sizes]


def compare(real: str | Path, predicted: str | Path) -> Fidelity:
    """Peaks and allocation-sequence match of ``predicted`` against ``real``."""
    real_allocated, real_reserved, real_sizes = _figures(real)
    predicted_allocated, predicted_reserved, predicted_sizes = _figures(predicted)
    matcher = difflib.SequenceMatcher(a=real_sizes, b=predicted_sizes, autojunk=False)
    matched = sum(block.size for block in matcher.get_matching_blocks())
    return Fidelity(
        real_peak_allocated_bytes=real_allocated,
        predicted_peak_allocated_bytes=predicted_allocated,
        real_peak_reserved_bytes=real_reserved,
        predicted_peak_reserved_bytes=predicted_reserved,
        real_allocs=len(real_sizes),
        predicted_allocs=len(predicted_sizes),
        matched_allocs=matched,
    )


__all__ = ["Fidelity", "compare"]
