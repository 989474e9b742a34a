"""What the fragmentation finder costs when it has to replay: parse vs analyse on a trace with
blocked cudaMallocs.

``bench_analysis.py``'s synthetic trace is not one the caching allocator would write (its replay
does not reproduce its reserved bytes, so the finder stops at the first cudaMalloc that
disagrees). This one is written by memlens' allocator simulator itself: a training loop whose
sequence length changes every step, so cached blocks are split for one shape and too small for
the next, and cudaMallocs happen while the pool holds enough free in pieces. The finder then
replays the trace up to its last cudaMalloc (to read the pools) and once in full with
``expandable_segments`` (for the saving): the cost this prints.

    python benchmarks/bench_fragmentation.py [--events 1000000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from bench_analysis import best_of, print_budget  # the sibling script: same timing, same budget

import memlens
from memlens.allocator import CachingAllocatorSimulator
from memlens.snapshot.reader import parse
from memlens.units import MiB, format_bytes


def fragmenting_loop(events: int, seed: int = 0) -> dict[str, Any]:
    """A loop of steps whose activation sizes follow a sequence length drawn per step."""
    rng = random.Random(seed)
    sim = CachingAllocatorSimulator()
    params = [sim.malloc(64 * MiB) for _ in range(8)]
    carried: list[int] = []
    while len(sim.trace) < events:
        seq = rng.choice((512, 768, 1024, 1536, 2048))
        activations = []
        for layer in range(24):
            activations.append(sim.malloc(seq * 4096 * 2))  # 4 to 16 MiB per layer
            temp = sim.malloc(seq * 1024 + 512 * layer)  # small-pool and odd-sized temporaries
            sim.free(temp)
        for address in carried:
            sim.free(address)
        carried = [sim.malloc(seq * 8192)]  # a tensor handed to the next step, between the others
        for address in reversed(activations):
            grad = sim.malloc(seq * 2048)
            sim.free(address)
            sim.free(grad)
    del params
    return sim.snapshot()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    start = time.perf_counter()
    raw = fragmenting_loop(args.events)
    print(f"simulated {len(raw['device_traces'][0]):,} trace entries in {time.perf_counter() - start:.1f}s")
    parse_s, snapshot = best_of(lambda: parse(raw, source="<fragmenting loop>"), args.repeat)
    analyze_s, report = best_of(lambda: memlens.analyze(snapshot), args.repeat)
    print(f"parse   {parse_s:7.3f}s")
    print(f"analyze {analyze_s:7.3f}s")
    for finding in report.findings:
        if finding.kind == "fragmentation":
            evidence = finding.evidence
            print(f"  fragmentation {finding.severity}: {evidence['blocked_cudamallocs']} of "
                  f"{evidence['cudamallocs']} cudaMallocs blocked; replay saving "
                  f"{format_bytes(finding.estimated_saving_bytes or 0)}")
    return print_budget(analyze_s, parse_s)


if __name__ == "__main__":
    raise SystemExit(main())
