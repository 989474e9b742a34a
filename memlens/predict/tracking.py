"""What the simulated GPU sees: CUDA storages born and freed, and the cuBLAS workspaces.

The fake CUDA tensors come from ``FakeTensorMode`` (meta storage, exact sizes). A dispatch mode
above it (``PredictMode``) sees every aten op the program, the autograd engine and the optimizer
run, exactly as the recorder's ``TrackingMode`` does on the CPU; the recorder's
``StorageTracker`` turns the new *CUDA* storages among the outputs into ``malloc`` calls and
their finalizers into ``free`` calls. CPU tensors (also fake, so a model built on the CPU first
costs nothing) are not on the GPU and are not counted.

One allocation that is no tensor is modelled: cuBLAS takes a workspace from the caching
allocator the first time a handle runs a GEMM, one per handle, i.e. one per thread that runs
matmuls (the forward on the main thread, the backward on autograd's device thread), and keeps
it for the life of the process. It is allocated after the op's output, as in the real kernel.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from memlens.allocator import CachingAllocatorSimulator
from memlens.predict.sharding import local_tensors
from memlens.recorder.cpu_tracker import StorageTracker
from memlens.recorder.stacks import StackCapture

_PREDICT_DIR = os.path.dirname(os.path.abspath(__file__))
# The tracker's own frames (recorder) and ours sit between the op and the user's code.
_OWN_DIRS = (_PREDICT_DIR, os.path.dirname(os.path.abspath(sys.modules[StorageTracker.__module__].__file__ or "")))
# Frames that are not the user's code: torch, memlens, the standard library.
_NOT_USER_DIRS = tuple(
    folder + os.sep
    for folder in (
        os.path.dirname(os.path.abspath(torch.__file__)),
        os.path.dirname(_PREDICT_DIR),
        os.path.dirname(os.path.abspath(os.__file__)),
    )
)
# Forward nodes whose line is kept for a backward OOM: a bound on what a long run accumulates
# (a step of a large model makes a few thousand nodes; older ones' graphs are long gone).
MAX_FORWARD_LINES = 1 << 18

_aten = torch.ops.aten
# Ops whose CUDA kernels call cuBLAS (and so take the calling thread's handle and workspace).
CUBLAS_OPS = frozenset(
    {
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        _aten.addbmm.default,
        _aten.addmv.default,
        _aten.mv.default,
        _aten.dot.default,
        _aten.vdot.default,
        _aten._addmm_activation.default,
    }
)


_is_user_code: dict[Any, bool] = {}


def user_location(frame: FrameType | None) -> str | None:
    """``file:line`` of the innermost frame at or outward of ``frame`` that is the user's code
    (not torch, memlens or the standard library, not ``<frozen ...>``); None if none is. Cheap
    enough to run per operator: the verdict is cached per code object."""
    while frame is not None:
        code = frame.f_code
        verdict = _is_user_code.get(code)
        if verdict is None:
            filename = code.co_filename
            verdict = not filename.startswith("<") and not os.path.abspath(filename).startswith(_NOT_USER_DIRS)
            _is_user_code[code] = verdict
        if verdict:
            return f"{code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return None


class PredictStackCapture(StackCapture):
    """Python stacks that start in the user's code: this package's frames are left out."""

    def capture(self, start: FrameType | None = None) -> list[dict[str, object]]:
        frame: FrameType | None = start if start is not None else sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(_OWN_DIRS):
            frame = frame.f_back
        return super().capture(frame)


# The innermost frame of a cuBLAS workspace's allocation, as a CUDA recording with C++ stacks
# shows it (aten/src/ATen/cuda/CublasHandlePool.cpp): the analysis knows a workspace by it
# (memlens.analysis.stacks.is_workspace_frame), also the one taken on autograd's thread, which has
# no Python frame.
WORKSPACE_FRAME: dict[str, object] = {
    "filename": "aten/src/ATen/cuda/CublasHandlePool.cpp", "line": 0, "name": "at::cuda::getNewWorkspace()",
}


class CudaStorageTracker(StorageTracker):
    """The recorder's tracker, restricted to storages on the (simulated) CUDA device, keeping
    whole-run peaks that ``torch.cuda.reset_peak_memory_stats`` does not touch."""

    def __init__(self, simulator: CachingAllocatorSimulator, stacks: StackCapture | None) -> None:
        super().__init__(simulator, stacks)
        self.run_peak_reserved_bytes = 0
        self.workspace_threads: dict[int, int] = {}  # thread id -> workspace address
        self.allocating_workspace = False
        self.on_malloc: Callable[[], None] | None = None
        # Storages outside the caching allocator (``outside_allocator``), by id while they live.
        self._outside_storages: set[int] = set()
        # CUDA storages resized to 0 bytes (FSDP2's freed all-gather outputs), by id while they
        # live: resized back, they take a block again.
        self._resized_to_nothing: set[int] = set()
        self._outside_depth = 0

    def _on_tensor(self, func: Any, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cuda":
            return
        shards = local_tensors(tensor)
        if shards is not None:  # a DTensor: the rank holds its local tensor, not the global one
            for shard in shards:
                self._on_tensor(func, shard)
            return
        outside = self._outside_storages
        if self._outside_depth or outside:
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in outside:
                return  # an op on memory outside the allocator (a fill, a view): still outside
            if self._outside_depth:
                outside.add(key)
                weakref.finalize(storage, outside.discard, key)
                return
        super()._on_tensor(func, tensor)

    @contextlib.contextmanager
    def outside_allocator(self) -> Iterator[None]:
        """The CUDA storages made in this block are not the caching allocator's (CUDA managed
        memory, as bitsandbytes' paged optimizers take it): never counted, nor freed into it."""
        self._outside_depth += 1
        try:
            yield
        finally:
            self._outside_depth -= 1

    def _register_storage(self, storage: Any, frames: list[dict[str, object]] | None) -> int | None:
        address = super()._register_storage(storage, frames)
        if address is not None:
            self._after_malloc()
        return address

    def storage_resized(self, storage: torch.UntypedStorage) -> None:
        """``storage`` was resized in place (FSDP2 frees and refills its all-gathered parameters
        so: ``memlens.predict.sharding``): as CUDA's resize does, a block of the new size is
        taken, then the old one goes back to the allocator."""
        self.drain()
        key = id(storage)
        if key not in self._live and key not in self._resized_to_nothing:
            return  # not a CUDA storage this tracker holds (a CPU one, or one made empty)
        with self._lock:
            address = self._live.pop(key, None)
            finalizer = self._finalizers.pop(key, None)
        if finalizer is not None:
            finalizer.detach()
        frames = self.stacks.capture(sys._getframe(1)) if self.stacks is not None else None
        if storage.nbytes() > 0:
            self._resized_to_nothing.discard(key)
            self._register_storage(storage, frames)
        elif key not in self._resized_to_nothing:
            self._resized_to_nothing.add(key)
            weakref.finalize(storage, self._resized_to_nothing.discard, key)
        if address is not None:
            with self._lock:
                self.simulator.free(address, frames if self.free_stacks else None)

    def _after_malloc(self) -> None:
        reserved = self.simulator.reserved_bytes
        if reserved > self.run_peak_reserved_bytes:
            self.run_peak_reserved_bytes = reserved

    def transfer_allocation(self, source: torch.Tensor, target: torch.Tensor) -> bool:
        """Let ``target``'s new storage take over ``source``'s block instead of allocating one
        (what an in-place op on the GPU does where the fake run had to go out of place)."""
        self.drain()
        source_storage, target_storage = source.untyped_storage(), target.untyped_storage()
        if source_storage.nbytes() != target_storage.nbytes() or id(target_storage) in self._live:
            return False
        with self._lock:
            address = self._live.pop(id(source_storage), None)
            if address is None:
                return False
            finalizer = self._finalizers.pop(id(source_storage), None)
            if finalizer is not None:
                finalizer.detach()
            key = id(target_storage)
            self._live[key] = address
            self._finalizers[key] = weakref.finalize(target_storage, self._on_storage_freed, key, address)
        return True

    def allocate_workspace(self, size: int) -> None:
        """Malloc this thread's cuBLAS workspace if it has none yet (never freed, like PyTorch's)."""
        thread = threading.get_ident()
        if thread in self.workspace_threads or size <= 0:
            return
        python_frames = self.stacks.capture(sys._getframe(1)) if self.stacks is not None else []
        frames = [WORKSPACE_FRAME, *python_frames]
        self.allocating_workspace = True  # what an OOM now was asking for
        try:
            with self._lock:
                self.workspace_threads[thread] = self._malloc_raw(size, frames)
        finally:
            self.allocating_workspace = False
        self._after_malloc()

    def _malloc_raw(self, size: int, frames: list[dict[str, object]] | None) -> int:
        from memlens.allocator import SimulatedOOM

        try:
            address = self.simulator.malloc(size, 0, frames)
        except SimulatedOOM as oom:
            if self.on_oom is not None:
                self.on_oom(oom)
            raise torch.OutOfMemoryError(f"memlens: {oom} (cuBLAS workspace, simulated device)") from None
        allocated = self.simulator.allocated_bytes
        if allocated > self.peak_allocated_bytes:
            self.peak_allocated_bytes = allocated
        return address


