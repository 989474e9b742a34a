"""Lens queries on a 1,000,000-entry snapshot from a warm snapshot cache, against ``pickle.load``.

Writes a synthetic training-loop snapshot (``memlens.synthetic``: steps with forward, backward
and AdamW phases, step annotations), opens it once to fill the cache, then times, best of
``--repeat``, in this one process:

  - bare ``pickle.load`` of the file (the yardstick);
  - ``memlens.load`` from the warm cache, and the analysis the lens inputs come from
    (``analyze_snapshot`` of the busiest device: lifetimes, categories, steps and the findings);
  - each ``memlens group --by`` at the peak (labels + one masked sum), a ``--window`` query (the
    peak of a window, then a grouping there), ``--step N``, ``memlens lines`` and ``memlens stages``.

Target (issue 16): each query well under a second. The ratios say what a query costs next to
reading the file at all.

    python benchmarks/bench_lenses.py [--events 1000000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from bench_analysis import best_of  # the sibling script: same timing

TARGET_S = 1.0


def timed(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="memlens-bench-lenses-")
    os.environ["MEMLENS_CACHE_DIR"] = os.path.join(workdir, "cache")  # before memlens reads it
    path = os.path.join(workdir, "large.pickle")
    subprocess.run([sys.executable, "-m", "memlens.synthetic", str(args.events), path], check=True)

    import memlens
    from memlens.analysis import analyze_snapshot, lenses
    from memlens.analysis.lenses.moments import Row, StepNumber, Window

    def bare() -> Any:
        with open(path, "rb") as handle:
            return pickle.load(handle)

    pickle_s, _ = best_of(bare, args.repeat)
    memlens.load(path, cache=True)  # fills the cache
    load_s, snapshot = best_of(lambda: memlens.load(path, cache=True), args.repeat)
    assert snapshot.from_cache
    busiest = analyze_snapshot(snapshot).device().device
    inputs_s, inputs = best_of(lambda: lenses.lens_inputs_of(analyze_snapshot(snapshot, device=busiest)),
                               args.repeat)
    trace = inputs.trace
    n = len(trace)
    print(f"{n:,} events, {len(inputs.index.size):,} allocations, {len(snapshot.stacks.stacks):,} stacks, "
          f"{len(inputs.steps)} steps, {os.path.getsize(path) / 2**20:.1f} MiB; best of {args.repeat}")
    print(f"  {'bare pickle.load':<46} {pickle_s:7.3f} s")
    print(f"  {'memlens.load from the warm cache':<46} {load_s:7.3f} s   {load_s / pickle_s:5.2f}x pickle.load")
    print(f"  {'analysis of one device (the lens inputs)':<46} {inputs_s:7.3f} s   {inputs_s / pickle_s:5.2f}x")

    rules = lenses.parse_rules({"rules": {"optimizer": r"optim", "backward": "backward", "model": "forward"}})
    peak = lenses.resolve_moment(inputs).event
    step = inputs.steps[len(inputs.steps) // 2].index if inputs.steps else None
    queries: list[tuple[str, Callable[[], Any]]] = [
        (f"group --by {g}", partial(lenses.group_live, inputs, g, peak, rules)) for g in lenses.GROUP_BYS
    ]
    window = f"{n // 3}:{2 * n // 3}"
    rows = Window(Row(n // 3), Row(2 * n // 3))

    def window_query() -> Any:
        moment = lenses.resolve_moment(inputs, rows)
        return lenses.group_live(inputs, "stack", moment.event, moment=moment)

    queries.append((f"group --window {window} --by stack", window_query))
    if step is not None:
        queries.append((f"group --step {step} --by annotation", lambda: lenses.group_live(
            inputs, "annotation", lenses.resolve_moment(inputs, StepNumber(step)).event)))
    top_file = lenses.group_live(inputs, "file", peak).groups[0].name.rsplit(":", 1)[0]
    queries.append((f"lines {os.path.basename(top_file)}", lambda: lenses.file_lines(inputs, top_file)))
    queries.append(("stages", lambda: lenses.summarize_stages(lenses.annotation_stages(inputs))))
    labels = lenses.labels_for(inputs, "stack")
    moments = [int(e) for e in range(0, n, max(n // 100, 1))][:100]
    queries.append((f"stack groups at {len(moments)} moments (labels reused)",
                    lambda: [lenses.group_labels_at(inputs, labels, e, "stack") for e in moments]))

    worst = 0.0
    for name, query in queries:
        seconds, _ = best_of(query, args.repeat)
        worst = max(worst, seconds)
        print(f"  {name:<46} {seconds:7.3f} s   {seconds / pickle_s:5.2f}x pickle.load   "
              f"warm open + inputs + query {(load_s + inputs_s + seconds) / pickle_s:5.2f}x")
    # The command a user types, as fresh processes (imports included), against a fresh pickle.load.
    command = [shutil.which("memlens") or "memlens", "group", path, "--by", "stack", "--window", window, "--json"]
    bare_cmd = [sys.executable, "-c", "import pickle, sys; pickle.load(open(sys.argv[1], 'rb'))", path]
    cli_s = min(timed(command) for _ in range(args.repeat))
    bare_process_s = min(timed(bare_cmd) for _ in range(args.repeat))
    print(f"  fresh processes: python -c pickle.load {bare_process_s:.3f} s; "
          f"memlens group --by stack --window {window} --json (warm cache) {cli_s:.3f} s "
          f"= {cli_s / bare_process_s:.2f}x")
    verdict = "OK" if worst < TARGET_S else "OVER"
    print(f"slowest query {worst:.3f} s (target < {TARGET_S:.0f} s) -> {verdict}")
    return 0 if worst < TARGET_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
