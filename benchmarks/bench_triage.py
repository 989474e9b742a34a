"""``memlens triage`` end to end vs bare ``pickle.load`` of the same 1,000,000-entry file.

Target (issue 7): the whole triage (load, analyse, print) at most 2x bare ``pickle.load``.
Both run as fresh processes, side by side in this one invocation, best of N:
  - ``python -c "pickle.load(...)"``
  - ``memlens triage FILE`` (output to /dev/null), the real console script.
It also records that the progress bar is drawn when stderr is a terminal (run under ``script``
to get a pty when it is available).

    python benchmarks/bench_triage.py [--events 1000000] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time


def timed(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="memlens-bench-")
    path = os.path.join(workdir, "large.pickle")
    subprocess.run([sys.executable, "-m", "memlens.synthetic", str(args.events), path], check=True)
    # No cache: the first open of a file is what someone triaging an OOM waits for.
    env = dict(os.environ, MEMLENS_CACHE_DIR=os.path.join(workdir, "cache"))
    memlens = shutil.which("memlens") or "memlens"
    bare_cmd = [sys.executable, "-c", "import pickle, sys; pickle.load(open(sys.argv[1], 'rb'))", path]
    triage_cmd = [memlens, "triage", path, "--width", "100"]
    bare, first, again = [], [], []
    for _ in range(args.runs):  # interleaved, so machine noise hits all alike
        bare.append(timed(bare_cmd, env))
        first.append(timed([*triage_cmd, "--no-color", "--no-cache"], env))
    timed([*triage_cmd, "--no-color", "--cache"], env)  # writes the cache
    for _ in range(args.runs):
        again.append(timed([*triage_cmd, "--no-color", "--cache"], env))
    print(f"{args.events:,} events, {os.path.getsize(path) / 2**20:.1f} MiB, best of {args.runs}, fresh processes")
    print(f"  bare pickle.load (python -c)          {min(bare):6.2f} s")
    print(f"  memlens triage, first open (no cache) {min(first):6.2f} s   ratio {min(first) / min(bare):.2f}x"
          "   target <= 2x")
    print(f"  memlens triage, again (cache)         {min(again):6.2f} s   ratio {min(again) / min(bare):.2f}x")
    if shutil.which("script"):
        out = subprocess.run(["script", "-qec", " ".join([*triage_cmd, "--no-cache", ">/dev/null"]), "/dev/null"],
                             capture_output=True, text=True, env=env)
        drawn = "reading" in out.stdout or "building timeline" in out.stdout
        print(f"  progress bar drawn on a terminal: {'yes' if drawn else 'no'}")


if __name__ == "__main__":
    main()