def _next_sequence_nr() -> int:
    """The number autograd gives the next node made on this thread."""
    return int(torch._C._autograd._get_sequence_nr())


class MissingFakeKernel(Exception):
    """An operator the fake tensors cannot run: a custom CUDA/Triton kernel with no meta (fake)
    implementation, which is the only way to know its outputs' shapes without running it."""

    def __init__(self, func: Any) -> None:
        self.func = func
        super().__init__(f"operator {func} has no meta (fake) implementation")


# What PyTorch says when an operator has no kernel for fake/meta tensors.
_NO_FAKE_KERNEL_MESSAGES = ("no fake impl", "'Meta' backend", "meta kernel", "no meta", "Meta tensor")


def _is_missing_fake_kernel(error: BaseException) -> bool:
    from torch._subclasses.fake_tensor import UnsupportedOperatorException

    if isinstance(error, UnsupportedOperatorException):
        return True
    message = str(error)
    return any(text in message for text in _NO_FAKE_KERNEL_MESSAGES)


class EmulatedDeviceFakeMode(FakeTensorMode):
    """``FakeTensorMode`` that knows the CUDA device is emulated, whatever ``torch.cuda`` says.

    Fake tensors of one element keep a real CPU copy (their "constant", so ``.item()`` works),
    and the mode runs an op on those copies when every input has one, unless the op moves them to
    a device that does not exist (``avoid_device_init``, read from ``torch.cuda.is_available()``).
    The session makes that answer True, so ``torch.tensor(3).to("cuda")`` (BatchNorm's
    ``num_batches_tracked``, transformers' cache) ran for real, on a CUDA backend a CPU build
    does not have (and on a real GPU would have put memory there). The emulated device never
    exists for real: this mode always avoids it, which also makes ``torch.tensor(...,
    device="cuda")`` build its data on the CPU and move a fake, as PyTorch does with no GPU."""

    @property
    def avoid_device_init(self) -> bool:
        return True


