"""``memlens plan``: what fits, and the cheapest way to make it fit, measured on the user's script.

``plan(PlanOptions(...))`` predicts the script once per configuration (the baseline first, then
each ``--try`` spec, at each combination of the ``--vary`` values), each in its own process
(``memlens.plan.child``), as many at once as there are CPUs; ``--max`` bisects a placeholder's
value for each lever set. It returns a ``PlanResult``: each configuration's predicted peaks,
whether it fits, what it costs, its snapshot (with the sidecar, so ``memlens triage`` opens it),
and the cheapest configuration that fits with the change that makes it so.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from memlens.errors import MemlensUsageError
from memlens.plan.child import run_in_child
from memlens.plan.configurations import (
    ChildJob,
    ChildResult,
    Configuration,
    check_placeholders,
    expand,
    substitute,
)
from memlens.plan.levers import Lever, alloc_conf, cost_key, is_whole_text, parse_max, parse_spec, parse_vary
from memlens.plan.processes import ConfigurationProcesses, stop_on_signals
from memlens.plan.recommend import change_for
from memlens.plan.search import largest_fitting

# The --out a plan writes to unless told otherwise: a second plan there gets memlens_plan-2, -3 ...
DEFAULT_OUT = "memlens_plan"


class PlanOptions(msgspec.Struct, frozen=True):
    """What to plan. ``command``: the script's command line (``python train.py ARGS``), with
    ``{NAME}`` placeholders for ``vary``/``max``; ``tries``: ``--try`` specs; ``vary``:
    ``NAME=V1,V2``; ``max``: ``NAME=LO..HI``; ``capacity``: bytes or "24GiB" (else the GPU's)."""

    command: list[str]
    gpu: str | None = None
    capacity: int | str | None = None
    reserve_outside: int | str = 0
    world_size: int = 1
    tries: list[str] = []
    vary: list[str] = []
    max: str | None = None
    out: str = DEFAULT_OUT
    jobs: int | None = None
    stacks: bool = False
    timeout_s: float = 900.0


class PlanConfig(msgspec.Struct):
    """One configuration's prediction. ``flops_change``: the run's floating-point operations
    relative to the baseline at the same values (+0.33: a third more compute, recomputation),
    None without such a baseline; ``offload_bytes_per_step``: what crosses PCIe each optimizer
    step; ``held_bytes``: parameters, gradients and optimizer state held at the end (per rank);
    ``problem``: why it did not complete (out of memory, the script's error)."""

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


class PlanResult(msgspec.Struct):
    configs: list[PlanConfig]
    recommended: int | None
    max: dict[str, int | None]
    change: str | None
    gpu: str
    capacity_bytes: int
    world_size: int
    out: str
    seconds: float


# Told of each configuration as it starts and ends: (started, finished, total or None while a
# --max search has not settled how many it runs, the configuration's label). memlens plan draws it.
PlanProgress = Callable[[int, int, int | None, str], None]


def plan(options: PlanOptions, on_progress: PlanProgress | None = None) -> PlanResult:
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
    if options.world_size < 1:
        raise MemlensUsageError(f"--world-size {options.world_size}: must be 1 or more")
    options = launched_options(options)  # ``command`` stays the launch the user typed, for the recommendation
    gpu_name, capacity = _device(options)
    out = _fresh_out(_absolute(options.out), numbered=options.out == DEFAULT_OUT)
    configurations = expand(lever_sets, vary)
    runner = _Runner(options, out, capacity, on_progress, len(configurations) if searched is None else None)
    with stop_on_signals():  # SIGTERM, Ctrl-C: every configuration's process ends with the plan
        results = runner.run_all(configurations) if searched is None else _search_all(runner, configurations, searched)
    configs = _scored(results)
    recommended = _recommended(results, configs)
    found_max: dict[str, int | None] = {}
    if searched is not None:
        found_max[searched[0]] = _max_of_baseline(results, searched[0])
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
        world_size=options.world_size,
        out=str(out.resolve()),
        seconds=round(time.perf_counter() - started, 3),
    )


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
    return msgspec.structs.replace(options, command=list(launched.command), world_size=launched.world_size)


