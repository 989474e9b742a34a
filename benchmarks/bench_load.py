"""Load speed and memory: ``memlens.load`` (+ curves) vs bare ``pickle.load`` of the same file.

Each measurement runs in its own fresh Python process so peak RSS is comparable; all of them
run side by side in this one invocation. Targets (issue 2): load time <= 1.5x and peak RSS
<= 1.5x of bare pickle.load; second open from the cache <= 0.1x of bare pickle.load.

    python benchmarks/bench_load.py [--events 1000000] [--runs 3] [--keep FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, pickle, resource, sys, time
mode, path = sys.argv[1], sys.argv[2]
if mode != "pickle":
    import memlens  # imports are not what is measured: only reading the file
start = time.perf_counter()
if mode == "pickle":
    with open(path, "rb") as handle:
        obj = pickle.load(handle)
    events = len(obj["device_traces"][0])
else:
    snap = memlens.load(path, cache=(mode != "nocache"))
    events = snap.device(0).events
    assert snap.from_cache == (mode == "cache"), (mode, snap.from_cache)
elapsed = time.perf_counter() - start
print(json.dumps({"seconds": elapsed, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "events": events}))
"""


def measure(mode: str, path: str, env: dict[str, str]) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode, path], capture_output=True, text=True, env=env,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def best_of(runs: int, mode: str, path: str, env: dict[str, str]) -> dict[str, float]:
    return min((measure(mode, path, env) for _ in range(runs)), key=lambda r: r["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=3, help="best of N for each measurement")
    parser.add_argument("--keep", help="write the generated snapshot here and keep it")
    args = parser.parse_args()

    workdir = tempfile.mkdtemp(prefix="memlens-bench-")
    path = args.keep or os.path.join(workdir, "large.pickle")
    started = time.perf_counter()
    # Generated in a child: Linux keeps a process's peak RSS across fork+exec, so a parent that
    # held the snapshot would inflate every child's measurement.
    subprocess.run([sys.executable, "-m", "memlens.synthetic", str(args.events), path], check=True)
    print(f"generated {path}: {os.path.getsize(path) / 2**20:.1f} MiB in {time.perf_counter() - started:.1f} s")
    env = dict(os.environ, MEMLENS_CACHE_DIR=os.path.join(workdir, "cache"))

    # Interleave the modes so drift on a noisy machine hits them alike.
    bare = best_of(args.runs, "pickle", path, env)
    loaded = best_of(args.runs, "nocache", path, env)
    first = measure("first", path, env)  # writes the cache
    cached = best_of(args.runs, "cache", path, env)

    rows = [
        ("bare pickle.load", bare, "(reference)"),
        ("memlens.load + curves", loaded, "time <= 1.5x, RSS <= 1.5x"),
        ("first open, writes cache", first, ""),
        ("second open, from cache", cached, "time <= 0.1x"),
    ]
    print(f"\n{bare['events']:,} trace entries, best of {args.runs} runs, each in a fresh process")
    print(f"{'':26} {'seconds':>8} {'peak RSS':>10} {'time x':>7} {'RSS x':>7}  target")
    for name, result, target in rows:
        print(f"{name:26} {result['seconds']:8.2f} {result['peak_rss'] / 2**20:8.0f}Mi "
              f"{result['seconds'] / bare['seconds']:7.2f} {result['peak_rss'] / bare['peak_rss']:7.2f}  {target}")


if __name__ == "__main__":
    main()
