"""A plan in the terminal: the table of configurations, the problems, the largest values that
fit and the recommended change (``render``), and the JSON (``plan_json``).

Reads a ``memlens.plan.results.PlanResult`` and nothing else; every number and sentence comes from it.
"""

from __future__ import annotations

import msgspec

from memlens.plan.child import NOT_APPLIED
from memlens.plan.results import RANKS_ALIKE, RANKS_PER_STAGE, PlanConfig, PlanRank, PlanResult, max_per_lever_set
from memlens.units import format_bytes


def plan_json(result: PlanResult) -> dict[str, object]:
    """What ``memlens plan --json`` prints: the result as it is."""
    payload = msgspec.to_builtins(result)
    assert isinstance(payload, dict)
    return payload


def _cost(config: PlanConfig) -> str:
    parts = []
    if config.flops_change is not None and abs(config.flops_change) >= 0.005:
        parts.append(f"{config.flops_change:+.0%} compute")
    if config.offload_bytes_per_step:
        parts.append(f"{format_bytes(config.offload_bytes_per_step)}/step over PCIe")
    return ", ".join(parts) or "-"


def _not_applied(config: PlanConfig) -> bool:
    """A lever asked for found nothing to act on: the row is not the configuration its label names."""
    return (config.problem or "").startswith(NOT_APPLIED)


def _fits_cell(config: PlanConfig) -> str:
    """The fits column: yes, OOM, "not applied" (a lever asked for found nothing to act on, so the
    row is not the configuration its label names), or no (the script failed or stopped)."""
    if config.fits:
        return "yes"
    if _not_applied(config):
        return "not applied"
    return "OOM" if config.oom else "no"


def _why_the_lowest_does_not_fit(result: PlanResult, name: str, levers: list[str], world: int | None) -> str:
    """``not even the lowest value fits: B=1 OUT OF MEMORY at ...``: the lowest value tried with
    these levers (at ``world`` ranks, where several world sizes were planned), and what stopped it."""
    tried = [c for c in result.configs if list(c.levers) == list(levers) and isinstance(c.values.get(name), int)
             and (world is None or c.world_size == world)]  # fmt: skip
    if not tried:
        return "not even the lowest value fits"
    lowest = min(tried, key=lambda config: int(config.values[name]))
    why = lowest.problem or "it did not fit"
    return f"not even the lowest value fits: {name}={lowest.values[name]} {why}"


def _margin_line(result: PlanResult) -> str:
    """How much the recommended configuration leaves, and what the prediction does not count: a
    last value that fits by a fraction of a GiB is no promise on a GPU that also holds the CUDA
    context and NCCL's buffers."""
    assert result.recommended is not None
    config = result.configs[result.recommended]
    capacity_bytes = _capacity(result, config)
    spare = capacity_bytes - config.peak_reserved_bytes
    last = [name for name in result.max
            if any(levers == config.levers and value is not None and config.values.get(name) == value
                   and world in (None, config.world_size)
                   for levers, world, value in max_per_lever_set(result, name))]
    what = f"the largest {' and '.join(last)} that fits" if last else "it fits"
    capacity = format_bytes(capacity_bytes)
    spare_line = f"  {what}, with {format_bytes(spare)} to spare of {capacity} (peak reserved)"
    if result.outside_bytes and capacity_bytes == result.capacity_bytes:
        return f"{spare_line}, after {format_bytes(result.outside_bytes)} outside PyTorch's allocator (above)"
    return (
        f"{spare_line}; not counted: the CUDA context and NCCL's buffers, outside PyTorch's allocator "
        "(--reserve-outside takes them off)"
    )


def _several(result: PlanResult) -> bool:
    """The plan ran at several world sizes (each configuration's label says its own)."""
    return len(result.world_sizes) > 1


def _capacity(result: PlanResult, config: PlanConfig) -> int:
    """What PyTorch could use per rank where ``config`` ran (its world size's), else the plan's."""
    return config.capacity_bytes or result.capacity_bytes


def _label(config: PlanConfig, world: bool = False) -> str:
    """The configuration as its row names it: the levers, the values, and where the plan ran at
    several world sizes (``world``), its own."""
    label = "+".join(config.levers) or "baseline"
    if config.values:
        label += " " + " ".join(f"{name}={value}" for name, value in config.values.items())
    if world:
        label += f" world-size={config.world_size}"
    return label


