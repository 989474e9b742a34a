"""Rank awareness: every rank writes its own ``rank{N}`` files; rank 0 writes a summary.

The rank comes from an initialised ``torch.distributed`` process group, else from the
environment torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), so a recording that starts
before ``init_process_group`` still names its files right.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    group_initialized: bool

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def rank_info() -> RankInfo:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
        return RankInfo(rank, world, local, True)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    return RankInfo(rank, world, local, False)


def gather_rank_summaries(local: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's summary (a collective: all ranks must call it), or None without a group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return [item for item in gathered if isinstance(item, dict)]


def summarize_ranks(ranks: list[dict[str, Any]], world_size: int) -> dict[str, Any]:
    """The rank-0 summary: each rank's peaks, the worst rank, and the spread between ranks."""
    ranks = sorted(ranks, key=lambda item: int(item["rank"]))
    peaks = [int(item["peak_allocated_bytes"]) for item in ranks]
    worst = max(ranks, key=lambda item: int(item["peak_allocated_bytes"])) if ranks else None
    return {
        "memlens_summary_version": 1,
        "world_size": world_size,
        "complete": len(ranks) == world_size,
        "ranks": ranks,
        "max_peak_allocated_bytes": max(peaks) if peaks else 0,
        "min_peak_allocated_bytes": min(peaks) if peaks else 0,
        "worst_rank": int(worst["rank"]) if worst else None,
    }


def write_rank_summary(
    ranks: RankInfo, target: Path, snapshot_name: str, peaks: tuple[int, int], oom: bool
) -> dict[str, Any] | None:
    """Gather every rank's peaks (a collective when a process group is up) and, on rank 0, write
    the summary to ``target``; returns what was written (None on other ranks or with one rank)."""
    from memlens.recorder.writing import write_json

    if not ranks.distributed:
        return None
    local = {
        "rank": ranks.rank,
        "peak_allocated_bytes": peaks[0],
        "peak_reserved_bytes": peaks[1],
        "snapshot": snapshot_name,
        "oom": oom,
    }
    gathered = gather_rank_summaries(local)
    if ranks.rank != 0:
        return None
    summary = summarize_ranks(gathered if gathered is not None else [local], ranks.world_size)
    write_json(target, summary)
    return summary


__all__ = ["RankInfo", "gather_rank_summaries", "rank_info", "summarize_ranks", "write_rank_summary"]