class OptimizerSteps:
    """The run's training steps, marked as ``memlens record`` marks a script it cannot change: step
    0 begins when the run does, every ``optimizer.step()`` ends one and begins the next, and what
    follows the last is the script's tail, not a step, unless an error ends the run inside it
    (then that step is kept, open to the end). ``steps`` are the recorder's ``{index, start_us,
    end_us}`` (the sidecar's, and what the leak-holder search reads); ``annotations`` the
    ``memlens.step#N`` START/END edges the analysis finds steps by."""

    def __init__(self, now: Callable[[], int]) -> None:
        self._now = now  # the trace's clock, after the queued frees
        self.steps: list[dict[str, Any]] = []
        self.annotations: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None

    def begin(self) -> None:
        index = len(self.steps)
        self._open = {"index": index, "start_us": self._edge(index, "START"), "end_us": None}
        self.steps.append(self._open)

    def mark(self) -> None:
        """An ``optimizer.step()`` returned: the open step ends and the next begins."""
        if self._open is not None:
            self._open["end_us"] = self._edge(self._open["index"], "END")
        self.begin()

    def finish(self, failed: bool) -> None:
        """The run ended: an error's step ends here; a completed run's tail is dropped."""
        open_step, self._open = self._open, None
        if open_step is None:
            return
        if failed:
            open_step["end_us"] = self._edge(open_step["index"], "END")
            return
        self.steps.remove(open_step)
        name = f"memlens.step#{open_step['index']}"
        self.annotations[:] = [edge for edge in self.annotations if edge["name"] != name]

    def _edge(self, index: int, stage: str) -> int:
        time_us = self._now()
        self.annotations.append({"name": f"memlens.step#{index}", "stage": stage, "device": 0, "time_us": time_us})
        return time_us


