"""The native core side by side with the Python engine, whole processes, one run.

Part 1, the issue's table (issue 23) on a 1M-entry snapshot tiled from a real trace
(``benchmarks/tiled_snapshot.py``): bare ``pickle.load``, ``python -m torch.cuda._memory_viz
stats``, ``memlens triage`` first open (no cache) and cached, and ``memlens whatif`` of the cached
file, each on the native engine and
on the Python one (``MEMLENS_PURE_PYTHON=1``); medians of ``--runs`` fresh processes, interleaved
so machine noise hits all alike, each with its ratio to bare ``pickle.load``.

Part 2, the simulator alone: the what-if replay loop over the same trace's columns
(``memlens._native.replay``) against the Python loop, in events per second, and ``whatif`` whole.

    python benchmarks/bench_native.py [--events 1000000] [--runs 3] [--file SNAPSHOT.pickle]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def timed(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one fresh process: the CPU figure (user + system, from the
    children's rusage) is what the command costs when other work shares the machine."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def process_table(path: Path, runs: int, workdir: Path) -> None:
    # Bytecode caches written and used, as on a user's machine (an environment that sets
    # PYTHONDONTWRITEBYTECODE recompiles every module at each start: half a second here).
    base = {k: v for k, v in os.environ.items() if k not in ("MEMLENS_PURE_PYTHON", "PYTHONDONTWRITEBYTECODE")}
    native_env = dict(base, MEMLENS_CACHE_DIR=str(workdir / "cache-native"))
    python_env = dict(base, MEMLENS_CACHE_DIR=str(workdir / "cache-python"), MEMLENS_PURE_PYTHON="1")
    memlens = shutil.which("memlens") or "memlens"
    triage = [memlens, "triage", str(path), "--width", "100", "--no-color"]
    rows: dict[str, tuple[list[str], dict[str, str]]] = {
        "pickle.load": ([sys.executable, "-c", "import pickle,sys; pickle.load(open(sys.argv[1],'rb'))", str(path)],
                        native_env),
        "python -m torch.cuda._memory_viz stats": (
            [sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(path)], native_env),
        "memlens triage, first open (native)": ([*triage, "--no-cache"], native_env),
        "memlens triage, first open (python)": ([*triage, "--no-cache"], python_env),
        "memlens triage, cached (native)": ([*triage, "--cache"], native_env),
        "memlens triage, cached (python)": ([*triage, "--cache"], python_env),
        "memlens whatif --expandable-segments, cached (native)": (
            [memlens, "whatif", str(path), "--expandable-segments"], native_env),
        "memlens whatif --expandable-segments, cached (python)": (
            [memlens, "whatif", str(path), "--expandable-segments"], python_env),
    }
    timed([*triage, "--cache"], native_env)  # write each engine's cache (and the bytecode) once
    timed([*triage, "--cache"], python_env)
    timed(rows["python -m torch.cuda._memory_viz stats"][0], native_env)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in rows}
    for _ in range(runs):
        for name, (command, env) in rows.items():
            times[name].append(timed(command, env))
    bare_wall = statistics.median(w for w, _ in times["pickle.load"])
    bare_cpu = statistics.median(c for _, c in times["pickle.load"])
    size = path.stat().st_size / 2**20
    print(f"\n{path.name}: {size:.1f} MiB, medians of {runs} fresh processes")
    print("| | wall | / bare `pickle.load` | CPU | / bare `pickle.load` |")
    print("|---|---|---|---|---|")
    for name, values in times.items():
        wall = statistics.median(w for w, _ in values)
        cpu = statistics.median(c for _, c in values)
        print(f"| {name} | {wall:.2f} s | {wall / bare_wall:.2f}x | {cpu:.2f} s | {cpu / bare_cpu:.2f}x |")


def simulator_alone(path: Path, runs: int) -> None:
    import numpy as np

    from memlens.allocator import replay as replay_module
    from memlens.allocator.engine import native_module
    from memlens.allocator.replay import whatif
    from memlens.allocator.simulator import CachingAllocatorSimulator as PythonSimulator
    from memlens.snapshot.reader import load

    native = native_module()
    if native is None:
        print("\nsimulator alone: the native core is not built (or MEMLENS_PURE_PYTHON): nothing to compare")
        return
    from memlens.allocator.native import NativeCachingAllocatorSimulator

    snapshot = load(path)
    trace = snapshot.device(None)
    events = len(trace)
    actions = np.ascontiguousarray(trace.action, dtype=np.int8)
    addresses = np.ascontiguousarray(trace.address, dtype=np.int64)
    sizes = np.ascontiguousarray(trace.size, dtype=np.int64)
    streams = np.ascontiguousarray(trace.stream, dtype=np.int64)
    completes = native.completed_requests(actions, addresses)
    no_release = np.zeros(events, dtype=np.uint8)
    hints = actions == 3

    def native_loop() -> float:
        sim = NativeCachingAllocatorSimulator(record_history=False)
        started = time.process_time()
        native.replay(sim, actions, addresses, sizes, streams, completes, no_release, addresses[hints].copy(),
                      sizes[hints].copy(), True, [], [], False, None)
        return time.process_time() - started

    def python_loop() -> float:
        sim = PythonSimulator(record_history=False)
        acts, addrs, szs, strs = actions.tolist(), addresses.tolist(), sizes.tolist(), streams.tolist()
        done = set(np.flatnonzero(completes).tolist())
        mapping: dict[int, int] = {}
        started = time.process_time()
        for i, act in enumerate(acts):
            if act == 0:
                mapping[addrs[i]] = sim.malloc(szs[i], strs[i])
            elif act in (1, 2):
                sim_address = mapping.get(addrs[i], -1)
                if sim_address >= 0 and sim.is_allocated(sim_address):
                    if act == 1 and i in done:
                        sim.request_free(sim_address)
                    else:
                        sim.free(sim_address) if act == 1 else sim.complete_free(sim_address)
                        del mapping[addrs[i]]
        return time.process_time() - started

    native_s = min(native_loop() for _ in range(runs))
    python_s = python_loop()
    # CPU seconds of this process (time.process_time): on a shared machine the wall clock counts
    # other processes' time too; the loop is single-threaded, so its CPU time is its cost.
    print(f"\nsimulator alone, {events:,} events ({path.name}), CPU seconds")
    print(f"  native replay loop  {native_s:7.3f} s  {events / native_s / 1e6:7.2f} M events/s   target >= 10 M/s")
    print(f"  python model loop   {python_s:7.3f} s  {events / python_s / 1e6:7.2f} M events/s   "
          f"native {python_s / native_s:.0f}x faster")
    for engine in ("native", "python"):
        if engine == "python":
            patched: Any = replay_module  # the replay's engine switched to Python for this run
            patched.native_module = lambda: None
            patched.simulator_class = lambda: PythonSimulator
        started = time.perf_counter()
        whatif(snapshot)
        print(f"  whatif() whole, {engine:<6} {time.perf_counter() - started:7.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--file", type=Path, help="an existing snapshot instead of a tiled one")
    parser.add_argument("--skip-processes", action="store_true", help="only the simulator alone")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="memlens-bench-native-"))
    path = args.file
    if path is None:
        path = workdir / "tiled.pickle"
        subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "tiled_snapshot.py"), str(path),
                        "--events", str(args.events)], check=True)
    if not args.skip_processes:
        process_table(path, args.runs, workdir)
    simulator_alone(path, args.runs)
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
