"""Each configuration's prediction scored (its compute against the baseline's, what crosses PCIe)
and the one a user would take recommended."""

from __future__ import annotations

from typing import Any

from memlens.plan.configurations import ChildResult, Configuration
from memlens.plan.levers import Lever, cost_key, is_whole_text
from memlens.plan.results import PlanConfig, WorldSizeFit


def _values(configuration: Configuration) -> dict[str, int | str]:
    return {name: int(value) if is_whole_text(value) else value for name, value in configuration.values.items()}


def _same_point(configuration: Configuration) -> tuple[Any, ...]:
    """What a configuration's compute is compared at: its values and its world size."""
    return (tuple(sorted(configuration.values.items())), configuration.world_size)


def scored(
    results: list[tuple[Configuration, ChildResult]], world_size: int = 1, capacity_at: dict[int, int] | None = None
) -> list[PlanConfig]:
    """Each result as a ``PlanConfig``: ``world_size`` is the plan's where a configuration names
    none, ``capacity_at`` what PyTorch may use per rank at each world size (else the child's)."""
    # Compute is compared between runs that completed: one stopped by an out-of-memory error
    # counted only the operations before it.
    baseline_flops = {
        _same_point(configuration): child.flops
        for configuration, child in results
        if not configuration.levers and child.flops and child.problem is None
    }
    configs = []
    for configuration, child in results:
        world = configuration.world_size if configuration.world_size is not None else world_size
        base = baseline_flops.get(_same_point(configuration))
        change = None
        if base and child.flops is not None and child.problem is None:
            change = round(child.flops / base - 1, 4)
        configs.append(
            PlanConfig(
                levers=[lever.text() for lever in configuration.levers],
                values=_values(configuration),
                peak_allocated_bytes=child.peak_allocated_bytes,
                peak_reserved_bytes=child.peak_reserved_bytes,
                fits=child.fits,
                snapshot=child.snapshot,
                problem=child.problem,
                flops=child.flops,
                flops_change=change,
                offload_bytes_per_step=_offload_bytes(configuration.levers, child),
                trainable_parameters=child.trainable_parameters,
                held_bytes=child.held_bytes,
                seconds=child.seconds,
                notes=child.notes,
                oom=child.oom,
                ranks=child.ranks,
                rank_rule=child.rank_rule,
                ranks_same=child.ranks_same,
                world_size=world,
                capacity_bytes=(capacity_at or {}).get(world, child.capacity_bytes),
                oom_requested_bytes=child.oom_requested_bytes,
            )
        )
    return configs


def _offload_bytes(levers: tuple[Lever, ...], child: ChildResult) -> int | None:
    """Bytes over PCIe per optimizer step: offloading the optimizer sends every gradient to the
    CPU and every updated parameter back; offloading the parameters also brings them in twice
    (forward, backward); a paged optimizer moves at most its paged state."""
    offload = next((lever.value for lever in levers if lever.name == "offload"), None)
    if offload and child.model is not None:
        parameter_bytes = child.model.parameter_bytes_total or 0
        total = child.model.parameters_total or 0
        trainable = child.model.parameters_trainable or 0
        trained_bytes = parameter_bytes * trainable // total if total else 0
        # params (FSDP2's CPU offload): the parameters come in for the forward and again for the
        # backward, the gradients go out.
        return (3 if offload == "params" else 2) * trained_bytes
    paged = child.notes.get("paged_optimizer_bytes")
    return int(paged) if paged else None


# A configuration that fits at least this many times the work per step (the product of its
# whole placeholder values: B, or B*T) of another is worth its levers' cost: half the gradient
# accumulation steps or more. Below it, the cheaper levers win (issue 36: a 9x larger batch with
# checkpointing was ranked below an 8-bit optimizer at batch 3).
WORTH_ITS_COST_FACTOR = 2


def _work_per_step(configuration: Configuration) -> int:
    work = 1
    for value in configuration.values.values():
        work *= int(value) if is_whole_text(value) else 1
    return work


