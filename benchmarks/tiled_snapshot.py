"""A large snapshot made of a real one: its trace repeated end to end, each copy moved.

The issue's figures are measured on a 1M-entry snapshot "tiled from a real trace": the real
history (default: the largest complete history among the real snapshots) is copied whole until
the trace has at least ``--events`` entries; copy k has its addresses moved by k * 64 GiB (its
own address range, so no two copies' segments meet) and its clock moved past the previous copy's
end. The final state is every copy's segments, moved alike, so the file is as consistent as the
real one. The frames are shared between copies, as a real long run's repeated steps share them.

    python benchmarks/tiled_snapshot.py OUT.pickle [--events 1000000] [--source REAL.pickle]
"""

from __future__ import annotations

import argparse
import copy
import pickle
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SOURCE = REPO_ROOT.parent / "shared" / "real_snapshots" / "ZidongLiu__DeComFL__memory.pickle"
ADDRESS_STRIDE = 64 << 30


def _moved_segment(segment: dict[str, Any], shift: int) -> dict[str, Any]:
    moved = dict(segment)
    moved["address"] = segment["address"] + shift
    moved["blocks"] = [{**block, "address": block["address"] + shift} for block in segment.get("blocks", [])]
    return moved


def tile(source: dict[str, Any], events: int) -> dict[str, Any]:
    traces = source["device_traces"]
    device = max(range(len(traces)), key=lambda d: len(traces[d]))
    trace = traces[device]
    if not trace:
        raise SystemExit("the source snapshot has no trace to tile")
    times = [e["time_us"] for e in trace if "time_us" in e]
    span = (max(times) - min(times) + 1) if times else 0
    copies = -(-events // len(trace))
    tiled: list[dict[str, Any]] = []
    segments: list[dict[str, Any]] = []
    for k in range(copies):
        shift, later = k * ADDRESS_STRIDE, k * span
        for entry in trace:
            moved = dict(entry)
            if "addr" in moved:
                moved["addr"] += shift
            if "time_us" in moved:
                moved["time_us"] += later
            tiled.append(moved)
        segments.extend(_moved_segment(s, shift) for s in source["segments"] if s.get("device", 0) == device)
    result = copy.copy(source)
    result["device_traces"] = [tiled if d == device else [] for d in range(len(traces))]
    result["segments"] = segments
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    args = parser.parse_args()
    with args.source.open("rb") as handle:
        source = pickle.load(handle)
    tiled = tile(source, args.events)
    with args.out.open("wb") as handle:
        pickle.dump(tiled, handle, protocol=pickle.HIGHEST_PROTOCOL)
    entries = sum(len(t) for t in tiled["device_traces"])
    print(f"{args.out}: {entries:,} entries tiled from {args.source.name}, {args.out.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
