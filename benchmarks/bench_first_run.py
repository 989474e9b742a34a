"""A user's first ``memlens triage`` of a file: when the answer is out, and when the process ends.

The first triage of a large file is the run that writes its caches (the columnar copy and the
report). The answer is now printed before they are written (``memlens.deferred``), so what the
user waits for is the answer, and the cache writing happens after it. This benchmark measures,
side by side in one run, as fresh processes and the best of N, against a bare ``pickle.load`` of
the same file:

- the first triage with a new cache folder: the time until the whole ``--json`` answer has
  arrived on its standard output, and the time until the process exits (the caches written);
- ``--no-cache`` (nothing written);
- the cached triage that follows;
- ``python -c pass``: the interpreter's own start, the floor under every row.

The file is left older than the cache's racy margin before the runs (a finished run's snapshot
is), so the first triage remembers its digest and the cached one reads none of its bytes. The
processes run with Python's bytecode cache on, as an installed memlens does (a
``PYTHONDONTWRITEBYTECODE`` in the environment would have every run compile memlens again).

    python benchmarks/bench_first_run.py [--events 1000000 4000000] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from memlens.cache_folder import RACY_MARGIN_NS


def timed(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def answered_and_ended(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(seconds until the whole JSON answer was read from the process, seconds until it exited)."""
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert process.stdout is not None
    received = b""
    answered = None
    while chunk := os.read(process.stdout.fileno(), 1 << 16):
        received += chunk
        if answered is None and received.endswith(b"\n"):
            try:
                json.loads(received)
            except ValueError:
                continue
            answered = time.perf_counter() - started
    process.wait()
    ended = time.perf_counter() - started
    if process.returncode != 0 or answered is None:
        raise SystemExit(f"{' '.join(command)} failed (exit {process.returncode})")
    return answered, ended


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, nargs="+", default=[1_000_000, 4_000_000])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    beside = os.path.join(os.path.dirname(sys.executable), "memlens")  # not a shim that starts another shell
    memlens = beside if os.path.exists(beside) else shutil.which("memlens") or "memlens"
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([memlens, "--help"], check=True, env=environment, stdout=subprocess.DEVNULL)  # compiled once
    workdir = tempfile.mkdtemp(prefix="memlens-bench-first-")
    try:
        for events in args.events:
            path = os.path.join(workdir, f"large-{events}.pickle")
            subprocess.run([sys.executable, "-m", "memlens.synthetic", str(events), path], check=True)
            time.sleep(RACY_MARGIN_NS / 1e9 + 0.5)
            bare_cmd = [sys.executable, "-c", "import pickle, sys; pickle.load(open(sys.argv[1], 'rb'))", path]
            triage = [memlens, "triage", path, "--json"]
            bare, no_cache, answered, ended, cached, interpreter = [], [], [], [], [], []
            for run in range(args.runs):  # interleaved, so the machine's noise hits all alike
                env = dict(environment, MEMLENS_CACHE_DIR=os.path.join(workdir, f"cache-{events}-{run}"))
                interpreter.append(timed([sys.executable, "-c", "pass"], env))
                bare.append(timed(bare_cmd, env))
                no_cache.append(timed([*triage, "--no-cache"], env))
                first = answered_and_ended([*triage, "--cache"], env)
                answered.append(first[0])
                ended.append(first[1])
                cached.append(timed([*triage, "--cache"], env))
            base = min(bare)
            print(f"{events:,} events, {os.path.getsize(path) / 2**20:.0f} MiB, best of {args.runs}, fresh processes")
            for label, seconds in (("bare pickle.load", base),
                                   ("first triage: the answer out", min(answered)),
                                   ("first triage: the process ends (caches written)", min(ended)),
                                   ("triage --no-cache", min(no_cache)),
                                   ("triage, cached", min(cached)),
                                   ("python -c pass (the interpreter's start)", min(interpreter))):
                print(f"  {label:<50} {seconds:6.2f} s  {seconds / base:5.2f}x")
            os.unlink(path)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
