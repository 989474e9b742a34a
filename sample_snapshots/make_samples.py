"""Regenerate the sample snapshots in this directory from real training loops on the CPU.

    python sample_snapshots/make_samples.py [--only healthy,leak,...] [--out DIR]

Every sample is a few steps of the tiny transformer LM in examples/train_tiny.py with AdamW,
recorded by ``memlens.record`` on the CPU (tensor storages tracked, replayed through memlens'
caching-allocator simulator). The output is byte-for-byte reproducible on the same torch
version: seeded models and data, a fake clock for ``time_us`` and file names in stacks made
relative (to the repo, site-packages and the standard library), so regenerating does not churn
git. See README.md for what each file shows.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import train_tiny  # noqa: E402

from memlens.recorder import record  # noqa: E402
from memlens.recorder.stacks import relative_filename_map  # noqa: E402

HERE = Path(__file__).resolve().parent
START_US = 1_700_000_000_000_000  # the fake clock starts here and ticks 1 us per reading
FILENAME_MAP = relative_filename_map(
    {
        str(ROOT) + os.sep: "",
        str(Path(torch.__file__).resolve().parents[1]) + os.sep: "site-packages/",
        sysconfig.get_paths()["stdlib"] + os.sep: "python/",
    }
)


def fake_clock() -> Callable[[], int]:
    return itertools.count(START_US).__next__


def recorder(out: Path, name: str, model: Any, optimizer: Any, **options: Any) -> Any:
    return record(
        out / f"{name}.pickle",
        model=model,
        optimizer=optimizer,
        clock=fake_clock(),
        filename_map=FILENAME_MAP,
        **options,
    )


def build(
    seed: int = 0, d_model: int = 64, layers: int = 2, max_seq: int = 512
) -> tuple[Any, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = train_tiny.TinyLM(d_model=d_model, n_layers=layers, max_seq=max_seq)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def tokens(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq + 1))


# ----------------------------------------------------------------------------- samples
def healthy(out: Path) -> None:
    """Five ordinary steps: the allocated level at every step end is the same."""
    model, optimizer = build()
    with recorder(out, "healthy", model, optimizer) as rec:
        for _ in range(5):
            with rec.step():
                train_tiny.train_step(model, optimizer, tokens(8, 64))


def leak(out: Path) -> None:
    """A held-out loss logged every step without torch.no_grad() and kept: ``losses.append(loss)``."""
    model, optimizer = build()
    held_out = tokens(8, 64)
    losses: list[torch.Tensor] = []
    with recorder(out, "leak", model, optimizer) as rec:
        for _ in range(5):
            with rec.step():
                train_tiny.train_step(model, optimizer, tokens(8, 64))
                logits = model(held_out[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, 256), held_out[:, 1:].reshape(-1))
                losses.append(loss)  # the leak: each loss keeps its graph and activations


def activations(out: Path, checkpointed: bool = False) -> None:
    """Large batch x sequence: activations dominate the peak (checkpointed: one block at a time)."""
    model, optimizer = build(d_model=64, layers=4)
    model.checkpointing = checkpointed
    name = "activations_checkpointed" if checkpointed else "activations"
    with recorder(out, name, model, optimizer) as rec:
        for _ in range(3):
            with rec.step():
                train_tiny.train_step(model, optimizer, tokens(16, 256))


def activations_checkpointed(out: Path) -> None:
    activations(out, checkpointed=True)


# Sequence lengths that change every step (a bucketing sampler without padding to a fixed size):
# each step's activations are cut from the cache in different sizes, and the small tensors kept
# across steps pin segments the next step cannot reuse.
FRAGMENTING_LENGTHS = (768, 96, 704, 160, 640, 224, 576, 288, 512, 352, 448, 416)
FRAGMENTATION_CAPACITY = 112 << 20
KEEP_POSITIONS = 160
# ...then one evaluation batch of long documents, whose first activation fits no cached hole.
EVAL_LENGTH = 6144


def fragmentation_oom(out: Path) -> None:
    """Varying shapes with per-step tensors kept for logging, on a 112 MiB simulated device: it
    ends in an out-of-memory error while much of the reserved memory is cached, not allocated."""
    model, optimizer = build(max_seq=EVAL_LENGTH)
    kept: list[torch.Tensor] = []
    with (
        recorder(out, "fragmentation_oom", model, optimizer, capacity=FRAGMENTATION_CAPACITY) as rec,
        _expect_oom(),
    ):
        for seq in FRAGMENTING_LENGTHS:
            with rec.step():
                batch = tokens(8, seq)
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                kept.append(logits.detach()[:, -KEEP_POSITIONS:].clone())  # logged: last positions
                del logits, loss
        with rec.step(), torch.no_grad():
            model(tokens(16, EVAL_LENGTH)[:, :-1])


class _expect_oom:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is None:
            raise RuntimeError("fragmentation_oom: the run was expected to end in a simulated OOM")
        return issubclass(exc_type, torch.OutOfMemoryError)


def _rank_worker(rank: int, world_size: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        model, optimizer = build()
        # Gradients as views of DDP's communication buckets (PyTorch's advice: one copy of the
        # gradients, not two). It also lets the recorder see the buckets: they are the
        # parameters' .grad storages; with the default the buckets live in C++ only and the
        # analysis can place them by inference alone.
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        torch.manual_seed(100 + rank)
        seq = 64 if rank == 0 else 128  # rank 1 gets the longer sequences: its peak is higher
        with recorder(Path(out), "ddp", ddp, optimizer) as rec:
            for _ in range(3):
                with rec.step():
                    batch = tokens(4, seq)
                    logits = ddp(batch[:, :-1])
                    F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1)).backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
    finally:
        dist.barrier()  # no rank tears its gloo pairs down while a peer still talks to it
        dist.destroy_process_group()


def ddp(out: Path) -> None:
    """Two ranks (gloo on the CPU) of DistributedDataParallel: ddp_rank{0,1}.pickle, ddp_ranks.json."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_worker, args=(2, os.path.join(tmp, "init"), str(out)), nprocs=2, join=True)


