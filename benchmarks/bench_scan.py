"""First open of a large snapshot: the native scanner (memlens._scan) vs the Python reader.

A snapshot of ``--events`` entries is tiled from a real trace (the largest device trace among the
real snapshots: its entries repeated, each tile's times shifted past the previous one, its frames
shared as PyTorch's pickler shares them), then each of these runs in a fresh process, interleaved,
best of ``--runs``:

  - bare ``pickle.load`` of the file (the reference);
  - ``memlens.snapshot.native_scan.scan`` of the file's bytes alone (its peak RSS includes them);
  - ``memlens.snapshot.native_scan.scan_file``: the scanner reading the file itself, a megabyte at
    a time, as ``memlens.load`` does (the file is never held whole);
  - ``memlens.load`` (no cache), native scanner, and with the scanner off (the Python path);
  - ``memlens triage --no-cache``, native scanner, and with the scanner off.

"Scanner off" turns off only the scanner (the allocator engine stays as it is), so the two rows
differ by the reader alone. Ratios are printed side by side. Peak RSS is each process's own
(VmHWM), not ru_maxrss, which Linux carries over from the benchmark's process.

    python benchmarks/bench_scan.py [--events 1000000] [--runs 3] [--source REAL.pickle] [--keep FILE]
"""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
REAL = Path(os.environ.get("MEMLENS_REAL_SNAPSHOTS") or REPO.parent / "shared" / "real_snapshots")

# The child: the scanner turned off by hand (MEMLENS_PURE_PYTHON would switch the allocator too).
CHILD = r"""
import resource, sys, time
mode, scanner, path = sys.argv[1], sys.argv[2], sys.argv[3]
def peak_rss():
    # This process's own peak (VmHWM): ru_maxrss carries the parent's over fork and exec on Linux,
    # which made every row below the benchmark's own ~390 MiB read as that.
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
def report(start, cpu):
    print(time.perf_counter() - start, time.process_time() - cpu, peak_rss())
if mode == "pickle":
    import pickle
    start, cpu = time.perf_counter(), time.process_time()
    with open(path, "rb") as handle:
        pickle.load(handle)
    report(start, cpu)
    raise SystemExit
import memlens.snapshot.native_scan as native_scan
import memlens.snapshot.ahead as ahead
if scanner == "python":
    ahead._native_scan = None
if mode == "scan":  # the scanner alone, on the bytes read (gc paused, as the reader has it)
    import gc
    with open(path, "rb") as handle:
        data = handle.read()
    gc.disable()
    start, cpu = time.perf_counter(), time.process_time()
    raw, declined = native_scan.scan(data)
    assert raw is not None, declined
    report(start, cpu)
    raise SystemExit
if mode == "scan_file":  # the scanner reading the file itself (gc paused, as the reader has it)
    import gc, os
    gc.disable()
    start, cpu = time.perf_counter(), time.process_time()
    fd = os.open(path, os.O_RDONLY)
    raw, declined = native_scan.scan_file(fd, os.fstat(fd).st_size)
    assert raw is not None, declined
    report(start, cpu)
    raise SystemExit
start, cpu = time.perf_counter(), time.process_time()
if mode == "load":
    import memlens
    memlens.load(path, cache=False)
else:
    import contextlib, io
    from memlens.cli.main import main
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(["triage", path, "--no-cache", "--no-color", "--width", "100"])
        except SystemExit as exc:
            assert not exc.code, exc.code
report(start, cpu)
"""


def largest_real_trace(source: Path | None) -> tuple[Path, dict[str, Any]]:
    candidates = [source] if source else sorted(REAL.glob("*.pickle"))
    best: tuple[int, Path, dict[str, Any]] | None = None
    for path in candidates:
        with open(path, "rb") as handle:
            raw = pickle.load(handle)  # the project's own real snapshots, read by the benchmark only
        if not isinstance(raw, dict):
            continue
        length = max((len(t) for t in raw.get("device_traces") or []), default=0)
        if best is None or length > best[0]:
            best = (length, path, raw)
    if best is None or best[0] == 0:
        raise SystemExit(f"no real snapshot with a trace in {REAL} (set MEMLENS_REAL_SNAPSHOTS)")
    return best[1], best[2]


