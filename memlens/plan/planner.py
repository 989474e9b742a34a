"""``memlens plan``'s answer, computed: the options checked, every configuration predicted (each
in its own process, ``runner``), ``--max`` bisected per lever set, the results scored and the
cheapest configuration that fits recommended with the change that makes it so (``recommend``).
The service ``memlens.ops.plan.plan`` and the Python API ``memlens.plan(...)`` both call ``plan``.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

from memlens.errors import MemlensUsageError
from memlens.plan.configurations import ChildResult, Configuration, check_placeholders, expand, parse_world_sizes
from memlens.plan.levers import parse_max, parse_spec, parse_vary
from memlens.plan.options import DEFAULT_OUT, PlanOptions
from memlens.plan.processes import stop_on_signals
from memlens.plan.recommend import change_for
from memlens.plan.results import PlanConfig, PlanProgress, PlanResult
from memlens.plan.runner import ConfigurationRunner, absolute_out, device_of, fresh_out, outside_allocator
from memlens.plan.scoring import max_of_baseline, recommended_index, scored, to_run_uncapped, world_size_fits
from memlens.plan.search import largest_fitting


def plan(options: PlanOptions, on_progress: PlanProgress | None = None) -> PlanResult:
    """Predict ``options.command`` once per configuration (the baseline first, then each ``--try``
    spec, at each combination of the ``--vary`` values; ``--max`` bisected per lever set), as many
    at once as there are CPUs; each configuration's snapshot is written under ``options.out``."""
    started = time.perf_counter()
    lever_sets = [parse_spec(spec) for spec in options.tries]
    vary = [parse_vary(text) for text in options.vary]
    searched = parse_max(options.max) if options.max else None
    names = [name for name, _ in vary] + ([searched[0]] if searched else [])
    if len(set(names)) != len(names):
        raise MemlensUsageError("a placeholder is given by two --vary/--max options")
    command = list(options.command)
    if not command:
        raise MemlensUsageError("nothing to run: give the command after --, e.g. -- python train.py")
    check_placeholders(command, names)
    from memlens.predict.launcher import read_launcher

    world_sizes = parse_world_sizes(options.world_size)
    if len(world_sizes) > 1 and read_launcher(command).launcher is not None:
        raise MemlensUsageError(
            f"--world-size {options.world_size}: several world sizes plan a plain command (python train.py), "
            "not a launcher's, which starts its own number of ranks"
        )
    # From here the options name one world size, the largest: a configuration names its own.
    options = dataclasses.replace(options, world_size=world_sizes[-1])
    options = launched_options(options)  # ``command`` stays the launch the user typed, for the recommendation
    gpu_name, capacity = device_of(options)
    outside = outside_allocator(options)  # what device_of took off: the result says it, and whence
    capacity_at = {world: device_of(dataclasses.replace(options, world_size=world))[1] for world in world_sizes}
    out = fresh_out(absolute_out(options.out), numbered=options.out == DEFAULT_OUT)
    configurations = expand(lever_sets, vary, world_sizes)
    total = len(configurations) if searched is None else None
    runner = ConfigurationRunner(options, out, capacity, on_progress, total, capacity_at=capacity_at)
    with stop_on_signals():  # SIGTERM, Ctrl-C: every configuration's process ends with the plan
        results = runner.run_all(configurations) if searched is None else _search_all(runner, configurations, searched)
    configs = scored(results, int(options.world_size), capacity_at)
    recommended = recommended_index(results, configs)
    several = len(world_sizes) > 1
    if several:
        _measure_uncapped(runner, results, configs)
    fits, closest, short = world_size_fits(configs) if several else ([], None, None)
    found_max: dict[str, int | None] = {}
    if searched is not None:
        found_max[searched[0]] = max_of_baseline(results, searched[0])
    change = None
    if recommended is not None:
        configuration, child = results[recommended]
        change = change_for(configuration, child, command)
    return PlanResult(
        configs=configs,
        recommended=recommended,
        max=found_max,
        change=change,
        gpu=gpu_name,
        capacity_bytes=capacity,
        world_size=int(options.world_size),
        out=str(out.resolve()),
        seconds=round(time.perf_counter() - started, 3),
        outside_bytes=outside[0],
        outside_source=outside[1],
        world_sizes=list(world_sizes) if several else [],
        world_size_fits=fits,
        closest=closest,
        closest_short_bytes=short,
    )