SAMPLES: dict[str, Callable[[Path], None]] = {
    "healthy": healthy,
    "leak": leak,
    "activations": activations,
    "activations_checkpointed": activations_checkpointed,
    "fragmentation_oom": fragmentation_oom,
    "ddp": ddp,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SAMPLES), help="comma-separated sample names")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    for name in args.only.split(","):
        # Regenerating replaces the samples on purpose (the recorder itself never overwrites an
        # earlier run's files: it would write NAME-2.pickle beside them).
        patterns = (f"{name}.pickle", f"{name}.memlens.json", f"{name}_rank*.pickle", f"{name}_rank*.memlens.json",
                    f"{name}_ranks.json")
        for old in [path for pattern in patterns for path in args.out.glob(pattern)]:
            old.unlink()
        gc.collect()  # tensors of the previous sample must not be seeded into this one
        began = time.perf_counter()
        SAMPLES[name](args.out)
        for sidecar in [path for pattern in patterns[1::2] for path in args.out.glob(pattern)]:
            steady_search_time(sidecar)
        print(f"{name}: {time.perf_counter() - began:.1f}s")
    print(f"all: {time.perf_counter() - started:.1f}s")


def steady_search_time(sidecar: Path) -> None:
    """The leak-holder search's wall time (``leak_holders.seconds``) differs on every run; the
    samples say 0.0 so that regenerating them does not churn git (nothing reads the figure)."""
    import json  # here, not above: the samples' stacks name this file's lines, which stay put

    from memlens.recorder.writing import write_json

    payload = json.loads(sidecar.read_text())
    holders = payload.get("leak_holders")
    if isinstance(holders, dict) and "seconds" in holders:
        holders["seconds"] = 0.0
        write_json(sidecar, payload)


if __name__ == "__main__":
    main()
