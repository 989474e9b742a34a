"""The configurations of a plan run, each in a process of its own, at most ``jobs`` at once.

``ConfigurationRunner`` writes each configuration's job into its own folder under the plan's, starts
``memlens.plan.child`` on it in a process forked from a fork server that has imported torch and the
predictor once (``preload``), waits for it under the plan's time limit, and reads back the
``ChildResult`` it wrote; the processes end with the plan (``processes``). Also here: the device a
plan predicts on and the plan's folder, both settled before any script runs.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from memlens.errors import MemlensUsageError
from memlens.plan.child import RESULT_NAME, run_in_child
from memlens.plan.configurations import ChildJob, ChildResult, Configuration, substitute
from memlens.plan.levers import alloc_conf
from memlens.plan.options import PlanOptions
from memlens.plan.pipeline import SENT_NAME
from memlens.plan.processes import ConfigurationProcesses

if TYPE_CHECKING:
    from memlens.predict.gpus import GpuSpec
from memlens.plan.results import RANKS_ALIKE, RANKS_PER_STAGE, RANKS_UNEVEN, PlanProgress, PlanRank


# ---------------------------------------------------------------------- the device and the folder
def device_of(options: PlanOptions) -> tuple[str, int]:
    """The simulated GPU's name, and the bytes PyTorch may use on it: the GPU's memory (or
    ``--capacity``) less what is outside the allocator (``outside_allocator``)."""
    spec = _board(options)
    return spec.name, spec.total_memory - outside_allocator(options)[0]


def _board(options: PlanOptions) -> GpuSpec:
    """The simulated GPU's spec: ``--gpu``'s board (or the default), with ``--capacity``'s memory."""
    from memlens.predict.gpus import DEFAULT_GPU, gpu_spec, with_capacity
    from memlens.units import capacity_bytes

    spec = gpu_spec(options.gpu or DEFAULT_GPU)
    if options.capacity is not None:
        spec = with_capacity(spec, capacity_bytes(options.capacity, "--capacity"))
    return spec


# What a rank's GPU holds outside PyTorch's caching allocator, which the emulation cannot see,
# estimated where --world-size N > 1 and no --reserve-outside is given:
# - the CUDA context: 300-600 MiB per device, depending on the CUDA version, the driver and how
#   many kernels are loaded (PyTorch's "CUDA semantics" notes; NVIDIA's CUDA C++ Programming
#   Guide, "Lazy Loading", for what the version changes); the upper half's 500 MiB is taken.
CUDA_CONTEXT_ESTIMATE = 500 << 20
# - NCCL's buffers: NCCL_BUFFSIZE (4 MiB by default: NCCL's "Environment Variables" page) per
#   channel per peer; a ring or tree rank talks to 2 peers, over (an estimate) 16 channels, which
#   NCCL picks for the topology at run time (NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS bound it).
NCCL_BUFFSIZE_DEFAULT = 4 << 20
NCCL_PEERS = 2
NCCL_CHANNELS_ESTIMATE = 16


def outside_allocator(options: PlanOptions) -> tuple[int, str | None]:
    """What is taken off each rank's GPU for memory outside PyTorch's allocator, and where the
    figure comes from: ``--reserve-outside`` when given (not 0), else at ``--world-size`` > 1 the
    estimate of the CUDA context and NCCL's buffers (``NCCL_BUFFSIZE`` and ``NCCL_MAX_NCHANNELS``
    read from the environment where set), else nothing."""
    from memlens.predict.gpus import checked_reserve
    from memlens.units import format_bytes, parse_bytes

    spec = _board(options)
    given = checked_reserve(spec, parse_bytes(options.reserve_outside))
    if given or int(options.world_size) <= 1:
        return given, ("--reserve-outside" if given else None)
    buffer = _environment_count("NCCL_BUFFSIZE", NCCL_BUFFSIZE_DEFAULT)
    channels = min(NCCL_CHANNELS_ESTIMATE, _environment_count("NCCL_MAX_NCHANNELS", NCCL_CHANNELS_ESTIMATE))
    nccl = buffer * NCCL_PEERS * channels
    estimate = CUDA_CONTEXT_ESTIMATE + nccl
    source = (
        f"estimated: the CUDA context {format_bytes(CUDA_CONTEXT_ESTIMATE)} (300-600 MiB by CUDA version) + "
        f"NCCL {format_bytes(nccl)} (NCCL_BUFFSIZE {format_bytes(buffer)} x {NCCL_PEERS} peers x {channels} "
        "channels; NCCL picks its channels by topology); --reserve-outside SIZE replaces it"
    )
    if estimate >= spec.total_memory:
        raise MemlensUsageError(
            f"--world-size {options.world_size}: the {format_bytes(spec.total_memory)} device would leave "
            f"PyTorch nothing after the {format_bytes(estimate)} {source}"
        )
    return estimate, source