# ---------------------------------------------------------------------- the device
def _device(options: PlanOptions) -> tuple[str, int]:
    from memlens.predict.gpus import DEFAULT_GPU, checked_reserve, gpu_spec, with_capacity
    from memlens.units import capacity_bytes, parse_bytes

    spec = gpu_spec(options.gpu or DEFAULT_GPU)
    if options.capacity is not None:
        spec = with_capacity(spec, capacity_bytes(options.capacity, "--capacity"))
    reserve = checked_reserve(spec, parse_bytes(options.reserve_outside))
    return spec.name, spec.total_memory - reserve


def _absolute(out: str) -> Path:
    """``--out`` resolved once, before any script runs: a script that chdirs would otherwise have
    its configuration's child write the result where the plan never looks."""
    return Path(os.path.abspath(out))


def _fresh_out(out: Path, numbered: bool = False) -> Path:
    """The plan's folder: new or empty (a plan never writes over another run's files). Where an
    earlier run's files are and ``numbered`` (the default --out, which the user did not choose),
    the first free ``OUT-2``, ``OUT-3`` ... beside it, as ``memlens record`` numbers its runs."""
    try:
        if out.exists() and not out.is_dir():
            raise MemlensUsageError(f"--out {out}: it is a file, not a folder")
        if out.is_dir() and any(out.iterdir()):
            if numbered:
                return _next_free_folder(out)
            raise MemlensUsageError(f"--out {out}: the folder is not empty (a plan writes into a new folder)")
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MemlensUsageError(f"--out {out}: {exc.strerror or exc}") from None
    return out


# How many numbered folders a plan tries beside the default --out before it asks for another.
MAX_NUMBERED_OUT = 10_000


def _next_free_folder(out: Path) -> Path:
    """``OUT-N`` for the least N >= 2 that is free or empty; made here, so two plans started at
    once never share one (``mkdir`` fails for the second)."""
    for number in range(2, MAX_NUMBERED_OUT):
        candidate = out.with_name(f"{out.name}-{number}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            if candidate.is_dir() and not any(candidate.iterdir()):
                return candidate
    raise MemlensUsageError(f"--out {out}: {MAX_NUMBERED_OUT} earlier plans are beside it: give a new folder")


# ---------------------------------------------------------------------- running children
class _Runner:
    """Runs configurations in child processes, at most ``jobs`` at once; one folder each."""

    def __init__(self, options: PlanOptions, out: Path, capacity: int, on_progress: PlanProgress | None = None,
                 total: int | None = None) -> None:
        self.options = options
        self.on_progress = on_progress
        self.total = total
        self._finished = 0
        self.out = out
        self.capacity = capacity
        self.jobs = max(1, options.jobs or _cpus())
        self._slots = threading.Semaphore(self.jobs)
        self._count = 0
        self._lock = threading.Lock()
        self._context = _process_context()
        self.processes = ConfigurationProcesses()

    def run_all(self, configurations: list[Configuration]) -> list[tuple[Configuration, ChildResult]]:
        with ThreadPoolExecutor(max_workers=self.jobs) as pool, self.processes.stopped_on_the_way_out():
            return list(zip(configurations, pool.map(self.run, configurations), strict=True))

    def run(self, configuration: Configuration) -> ChildResult:
        if self.processes.stopping:  # the plan was stopped: the configurations still queued are not run
            return ChildResult(problem="not run: the plan was stopped")
        with self._lock:
            index = self._count
            self._count += 1
        self._tell(configuration)
        try:
            return self._run(configuration, index)
        finally:
            with self._lock:
                self._finished += 1
            self._tell(configuration)

    def _tell(self, configuration: Configuration) -> None:
        if self.on_progress is not None:
            self.on_progress(self._count, self._finished, self.total, configuration.label())

    def _run(self, configuration: Configuration, index: int) -> ChildResult:
        folder = self.out / f"{index:02d}-{configuration.slug()}"
        folder.mkdir()
        job = ChildJob(
            command=substitute(self.options.command, configuration.values),
            levers=list(configuration.levers),
            out_dir=str(folder),
            gpu=self.options.gpu,
            capacity=self.capacity,
            world_size=self.options.world_size,
            stacks=self.options.stacks,
        )
        job_path = folder / "job.json"
        job_path.write_bytes(msgspec.json.encode(job))
        conf = alloc_conf(configuration.levers, os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
        with self._slots:
            process = self._context.Process(
                target=run_in_child, args=(str(job_path), str(folder / "script.log"), conf), daemon=True
            )
            process.start()
            self.processes.started(process)
            try:
                process.join(self.options.timeout_s)
                if process.is_alive():
                    process.kill()
                    process.join()
                    return ChildResult(problem=f"the prediction took longer than {self.options.timeout_s:g} s")
            finally:
                self.processes.finished(process)
        result_path = folder / "plan_result.json"
        if not result_path.is_file():
            tail = (folder / "script.log").read_bytes()[-300:].decode(errors="replace").strip().splitlines()
            return ChildResult(
                problem="the prediction process ended without a result" + (f": {tail[-1]}" if tail else "")
            )
        return msgspec.json.decode(result_path.read_bytes(), type=ChildResult)


def predict_configurations(options: PlanOptions, configurations: list[Configuration]) -> list[PlanConfig]:
    """Each configuration predicted (in parallel, as ``plan`` does), scored against the baseline
    at the same values when one is among them; into ``options.out`` (a new folder)."""
    options = launched_options(options)
    _, capacity = _device(options)
    runner = _Runner(options, _fresh_out(_absolute(options.out)), capacity)
    return _scored(runner.run_all(configurations))


def _search_all(
    runner: _Runner, configurations: list[Configuration], searched: tuple[str, int, int]
) -> list[tuple[Configuration, ChildResult]]:
    """Each configuration's largest value of the searched placeholder that fits (bisection, in
    parallel across configurations); every probe is part of the result, in value order."""
    name, low, high = searched

    def search(configuration: Configuration) -> list[tuple[Configuration, ChildResult]]:
        probes: dict[int, tuple[Configuration, ChildResult]] = {}

        def fits(value: int) -> bool:
            probe = Configuration(levers=configuration.levers, values={**configuration.values, name: str(value)})
            probes[value] = (probe, runner.run(probe))
            return probes[value][1].fits

        largest_fitting(fits, low, high)
        return [probes[value] for value in sorted(probes)]

    with ThreadPoolExecutor(max_workers=max(1, len(configurations))) as pool, runner.processes.stopped_on_the_way_out():
        found = list(pool.map(search, configurations))
    return [probe for probes in found for probe in probes]


# ---------------------------------------------------------------------- scoring
def _values(configuration: Configuration) -> dict[str, int | str]:
    return {name: int(value) if is_whole_text(value) else value for name, value in configuration.values.items()}


def _scored(results: list[tuple[Configuration, ChildResult]]) -> list[PlanConfig]:
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
            )
        )
    return configs


