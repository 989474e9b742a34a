"""Two ranks (gloo, CPU) training a DDP model under memlens.record: rank{N} files and a rank-0 summary."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import memlens

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow


def _worker(rank: int, world_size: int, init_file: str, out: str) -> None:
    from memlens.recorder import record

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        )
        optimizer = torch.optim.AdamW(model.parameters())
        # rank 1 works on a larger batch, so the ranks' peaks differ
        batch = 16 * (rank + 1)
        with record(out, model=model, optimizer=optimizer) as rec:
            for _ in range(3):
                with rec.step():
                    model(torch.randn(batch, 32)).square().mean().backward()
                    optimizer.step()
                    optimizer.zero_grad()
    finally:
        dist.barrier()  # no rank tears its gloo pairs down while a peer still talks to it
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_write_their_files_and_a_summary(tmp_path: Path) -> None:
    out = tmp_path / "run"
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, join=True)
    for rank in (0, 1):
        snapshot = memlens.load(out / f"rank{rank}.pickle")
        assert snapshot.sidecar is not None
        assert snapshot.sidecar.rank == rank and snapshot.sidecar.world_size == 2
        steps = [a.name for a in snapshot.annotations if a.stage == "END" and a.name.startswith("memlens.step#")]
        assert steps == [f"memlens.step#{i}" for i in range(3)]
    summary = json.loads((out / "ranks.json").read_text())
    assert summary["complete"] is True and summary["world_size"] == 2
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert summary["worst_rank"] == 1
    peaks = [r["peak_allocated_bytes"] for r in summary["ranks"]]
    assert summary["max_peak_allocated_bytes"] == max(peaks) and peaks[1] > peaks[0]
    assert summary["ranks"][1]["snapshot"] == "rank1.pickle"