def _outside_line(result: PlanResult) -> str | None:
    """What was taken off each rank's GPU for memory outside PyTorch's allocator, and whence."""
    if not result.outside_bytes:
        return None
    source = result.outside_source or "--reserve-outside"
    return f"  outside PyTorch's allocator, per rank: {format_bytes(result.outside_bytes)} taken off ({source})"


def _world_sizes_header(result: PlanResult) -> str:
    """``, world sizes 1, 2, 4`` and, where a world size's capacity differs (1: nothing outside
    the allocator estimated), what PyTorch could use there."""
    sizes = ", ".join(str(world) for world in result.world_sizes)
    other = sorted({(config.world_size, config.capacity_bytes) for config in result.configs
                    if config.capacity_bytes and config.capacity_bytes != result.capacity_bytes})  # fmt: skip
    at = "".join(f"; {format_bytes(capacity)} at world size {world}" for world, capacity in other)
    return f", world sizes {sizes}{at}"


def _rank_name(rank: PlanRank) -> str:
    if rank.stage is not None and rank.num_stages is not None:
        return f"rank {rank.rank} (stage {rank.stage} of {rank.num_stages})"
    return f"rank {rank.rank}"


def _held(rank: PlanRank) -> str:
    held = rank.held_bytes
    if not held:
        return "-"
    return " / ".join(format_bytes(held.get(key, 0)) for key in ("parameters", "gradients", "optimizer_state"))


def _rank_fits(rank: PlanRank) -> str:
    return "yes" if rank.fits else ("OOM" if rank.oom else "no")


def _rank_lines(result: PlanResult) -> list[str]:
    """Where ranks were run at --world-size N: a table per configuration whose ranks differ (one
    row per rank or pipeline stage, with its snapshot's peaks and whether it fits), else one line
    saying which ranks stand for which."""
    world = result.world_size
    several = _several(result)
    every = ("at each world size, its ranks" if several else f"ranks 0-{world - 1}" if world > 2
             else "ranks 0 and 1")  # fmt: skip
    lines: list[str] = []
    alike = [index for index, config in enumerate(result.configs) if config.rank_rule == RANKS_ALIKE]
    ranked = [config for config in result.configs if config.rank_rule is not None or config.world_size > 1]
    if alike and len(alike) == len(ranked):
        lines.append(f"{every}: rank 0 stands for all (no pipeline stage, no uneven shard); only rank 0 was run")
    elif alike:
        lines.append(f"{every}: rank 0 stands for all in #{', #'.join(str(i) for i in alike)} "
                     "(no pipeline stage, no uneven shard)")  # fmt: skip
    for index, config in enumerate(result.configs):
        if config.rank_rule in (None, RANKS_ALIKE) or not config.ranks:
            continue
        per_stage = config.rank_rule == RANKS_PER_STAGE
        why = "one rank per pipeline stage" if per_stage else "uneven shards: rank 0 and the last"
        names = " and ".join(str(rank.rank) for rank in config.ranks)
        if config.ranks_same:
            lines.append(f"#{index} {_label(config, several)}: ranks {names} ({why}) came out the same")
            continue
        lines.append(f"#{index} {_label(config, several)}: the ranks differ ({why}); fits only if every rank fits")
        header = ("rank", "peak allocated", "peak reserved", "fits", "held at the end (params / grads / optimizer)")
        rows = [(_rank_name(rank), format_bytes(rank.peak_allocated_bytes), format_bytes(rank.peak_reserved_bytes),
                 _rank_fits(rank), _held(rank)) for rank in config.ranks]  # fmt: skip
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        lines += ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
                  for row in [header, *rows]]  # fmt: skip
        lines += [f"    {_rank_name(rank)}: {rank.problem}" for rank in config.ranks if rank.problem and not rank.oom]
    return lines


def _world_size_lines(result: PlanResult) -> list[str]:
    """At several world sizes: each layout's smallest world size that fits, with its per-rank
    peak and headroom, or the configuration that came closest and by how much."""
    if not _several(result):
        return []
    sizes = ", ".join(str(world) for world in result.world_sizes)
    lines = [f"smallest world size that fits, of {sizes}:"]
    for fit in result.world_size_fits:
        layout = _label(PlanConfig(levers=fit.levers, values=fit.values, peak_allocated_bytes=0,
                                   peak_reserved_bytes=0, fits=False, snapshot=None))  # fmt: skip
        if fit.world_size is not None and fit.config is not None:
            lines.append(f"  {layout}: {fit.world_size} (#{fit.config}: {format_bytes(fit.peak_reserved_bytes or 0)} "
                         f"peak reserved per rank, {format_bytes(fit.headroom_bytes or 0)} headroom)")  # fmt: skip
        elif fit.closest is not None:
            closest = result.configs[fit.closest]
            lines.append(f"  {layout}: none; closest at world size {closest.world_size} (#{fit.closest}), "
                         f"{format_bytes(fit.short_bytes or 0)} short per rank (it needs "
                         f"{format_bytes(closest.needed_bytes or 0)} run again with no memory limit)")  # fmt: skip
        else:
            lines.append(f"  {layout}: none (no run that ran out of memory completed with no memory limit, "
                         "to measure how close: see the problems above)")  # fmt: skip
    return lines