class PredictMode(TorchDispatchMode):
    """Runs each op (on the fake tensors below it) and shows its CUDA outputs to the tracker."""

    def __init__(self, tracker: CudaStorageTracker, workspace_bytes: int) -> None:
        super().__init__()
        self.tracker = tracker
        self.workspace_bytes = workspace_bytes
        self.op_hook: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any] | None = None
        # The op whose outputs are being sized now (what an OOM names).
        self.current_op: Any = None
        # The thread the program runs its forward on, and the user's line of each autograd node
        # it made, by the node's sequence number (``forward_line``).
        self.forward_thread = threading.get_ident()
        self._forward_lines: dict[int, str | None] = {}
        self._next_sequence_nr = _next_sequence_nr()

    def forward_line(self, node: Any) -> str | None:
        """The user's line whose forward made the autograd ``node`` (None if not seen)."""
        try:
            return self._forward_lines.get(int(node._sequence_nr()))
        except (AttributeError, RuntimeError, TypeError):
            return None

    def _note_forward_line(self) -> None:
        """Autograd makes an op's backward node, numbering it from a per-thread counter, just
        before the op reaches this mode: when the counter moved since the last op, node number
        ``counter - 1`` belongs to this op, and the user's line is where it was called."""
        sequence_nr = _next_sequence_nr()
        if sequence_nr == self._next_sequence_nr:
            return
        self._next_sequence_nr = sequence_nr
        lines = self._forward_lines
        lines[sequence_nr - 1] = user_location(sys._getframe(2))
        if len(lines) > MAX_FORWARD_LINES:
            del lines[next(iter(lines))]  # the oldest node (numbers only grow)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if threading.get_ident() == self.forward_thread:
            self._note_forward_line()
        self.current_op = func
        hook = self.op_hook
        if hook is not None:
            replaced = hook(func, args, kwargs)
            if replaced is not NotImplemented:
                return replaced
        try:
            outputs = func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as error:
            if _is_missing_fake_kernel(error):
                raise MissingFakeKernel(func) from error
            raise
        tracker = self.tracker
        tracker.on_outputs(func, outputs)
        if func in CUBLAS_OPS and isinstance(outputs, torch.Tensor) and outputs.device.type == "cuda":
            tracker.allocate_workspace(self.workspace_bytes)
        return outputs


__all__ = [
    "CUBLAS_OPS",
    "CudaStorageTracker",
    "EmulatedDeviceFakeMode",
    "MissingFakeKernel",
    "OptimizerSteps",
    "PredictMode",
    "PredictStackCapture",
    "user_location",
]
