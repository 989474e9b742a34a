"""memlens: GPU memory profiling and snapshot analysis for PyTorch training.

The public face, nothing else: ``load`` a snapshot, ``analyze`` it, compute a ``budget``,
``record`` a training loop, ``whatif`` replay it through the allocator simulator, ``predict``
a CUDA run's memory on a machine without a GPU, ``plan`` the cheapest change that makes it
fit. Heavy modules (torch, dash) are imported only when the function that needs them is called.

The entry points take the same explicit, typed keyword arguments as the functions they call
(an IDE and ``mypy --strict`` see them; a misspelt option is a ``TypeError`` at the call), and
import those functions' modules only when called. The subpackages (``memlens.budget``,
``memlens.allocator``, ...) are attributes after a bare ``import memlens`` too, imported on first
use (PEP 562 ``__getattr__``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memlens._lazy import lazy_names
from memlens.errors import MemlensError, MemlensFormatError, MemlensOutOfMemory, MemlensUsageError

if TYPE_CHECKING:
    # What the lazy attributes below are, for mypy and IDEs; at run time ``__getattr__`` imports them.
    from memlens import allocator as allocator
    from memlens import analysis as analysis
    from memlens import budget as budget
    from memlens import recorder as recorder
    from memlens import reporters as reporters
    from memlens import units as units
    from memlens.allocator.replay import Observer, Watch, WhatIfResult
    from memlens.allocator.settings import AllocatorSettings
    from memlens.analysis.report import Report
    from memlens.ops.plan import PlanResult
    from memlens.predict.session import PredictResult
    from memlens.recorder.session import Backend, Recorder
    from memlens.snapshot import Snapshot as Snapshot
    from memlens.snapshot import load as load

# Subpackages a user reaches as ``memlens.<name>`` without importing them first. ``predict`` is
# not here: it is the function below until ``import memlens.predict`` replaces it with the
# (callable) subpackage.
# ``load`` and ``Snapshot`` (numpy and the columnar model) are imported on first use too, so that
# ``import memlens.<anything>`` costs no numpy: a cached ``memlens triage`` never needs it; and
# ``__version__``, read from the package metadata: 30 ms that most commands never need.
_HOMES = {
    **{name: f"memlens.{name}" for name in ("allocator", "analysis", "budget", "recorder", "reporters", "units")},
    "Snapshot": "memlens.snapshot",
    "load": "memlens.snapshot",
    "__version__": "memlens._version",
}

# The recorder's defaults (memlens.recorder.options.RecordOptions), repeated so that the signature
# below is complete without importing the recorder; tests/test_public_api.py keeps them equal.
_RECORDER_MAX_ENTRIES = 200_000
_RECORDER_MAX_STACK_DEPTH = 64
_RECORDER_DUMP_KEEP = 3


def analyze(
    source: str | os.PathLike[str] | Snapshot,
    *,
    capacity: int | str | None = None,
    device: int | None = None,
    bytes_per_param: int | None = None,
    top_stacks: int | None = None,
) -> Report:
    """Analyse a snapshot (a path or a loaded ``Snapshot``): see ``memlens.analysis.analyze``."""
    from memlens.analysis import analyze as _analyze

    return _analyze(source, capacity=capacity, device=device, bytes_per_param=bytes_per_param, top_stacks=top_stacks)


def record(
    out: str | Path = "memlens_runs",
    *,
    steps: Iterable[int] | None = None,
    name: str | None = None,
    model: Any = None,
    optimizer: Any = None,
    device: str = "auto",
    capacity: int | str | None = None,
    allocator_settings: Any = None,
    max_entries: int = _RECORDER_MAX_ENTRIES,
    stacks: str = "python",
    context: str = "all",
    max_stack_depth: int = _RECORDER_MAX_STACK_DEPTH,
    dump_every: int | None = None,
    dump_keep: int = _RECORDER_DUMP_KEEP,
    record_optimizer_steps: bool = False,
    module_scopes: bool | int = True,
    clock: Callable[[], int] | None = None,
    filename_map: Callable[[str], str] | None = None,
    backend: Backend | None = None,
) -> Recorder:
    """Record a training loop's memory: see ``memlens.recorder.record``."""
    from memlens.recorder import record as _record

    return _record(
        out,
        steps=steps,
        name=name,
        model=model,
        optimizer=optimizer,
        device=device,
        capacity=capacity,
        allocator_settings=allocator_settings,
        max_entries=max_entries,
        stacks=stacks,
        context=context,
        max_stack_depth=max_stack_depth,
        dump_every=dump_every,
        dump_keep=dump_keep,
        record_optimizer_steps=record_optimizer_steps,
        module_scopes=module_scopes,
        clock=clock,
        filename_map=filename_map,
        backend=backend,
    )


def predict(
    fn: Callable[..., Any],
    *args: Any,
    capacity: int | str | None = None,
    gpu: str | None = None,
    reserve_outside: int | str = 0,
    settings: AllocatorSettings | None = None,
    stacks: bool = True,
    placeholder_values: bool = False,
    **kwargs: Any,
) -> PredictResult:
    """Predict a CUDA run's memory on the CPU: see ``memlens.predict.predict``.

    ``*args`` and ``**kwargs`` are ``fn``'s own arguments. ``import memlens.predict`` replaces
    this function with the (callable) subpackage, so both spellings call the same thing.
    """
    from memlens.predict import predict as _predict

    return _predict(
        fn,
        *args,
        capacity=capacity,
        gpu=gpu,
        reserve_outside=reserve_outside,
        settings=settings,
        stacks=stacks,
        placeholder_values=placeholder_values,
        **kwargs,
    )


def plan(
    command: Sequence[str],
    *,
    gpu: str | None = None,
    capacity: int | str | None = None,
    reserve_outside: int | str = 0,
    world_size: int | str = 1,
    tries: Sequence[str] = (),
    vary: Sequence[str] = (),
    maximum: str | None = None,
    out: str = "memlens_plan",
    jobs: int | None = None,
    stacks: bool = False,
    placeholder_values: bool = False,
    timeout_s: float = 900.0,
) -> PlanResult:
    """What fits, and the cheapest change that makes it fit: see ``memlens.plan.plan``.

    ``import memlens.plan`` replaces this function with the (callable) subpackage."""
    from memlens.plan import plan as _plan

    return _plan(
        command, gpu=gpu, capacity=capacity, reserve_outside=reserve_outside, world_size=world_size,
        tries=tries, vary=vary, maximum=maximum, out=out, jobs=jobs, stacks=stacks,
        placeholder_values=placeholder_values, timeout_s=timeout_s,
    )  # fmt: skip


def whatif(
    snapshot_or_path: Snapshot | str | Path,
    settings: AllocatorSettings | None = None,
    capacity: int | None = None,
    device: int | None = None,
    use_recorded_addresses: bool = True,
    observer: Observer | None = None,
    watch: Watch | None = None,
) -> WhatIfResult:
    """Replay a snapshot through the allocator simulator: see ``memlens.allocator.whatif``."""
    from memlens.allocator import whatif as _whatif

    return _whatif(
        snapshot_or_path,
        settings=settings,
        capacity=capacity,
        device=device,
        use_recorded_addresses=use_recorded_addresses,
        observer=observer,
        watch=watch,
    )


__getattr__, __dir__ = lazy_names(__name__, _HOMES)


__all__ = [
    "MemlensError",
    "MemlensFormatError",
    "MemlensOutOfMemory",
    "MemlensUsageError",
    "Snapshot",
    "__version__",
    "analyze",
    "budget",
    "load",
    "plan",
    "predict",
    "record",
    "whatif",
]
