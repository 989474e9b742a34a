"""What a plan answers, as typed values: ``PlanConfig`` per configuration and the ``PlanResult``
(the configurations, the recommended one and its change), which the faces render as they are."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec


class PlanRank(msgspec.Struct):
    """One rank of a configuration predicted at ``--world-size`` N, from its own snapshot
    (``snapshot``: ``rank<N>/predicted.pickle`` in the configuration's folder). ``stage`` and
    ``num_stages``: the pipeline stage this rank built (``torch.distributed.pipelining``), None
    without one; ``uneven_shards``: parameters whose shards differ in size between ranks."""

    rank: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    fits: bool
    snapshot: str | None
    problem: str | None = None
    oom: bool = False
    held_bytes: dict[str, int] = {}
    stage: int | None = None
    num_stages: int | None = None
    uneven_shards: int = 0


# Why a configuration ran the ranks it ran (``PlanConfig.rank_rule``).
RANKS_ALIKE = "alike"  # no pipeline stage, no uneven shard: rank 0 stands for every rank
RANKS_PER_STAGE = "per-stage"  # a pipeline: the ranks in order, up to the last stage
RANKS_UNEVEN = "uneven"  # uneven shards: rank 0 and the last rank (the one with the smallest shards)


class PlanConfig(msgspec.Struct):
    """One configuration's prediction. ``flops_change``: the run's floating-point operations
    relative to the baseline at the same values (+0.33: a third more compute, recomputation),
    None without such a baseline; ``offload_bytes_per_step``: what crosses PCIe each optimizer
    step; ``held_bytes``: parameters, gradients and optimizer state held at the end (per rank);
    ``problem``: why it did not complete (out of memory, the script's error); ``oom``: the run
    ran out of the simulated GPU's memory."""

    levers: list[str]
    values: dict[str, int | str]
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    fits: bool
    snapshot: str | None
    problem: str | None = None
    flops: int | None = None
    flops_change: float | None = None
    offload_bytes_per_step: int | None = None
    trainable_parameters: int | None = None
    held_bytes: dict[str, int] = {}
    seconds: float = 0.0
    notes: dict[str, Any] = {}
    oom: bool = False
    # --world-size N: each rank run (rank 0 first), why those (``rank_rule``: RANKS_ALIKE,
    # RANKS_PER_STAGE, RANKS_UNEVEN), and whether their figures came out the same. The figures
    # above are the worst rank's (the highest peak reserved; one that did not fit first), and the
    # configuration fits only if every rank run does.
    ranks: list[PlanRank] = []
    rank_rule: str | None = None
    ranks_same: bool | None = None
    # The ranks it ran at (``--world-size``'s, or one of several), what PyTorch's allocator could
    # use on each rank's GPU there, and the rounded size of the allocation it ran out of memory
    # at (None: it did not).
    world_size: int = 1
    capacity_bytes: int = 0
    oom_requested_bytes: int | None = None
    # Where it ran out of memory and its layout fit at none of several world sizes: the peak
    # reserved per rank it reached when run again with no memory limit (its worst rank's; the
    # snapshot ``needed_snapshot``), None where not run again or that run did not complete.
    needed_bytes: int | None = None
    needed_snapshot: str | None = None


class WorldSizeFit(msgspec.Struct):
    """One layout (a lever set at its ``--vary`` values) planned at several ``--world-size``
    values. ``world_size``: the smallest at which every rank run fits, None where none did;
    ``config``: that configuration's index in ``PlanResult.configs``, with its per-rank
    ``peak_reserved_bytes`` and ``headroom_bytes`` (its capacity less that peak). Where none
    fits: ``closest``, the configuration that came closest, and ``short_bytes``, by how much it
    did not fit: the peak reserved per rank it reached run again with no memory limit
    (``PlanConfig.needed_bytes``), less its capacity."""

    levers: list[str]
    values: dict[str, int | str]
    world_size: int | None
    config: int | None
    peak_reserved_bytes: int | None = None
    headroom_bytes: int | None = None
    closest: int | None = None
    short_bytes: int | None = None


class PlanResult(msgspec.Struct):
    """``capacity_bytes``: what PyTorch's allocator may use on each rank's GPU (the board less
    ``outside_bytes``); ``outside_bytes``: what was taken off for memory outside the allocator
    (``--reserve-outside``, else at ``--world-size`` > 1 the estimate ``outside_source`` says)."""

    configs: list[PlanConfig]
    recommended: int | None
    max: dict[str, int | None]
    change: str | None
    gpu: str
    capacity_bytes: int
    world_size: int
    out: str
    seconds: float
    outside_bytes: int = 0
    outside_source: str | None = None
    # --world-size with several values (``world_size`` is then the largest, and ``capacity_bytes``
    # and ``outside_bytes`` are its; each configuration says its own): the world sizes, each
    # layout's smallest that fits (``WorldSizeFit``), and where none fits at all, the
    # configuration that came closest and by how much. ``recommended`` is the cheapest overall:
    # the fewest GPUs, then the levers' cost as at one world size.
    world_sizes: list[int] = []
    world_size_fits: list[WorldSizeFit] = []
    closest: int | None = None
    closest_short_bytes: int | None = None


# Told of each configuration as it starts and ends: (started, finished, total or None while a
# --max search has not settled how many it runs, the configuration's label). memlens plan draws it.
PlanProgress = Callable[[int, int, int | None, str], None]


def max_per_lever_set(result: PlanResult, name: str) -> list[tuple[list[str], int | None, int | None]]:
    """For each lever set of a ``--max`` plan, the largest value that fits (None: not even LO),
    as (levers, world size, value); the world size is None unless ``--world-size`` gave several,
    where each lever set is searched at each."""
    found: dict[tuple[tuple[str, ...], int | None], int | None] = {}
    several = len(result.world_sizes) > 1
    for config in result.configs:
        key = (tuple(config.levers), config.world_size if several else None)
        value = config.values.get(name)
        best = found.get(key)
        if config.fits and isinstance(value, int):
            found[key] = value if best is None else max(best, value)
        else:
            found.setdefault(key, None)
    return [(list(levers), world, value) for (levers, world), value in found.items()]


__all__ = [
    "RANKS_ALIKE",
    "RANKS_PER_STAGE",
    "RANKS_UNEVEN",
    "PlanConfig",
    "PlanProgress",
    "PlanRank",
    "PlanResult",
    "WorldSizeFit",
    "max_per_lever_set",
]
