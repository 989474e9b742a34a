"""How closely a replay with the recorded settings reproduces the recorded run.

Used by the fidelity tests and ``benchmarks/bench_allocator.py``: the what-if figures are only
worth trusting if these agree on real snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from memlens.allocator.replay import whatif
from memlens.snapshot.model import Snapshot

# Acceptance bounds (issue 5): peak reserved within 2 %, cudaMalloc count within 5 %.
PEAK_RESERVED_TOLERANCE = 0.02
SEGMENT_ALLOC_TOLERANCE = 0.05


@dataclass(frozen=True)
class FidelityRow:
    name: str
    events: int
    history: str  # "complete", "mid-run (seeded)" or "state only" (no history to replay)
    recorded_peak_reserved: int
    simulated_peak_reserved: int
    recorded_segment_allocs: int
    simulated_segment_allocs: int
    alloc_address_match: float | None

    @property
    def peak_error(self) -> float:
        if not self.recorded_peak_reserved:
            return 0.0 if not self.simulated_peak_reserved else 1.0
        return abs(self.simulated_peak_reserved - self.recorded_peak_reserved) / self.recorded_peak_reserved

    @property
    def segment_alloc_error(self) -> float:
        if not self.recorded_segment_allocs:
            return 0.0 if not self.simulated_segment_allocs else 1.0
        return abs(self.simulated_segment_allocs - self.recorded_segment_allocs) / self.recorded_segment_allocs

    @property
    def within_bounds(self) -> bool:
        return self.peak_error <= PEAK_RESERVED_TOLERANCE and self.segment_alloc_error <= SEGMENT_ALLOC_TOLERANCE


def fidelity(snapshot: Snapshot | str | Path, use_recorded_addresses: bool = True) -> FidelityRow:
    """Replay ``snapshot`` with its own settings and compare with what was recorded."""
    result = whatif(snapshot, use_recorded_addresses=use_recorded_addresses)
    events = int(result.recorded["events"])
    if events <= 1:
        history = "state only"
    elif result.seeded:
        history = "mid-run (seeded)"
    else:
        history = "complete"
    return FidelityRow(
        name=Path(result.source).name,
        events=events,
        history=history,
        recorded_peak_reserved=int(result.recorded["peak_reserved_bytes"]),
        simulated_peak_reserved=int(result.simulated["peak_reserved_bytes"]),
        recorded_segment_allocs=int(result.recorded["segment_allocs"]),
        simulated_segment_allocs=int(result.simulated["segment_allocs"]),
        alloc_address_match=result.simulated["alloc_address_match"],
    )
