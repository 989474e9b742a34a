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


def _why_the_lowest_does_not_fit(result: PlanResult, name: str, levers: list[str]) -> str:
    """``not even the lowest value fits: B=1 OUT OF MEMORY at ...``: the lowest value tried with
    these levers, and what stopped it."""
    tried = [c for c in result.configs if list(c.levers) == list(levers) and isinstance(c.values.get(name), int)]
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
    spare = result.capacity_bytes - config.peak_reserved_bytes
    last = [name for name in result.max
            if any(levers == config.levers and value is not None and config.values.get(name) == value
                   for levers, value in max_per_lever_set(result, name))]
    what = f"the largest {' and '.join(last)} that fits" if last else "it fits"
    capacity = format_bytes(result.capacity_bytes)
    spare_line = f"  {what}, with {format_bytes(spare)} to spare of {capacity} (peak reserved)"
    if result.outside_bytes:
        return f"{spare_line}, after {format_bytes(result.outside_bytes)} outside PyTorch's allocator (above)"
    return (
        f"{spare_line}; not counted: the CUDA context and NCCL's buffers, outside PyTorch's allocator "
        "(--reserve-outside takes them off)"
    )


def _label(config: PlanConfig) -> str:
    label = "+".join(config.levers) or "baseline"
    if config.values:
        label += " " + " ".join(f"{name}={value}" for name, value in config.values.items())
    return label


def _outside_line(result: PlanResult) -> str | None:
    """What was taken off each rank's GPU for memory outside PyTorch's allocator, and whence."""
    if not result.outside_bytes:
        return None
    source = result.outside_source or "--reserve-outside"
    return f"  outside PyTorch's allocator, per rank: {format_bytes(result.outside_bytes)} taken off ({source})"


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
    every = f"ranks 0-{world - 1}" if world > 2 else "ranks 0 and 1"
    lines: list[str] = []
    alike = [index for index, config in enumerate(result.configs) if config.rank_rule == RANKS_ALIKE]
    if alike and len(alike) == len(result.configs):
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
            lines.append(f"#{index} {_label(config)}: ranks {names} ({why}) came out the same")
            continue
        lines.append(f"#{index} {_label(config)}: the ranks differ ({why}); fits only if every rank fits")
        header = ("rank", "peak allocated", "peak reserved", "fits", "held at the end (params / grads / optimizer)")
        rows = [(_rank_name(rank), format_bytes(rank.peak_allocated_bytes), format_bytes(rank.peak_reserved_bytes),
                 _rank_fits(rank), _held(rank)) for rank in config.ranks]  # fmt: skip
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        lines += ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
                  for row in [header, *rows]]  # fmt: skip
        lines += [f"    {_rank_name(rank)}: {rank.problem}" for rank in config.ranks if rank.problem and not rank.oom]
    return lines


def render(result: PlanResult) -> str:
    """The plan as ``memlens plan`` prints it: a row per configuration, each problem, the largest
    values that fit, and the recommended change."""
    header = ("#", "configuration", "peak allocated", "peak reserved", "fits", "cost", "trainable")
    rows = []
    for index, config in enumerate(result.configs):
        label = _label(config)
        fits = _fits_cell(config)
        trainable = f"{config.trainable_parameters:,}" if config.trainable_parameters is not None else "-"
        mark = "*" if index == result.recommended else ""
        rows.append((f"{index}{mark}", label, format_bytes(config.peak_allocated_bytes),
                     format_bytes(config.peak_reserved_bytes), fits, _cost(config), trainable))  # fmt: skip
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        f"memlens plan on a simulated {result.gpu} ({format_bytes(result.capacity_bytes)} for PyTorch per rank"
        + (f", {result.world_size} ranks" if result.world_size > 1 else "")
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
    for name in result.max:
        for levers, value in max_per_lever_set(result, name):
            where = "+".join(levers) or "baseline"
            said = f"{value}" if value is not None else f"none ({_why_the_lowest_does_not_fit(result, name, levers)})"
            lines.append(f"largest {name} that fits, {where}: {said}")
    if result.recommended is None:
        lines.append("no configuration fits: try more levers (--try), a smaller --vary value, or a larger GPU")
    else:
        lines.append(f"recommended: #{result.recommended}, the cheapest configuration that fits:")
        lines += [f"  {line}" for line in (result.change or "").splitlines()]
        lines.append(_margin_line(result))
    lines.append(f"snapshots under {result.out} (memlens triage FILE); {result.seconds:.1f} s")
    return "\n".join(lines)