def _measure_uncapped(
    runner: ConfigurationRunner, results: list[tuple[Configuration, ChildResult]], configs: list[PlanConfig]
) -> None:
    """Where a layout fits at none of the world sizes, each of its configurations that ran out of
    memory is run again with no memory limit: its peak there is what it needs (``needed_bytes``),
    which says how close it came."""
    indices = to_run_uncapped(configs)
    if not indices:
        return
    with ThreadPoolExecutor(max_workers=len(indices)) as pool, runner.processes.stopped_on_the_way_out():
        uncapped = list(pool.map(runner.run_uncapped, [results[index][0] for index in indices]))
    for index, child in zip(indices, uncapped, strict=True):
        if child.problem is None:
            configs[index].needed_bytes = child.peak_reserved_bytes
            configs[index].needed_snapshot = child.snapshot


def launched_options(options: PlanOptions) -> PlanOptions:
    """A torchrun command line planned as what it launches: its script, at its world size (what
    ``--world-size`` gives a plain command; the two must agree when both are given)."""
    from memlens.predict.launcher import read_launcher

    launched = read_launcher(options.command)
    if launched.launcher is None:
        return options
    if options.world_size not in (1, launched.world_size):
        raise MemlensUsageError(
            f"--world-size {options.world_size} and {launched.launcher}'s {launched.world_size} ranks disagree: "
            "give one of them"
        )
    return dataclasses.replace(options, command=list(launched.command), world_size=launched.world_size)


def predict_configurations(options: PlanOptions, configurations: list[Configuration]) -> list[PlanConfig]:
    """Each configuration predicted (in parallel, as ``plan`` does), scored against the baseline
    at the same values when one is among them; into ``options.out`` (a new folder)."""
    options = launched_options(dataclasses.replace(options, world_size=parse_world_sizes(options.world_size)[-1]))
    _, capacity = device_of(options)
    worlds = {configuration.world_size for configuration in configurations if configuration.world_size is not None}
    capacity_at = {world: device_of(dataclasses.replace(options, world_size=world))[1] for world in worlds}
    runner = ConfigurationRunner(options, fresh_out(absolute_out(options.out)), capacity, capacity_at=capacity_at)
    return scored(runner.run_all(configurations), int(options.world_size), capacity_at)


def _search_all(
    runner: ConfigurationRunner, configurations: list[Configuration], searched: tuple[str, int, int]
) -> list[tuple[Configuration, ChildResult]]:
    """Each configuration's largest value of the searched placeholder that fits (bisection, in
    parallel across configurations); every probe is part of the result, in value order."""
    name, low, high = searched

    def search(configuration: Configuration) -> list[tuple[Configuration, ChildResult]]:
        probes: dict[int, tuple[Configuration, ChildResult]] = {}

        def fits(value: int) -> bool:
            probe = Configuration(
                levers=configuration.levers,
                values={**configuration.values, name: str(value)},
                world_size=configuration.world_size,
            )
            probes[value] = (probe, runner.run(probe))
            return probes[value][1].fits

        largest_fitting(fits, low, high)
        return [probes[value] for value in sorted(probes)]

    with ThreadPoolExecutor(max_workers=max(1, len(configurations))) as pool, runner.processes.stopped_on_the_way_out():
        found = list(pool.map(search, configurations))
    return [probe for probes in found for probe in probes]


__all__ = ["launched_options", "plan", "predict_configurations"]
