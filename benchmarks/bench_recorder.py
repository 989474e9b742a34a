"""CPU recording overhead: step time of a small LM training loop, recorded vs not, in one run.

    python benchmarks/bench_recorder.py [--steps 12] [--d-model 256] [--batch 16] [--seq 128]

Recorded and unrecorded steps alternate in rounds (so machine noise hits both alike) and the
median step time of each is compared; the target is a ratio under 3x. The recorded side pays
for the dispatch mode on every op, a stack capture per new storage and per free, and the
allocator simulator.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def load_tiny() -> object:
    spec = importlib.util.spec_from_file_location("train_tiny", REPO / "examples" / "train_tiny.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_tiny"] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    from memlens.recorder import record

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="steps per side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()

    tiny = load_tiny()
    torch.manual_seed(0)
    model = tiny.TinyLM(d_model=args.d_model, n_layers=args.layers)  # type: ignore[attr-defined]
    optimizer = torch.optim.AdamW(model.parameters())
    batches = [torch.randint(0, 256, (args.batch, args.seq + 1)) for _ in range(args.steps)]

    def run_steps(rec: object | None) -> list[float]:
        times = []
        for tokens in batches:
            start = time.perf_counter()
            tiny.train_step(model, optimizer, tokens)  # type: ignore[attr-defined]
            if rec is not None:
                rec.mark_step()  # type: ignore[attr-defined]
            times.append(time.perf_counter() - start)
        return times

    run_steps(None)  # warm up: AdamW state, kernels, allocator
    plain: list[float] = []
    recorded: list[float] = []
    events = 0
    with tempfile.TemporaryDirectory() as out:
        for _ in range(args.rounds):
            plain += run_steps(None)
            with record(out, model=model, optimizer=optimizer) as rec:
                recorded += run_steps(rec)
            events = len(rec.backend.simulator.trace)  # type: ignore[attr-defined]

    plain_ms = statistics.median(plain) * 1e3
    recorded_ms = statistics.median(recorded) * 1e3
    print(f"model: TinyLM d_model={args.d_model} layers={args.layers} batch={args.batch} seq={args.seq}")
    print(f"{'':12}{'unrecorded':>12}{'recorded':>12}{'ratio':>8}")
    print(f"{'median step':12}{plain_ms:>10.2f}ms{recorded_ms:>10.2f}ms{recorded_ms / plain_ms:>7.2f}x")
    print(f"trace entries per recorded session: {events} ({events // args.steps} per step)")


if __name__ == "__main__":
    main()
