"""What ``--dump-every`` costs a training step on the CPU recorder, side by side in one run.

The same small training loop (an MLP with AdamW on the CPU) runs under ``memlens.record`` without
periodic dumps and with ``dump_every`` N for each N asked, the configurations taking turns in
each round so that a machine's drift falls on all of them alike; each is timed per step (the
step's ``with rec.step()`` block, which is where a periodic dump is written, at the step's end).
Printed per configuration: the mean and median step, the mean step as a ratio to no dumps, the
dumps written, what one dump cost on average (the extra time over no dumps, divided by the
dumps), and the size of the last rolling snapshot. A loop without the recorder is the floor.

A rolling snapshot holds the whole trace so far (the ring buffer's newest ``--max-entries``), so
a dump costs more as the run goes on, until the ring buffer is full: ``--steps`` sets how far.

    python benchmarks/bench_dump_every.py [--steps 60] [--every 10 5 1] [--rounds 3] [--hidden 256]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from memlens.recorder import record
from memlens.units import format_bytes


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


def bare(steps: int, hidden: int) -> list[float]:
    model, optimizer, batch = loop(hidden)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        train_step(model, optimizer, batch)
        times.append(time.perf_counter() - started)
    return times


def recorded(steps: int, hidden: int, every: int | None, folder: Path) -> tuple[list[float], int, int]:
    """Each step's seconds, the dumps written, the last rolling snapshot's bytes."""
    model, optimizer, batch = loop(hidden)
    times = []
    with record(folder, dump_every=every, model=model, optimizer=optimizer, device="cpu") as rec:
        for _ in range(steps):
            started = time.perf_counter()
            with rec.step():
                train_step(model, optimizer, batch)
            times.append(time.perf_counter() - started)
    rolled = [p for p in rec.paths if ".step" in p.name]
    size = rolled[-1].stat().st_size if rolled and rolled[-1].exists() else 0
    return times, len(rolled), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, nargs="+", default=[10, 5, 1])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()

    configurations: list[int | None] = [None, *args.every]
    results: dict[str, list[float]] = {"bare": []}
    dumps: dict[int | None, int] = {}
    sizes: dict[int | None, int] = {}
    for every in configurations:
        results[str(every)] = []
    for round_index in range(args.rounds):
        order = configurations if round_index % 2 == 0 else configurations[::-1]
        results["bare"] += bare(args.steps, args.hidden)
        for every in order:
            with tempfile.TemporaryDirectory(prefix="memlens-bench-dump-") as folder:
                times, written, size = recorded(args.steps, args.hidden, every, Path(folder))
            results[str(every)] += times
            dumps[every], sizes[every] = written, size

    base = statistics.fmean(results["None"])
    print(
        f"{args.steps} steps x {args.rounds} rounds, MLP hidden {args.hidden}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"{'configuration':<22} {'mean step':>10} {'median':>10} {'ratio':>7} {'dumps':>6} {'per dump':>10} "
        f"{'snapshot':>10}"
    )
    rows: list[tuple[str, Any]] = [("no recorder", "bare"), ("recorded, no dumps", None)]
    rows += [(f"--dump-every {every}", every) for every in args.every]
    for label, key in rows:
        times = results[str(key)] if key != "bare" else results["bare"]
        mean, median = statistics.fmean(times), statistics.median(times)
        written = dumps.get(key, 0) if key != "bare" else 0
        per_dump = (mean - base) * args.steps / written if written else None
        print(
            f"{label:<22} {mean * 1e3:>8.2f}ms {median * 1e3:>8.2f}ms {mean / base:>6.2f}x {written:>6} "
            f"{(f'{per_dump * 1e3:.1f}ms' if per_dump is not None else '-'):>10} "
            f"{(format_bytes(sizes[key]) if key != 'bare' and sizes.get(key) else '-'):>10}"
        )


if __name__ == "__main__":
    main()