def tiled(raw: dict[str, Any], events: int) -> dict[str, Any]:
    """``raw`` with its longest trace tiled to ``events`` entries (times shifted per tile)."""
    traces = raw["device_traces"]
    device = max(range(len(traces)), key=lambda d: len(traces[d]))
    trace = traces[device]
    times = [e.get("time_us", 0) for e in trace]
    span = (max(times) - min(times) + 1) if times else 1
    out: list[dict[str, Any]] = []
    tile = 0
    while len(out) < events:
        for item in trace[: events - len(out)]:
            copy = dict(item)
            if "time_us" in copy:
                copy["time_us"] = item["time_us"] + tile * span
            out.append(copy)
        tile += 1
    return {**raw, "device_traces": [out if d == device else t for d, t in enumerate(traces)]}


def timed(mode: str, scanner: str, path: str, env: dict[str, str]) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak RSS bytes) of one fresh process."""
    result = subprocess.run([sys.executable, "-c", CHILD, mode, scanner, path], capture_output=True, text=True,
                            env=env, check=True)
    wall, cpu, rss = map(float, result.stdout.strip().splitlines()[-1].split())
    return wall, cpu, rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--source", type=Path, help="the real snapshot to tile (default: the longest trace)")
    parser.add_argument("--keep", help="write the tiled snapshot here and keep it")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="memlens-bench-scan-")
    path = args.keep or os.path.join(workdir, "tiled.pickle")
    source, raw = largest_real_trace(args.source)
    with open(path, "wb") as handle:
        pickle.dump(tiled(raw, args.events), handle, protocol=4)
    del raw
    print(f"tiled {source.name} to {args.events:,} entries: {os.path.getsize(path) / 2**20:.1f} MiB")
    env = dict(os.environ, MEMLENS_CACHE_DIR=os.path.join(workdir, "cache"))
    env.pop("MEMLENS_PURE_PYTHON", None)
    rows = [("pickle", "-"), ("scan", "native"), ("scan_file", "native"), ("load", "native"), ("load", "python"),
            ("triage", "native"), ("triage", "python")]
    times: dict[tuple[str, str], list[tuple[float, float, float]]] = {row: [] for row in rows}
    started = time.perf_counter()
    for _ in range(args.runs):  # interleaved, so machine noise hits all alike
        for mode, scanner in rows:
            times[(mode, scanner)].append(timed(mode, scanner, path, env))
    # Best of N by wall time; CPU seconds too, as the wall time of a busy machine's runs is noise.
    best = {row: min(values) for row, values in times.items()}
    bare, bare_cpu, _rss = best[("pickle", "-")]
    size = os.path.getsize(path)
    print(f"best of {args.runs}, fresh processes ({time.perf_counter() - started:.0f} s in all)")
    print(f"{'':36} {'wall s':>7} {'x pickle':>9} {'CPU s':>7} {'x pickle':>9} {'native/py':>10} "
          f"{'peak RSS':>9} {'x file':>7}")
    labels = {("pickle", "-"): "bare pickle.load", ("scan", "native"): "memlens._scan.scan of the bytes",
              ("scan_file", "native"): "memlens._scan.scan_file of the file",
              ("load", "native"): "memlens.load, native scanner", ("load", "python"): "memlens.load, Python reader",
              ("triage", "native"): "memlens triage first open, native",
              ("triage", "python"): "memlens triage first open, Python"}
    for row in rows:
        wall, cpu, rss = best[row]
        python = best.get((row[0], "python")) if row[1] == "native" else None
        ratio = f"{cpu / python[1]:9.2f}x" if python else ""
        print(f"{labels[row]:36} {wall:7.2f} {wall / bare:8.2f}x {cpu:7.2f} {cpu / bare_cpu:8.2f}x {ratio:>10} "
              f"{rss / 2**20:7.0f}Mi {rss / size:6.1f}x")


if __name__ == "__main__":
    main()