def recommended_index(results: list[tuple[Configuration, ChildResult]], configs: list[PlanConfig]) -> int | None:
    """The configuration a user would take: at the fewest GPUs that any fits at (several
    ``--world-size`` values), among those that fit within a factor of ``WORTH_ITS_COST_FACTOR``
    of the most work per step, the lowest lever cost (``levers.cost_key``), then the largest
    placeholder values, then the lower peak."""
    candidates = [index for index, config in enumerate(configs) if config.fits]
    if not candidates:
        return None
    fewest = min(configs[index].world_size for index in candidates)
    candidates = [index for index in candidates if configs[index].world_size == fewest]
    most = max(_work_per_step(results[index][0]) for index in candidates)
    worth = [index for index in candidates if _work_per_step(results[index][0]) * WORTH_ITS_COST_FACTOR > most]

    def key(index: int) -> tuple[Any, ...]:
        configuration = results[index][0]
        values = tuple(-int(v) if is_whole_text(v) else 0 for v in configuration.values.values())
        return (cost_key(configuration.levers), values, configs[index].peak_reserved_bytes)

    return min(worth, key=key)


def max_of_baseline(results: list[tuple[Configuration, ChildResult]], name: str) -> int | None:
    """The largest value of ``name`` the baseline fits at (at several world sizes, the smallest
    world size's: what the table's one ``--max`` figure would be without them)."""
    worlds = [c.world_size for c, _ in results if c.world_size is not None]
    fewest = min(worlds) if worlds else None
    fitting = [int(c.values[name]) for c, child in results
               if not c.levers and child.fits and c.world_size == fewest]  # fmt: skip
    return max(fitting) if fitting else None


def short_bytes(config: PlanConfig) -> int | None:
    """By how much a configuration that ran out of memory did not fit: the peak reserved per rank
    it reached run again with no memory limit (``needed_bytes``) less what PyTorch could use per
    rank there (0 where that peak is within it: at the capacity, the cache's fragmentation, not
    the total, stopped it). None for one that fits, was not run again, or failed otherwise (a
    script error says nothing of its size)."""
    if config.fits or not config.oom or config.needed_bytes is None or not config.capacity_bytes:
        return None
    return max(config.needed_bytes - config.capacity_bytes, 0)


def to_run_uncapped(configs: list[PlanConfig]) -> list[int]:
    """At several world sizes, the configurations to run again with no memory limit, to say how
    close each came: those that ran out of memory in a layout (a lever set at its values) that
    fits at none of them (where one fits, the smallest that fits is the answer)."""
    fitting = {(tuple(config.levers), tuple(config.values.items())) for config in configs if config.fits}
    return [index for index, config in enumerate(configs)
            if config.oom and (tuple(config.levers), tuple(config.values.items())) not in fitting]  # fmt: skip


def world_size_fits(configs: list[PlanConfig]) -> tuple[list[WorldSizeFit], int | None, int | None]:
    """At several world sizes: each layout (lever set and values, in the table's order) with the
    smallest world size at which it fits, its peak reserved per rank and headroom; where it fits
    at none, the configuration that came closest (the least short of its capacity) and by how
    much. And over every layout, where nothing fits: the closest configuration and its shortfall."""
    layouts: dict[tuple[Any, ...], list[int]] = {}
    for index, config in enumerate(configs):
        layouts.setdefault((tuple(config.levers), tuple(config.values.items())), []).append(index)
    fits: list[WorldSizeFit] = []
    overall: tuple[int, int] | None = None  # (shortfall, index)
    for indices in layouts.values():
        first = configs[indices[0]]
        fitting = [index for index in indices if configs[index].fits]
        if fitting:
            best = min(fitting, key=lambda index: (configs[index].world_size, index))
            config = configs[best]
            fits.append(WorldSizeFit(levers=list(first.levers), values=dict(first.values),
                                     world_size=config.world_size, config=best,
                                     peak_reserved_bytes=config.peak_reserved_bytes,
                                     headroom_bytes=config.capacity_bytes - config.peak_reserved_bytes))  # fmt: skip
            continue
        shorts = [(short, index) for index in indices if (short := short_bytes(configs[index])) is not None]
        closest = min(shorts, key=lambda pair: (pair[0], configs[pair[1]].world_size)) if shorts else None
        if closest is not None and (overall is None or closest[0] < overall[0]):
            overall = closest
        fits.append(WorldSizeFit(levers=list(first.levers), values=dict(first.values), world_size=None,
                                 config=None, closest=closest[1] if closest else None,
                                 short_bytes=closest[0] if closest else None))  # fmt: skip
    if any(config.fits for config in configs) or overall is None:
        return fits, None, None
    return fits, overall[1], overall[0]


__all__ = [
    "WORTH_ITS_COST_FACTOR",
    "max_of_baseline",
    "recommended_index",
    "scored",
    "short_bytes",
    "to_run_uncapped",
    "world_size_fits",
]
