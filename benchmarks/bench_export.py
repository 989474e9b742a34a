"""``memlens export --format jsonl|csv``: rows per second, and memory that does not grow with the file.

For each size, a synthetic snapshot (``memlens.synthetic``: training steps, 10-60 frame stacks) is
written to disk, then measured in fresh processes (Linux keeps a parent's peak RSS across
fork+exec, so each figure comes from a child that did only that job):

* ``pickle.load``: the bare unpickling of the file (the reference the README's ratios use);
* ``export``: ``memlens.load`` + ``analyze_snapshot`` (for the step and category columns), then
  the streamed export; peak RSS before the export and after it (the export's own growth);
* ``heap``: the export again under ``tracemalloc``, its peak Python heap (what the streaming
  bounds: it must not grow with the file).

The output goes to /dev/null by default (the formatting speed, not the disk's); ``--to DIR``
writes real files there.

    python benchmarks/bench_export.py [--events 100000 1000000] [--format jsonl csv] [--to DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, pickle, resource, sys, time
mode, path, fmt, out = sys.argv[1:5]
def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
if mode == "pickle":
    start = time.perf_counter()
    with open(path, "rb") as handle:
        pickle.load(handle)
    print(json.dumps({"seconds": time.perf_counter() - start, "peak_rss": rss()}))
    sys.exit()
import memlens
from memlens.analysis import analyze_snapshot
from memlens.stream_export import event_labels, write_table
start = time.perf_counter()
snapshot = memlens.load(path, cache=False)
labels = event_labels(analyze_snapshot(snapshot))
prepared = time.perf_counter()
before = rss()
if mode == "heap":
    import tracemalloc
    tracemalloc.start()
with open(out, "wb") as handle:
    rows = write_table(snapshot, handle, fmt, "events", labels)
    written = handle.tell() if out != os.devnull else None
done = time.perf_counter()
heap = tracemalloc.get_traced_memory()[1] if mode == "heap" else None
print(json.dumps({"prepare_seconds": prepared - start, "export_seconds": done - prepared, "rows": rows,
                  "bytes": written, "rss_before": before, "peak_rss": rss(), "heap_peak": heap}))
"""


def child(mode: str, path: str, fmt: str, out: str) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", CHILD, mode, path, fmt, out], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--format", dest="formats", nargs="+", choices=["jsonl", "csv"], default=["jsonl", "csv"])
    parser.add_argument("--to", default=None, help="write the exports into this folder (default: /dev/null)")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="memlens-bench-export-")
    print(f"{'events':>10} {'fmt':>5} {'pickle':>8} {'load':>6} {'load+an.':>8} {'export':>7} {'rows/s':>9} "
          f"{'out':>9} {'RSS before':>10} {'RSS after':>10} {'growth':>7} {'heap peak':>9} {'x load':>6}")
    for events in args.events:
        path = os.path.join(workdir, f"synthetic-{events}.pickle")
        subprocess.run([sys.executable, "-m", "memlens.synthetic", str(events), path], check=True,
                       capture_output=True)
        size = os.path.getsize(path)
        bare = child("pickle", path, "jsonl", os.devnull)
        for fmt in args.formats:
            out = os.path.join(args.to, f"events-{events}.{fmt}") if args.to else os.devnull
            run = child("export", path, fmt, out)
            heap = child("heap", path, fmt, os.devnull)
            seconds = run["export_seconds"]
            out_size = f"{run['bytes'] / 2**20:7.0f}Mi" if run["bytes"] is not None else "/dev/null"
            total = (run["prepare_seconds"] + seconds) / bare["seconds"]
            print(f"{int(run['rows']):>10,} {fmt:>5} {size / 2**20:6.0f}Mi {bare['seconds']:6.2f} "
                  f"{run['prepare_seconds']:8.2f} {seconds:7.2f} {run['rows'] / seconds:9,.0f} {out_size:>9} "
                  f"{run['rss_before'] / 2**20:8.0f}Mi {run['peak_rss'] / 2**20:8.0f}Mi "
                  f"{(run['peak_rss'] - run['rss_before']) / 2**20:5.0f}Mi {heap['heap_peak'] / 2**20:7.1f}Mi "
                  f"{total:6.2f}")
        os.unlink(path)
    print("\nx load: (load + analysis + export) / bare pickle.load of the same file. growth: peak RSS added "
          "by the export; heap peak: its Python heap under tracemalloc (flat in the file's size is the target).")
    os.rmdir(workdir)


if __name__ == "__main__":
    main()
