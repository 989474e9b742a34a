"""DistributedDataParallel on the simulated process group: one rank of N, from one process.

DDP's memory is its C++ reducer's: the gradient buckets, one flat tensor per bucket (all the
parameters in one bucket at first; from the second iteration on, rebuilt in the order the
gradients became ready, a first bucket of 1 MiB then ``bucket_cap_mb``, 25 MiB by default), into
which each gradient is copied for the allreduce (with ``gradient_as_bucket_view=True`` the
gradients are views of them instead). The reducer runs unchanged here, so its buckets are
allocated, rebuilt and freed on the simulated device as a real run's are. What one process on
fake tensors lacks of a real job is supplied, and nothing else:

- the collectives' results: PyTorch's fake process group completes every collective with a
  future holding None, where a real backend's holds the collective's tensors, which the reducer
  reads when it finalizes a bucket (and a comm hook as ``fut.value()[0]``). Each collective's
  Work is replaced by a completed one whose future holds its tensors (``collective_op_hook``).
- the reducer's bookkeeping on the CPU: rebuilding its buckets, it writes the new bucket
  assignment into CPU tensors through their data and broadcasts it from rank 0. Inside
  ``Reducer._rebuild_buckets`` those CPU tensors are real (an int per parameter); every device
  tensor stays simulated.
- the check that every rank has the same parameter shapes (``_verify_params_across_processes``)
  reads what the other ranks sent, which one rank cannot: its device tensors (a long per rank,
  two per parameter dimension) are allocated and freed as the check does, without comparing.
- DDP's runtime statistics (``Logger.set_runtime_stats_and_log``, logging only) time iterations
  with CUDA events, through a timer the reducer makes for real CUDA devices: skipped.

Not supported: ``find_unused_parameters=True`` and ``static_graph=True``. With either, the reducer
copies its map of used parameters to the device through a pinned host buffer it allocates
directly (``at::native::empty_like(..., pinned_memory=true)``, past the dispatcher, so nothing
here can stand in for it), which needs a real accelerator; DDP built so stops with one line
saying so (``UNSUPPORTED``), not with the reducer's internal assert.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch

from memlens.errors import MemlensUsageError

UNSUPPORTED = (
    "DistributedDataParallel with {option}=True is not supported at --world-size: its reducer copies the map of "
    "used parameters through pinned host memory, which needs a real GPU (the default find_unused_parameters=False "
    "and static_graph=False are)"
)


class _RealCpuTensors:
    """Where the reducer's CPU bookkeeping runs on real tensors: the thread, while it rebuilds."""

    def __init__(self) -> None:
        self.thread: int | None = None


_REAL_CPU = _RealCpuTensors()


def _creates_a_cpu_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A factory op (no tensor among its arguments) whose result is on the CPU."""
    if any(isinstance(arg, torch.Tensor) for arg in args):
        return False
    device = kwargs.get("device")
    return device is None or torch.device(device).type == "cpu"


def collective_op_hook(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The session's op hook for DDP (``PredictSession.op_hooks``): a ``c10d`` collective returns
    a completed Work whose future holds its tensors; inside the reducer's bucket rebuild, a CPU
    tensor made from nothing is a real one. Every other op: NotImplemented (run as usual)."""
    if _REAL_CPU.thread == threading.get_ident() and _creates_a_cpu_tensor(args, kwargs):
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            return func(*args, **kwargs)
    if getattr(func, "namespace", None) != "c10d":
        return NotImplemented
    outputs = func(*args, **kwargs)
    if not (isinstance(outputs, tuple) and len(outputs) == 2 and isinstance(outputs[1], torch.ScriptObject)):
        return outputs
    tensors = outputs[0]
    future: torch.futures.Future[Any] = torch.futures.Future()
    future.set_result(tensors if isinstance(tensors, list) else [tensors])
    work = torch._C._distributed_c10d._create_work_from_future(future)  # type: ignore[attr-defined]
    return tensors, work.boxed()


def _verify_params_across_processes(process_group: Any, tensors: list[torch.Tensor], logger: Any = None) -> None:
    """``dist._verify_params_across_processes`` as it uses the device (reducer.cpp): the
    parameter count and its gathered copies, one per rank, and the shapes' metadata (two longs a
    dimension), freed when it returns."""
    if not tensors:
        return
    device = tensors[0].device
    count = torch.empty(1, dtype=torch.long, device=device)  # at::tensor({count}) on the device
    gathered = [torch.empty_like(count) for _ in range(process_group.size())]
    metadata = torch.empty(sum(2 * t.dim() for t in tensors), dtype=torch.long, device=device)
    del count, gathered, metadata


def install_ddp_support() -> Callable[[], None]:
    """Patch what DDP needs of one simulated rank (see the module's text); returns the undo.
    ``collective_op_hook`` must be in the session's ``op_hooks`` as well."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import Logger, Reducer

    original_rebuild = Reducer._rebuild_buckets

    def rebuild_buckets(reducer: Any) -> bool:
        previous, _REAL_CPU.thread = _REAL_CPU.thread, threading.get_ident()
        try:
            return bool(original_rebuild(reducer))
        finally:
            _REAL_CPU.thread = previous

    def skip_runtime_stats(logger: Any) -> None:
        return None

    from torch.nn.parallel import DistributedDataParallel

    original_init = DistributedDataParallel.__init__
    signature = inspect.signature(original_init)

    def init(ddp: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(ddp, *args, **kwargs)
        for option in ("find_unused_parameters", "static_graph"):
            if bound.arguments.get(option):
                raise MemlensUsageError(UNSUPPORTED.format(option=option))
        original_init(ddp, *args, **kwargs)

    def set_static_graph(ddp: Any) -> None:
        raise MemlensUsageError(UNSUPPORTED.format(option="static_graph"))

    saved: list[tuple[Any, str, Any]] = []
    for owner, name, value in ((Reducer, "_rebuild_buckets", rebuild_buckets),
                               (Logger, "set_runtime_stats_and_log", skip_runtime_stats),
                               (DistributedDataParallel, "__init__", init),
                               (DistributedDataParallel, "_set_static_graph", set_static_graph),
                               (dist, "_verify_params_across_processes", _verify_params_across_processes)):  # fmt: skip
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def undo() -> None:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)

    return undo
