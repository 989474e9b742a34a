"""CPU-recorded snapshots of a tiny training loop, one per rank, for the fleet tests and benchmark.

Each rank is its own ``memlens.record`` session in this process with ``RANK``/``WORLD_SIZE`` set
as torchrun would, so the recorder names the files ``rank{N}.pickle`` and writes the rank into
each sidecar. Every rank trains the same model on the same batch, except the ones named in
``leaky`` (they keep each step's logits in a list: a leak) and ``big_batch`` (4x the batch).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

BATCH = 128
BIG_BATCH_FACTOR = 4


@contextmanager
def _rank_environment(rank: int, world_size: int) -> Iterator[None]:
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def record_rank(out: Path, rank: int, world_size: int, *, leaky: bool = False, big_batch: bool = False,
                steps: int = 4) -> Path:
    """Record one rank's tiny training loop into ``out/rank{rank}.pickle`` and return its path."""
    import gc

    import torch

    from memlens.recorder import record

    # An earlier rank's leaked tensors can outlive its call in reference cycles (frames the
    # recorder's stacks saw): collected here, so no rank starts with another's memory.
    gc.collect()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    hidden_layers, head = model[:2], model[2]
    optimizer = torch.optim.AdamW(model.parameters())
    batch = BATCH * (BIG_BATCH_FACTOR if big_batch else 1)
    kept: list[torch.Tensor] = []
    with _rank_environment(rank, world_size), record(out, model=model, optimizer=optimizer) as rec:
        for _ in range(steps):
            with rec.step():
                hidden = hidden_layers(torch.randn(batch, 64))
                if leaky:
                    kept.append(hidden)  # the bug: every step's hidden activations stay alive
                logits = head(hidden)
                logits.square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
        path = rec.path
    return Path(path)


def record_ranks(out: Path, world_size: int, *, leaky: Collection[int] = (),
                 big_batch: Collection[int] = (), steps: int = 4) -> list[Path]:
    """Every rank of a ``world_size`` job into ``out``; returns the snapshot paths, rank order."""
    return [record_rank(out, rank, world_size, leaky=rank in leaky, big_batch=rank in big_batch, steps=steps)
            for rank in range(world_size)]
