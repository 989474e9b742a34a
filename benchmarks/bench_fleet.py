"""A 64-rank fleet: in this process, limited child processes (--jobs 1 and N) and a Dask LocalCluster.

The ranks are CPU-recorded snapshots of a tiny training loop (``tests/fleet_ranks.py``), one
rank leaking and one with a 4x batch, recorded once and kept in a temporary folder for the next
run. Each of those takes tens of milliseconds to analyse, so a second table does the same over
larger synthetic ranks (``memlens.synthetic``, 100,000 events, about a second each, one leaking),
where the work per file, not the start of the workers, dominates, as with real ranks' snapshots.
Each way is timed best of N over the same files (``memlens.ops.fleet.triage_fleet``, what
``memlens fleet FILES --jobs N`` / ``--dask ADDRESS`` calls, each rank in its own child process
under the runner's limits), with the speed-up over analysing the files one after another in this
process, without limits (``rank_job`` called here: what the runner's children cost) beside it.
The Dask cluster is started once, outside the timing, as a user's existing cluster would be; its
start-up is printed apart. Every way must name the planted outlier ranks.

    python benchmarks/bench_fleet.py [--ranks 64] [--steps 16] [--large 16] [--jobs 2] [--runs 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.fleet_ranks

from memlens.ops.fleet import FleetReport, fleet_of_rows, rank_job, triage_fleet
from tests.fleet_ranks import record_ranks


def fleet_files(ranks: int, steps: int) -> tuple[list[str], set[int]]:
    """The recorded ranks (reused when a previous run left them complete) and the outliers planted."""
    leaky, big = ranks // 4 + 1, (3 * ranks) // 4 - 1
    folder = Path(tempfile.gettempdir()) / f"memlens-bench-fleet-{ranks}x{steps}-{leaky}-{big}"
    done = folder / "complete"
    if not done.exists():
        started = time.perf_counter()
        record_ranks(folder / "run", ranks, leaky={leaky}, big_batch={big}, steps=steps)
        done.write_text(f"{time.perf_counter() - started:.1f}\n")
        print(f"recorded {ranks} ranks into {folder} in {done.read_text().strip()} s", file=sys.stderr)
    paths = [str(folder / "run" / f"rank{r}.pickle") for r in range(ranks)]
    return paths, {leaky, big}


def large_files(count: int, events: int) -> tuple[list[str], set[int]]:
    """``count`` synthetic rank snapshots of ``events`` entries each (``memlens.synthetic``), one
    leaking: where each file takes a second or more to analyse, as a real rank's does."""
    from memlens.synthetic import synthetic_snapshot, write_pickle

    leaky, leak_per_step = count // 3, 32 << 20  # ~2 GiB over the run: a third more than a rank's peak
    folder = Path(tempfile.gettempdir()) / f"memlens-bench-fleet-large-{count}x{events}-{leaky}-{leak_per_step}"
    folder.mkdir(exist_ok=True)
    paths = [str(folder / f"rank{r}.pickle") for r in range(count)]
    for rank, path in enumerate(paths):
        if not os.path.exists(path):
            leak = leak_per_step if rank == leaky else 0
            write_pickle(synthetic_snapshot(events, seed=rank, leak_bytes_per_step=leak), path)
    return paths, {leaky}


def best_of(runs: int, triage: Callable[[], FleetReport]) -> tuple[float, FleetReport]:
    best, fleet = float("inf"), None
    for _ in range(runs):
        started = time.perf_counter()
        fleet = triage()
        best = min(best, time.perf_counter() - started)
    assert fleet is not None
    return best, fleet


def compare(title: str, paths: list[str], planted: set[int], jobs: int, runs: int, dask: str | None) -> None:
    """In this process, the limited children and (given an address) Dask over ``paths``, side by side."""
    timings: list[tuple[str, float, FleetReport]] = []
    seconds, fleet = best_of(runs, lambda: fleet_of_rows([rank_job(p, cache=False).row for p in paths], "processes"))
    timings.append(("in this process, one after another, no limits", seconds, fleet))
    seconds, fleet = best_of(runs, lambda: triage_fleet(paths, jobs=1, cache=False))
    timings.append(("limited children, one at a time (--jobs 1)", seconds, fleet))
    seconds, fleet = best_of(runs, lambda: triage_fleet(paths, jobs=jobs, cache=False))
    timings.append((f"limited children (--jobs {jobs})", seconds, fleet))
    if dask is not None:
        seconds, fleet = best_of(runs, lambda: triage_fleet(paths, dask=dask, cache=False))
        timings.append((f"Dask LocalCluster ({jobs} worker processes)", seconds, fleet))
    sequential = timings[0][1]
    per_file = sum(row.seconds for row in timings[0][2].rows) / len(paths)
    size = sum(os.path.getsize(p) for p in paths)
    print(f"{title}: {len(paths)} rank snapshots, {size / 2**20:.1f} MiB in all, "
          f"{per_file * 1000:,.0f} ms of analysis each (in this process); best of {runs}")
    print(f"  {'way':<48} {'seconds':>8} {'speed-up':>9}  outliers named")
    for name, seconds, fleet in timings:
        named = sorted(o.rank for o in fleet.outliers if o.rank is not None)
        verdict = "ok" if set(named) == planted else f"WRONG (planted {sorted(planted)})"
        print(f"  {name:<48} {seconds:8.2f} {sequential / seconds:8.2f}x  ranks {named} {verdict}")
    for outlier in timings[0][2].outliers:
        print(f"    {outlier.verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16, help="training steps recorded per rank")
    parser.add_argument("--large", type=int, default=16, help="synthetic large ranks (0: skip that table)")
    parser.add_argument("--large-events", type=int, default=100_000)
    parser.add_argument("--jobs", type=int, default=2, help="processes, and Dask workers")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    recorded = fleet_files(args.ranks, args.steps)
    large = large_files(args.large, args.large_events) if args.large else None
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start")
    with contextlib.ExitStack() as stack:
        address = None
        try:
            from distributed import LocalCluster
        except ImportError:
            print("dask: not installed (pip install 'memlens[dask]'): its rows are skipped")
        else:
            started = time.perf_counter()
            cluster = stack.enter_context(LocalCluster(processes=True, n_workers=args.jobs, threads_per_worker=1,
                                                       dashboard_address=None, silence_logs=40))
            address = cluster.scheduler_address
            print(f"the LocalCluster took {time.perf_counter() - started:.2f} s to start "
                  "(not counted: it stands for an existing cluster)")
        compare("CPU-recorded", *recorded, args.jobs, args.runs, address)
        if large is not None:
            compare(f"synthetic, {args.large_events:,} events each", *large, args.jobs, args.runs, address)


if __name__ == "__main__":
    main()
