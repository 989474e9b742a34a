"""Each configuration's prediction scored (its compute against the baseline's, what crosses PCIe)
and the one a user would take recommended."""

from __future__ import annotations

from typing import Any

from memlens.plan.configurations import ChildResult, Configuration
from memlens.plan.levers import Lever, cost_key, is_whole_text
from memlens.plan.results import PlanConfig


def _values(configuration: Configuration) -> dict[str, int | str]:
    return {name: int(value) if is_whole_text(value) else value for name, value in configuration.values.items()}


def scored(results: list[tuple[Configuration, ChildResult]]) -> list[PlanConfig]:
    # Compute is compared between runs that completed: one stopped by an out-of-memory error
    # counted only the operations before it.
    baseline_flops = {
        tuple(sorted(configuration.values.items())): child.flops
        for configuration, child in results
        if not configuration.levers and child.flops and child.problem is None
    }
    configs = []
    for configuration, child in results:
        base = baseline_flops.get(tuple(sorted(configuration.values.items())))
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
    """The configuration a user would take: among those that fit within a factor of
    ``WORTH_ITS_COST_FACTOR`` of the most work per step, the lowest lever cost
    (``levers.cost_key``), then the largest placeholder values, then the lower peak."""
    candidates = [index for index, config in enumerate(configs) if config.fits]
    if not candidates:
        return None
    most = max(_work_per_step(results[index][0]) for index in candidates)
    worth = [index for index in candidates if _work_per_step(results[index][0]) * WORTH_ITS_COST_FACTOR > most]

    def key(index: int) -> tuple[Any, ...]:
        configuration = results[index][0]
        values = tuple(-int(v) if is_whole_text(v) else 0 for v in configuration.values.values())
        return (cost_key(configuration.levers), values, configs[index].peak_reserved_bytes)

    return min(worth, key=key)


def max_of_baseline(results: list[tuple[Configuration, ChildResult]], name: str) -> int | None:
    fitting = [int(c.values[name]) for c, child in results if not c.levers and child.fits]
    return max(fitting) if fitting else None


__all__ = ["WORTH_ITS_COST_FACTOR", "max_of_baseline", "recommended_index", "scored"]