def _environment_count(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() and int(value) > 0 else default


def absolute_out(out: str) -> Path:
    """``--out`` resolved once, before any script runs: a script that chdirs would otherwise have
    its configuration's child write the result where the plan never looks."""
    return Path(os.path.abspath(out))


def fresh_out(out: Path, numbered: bool = False) -> Path:
    """The plan's folder: new or empty (a plan never writes over another run's files). Where an
    earlier run's files are and ``numbered`` (the default --out, which the user did not choose),
    the first free ``OUT-2``, ``OUT-3`` ... beside it, as ``memlens record`` numbers its runs."""
    try:
        if out.exists() and not out.is_dir():
            raise MemlensUsageError(f"--out {out}: it is a file, not a folder")
        if out.is_dir() and any(out.iterdir()):
            if numbered:
                return next_free_folder(out)
            raise MemlensUsageError(f"--out {out}: the folder is not empty (a plan writes into a new folder)")
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MemlensUsageError(f"--out {out}: {exc.strerror or exc}") from None
    return out


# How many numbered folders a plan tries beside the default --out before it asks for another.
MAX_NUMBERED_OUT = 10_000


def next_free_folder(out: Path) -> Path:
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
# The device memory a configuration is run again with to see what it would need where it ran out
# (several --world-size values, none fitting): 1 PiB, more than any GPU, which the emulation
# never allocates (its tensors are fake).
UNCAPPED_BYTES = 1 << 50

class ConfigurationRunner:
    """Runs configurations in child processes, at most ``jobs`` at once; one folder each."""

    def __init__(self, options: PlanOptions, out: Path, capacity: int, on_progress: PlanProgress | None = None,
                 total: int | None = None, capacity_at: dict[int, int] | None = None) -> None:
        """``capacity``: what PyTorch may use on each rank's GPU; ``capacity_at``: the same at each
        world size a configuration names (several ``--world-size`` values: the estimate outside
        the allocator is taken off only above 1)."""
        self.options = options
        self.capacity_at = capacity_at or {}
        self.on_progress = on_progress
        self.total = total
        self._finished = 0
        self.out = out
        self.capacity = capacity
        self.jobs = max(1, options.jobs or cpus())
        self._slots = threading.Semaphore(self.jobs)
        self._count = 0
        self._lock = threading.Lock()
        self._context = process_context()
        self.processes = ConfigurationProcesses()

    def run_all(self, configurations: list[Configuration]) -> list[tuple[Configuration, ChildResult]]:
        with ThreadPoolExecutor(max_workers=self.jobs) as pool, self.processes.stopped_on_the_way_out():
            return list(zip(configurations, pool.map(self.run, configurations), strict=True))

    def run_uncapped(self, configuration: Configuration) -> ChildResult:
        """``configuration`` again with no memory limit (``UNCAPPED_BYTES``), into its own
        ``NN-LABEL-uncapped`` folder: where it ran out of memory, what it would have needed."""
        with self._lock:
            index = self._count
            self._count += 1
        return self._run(configuration, index, capacity=UNCAPPED_BYTES, suffix="-uncapped")

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

    def _run(self, configuration: Configuration, index: int, capacity: int | None = None,
             suffix: str = "") -> ChildResult:  # fmt: skip
        folder = self.out / f"{index:02d}-{configuration.slug()}{suffix}"
        folder.mkdir()
        world_size = configuration.world_size if configuration.world_size is not None else self.world_size()
        job = ChildJob(
            command=substitute(list(self.options.command), configuration.values),
            levers=list(configuration.levers),
            out_dir=str(folder),
            gpu=self.options.gpu,
            capacity=capacity if capacity is not None else self.capacity_at.get(world_size, self.capacity),
            world_size=world_size,
            stacks=self.options.stacks,
            placeholder_values=self.options.placeholder_values,
            distributed=configuration.world_size is not None,
        )
        conf = alloc_conf(configuration.levers, os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
        if world_size == 1:
            return self._run_child(job, folder, conf)
        return self._run_ranks(job, folder, conf)

    def world_size(self) -> int:
        """The plan's one world size (a configuration that names none runs at it)."""
        return int(self.options.world_size)

    def _run_ranks(self, job: ChildJob, folder: Path, conf: str) -> ChildResult:
        """The ranks of one configuration that can differ, each in ``rank<N>/`` (the recorder's
        per-rank naming): rank 0; then, where rank 0 built a pipeline stage, the ranks after it in
        order (each needs the shapes the one before sent) until the last stage has run; else,
        where its shards were uneven, the last rank. The result is the worst rank's, with every
        rank's figures in ``ranks``."""
        world_size = job.world_size
        runs: list[tuple[int, ChildResult]] = []
        rank, received = 0, None
        rule = RANKS_ALIKE
        while rank < world_size:
            rank_folder = folder / f"rank{rank}"
            rank_folder.mkdir()
            rank_job = msgspec.structs.replace(job, out_dir=str(rank_folder), rank=rank, pipeline_received=received)
            child = self._run_child(rank_job, rank_folder, conf)
            runs.append((rank, child))
            stage = _stage_of(child)
            if stage is not None:
                rule = RANKS_PER_STAGE
                if stage[0] == stage[1] - 1 or child.problem is not None:
                    break  # the last stage has run (or a stage failed: those after need its shapes)
                received = str(rank_folder / SENT_NAME)
                rank += 1
            elif rank == 0 and child.notes.get("uneven_shards"):
                rule = RANKS_UNEVEN
                rank = world_size - 1
            else:
                break
        return _worst_of(runs, rule)

    def _run_child(self, job: ChildJob, folder: Path, conf: str) -> ChildResult:
        job_path = folder / "job.json"
        job_path.write_bytes(msgspec.json.encode(job))
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
        result_path = folder / RESULT_NAME
        if not result_path.is_file():
            tail = (folder / "script.log").read_bytes()[-300:].decode(errors="replace").strip().splitlines()
            return ChildResult(
                problem="the prediction process ended without a result" + (f": {tail[-1]}" if tail else "")
            )
        return msgspec.json.decode(result_path.read_bytes(), type=ChildResult)


def _stage_of(result: ChildResult) -> tuple[int, int] | None:
    """The (last) pipeline stage the rank built, and how many there are; None without one."""
    pipeline = result.notes.get("pipeline")
    stages = pipeline.get("stages") if isinstance(pipeline, dict) else None
    if not stages:
        return None
    last = max(stages, key=lambda stage: int(stage["stage_index"]))
    return int(last["stage_index"]), int(last["num_stages"])


def _rank_figures(rank: int, result: ChildResult) -> PlanRank:
    stage = _stage_of(result)
    return PlanRank(
        rank=rank,
        peak_allocated_bytes=result.peak_allocated_bytes,
        peak_reserved_bytes=result.peak_reserved_bytes,
        fits=result.fits,
        snapshot=result.snapshot,
        problem=result.problem,
        oom=result.oom,
        held_bytes=result.held_bytes,
        stage=stage[0] if stage else None,
        num_stages=stage[1] if stage else None,
        uneven_shards=int(result.notes.get("uneven_shards", 0)),
    )


def _worst_of(runs: list[tuple[int, ChildResult]], rule: str) -> ChildResult:
    """One configuration's result from its ranks': the worst rank's figures (the first that did
    not fit, else the highest peak reserved), fitting only if every rank fits, with each rank's."""
    ranks = [_rank_figures(rank, child) for rank, child in runs]
    failed = [index for index, (_, child) in enumerate(runs) if not child.fits]
    worst = failed[0] if failed else max(range(len(runs)), key=lambda index: runs[index][1].peak_reserved_bytes)
    result = msgspec.structs.replace(runs[worst][1])
    if failed and len(runs) > 1 and result.problem is not None:
        result.problem = f"rank {ranks[worst].rank}: {result.problem}"
    result.fits = not failed
    result.ranks = ranks
    result.rank_rule = rule
    figures = {(r.peak_allocated_bytes, r.peak_reserved_bytes, tuple(sorted(r.held_bytes.items()))) for r in ranks}
    result.ranks_same = len(figures) == 1
    # A pipeline's stages each hold their own layers: the model's trainable parameters are every
    # stage's (once each), not the worst rank's.
    stages: dict[int, int | None] = {}
    for _, child in runs:
        stage = _stage_of(child)
        if stage is not None:
            stages.setdefault(stage[0], child.trainable_parameters)
    if len(stages) > 1 and all(count is not None for count in stages.values()):
        result.trainable_parameters = sum(count for count in stages.values() if count is not None)
    return result


def process_context() -> Any:
    """Children forked from a server that has imported torch, the predictor and the fake-tensor
    machinery once (seconds per child otherwise); each configuration still gets a fresh process."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["memlens.plan.preload"])
    return context


def cpus() -> int:
    """The CPUs this process may run on (a container's share, not the host's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


__all__ = ["ConfigurationRunner", "absolute_out", "cpus", "device_of", "fresh_out", "outside_allocator",
           "process_context"]
