"""Big snapshots (issue 23's 4M-entry, 6M-entry and 1 GB targets), whole processes, one run.

For each file, side by side and interleaved (so machine noise hits all alike): bare
``pickle.load`` of the file, then ``memlens triage --no-cache`` (the first open: scan, analysis,
screen), each in a fresh process, with its wall time and its peak RSS (``ru_maxrss`` of the child);
the ratios are the ones the issue sets targets for: the first open's wall time over bare
``pickle.load``'s (target <= 0.5x) and its peak RSS over the file's size (target <= 1.5x).

The files are tiled from a real trace (``benchmarks/tiled_snapshot.py``), made here if missing:

    python benchmarks/bench_large.py [--events 4000000 --events 6000000 ...] [--file BIG.pickle ...]
        [--runs 1] [--workdir DIR] [--python-too]

``--python-too`` adds the first open with ``MEMLENS_PURE_PYTHON=1`` (slow: minutes per file).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# The child measures itself: wall from its start, and its own peak RSS.
PICKLE_CHILD = r"""
import pickle, resource, sys, time
start = time.perf_counter()
with open(sys.argv[1], "rb") as handle:
    pickle.load(handle)
print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def measure_isolated(command: list[str], env: dict[str, str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one fresh process, run from a wrapper process of its own
    so that the RSS is this command's alone (RUSAGE_CHILDREN keeps the largest child ever waited for)."""
    wrapper = [sys.executable, "-c",
               "import resource, subprocess, sys, time\n"
               "t = time.perf_counter()\n"
               "r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)\n"
               "w = time.perf_counter() - t\n"
               "sys.stderr.write(r.stderr.decode()[-400:] if r.returncode not in (0, 1) else '')\n"
               "print(w, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, r.returncode)\n",
               *command]
    result = subprocess.run(wrapper, env=env, capture_output=True, text=True, check=True)
    wall, rss, code = result.stdout.split()
    if int(code) not in (0, 1):
        raise SystemExit(f"{command[:3]} failed (exit {code}): {result.stderr.strip()}")
    return float(wall), int(rss)


def tiled(events: int, workdir: Path) -> Path:
    path = workdir / f"tiled-{events}.pickle"
    if not path.exists():
        subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "tiled_snapshot.py"), str(path),
                        "--events", str(events)], check=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, action="append", default=[], help="tile a file of this many entries")
    parser.add_argument("--file", type=Path, action="append", default=[], help="an existing snapshot")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=None, help="where tiled files are kept (default: a temp dir)")
    parser.add_argument("--python-too", action="store_true", help="also the first open on the Python engine")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="memlens-large-"))
    workdir.mkdir(parents=True, exist_ok=True)
    files = [*args.file, *(tiled(n, workdir) for n in args.events)] or [tiled(4_000_000, workdir)]
    base = {k: v for k, v in os.environ.items() if k not in ("MEMLENS_PURE_PYTHON", "PYTHONDONTWRITEBYTECODE")}
    base["MEMLENS_CACHE_DIR"] = str(workdir / "cache")
    memlens = shutil.which("memlens") or "memlens"
    print("| file | entries / size | run | wall | / bare `pickle.load` | peak RSS | / file size |")
    print("|---|---|---|---|---|---|---|")
    for path in files:
        size = path.stat().st_size
        rows: dict[str, tuple[list[str], dict[str, str]]] = {
            "pickle.load": ([sys.executable, "-c", PICKLE_CHILD, str(path)], base),
            "memlens triage, first open (native)": (
                [memlens, "triage", str(path), "--no-cache", "--no-color", "--width", "100"], base),
        }
        if args.python_too:
            rows["memlens triage, first open (python)"] = (
                [memlens, "triage", str(path), "--no-cache", "--no-color", "--width", "100"],
                dict(base, MEMLENS_PURE_PYTHON="1"))
        times: dict[str, list[tuple[float, int]]] = {name: [] for name in rows}
        for _ in range(args.runs):
            for name, (command, env) in rows.items():
                times[name].append(measure_isolated(command, env))
        bare = statistics.median(w for w, _ in times["pickle.load"])
        for name, values in times.items():
            wall = statistics.median(w for w, _ in values)
            rss = max(r for _, r in values)
            print(f"| {path.name} | {size / 2**20:,.0f} MiB | {name} | {wall:.2f} s | {wall / bare:.2f}x | "
                  f"{rss / 2**20:,.0f} MiB | {rss / size:.2f}x |", flush=True)
    print(f"\nmedians of {args.runs} run(s); targets: first open <= 0.5x bare pickle.load, peak RSS <= 1.5x "
          "the file's size")


if __name__ == "__main__":
    main()
