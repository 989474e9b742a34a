"""What ``--dump-every`` costs a training step on the CPU recorder, side by side in one run.

The same small training loop (an MLP with AdamW on the CPU) runs under ``memlens.record`` without
periodic dumps and with ``dump_every`` N for each N asked, the configurations taking turns in
each round so that a machine's drift falls on all of them alike; each is timed per step (the
step's ``with rec.step()`` block, which is where a periodic dump is written, at the step's end).
Printed per configuration, its first steps left out: the mean step of its best round (the machine's
other jobs only add time), the median step, the mean as a ratio to no dumps, the dumps written,
what one dump cost (the extra time over no dumps, divided by the dumps in the timed steps), and
the size of the last rolling snapshot. A loop without the recorder is the floor.

A rolling snapshot holds the whole trace so far (the ring buffer's newest ``--max-entries``), so
a dump costs more as the run goes on, until the ring buffer is full: ``--steps`` sets how far.

Steps are timed in the process's CPU time by default (``--clock wall`` for elapsed time): on a
machine shared with other jobs, elapsed time measures them as much as the step; a dump's wait for
its ``fsync`` is then not counted (milliseconds for a dump of this size).

    python benchmarks/bench_dump_every.py [--steps 60] [--every 10 5 1] [--rounds 3] [--hidden 256] [--clock cpu]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from memlens.recorder import record
from memlens.units import format_bytes

# The first steps pay for what a loop does once (AdamW's state, autograd's threads, the recorder's
# first stacks): left out of every configuration alike.
WARMUP_STEPS = 2
Clock = Callable[[], float]


def loop(hidden: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )
    return model, torch.optim.AdamW(model.parameters()), torch.randn(32, 64)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    model(batch).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def bare(steps: int, hidden: int, clock: Clock) -> list[float]:
    model, optimizer, batch = loop(hidden)
    times = []
    for _ in range(steps):
        started = clock()
        train_step(model, optimizer, batch)
        times.append(clock() - started)
    return times


def recorded(steps: int, hidden: int, every: int | None, folder: Path, clock: Clock) -> tuple[list[float], int, int]:
    """Each step's seconds, the dumps written, the last rolling snapshot's bytes."""
    model, optimizer, batch = loop(hidden)
    times = []
    with record(folder, dump_every=every, model=model, optimizer=optimizer, device="cpu") as rec:
        for _ in range(steps):
            started = clock()
            with rec.step():
                train_step(model, optimizer, batch)
            times.append(clock() - started)
    rolled = [p for p in rec.paths if ".step" in p.name]
    size = rolled[-1].stat().st_size if rolled and rolled[-1].exists() else 0
    return times, len(rolled), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, nargs="+", default=[10, 5, 1])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: the process's CPU time (default: steadier on a shared machine); wall: elapsed",
    )
    args = parser.parse_args()
    clock: Clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be more than the {WARMUP_STEPS} warm-up steps")

    configurations: list[int | None] = [None, *args.every]
    keys = ["bare", *(str(every) for every in configurations)]
    rounds: dict[str, list[list[float]]] = {key: [] for key in keys}  # each round's steps, warm-up left out
    dumps: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for round_index in range(args.rounds):
        order = configurations if round_index % 2 == 0 else configurations[::-1]
        rounds["bare"].append(bare(args.steps, args.hidden, clock)[WARMUP_STEPS:])
        for every in order:
            with tempfile.TemporaryDirectory(prefix="memlens-bench-dump-") as folder:
                times, written, size = recorded(args.steps, args.hidden, every, Path(folder), clock)
            rounds[str(every)].append(times[WARMUP_STEPS:])
            dumps[str(every)], sizes[str(every)] = written, size

    # A round's mean step (its dumps included); the best round of each: the machine's other jobs
    # only ever add time, so the least a configuration took is the closest to its own cost.
    best = {key: min(statistics.fmean(times) for times in rounds[key]) for key in keys}
    base = best["None"]
    timed = args.steps - WARMUP_STEPS
    print(
        f"{args.steps} steps ({WARMUP_STEPS} warm-up left out) x {args.rounds} rounds, MLP hidden {args.hidden}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.clock} time, best round of each"
    )
    print(
        f"{'configuration':<22} {'mean step':>10} {'median':>10} {'ratio':>7} {'dumps':>6} {'per dump':>10} "
        f"{'snapshot':>10}"
    )
    rows = [("no recorder", "bare"), ("recorded, no dumps", "None")]
    rows += [(f"--dump-every {every}", str(every)) for every in args.every]
    for label, key in rows:
        median = statistics.median(step for times in rounds[key] for step in times)
        # the dumps in the timed steps: every N-th step's end, counted from step 0
        written = (
            sum(1 for step in range(WARMUP_STEPS, args.steps) if (step + 1) % int(key) == 0)
            if key not in ("bare", "None")
            else 0
        )
        per_dump = (best[key] - base) * timed / written if written else None
        print(
            f"{label:<22} {best[key] * 1e3:>8.2f}ms {median * 1e3:>8.2f}ms {best[key] / base:>6.2f}x "
            f"{dumps.get(key, 0):>6} {(f'{per_dump * 1e3:.1f}ms' if per_dump is not None else '-'):>10} "
            f"{(format_bytes(sizes[key]) if sizes.get(key) else '-'):>10}"
        )


if __name__ == "__main__":
    main()
