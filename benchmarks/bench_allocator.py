"""Allocator simulator: fidelity on the real snapshots, and replay speed on a 1M-event trace.

    python benchmarks/bench_allocator.py [--events 1000000] [--snapshots ../shared/real_snapshots]

Part 1 replays every real snapshot with its own recorded settings and prints the recorded and
simulated peak reserved memory and cudaMalloc (segment_alloc) counts; the acceptance bounds are
2 % and 5 %. Part 2 builds a synthetic training-like trace (weights, per-step activations with a
varying batch size, short-lived temporaries, gradients) by driving the simulator, loads it through
the snapshot reader, and times ``memlens.allocator.whatif`` on it (the bound is 30 s).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from memlens.allocator import AllocatorSettings, CachingAllocatorSimulator, whatif
from memlens.allocator.fidelity import fidelity
from memlens.snapshot.reader import parse
from memlens.units import KiB, MiB, format_bytes

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SNAPSHOTS = REPO_ROOT.parent / "shared" / "real_snapshots"
REPLAY_TIME_LIMIT_S = 30.0


def fidelity_table(directory: Path) -> list[str]:
    lines = [
        "| snapshot | events | history | peak reserved: recorded | simulated | error "
        "| segment_alloc: recorded | simulated | tensors at the recorded address |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for path in sorted(directory.glob("*.pickle")):
        row = fidelity(path)
        match = "n/a" if row.alloc_address_match is None else f"{row.alloc_address_match:.1%}"
        lines.append(
            f"| {row.name} | {row.events} | {row.history} | {format_bytes(row.recorded_peak_reserved)} "
            f"| {format_bytes(row.simulated_peak_reserved)} | {row.peak_error:.2%} "
            f"| {row.recorded_segment_allocs} | {row.simulated_segment_allocs} | {match} |"
        )
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
    print(f"- trace entries replayed:            {result.recorded['events']:,}")
    print(f"- generate (simulator with history): {generated - started:.1f} s")
    print(f"- parse into the snapshot model:     {loaded - generated:.1f} s")
    print(
        f"- whatif replay, recorded settings:  {replay_s:.1f} s "
        f"({result.recorded['events'] / replay_s / 1e6:.2f} M events/s; bound {REPLAY_TIME_LIMIT_S:.0f} s)"
    )
    print(f"- whatif replay, expandable:         {replayed_expandable - replayed:.1f} s")
    print(
        f"- peak reserved recorded {format_bytes(result.recorded['peak_reserved_bytes'])}, "
        f"replayed {format_bytes(result.simulated['peak_reserved_bytes'])}, "
        f"with expandable segments {format_bytes(expandable.simulated['peak_reserved_bytes'])}"
    )
    if replay_s > REPLAY_TIME_LIMIT_S:
        raise SystemExit(f"replay took {replay_s:.1f} s, over the {REPLAY_TIME_LIMIT_S:.0f} s bound")


if __name__ == "__main__":
    main()