def _offload_bytes(levers: tuple[Lever, ...], child: ChildResult) -> int | None:
    """Bytes over PCIe per optimizer step: offloading the optimizer sends every gradient to the
    CPU and every updated parameter back; offloading the parameters also brings them in twice
    (forward, backward); a paged optimizer moves at most its paged state."""
    offload = next((lever.value for lever in levers if lever.name == "offload"), None)
    if offload and child.model:
        parameter_bytes = int(child.model.get("parameter_bytes_total") or 0)
        total = int(child.model.get("parameters_total") or 0)
        trainable = int(child.model.get("parameters_trainable") or 0)
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


def _recommended(results: list[tuple[Configuration, ChildResult]], configs: list[PlanConfig]) -> int | None:
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


def _max_of_baseline(results: list[tuple[Configuration, ChildResult]], name: str) -> int | None:
    fitting = [int(c.values[name]) for c, child in results if not c.levers and child.fits]
    return max(fitting) if fitting else None


def max_per_lever_set(result: PlanResult, name: str) -> list[tuple[list[str], int | None]]:
    """For each lever set of a ``--max`` plan, the largest value that fits (None: not even LO)."""
    found: dict[tuple[str, ...], int | None] = {}
    for config in result.configs:
        key = tuple(config.levers)
        value = config.values.get(name)
        best = found.get(key)
        if config.fits and isinstance(value, int):
            found[key] = value if best is None else max(best, value)
        else:
            found.setdefault(key, None)
    return [(list(key), value) for key, value in found.items()]


def _process_context() -> Any:
    """Children forked from a server that has imported torch, the predictor and the fake-tensor
    machinery once (seconds per child otherwise); each configuration still gets a fresh process."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["memlens.plan.preload"])
    return context


def _cpus() -> int:
    """The CPUs this process may run on (a container's share, not the host's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
