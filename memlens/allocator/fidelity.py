"""How closely a replay with the recorded settings reproduces the recorded run.

Used by the fidelity tests and ``benchmarks/bench_allocator.py``: the what-if figures are only
worth trusting if these agree on real snapshots. What each figure can show depends on the
history behind it, so every row says which it had:

* ``complete``: the window starts with the process (nothing seeded), so every segment the real
  allocator opened is in it and the replay makes every decision itself;
* ``mid-run (seeded)``: the replay starts from the state inferred at the window's first event
  (``memlens.allocator.initial_state``). Its agreement is only as telling as the number of
  segments the window opens: a window that opens none agrees on peak reserved and cudaMalloc
  count whenever the seeded cache held every request;
* ``state only``: no history (0 or 1 events): nothing is replayed.

Where tensors land is compared as (segment, offset) (``segment_offset_match``): raw address
equality (``address_match``) holds with the recorded segment bases only because they are
copied, and says nothing with fresh ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from memlens.allocator.replay import whatif
from memlens.snapshot.model import Snapshot

# Acceptance bounds (issue 5): peak reserved within 2 %, cudaMalloc count within 5 %.
PEAK_RESERVED_TOLERANCE = 0.02
SEGMENT_ALLOC_TOLERANCE = 0.05

COMPLETE = "complete"
SEEDED = "mid-run (seeded)"
STATE_ONLY = "state only"


@dataclass(frozen=True)
class FidelityRow:
    name: str
    events: int
    history: str  # COMPLETE, SEEDED or STATE_ONLY
    recorded_peak_reserved: int
    simulated_peak_reserved: int
    recorded_segment_allocs: int
    simulated_segment_allocs: int
    # Segments (and live blocks in them) the replay was seeded with: 0 for a complete history.
    seeded_segments: int
    seeded_blocks: int
    # Fraction of replayed allocations at the recorded address / in the paired segment at the
    # recorded offset (None without allocations); of ``placed_allocs`` whose recorded segment is known.
    address_match: float | None
    segment_offset_match: float | None
    placed_allocs: int
    use_recorded_addresses: bool

    @property
    def segments_opened_in_window(self) -> int:
        """cudaMallocs the recorded window made: the decisions a replay can get wrong."""
        return self.recorded_segment_allocs

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
    """Replay ``snapshot`` with its own settings and compare with what was recorded.

    ``use_recorded_addresses=False`` opens the replay's segments at fresh addresses, so the
    (segment, offset) agreement measures the replay's choices rather than copied bases.
    """
    result = whatif(snapshot, use_recorded_addresses=use_recorded_addresses)
    events = int(result.recorded.events)
    if events <= 1:
        history = STATE_ONLY
    elif result.seeded:
        history = SEEDED
    else:
        history = COMPLETE
    return FidelityRow(
        name=Path(result.source).name,
        events=events,
        history=history,
        recorded_peak_reserved=int(result.recorded.peak_reserved_bytes),
        simulated_peak_reserved=int(result.simulated.peak_reserved_bytes),
        recorded_segment_allocs=int(result.recorded.segment_allocs),
        simulated_segment_allocs=int(result.simulated.segment_allocs),
        seeded_segments=len(result.initial_state.segments),
        seeded_blocks=result.initial_state.live_blocks,
        address_match=result.simulated.alloc_address_match,
        segment_offset_match=result.simulated.alloc_segment_offset_match,
        placed_allocs=int(result.simulated.allocs_in_known_segment),
        use_recorded_addresses=use_recorded_addresses,
    )