def _nothing_fits_line(result: PlanResult) -> str:
    if not any(config.oom for config in result.configs):
        # Nothing ran out of memory: every run stopped for another reason (each one's problem is
        # above), so nothing was measured that a lever or a larger GPU would change.
        return "no configuration ran to its end (each one's problem is above): nothing was measured to fit or not"
    if not _several(result):
        return "no configuration fits: try more levers (--try), a smaller --vary value, or a larger GPU"
    sizes = ", ".join(str(world) for world in result.world_sizes)
    line = f"no configuration fits at world size {sizes}"
    if result.closest is not None:
        closest = result.configs[result.closest]
        capacity = format_bytes(_capacity(result, closest))
        line += (f": the closest is #{result.closest} {_label(closest, True)}, "
                 f"{format_bytes(result.closest_short_bytes or 0)} short per rank "
                 f"(it needs {format_bytes(closest.needed_bytes or 0)}, run again with no memory limit, "
                 f"of {capacity}; its snapshot {closest.needed_snapshot})")  # fmt: skip
    return line + "; try more GPUs (--world-size), more levers (--try), a smaller --vary value, or a larger GPU"


def render(result: PlanResult) -> str:
    """The plan as ``memlens plan`` prints it: a row per configuration, each problem, the largest
    values that fit, and the recommended change."""
    header = ("#", "configuration", "peak allocated", "peak reserved", "fits", "cost", "trainable")
    rows = []
    several = _several(result)
    for index, config in enumerate(result.configs):
        label = _label(config, several)
        fits = _fits_cell(config)
        trainable = f"{config.trainable_parameters:,}" if config.trainable_parameters is not None else "-"
        mark = "*" if index == result.recommended else ""
        rows.append((f"{index}{mark}", label, format_bytes(config.peak_allocated_bytes),
                     format_bytes(config.peak_reserved_bytes), fits, _cost(config), trainable))  # fmt: skip
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        f"memlens plan on a simulated {result.gpu} ({format_bytes(result.capacity_bytes)} for PyTorch per rank"
        + (_world_sizes_header(result) if several else f", {result.world_size} ranks" if result.world_size > 1 else "")
        + ")",
        "  ".join(cell.ljust(width) for cell, width in zip(header, widths, strict=True)).rstrip(),
    ]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    # Every problem but a plain out-of-memory (the fits column says OOM) gets its line: a lever
    # that found nothing to act on is said in the table, even when the run then ran out too.
    # When nothing fits, where each ran out is the answer, so those are said too.
    lines += [f"  {index}: {config.problem}" for index, config in enumerate(result.configs)
              if config.problem and not config.fits
              and (result.recommended is None or not config.oom or _not_applied(config))]  # fmt: skip
    outside = _outside_line(result)
    if outside is not None:
        lines.append(outside)
    lines += _rank_lines(result)
    lines += _world_size_lines(result)
    for name in result.max:
        for levers, world, value in max_per_lever_set(result, name):
            where = ("+".join(levers) or "baseline") + (f" world-size={world}" if world is not None else "")
            said = (f"{value}" if value is not None
                    else f"none ({_why_the_lowest_does_not_fit(result, name, levers, world)})")  # fmt: skip
            lines.append(f"largest {name} that fits, {where}: {said}")
    if result.recommended is None:
        lines.append(_nothing_fits_line(result))
    else:
        fewest = (f" (world size {result.configs[result.recommended].world_size}, the fewest GPUs that fit)"
                  if several else "")  # fmt: skip
        lines.append(f"recommended: #{result.recommended}, the cheapest configuration that fits{fewest}:")
        lines += [f"  {line}" for line in (result.change or "").splitlines()]
        lines.append(_margin_line(result))
    lines.append(f"snapshots under {result.out} (memlens triage FILE); {result.seconds:.1f} s")
    return "\n".join(lines)
