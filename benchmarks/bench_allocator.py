"""Allocator simulator: fidelity on the real snapshots, and replay speed on a 1M-event trace.

    python benchmarks/bench_allocator.py [--events 1000000] [--snapshots ../shared/real_snapshots]

Part 1 replays every real snapshot with its own recorded settings and prints the recorded and
simulated peak reserved memory and cudaMalloc (segment_alloc) counts (the acceptance bounds are
2 % and 5 %) and where the tensors land as (segment, offset), with the recorded segment bases and
with fresh ones, in separate tables for complete histories, seeded mid-run windows and
state-only dumps. Part 2 builds a synthetic training-like trace (weights, per-step activations with a
varying batch size, short-lived temporaries, gradients) by driving the simulator, loads it through
the snapshot reader, and times ``memlens.allocator.whatif`` on it (the bound is 30 s).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from memlens.allocator import AllocatorSettings, CachingAllocatorSimulator, whatif
from memlens.allocator.fidelity import COMPLETE, SEEDED, fidelity
from memlens.snapshot.reader import parse
from memlens.units import KiB, MiB, format_bytes

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SNAPSHOTS = REPO_ROOT.parent / "shared" / "real_snapshots"
REPLAY_TIME_LIMIT_S = 30.0


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def fidelity_table(directory: Path) -> list[str]:
    """Three tables: complete histories, seeded windows, state-only dumps.

    Each history is replayed twice: with the recorded segment bases (the default) and with
    fresh ones, where only the (segment, offset) agreement can show that tensors land where the
    real allocator put them. "segments opened in window" counts the cudaMalloc decisions the
    replay had to reproduce: with 0, the peak and count errors only say the seeded cache held
    every request.
    """
    complete, seeded, state_only = [], [], []
    for path in sorted(directory.glob("*.pickle")):
        row = fidelity(path)
        fresh = fidelity(path, use_recorded_addresses=False)
        peaks = (
            f"{format_bytes(row.recorded_peak_reserved)} | {format_bytes(row.simulated_peak_reserved)} "
            f"| {row.peak_error:.2%} | {row.recorded_segment_allocs} | {row.simulated_segment_allocs}"
        )
        placement = (
            f"{_percent(row.segment_offset_match)} | {_percent(fresh.segment_offset_match)} "
            f"| {_percent(fresh.address_match)}"
        )
        if row.history == COMPLETE:
            opened = row.segments_opened_in_window
            complete.append(f"| {row.name} | {row.events:,} | {opened} | {peaks} | {placement} |")
        elif row.history == SEEDED:
            seeded.append(
                f"| {row.name} | {row.events:,} | {row.seeded_segments} | {row.seeded_blocks} "
                f"| {row.segments_opened_in_window} | {peaks} | {placement} |"
            )
        else:
            state_only.append(
                f"| {row.name} | {row.events} | {row.seeded_segments} | {row.seeded_blocks} "
                f"| {format_bytes(row.recorded_peak_reserved)} |"
            )
    peak_columns = (
        "peak reserved: recorded | simulated | error | cudaMallocs (segment_alloc): recorded | simulated "
        "| same (segment, offset), recorded bases | same (segment, offset), fresh bases "
        "| same raw address, fresh bases |"
    )
    lines = [
        "### Complete histories (the window starts with the process: nothing seeded)",
        "",
        f"| snapshot | events | segments opened in window | {peak_columns}",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *complete,
        "",
        "### Windows opened mid-run (seeded with the state inferred at their first event)",
        "",
        f"| snapshot | events | segments seeded | live blocks seeded | segments opened in window | {peak_columns}",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *seeded,
        "",
        "### State only (0 or 1 events: nothing to replay)",
        "",
        "| snapshot | events | segments in the final state | live blocks | reserved |",
        "|---|---:|---:|---:|---:|",
        *state_only,
    ]
    return lines


def synthetic_trace(target_events: int, seed: int = 0) -> dict[str, object]:
    """A training-like alloc/free history of at least ``target_events`` trace entries (whole steps)."""
    rng = np.random.default_rng(seed)
    sim = CachingAllocatorSimulator(record_history=True)
    weight_sizes = (rng.lognormal(np.log(4 * MiB), 1.2, 150)).astype(np.int64) + 1
    weights = [sim.malloc(int(s)) for s in weight_sizes]
    activation_base = rng.lognormal(np.log(2 * MiB), 1.5, 250)
    while len(sim.trace) < target_events:
        batch = rng.uniform(0.85, 1.15)
        activations = [sim.malloc(int(s * batch) + 1) for s in activation_base]
        temp_sizes = rng.lognormal(np.log(64 * KiB), 2.0, 150).astype(np.int64) + 1
        for size in temp_sizes:
            sim.free(sim.malloc(int(size)))
        for address in reversed(activations):
            sim.free(address)
        gradients = [sim.malloc(int(s)) for s in weight_sizes]
        for address in gradients:
            sim.request_free(address)
            sim.complete_free(address)
    del weights
    return sim.snapshot()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--snapshots", type=Path, default=DEFAULT_SNAPSHOTS)
    args = parser.parse_args()

    if args.snapshots.is_dir():
        print("## Fidelity: replaying real snapshots with their recorded settings\n")
        print("\n".join(fidelity_table(args.snapshots)))
        print()
    else:
        print(f"(no real snapshots at {args.snapshots}: fidelity table skipped)\n")

    print(f"## Replay speed: synthetic trace of {args.events:,} events\n")
    started = time.perf_counter()
    raw = synthetic_trace(args.events)
    generated = time.perf_counter()
    snapshot = parse(raw, source="<synthetic>")
    loaded = time.perf_counter()
    result = whatif(snapshot)
    replayed = time.perf_counter()
    expandable = whatif(snapshot, settings=AllocatorSettings(expandable_segments=True))
    replayed_expandable = time.perf_counter()
    replay_s = replayed - loaded
    print(f"- trace entries replayed:            {result.recorded.events:,}")
    print(f"- generate (simulator with history): {generated - started:.1f} s")
    print(f"- parse into the snapshot model:     {loaded - generated:.1f} s")
    print(
        f"- whatif replay, recorded settings:  {replay_s:.1f} s "
        f"({result.recorded.events / replay_s / 1e6:.2f} M events/s; bound {REPLAY_TIME_LIMIT_S:.0f} s)"
    )
    print(f"- whatif replay, expandable:         {replayed_expandable - replayed:.1f} s")
    print(
        f"- peak reserved recorded {format_bytes(result.recorded.peak_reserved_bytes)}, "
        f"replayed {format_bytes(result.simulated.peak_reserved_bytes)}, "
        f"with expandable segments {format_bytes(expandable.simulated.peak_reserved_bytes)}"
    )
    if replay_s > REPLAY_TIME_LIMIT_S:
        raise SystemExit(f"replay took {replay_s:.1f} s, over the {REPLAY_TIME_LIMIT_S:.0f} s bound")


if __name__ == "__main__":
    main()
