"""How much ``memlens.analyze`` adds to loading: parse vs analyse on a ~1M-entry snapshot.

Builds a realistic raw snapshot in-process (``memlens.synthetic``: training steps with forward,
backward and AdamW phases, shared frame dicts as real files have them), then times
``memlens.snapshot.reader.parse`` and ``memlens.analyze`` on it (best of ``--repeat``).
Budget: the analysis may add at most 50% to the load time.

    python benchmarks/bench_analysis.py [--events 1000000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

import memlens
from memlens.snapshot.reader import parse
from memlens.synthetic import synthetic_snapshot

BUDGET_RATIO = 0.5


def best_of(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """The fastest of ``repeat`` runs of ``fn`` (after a garbage collection each), and its result."""
    best, result = float("inf"), None
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--leak", type=int, default=0, help="bytes leaked per step in the synthetic loop")
    args = parser.parse_args()
    start = time.perf_counter()
    raw = synthetic_snapshot(args.events, leak_bytes_per_step=args.leak)
    print(f"built {len(raw['device_traces'][0]):,} trace entries in {time.perf_counter() - start:.1f}s")
    parse_s, snapshot = best_of(lambda: parse(raw, source="<synthetic>"), args.repeat)
    analyze_s, report = best_of(lambda: memlens.analyze(snapshot), args.repeat)
    device = report.device()
    print(f"parse   {parse_s:7.3f}s")
    print(f"analyze {analyze_s:7.3f}s  ({device.step_source} steps: {len(device.steps)}, "
          f"findings: {', '.join(f.kind for f in device.findings) or 'none'})")
    return print_budget(analyze_s, parse_s)


def print_budget(analyze_s: float, parse_s: float) -> int:
    """Print analyse/parse against the budget; the exit code says whether it was met."""
    ratio = analyze_s / parse_s
    print(f"analyze / parse = {ratio:.2f} (budget {BUDGET_RATIO:.2f}) -> {'OK' if ratio <= BUDGET_RATIO else 'OVER'}")
    return 0 if ratio <= BUDGET_RATIO else 1


if __name__ == "__main__":
    raise SystemExit(main())
