"""A prediction: the user's code runs on the CPU as if a CUDA GPU were there.

``PredictSession`` is the context in which that holds: fake CUDA tensors (``FakeTensorMode``;
exact shapes, dtypes, strides and aliasing, no memory, no compute), every CUDA storage sent
through the caching-allocator simulator, ``torch.cuda`` answering from the simulator, and the
choices PyTorch makes per device (autocast on ``cuda``, foreach optimizers, cuBLAS workspaces)
made as on the named GPU. ``predict(fn)`` runs a function in one and returns a
``PredictResult``; ``memlens predict -- python train.py`` runs a script in one.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import msgspec
import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)

from memlens.allocator import AllocatorSettings, CachingAllocatorSimulator, SimulatedOOM
from memlens.predict.bnb import EmulatedBitsandbytes
from memlens.predict.cuda_api import CudaApi
from memlens.predict.gpus import (
    DEFAULT_GPU,
    GpuSpec,
    checked_reserve,
    cublas_workspace_bytes,
    gpu_spec,
    with_capacity,
)
from memlens.predict.guard import check_autograd_sees_cuda, ensure_cuda_guard
from memlens.predict.sdpa import fused_sdpa
from memlens.predict.sharding import (
    fake_data_setter_patch,
    fsdp1_patches,
    model_parameter_counts,
    pin_memory_op_hook,
    record_stream_patch,
    storage_released,
    storage_resize_patch,
)
from memlens.predict.tracking import (
    CudaStorageTracker,
    EmulatedDeviceFakeMode,
    MissingFakeKernel,
    OptimizerSteps,
    PredictMode,
    PredictStackCapture,
)
from memlens.predict.tracking import user_location as frame_location
from memlens.recorder.cpu_tracker import monotonic_epoch_clock
from memlens.recorder.model_inspection import ModelInspector
from memlens.recorder.roles import (
    RoleRecorder,
    find_model,
    forward_inputs,
    forward_outputs,
    model_state,
    retained_graph_tensors,
)

_MEMLENS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__))

DATA_DEPENDENT_ERRORS = (DataDependentOutputException, DynamicOutputShapeException)


@dataclass
class PredictResult:
    """What a prediction found. Peaks are whole-run, in the allocator's rounded block sizes
    (what ``torch.cuda.max_memory_allocated``/``max_memory_reserved`` report)."""

    gpu: str
    capacity_bytes: int
    reserve_outside_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    oom: bool
    oom_at: str | None = None
    # The OOM's circumstances: the op whose output did not fit, its request (rounded, bytes),
    # and, when the backward pass ran out, the forward line whose gradient it was computing
    # (``oom_at`` is then the line that called backward).
    oom_op: str | None = None
    oom_requested_bytes: int | None = None
    oom_in_backward: bool = False
    oom_forward_at: str | None = None
    stopped_at: str | None = None
    stop_reason: str | None = None
    snapshots: list[str] = field(default_factory=list)
    model: dict[str, Any] | None = None
    optimizer: dict[str, Any] | None = None
    placeholder_values: int = 0
    first_placeholder_at: str | None = None
    # Each line whose GPU values stood in, with how many, in the order first met.
    placeholder_sites: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    error_traceback: str | None = field(default=None, repr=False)
    # "terminated" (SIGTERM) or "interrupted" (Ctrl-C): the run was stopped from outside.
    interrupted: str | None = None
    # Whether the program put anything on the (simulated) GPU at all.
    used_cuda: bool = True
    seconds: float = 0.0
    value: Any = None
    snapshot: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def completed(self) -> bool:
        return not self.oom and self.stopped_at is None and self.error is None and self.interrupted is None

    @property
    def fits(self) -> bool:
        """The whole program ran within the capacity: the one outcome that answers "it fits". A
        program that never put anything on the GPU answers nothing about it, so claims no fit."""
        return self.completed and self.used_cuda

    def record(self) -> PredictRecord:
        """The result as its JSON form's struct (``memlens predict --json``, the MCP predict tool)."""
        return PredictRecord(
            self.peak_allocated_bytes, self.peak_reserved_bytes, self.oom, list(self.snapshots), self.oom_at,
            self.oom_op, self.oom_requested_bytes, self.oom_in_backward, self.oom_forward_at, self.fits,
            self.interrupted, self.used_cuda, self.stopped_at, self.stop_reason, self.error, self.gpu,
            self.placeholder_values, self.first_placeholder_at, self.model, self.optimizer, self.capacity_bytes,
            self.reserve_outside_bytes, round(self.seconds, 3), dict(self.placeholder_sites))

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.record())


class PredictRecord(msgspec.Struct, frozen=True):
    """The JSON form of a ``PredictResult``."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    oom: bool
    snapshots: list[str]
    oom_at: str | None
    oom_op: str | None
    oom_requested_bytes: int | None
    oom_in_backward: bool
    oom_forward_at: str | None
    fits: bool  # the whole program ran within the capacity
    interrupted: str | None
    used_cuda: bool
    stopped_at: str | None
    stop_reason: str | None
    error: str | None
    gpu: str
    placeholder_values: int
    first_placeholder_at: str | None
    model: dict[str, Any] | None  # the recorder's model stats (memlens.recorder.model_inspection.model_stats)
    optimizer: dict[str, Any] | None
    capacity_bytes: int
    reserve_outside_bytes: int
    seconds: float
    placeholder_sites: dict[str, int] = {}  # "file:line" -> values that stood in there


def user_location(tb: TracebackType | None) -> str | None:
    """``file:line`` of the innermost frame that is the user's code (not torch, memlens or
    the standard library), from a traceback; None if there is none."""
    found = None
    for frame_summary in traceback.extract_tb(tb):
        filename = os.path.abspath(frame_summary.filename)
        if filename.startswith((_TORCH_DIR, _MEMLENS_DIR, _STDLIB_DIR)) or frame_summary.filename.startswith("<"):
            continue
        found = f"{frame_summary.filename}:{frame_summary.lineno}"
    return found


class PredictSession:
    """Enter to make ``cuda`` a simulated device in this process; exit to restore everything."""

    def __init__(
        self,
        gpu: str | GpuSpec | None = None,
        capacity: int | None = None,
        reserve_outside: int = 0,
        settings: AllocatorSettings | None = None,
        stacks: bool = True,
        placeholder_values: bool = False,
    ) -> None:
        spec = gpu if isinstance(gpu, GpuSpec) else gpu_spec(gpu or DEFAULT_GPU)
        if capacity is not None:
            spec = with_capacity(spec, capacity)
        checked_reserve(spec, reserve_outside)  # in the user's units: "... is more than the 79.14 GiB board"
        self.gpu = spec
        self.reserve_outside = reserve_outside
        self.capacity = spec.total_memory - reserve_outside
        if settings is None:
            settings = AllocatorSettings.from_alloc_conf(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
        self.settings = settings
        self._clock = monotonic_epoch_clock()
        self.simulator = CachingAllocatorSimulator(
            settings=settings, capacity=self.capacity, device=0, record_history=True, clock=self._clock
        )
        self.tracker = CudaStorageTracker(self.simulator, PredictStackCapture() if stacks else None)
        # What each tensor is, as the recorder notes it (``memlens.recorder.roles``): the model
        # and optimizer are found at the first optimizer.step() as ``memlens record`` finds them.
        self.roles = RoleRecorder(self.tracker.storage_address)
        self._models: list[weakref.ref[Any]] = []
        self._optimizers: list[weakref.ref[Any]] = []
        self._hooks: list[Any] = []
        # What the recorder's sidecar says of a run, found the recorder's way: the steps (one per
        # optimizer.step()), the model's shapes from its forward calls, and who holds a leak
        # (asked at the end, while the script's objects are still alive).
        self.steps = OptimizerSteps(self.now)
        self.model_inspector: ModelInspector | None = None
        self.leak_holders: dict[str, Any] | None = None
        self.tracker.active = True
        self.tracker.on_oom = self._on_oom
        self.bitsandbytes = EmulatedBitsandbytes(self.tracker.outside_allocator)
        self.workspace_bytes = cublas_workspace_bytes(spec, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
        self.snapshot_paths: list[str] = []
        self.placeholder_values = placeholder_values
        self.placeholders_used = 0
        self.first_placeholder_at: str | None = None
        self.placeholder_sites: dict[str, int] = {}
        self.oom_seen = False
        self.oom_at: str | None = None
        self.oom_message: str | None = None
        self.oom_op: str | None = None
        self.oom_requested_bytes: int | None = None
        self.oom_in_backward = False
        self.oom_forward_at: str | None = None
        self._script_history_start: int | None = None
        self._script_max_entries: int | None = None
        self._fake_mode: FakeTensorMode | None = None
        self._mode: PredictMode | None = None
        self._saved: list[tuple[Any, str, Any]] = []
        self._thread = threading.get_ident()
        # Asked first about every op (``func, args, kwargs``); what one returns other than
        # NotImplemented is the op's result (the plan's simulated process group: ``memlens.plan.ddp``;
        # pinned host memory: ``memlens.predict.sharding.pin_memory_op_hook``).
        self.op_hooks: list[Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]] = [pin_memory_op_hook]

    # ------------------------------------------------------------------ enter / exit
    def __enter__(self) -> PredictSession:
        ensure_cuda_guard()
        check_autograd_sees_cuda()  # before anything is tracked: the probe is not the script's memory
        self._thread = threading.get_ident()
        # Before patching: building the mode imports torch._dynamo, which indexes torch.cuda.
        self._fake_mode = EmulatedDeviceFakeMode(allow_non_fake_inputs=True)
        self._patch_all()
        self._mode = PredictMode(self.tracker, self.workspace_bytes)
        self._mode.op_hook = self._op_hook
        self._mode.forward_thread = self._thread
        self._fake_mode.__enter__()
        self._mode.__enter__()
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._hooks += [
            register_optimizer_step_pre_hook(self._before_optimizer_step),
            register_optimizer_step_post_hook(self._after_optimizer_step),
        ]
        self.steps.begin()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
            if self._fake_mode is not None:
                self._fake_mode.__exit__(None, None, None)
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            self.tracker.drain()
            self._unpatch_all()

    def close(self) -> None:
        """Detach the finalizers (after the snapshot is taken): nothing calls back later."""
        self.tracker.close()

    def _patch_all(self) -> None:
        patches = CudaApi(self).patches()
        patches.append((torch.utils, "swap_tensors", _swap_fake_tensors(torch.utils.swap_tensors)))
        patches.append(storage_resize_patch(self.tracker))
        patches.append(fake_data_setter_patch())
        patches.append(record_stream_patch())
        patches += fsdp1_patches()
        patches += _skipped_initialisers()
        patches.append(_grad_scaler_step_patch())
        functional = torch.nn.functional
        patches.append(
            (functional, "scaled_dot_product_attention", fused_sdpa(self.gpu, functional.scaled_dot_product_attention))
        )
        for owner, name, value in patches:
            self._saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
            setattr(owner, name, value)
        # Foreach/fused optimizer defaults look at type(p): FakeTensor parameters must count as
        # plain tensors, so the default is the one a real CUDA run makes (foreach).
        import torch.optim.optimizer as optimizer_module

        supported = optimizer_module._foreach_supported_types
        if FakeTensor not in supported:
            supported.append(FakeTensor)
            self._saved.append((supported, "__list__", FakeTensor))
        self.bitsandbytes.install()

    def _unpatch_all(self) -> None:
        self.bitsandbytes.uninstall()
        for owner, name, value in reversed(self._saved):
            if name == "__list__":
                if value in owner:
                    owner.remove(value)
            elif value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self._saved.clear()

    # ------------------------------------------------------------------ roles
    def now(self) -> int:
        """The trace's clock, after the queued frees (so they come before it)."""
        self.tracker.drain()
        return self._clock()

    def _watched(self, refs: list[weakref.ref[Any]]) -> list[Any]:
        return [obj for obj in (ref() for ref in refs) if obj is not None]

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not any(ref() is optimizer for ref in self._optimizers):
            self._optimizers.append(weakref.ref(optimizer))
            model = find_model(optimizer)
            if model is not None and not any(ref() is model for ref in self._models):
                self._models.append(weakref.ref(model))
                self.model_inspector = ModelInspector(model)
                self._hooks.append(model.register_forward_pre_hook(self._on_model_inputs, with_kwargs=True))
                self._hooks.append(model.register_forward_hook(self._on_model_outputs))
        self.note_roles("optimizer.pre", self.now())

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.note_roles("optimizer.post", self.now())
        self.steps.mark()

    def _on_model_inputs(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.model_inspector is not None:
            self.model_inspector.on_inputs(module, args, kwargs)
        self.roles.note("forward", self.now(), {"inputs": forward_inputs(args, kwargs)})

    def _on_model_outputs(self, module: Any, args: Any, output: Any) -> None:
        if self.model_inspector is not None:
            self.model_inspector.on_outputs(module, output)
        self.roles.note("forward.end", self.now(), {"outputs": forward_outputs(output)})

    def note_roles(
        self, at: str, time_us: int | None, graphs: bool = False, parameters: list[torch.Tensor] | None = None
    ) -> None:
        """Note the watched model's and optimizer's tensors by role; at the end of the run
        (``graphs``, ``time_us`` None) also what live autograd graphs hold, and ``parameters``:
        every CUDA parameter still alive, whoever holds it (a model no optimizer trains)."""
        self.tracker.drain()
        state = model_state(self._watched(self._models), self._watched(self._optimizers))
        if parameters:
            state["parameters"] = [*state["parameters"], *parameters]
        if graphs:
            state["graph"] = retained_graph_tensors()
        self.roles.note(at, time_us, state)

    # ------------------------------------------------------------------ op hook
    def _op_hook(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        for hook in self.op_hooks:
            replaced = hook(func, args, kwargs)
            if replaced is not NotImplemented:
                return replaced
        if func is torch.ops.aten._local_scalar_dense.default and self.placeholder_values:
            return self._placeholder(args[0])
        if threading.get_ident() != self._thread and (
            func is torch.ops.aten.add.Tensor or func.overloadpacket in _SCATTER_INTO_FRESH_OPS
        ):
            return self._in_place_on_the_gpu(func, args, kwargs)
        return NotImplemented

    def _placeholder(self, tensor: torch.Tensor) -> bool | int | float | complex:
        """A stand-in for a value the simulated GPU does not hold (``.item()``, ``bool(t)``,
        ``tolist``): NaN for floating point, so a check on it fails loudly rather than quietly
        ending a loop early; 0 for integers; False for booleans."""
        self.placeholders_used += 1
        where = frame_location(sys._getframe(1))
        # Counted per line of the script, so each .item() that stood in is told where it is.
        site = where or "?"
        self.placeholder_sites[site] = self.placeholder_sites.get(site, 0) + 1
        if self.first_placeholder_at is None:
            self.first_placeholder_at = where
        if tensor.dtype == torch.bool:
            return False
        if tensor.dtype.is_complex:
            return complex(float("nan"), float("nan"))
        if tensor.dtype.is_floating_point:
            return float("nan")
        return 0

    def _in_place_on_the_gpu(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Where the backward pass works in place on a real GPU but out of place on fakes.

        A FakeTensor is a tensor subclass, and PyTorch's backward code takes the out-of-place
        road for subclasses: autograd's ``InputBuffer`` sums two gradients with ``old + new``
        instead of ``old.add_(new)``, and the backward formulas fill fresh zeros with
        ``scatter``/``index_put``/``slice_scatter`` instead of their in-place forms. Each would
        allocate a block the GPU never does. On the backward thread, without grad mode, when the
        first operand is a CUDA tensor that nothing else holds (no Python reference beyond this
        call's, and no other tensor on its storage: no more than a fresh tensor's), the result
        takes over its block, as the in-place op would."""
        if torch.is_grad_enabled() or kwargs.get("alpha", 1) != 1 or not args:
            return NotImplemented
        old = args[0]
        if func is torch.ops.aten.add.Tensor:
            new = args[1] if len(args) > 1 else None
            if not (isinstance(new, torch.Tensor) and new.shape == getattr(old, "shape", None)):
                return NotImplemented
        if not (
            isinstance(old, FakeTensor)
            and old.device.type == "cuda"
            and old.is_contiguous()
            and old.storage_offset() == 0
        ):
            return NotImplemented
        # Held from Python too (a variable, a list): the GPU's op would leave it alone as well.
        # Here: the args tuple, ``old``, getrefcount's argument and the C++ owner's reference.
        if sys.getrefcount(old) > _REFERENCES_OF_AN_UNHELD_ARGUMENT:
            return NotImplemented
        old_references = torch._C._storage_Use_Count(old.untyped_storage()._cdata)
        result = func(*args, **kwargs)
        fresh_references = torch._C._storage_Use_Count(result.untyped_storage()._cdata)
        if (
            isinstance(result, torch.Tensor)
            and result.dtype == old.dtype
            and old_references <= fresh_references
            and self.tracker.transfer_allocation(old, result)
        ):
            return result
        self.tracker.on_outputs(func, result)
        return result

    # ------------------------------------------------------------------ allocator state
    def allocator_state(self) -> dict[str, int]:
        self.tracker.drain()
        simulator = self.simulator
        return {
            "allocated": simulator.allocated_bytes,
            "peak_allocated": simulator.peak_allocated_bytes,
            "reserved": simulator.reserved_bytes,
            "peak_reserved": simulator.peak_reserved_bytes,
            "requested": simulator.requested_bytes,
        }

    def reset_peaks(self) -> None:
        self.tracker.drain()
        self.simulator.peak_allocated_bytes = self.simulator.allocated_bytes
        self.simulator.peak_reserved_bytes = self.simulator.reserved_bytes

    def empty_cache(self) -> None:
        self.tracker.drain()
        with self.tracker._lock:
            self.simulator.empty_cache(self._frames())

    def _frames(self) -> list[dict[str, object]] | None:
        stacks = self.tracker.stacks
        return stacks.capture(sys._getframe(1)) if stacks is not None else None

    def _on_oom(self, oom: SimulatedOOM) -> None:
        """Where the simulated device ran out. In the forward pass, the user's innermost line on
        this thread's stack. The backward pass runs on autograd's device thread, whose stack
        holds no user code: there the line is the one that called backward (the program's
        thread, waiting in it), and the forward line is that of the node being run."""
        self.oom_seen = True
        self.oom_message = str(oom)
        self.oom_requested_bytes = oom.rounded
        mode = self._mode
        op = mode.current_op if mode is not None else None
        self.oom_op = str(op) if op is not None else None
        if self.oom_op is not None and self.tracker.allocating_workspace:
            self.oom_op += "'s cuBLAS workspace"
        if threading.get_ident() == self._thread:
            self.oom_at = frame_location(sys._getframe(1))
            return
        self.oom_in_backward = True
        self.oom_at = frame_location(sys._current_frames().get(self._thread))
        node = torch._C._current_autograd_node()
        if node is not None and mode is not None:
            self.oom_forward_at = mode.forward_line(node)
            self.oom_op = self.oom_op or type(node).__name__

    # ------------------------------------------------------------------ snapshots
    def start_script_history(self, max_entries: int | None) -> None:
        self.tracker.drain()
        self._script_history_start = len(self.simulator.trace)
        self._script_max_entries = max_entries

    def stop_script_history(self) -> None:
        self._script_history_start = None

    def script_snapshot(self) -> dict[str, Any]:
        """The snapshot the script asked for: every live block, and the trace since it started
        recording (none if it is not recording, as CUDA's would be)."""
        self.tracker.drain()
        snapshot = self.simulator.snapshot()
        trace = snapshot["device_traces"][0]
        start = self._script_history_start
        if start is None:
            del trace[:]
        else:
            del trace[:start]
            limit = self._script_max_entries
            if limit is not None and len(trace) > limit:
                del trace[: len(trace) - limit]  # CUDA's history is a ring buffer
        return snapshot

    def full_snapshot(self) -> dict[str, Any]:
        """The whole run: every allocation since the session began, the live blocks, and the
        steps' edges."""
        self.tracker.drain()
        snapshot = self.simulator.snapshot()
        snapshot["external_annotations"] = list(self.steps.annotations)
        return snapshot

    def find_leak_holders(self, snapshot: dict[str, Any]) -> None:
        """Who holds the blocks that outlive their step (``memlens.recorder.holders``, the
        recorder's search, over the fake tensors): asked before ``close``, while the tracker still
        knows every storage's address and the script's objects are alive."""
        from memlens.recorder.holders import leak_holders

        self.leak_holders = msgspec.to_builtins(leak_holders(snapshot, self.steps.steps, self))


_MISSING = object()

_aten = torch.ops.aten
_REFERENCES_OF_AN_UNHELD_ARGUMENT = 4
# Out-of-place ops that backward formulas use on a fresh tensor of zeros only for subclasses
# (``isTensorSubclassLike``); on the GPU they are the in-place forms.
_SCATTER_INTO_FRESH_OPS = frozenset(
    {
        _aten.scatter,
        _aten.scatter_add,
        _aten.scatter_reduce,
        _aten.index_add,
        _aten.index_put,
        _aten._index_put_impl,
        _aten.index_copy,
        _aten.index_fill,
        _aten.masked_fill,
        _aten.masked_scatter,
        _aten.slice_scatter,
        _aten.select_scatter,
        _aten.diagonal_scatter,
        _aten.as_strided_scatter,
    }
)


def _grad_scaler_step_patch() -> tuple[Any, str, Any]:
    """``GradScaler`` takes the optimizer's step only when its found-inf flags sum to zero, read
    with ``.item()``: values the simulated GPU does not hold (a NaN placeholder would skip every
    step, and the optimizer's state would never be allocated). The step is taken, as a run takes
    it at every step without an overflow: the memory of a stepped iteration, which is what fits or
    not (a real fp16 run may skip its first steps while the scale settles)."""
    from torch.amp.grad_scaler import GradScaler

    def _maybe_opt_step(self: Any, optimizer: Any, optimizer_state: Any, *args: Any, **kwargs: Any) -> Any:
        return optimizer.step(*args, **kwargs)

    return GradScaler, "_maybe_opt_step", _maybe_opt_step


def _swap_fake_tensors(original: Callable[[torch.Tensor, torch.Tensor], None]) -> Callable[..., None]:
    """``Module.to('cuda')`` swaps FakeTensor parameters, which the fake-tensor memo's weak
    references forbid; do what a real CUDA run does instead (``param.data = new``), keeping
    the same Parameter object so optimizers built earlier still hold it."""

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        try:
            original(t1, t2)
        except RuntimeError:
            if not (isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor)):
                raise
            with torch.no_grad():
                t1.data = t2
            t1.fake_device = t2.fake_device

    return swap_tensors


def _skipped_initialisers() -> list[tuple[Any, str, Any]]:
    """``torch.nn.init``'s in-place initialisers return the tensor untouched: values do not
    matter to memory, and some (``trunc_normal_``) read values, which fake tensors do not hold."""

    def skip(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor

    names = [
        name
        for name in dir(torch.nn.init)
        if name.endswith("_") and not name.startswith("_") and callable(getattr(torch.nn.init, name))
    ]
    return [(torch.nn.init, name, skip) for name in names]


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
    """Run ``fn(*args, **kwargs)`` on a simulated CUDA GPU and say how much memory it needs.

    ``capacity`` (bytes or ``"80GiB"``) sets the device memory; ``gpu`` names one of
    ``memlens.predict.GPUS`` (default ``a100-80gb``); ``reserve_outside`` is memory outside
    PyTorch's allocator (CUDA context, NCCL) taken off the capacity. An out-of-memory error
    and an operation that needs a real value end the run and are reported, not raised; any
    other exception propagates. ``placeholder_values=True`` lets ``.item()`` and friends go on
    with a stand-in (NaN, 0, False), counted in the result.
    """
    from memlens.units import parse_bytes

    session = PredictSession(
        gpu=gpu,
        capacity=parse_bytes(capacity) if capacity is not None else None,
        reserve_outside=parse_bytes(reserve_outside),
        settings=settings,
        stacks=stacks,
        placeholder_values=placeholder_values,
    )
    return run_in_session(session, lambda: fn(*args, **kwargs))


class ProgramExit(Exception):
    """The program called ``sys.exit`` with a failure status (``memlens predict`` raises it for
    the script's ``SystemExit``): the prediction ends there, as a result."""

    def __init__(self, code: object) -> None:
        super().__init__(f"the script exited with status {code}" if isinstance(code, int) else str(code))
        self.code = code


def run_in_session(session: PredictSession, body: Callable[[], Any], capture_errors: bool = False) -> PredictResult:
    """Run ``body`` inside ``session`` and turn what happened into a ``PredictResult``.

    Every way the program ends is a result with the figures up to that point: it completed, the
    simulated device ran out of memory (in the forward or the backward pass), it needed a real
    value, or an operator had no fake kernel. ``capture_errors`` (``memlens predict``): also an
    exception of the program's own, kept in ``error``/``error_traceback``, and SIGTERM / Ctrl-C
    (``Terminated``, ``KeyboardInterrupt``: ``interrupted``), instead of propagating."""
    from memlens.recorder.session import Terminated

    started = time.perf_counter()
    value = None
    stopped_at = stop_reason = error = error_traceback = interrupted = None
    model = optimizer = None
    # The exception that ended the program: its traceback holds the program's frames, so what
    # they hold (the model, the optimizer) is still alive at the end, as in ``memlens record``.
    ended_by: list[BaseException] = []
    try:
        with session:
            try:
                value = body()
            except torch.OutOfMemoryError as oom:
                if not session.oom_seen:
                    raise  # the script's own OutOfMemoryError, not the simulator's
                ended_by.append(oom)
            except DATA_DEPENDENT_ERRORS as data_dependent:
                ended_by.append(data_dependent)
                stopped_at = user_location(data_dependent.__traceback__)
                stop_reason = (
                    f"needs a real value ({_op_name(data_dependent)}): tensors on the simulated GPU hold no data; "
                    "compute it on the CPU, take it out of the predicted run, or let a placeholder stand "
                    "in (--placeholder-values)"
                )
            except (MissingFakeKernel, UnsupportedOperatorException) as missing:
                ended_by.append(missing)
                stopped_at = user_location(missing.__traceback__)
                stop_reason = (
                    f"operator {missing.func} has no meta (fake) implementation, so its outputs cannot be "
                    "sized without running it: register one (torch.library.register_fake) for a custom "
                    "CUDA/Triton kernel"
                )
            except (Terminated, KeyboardInterrupt) as stop:
                if not capture_errors:
                    raise
                ended_by.append(stop)
                interrupted = "interrupted" if isinstance(stop, KeyboardInterrupt) else "terminated"
                stopped_at = user_location(stop.__traceback__)
            except ProgramExit as stop:  # sys.exit(status): no traceback, as python shows none
                ended_by.append(stop)
                location = user_location((stop.__context__ or stop).__traceback__)  # the SystemExit's
                error = f"{stop}" + (f" (at {location})" if location else "")
            except Exception as failure:
                if not capture_errors:
                    raise
                ended_by.append(failure)
                location = user_location(failure.__traceback__)
                error = f"{type(failure).__name__}: {failure}" + (f" (at {location})" if location else "")
                error_traceback = "".join(traceback.format_exception(failure))
            parameters = live_cuda_parameters()  # one scan of the heap for both
            model, optimizer = simulated_model_and_optimizer(parameters)
            session.steps.finish(failed=bool(ended_by))
            session.note_roles("dump", None, graphs=True, parameters=parameters)
        snapshot = session.full_snapshot()
        session.find_leak_holders(snapshot)
    finally:
        ended_by.clear()
        session.close()
    return PredictResult(
        gpu=session.gpu.name,
        capacity_bytes=session.capacity,
        reserve_outside_bytes=session.reserve_outside,
        peak_allocated_bytes=session.tracker.peak_allocated_bytes,
        peak_reserved_bytes=session.tracker.run_peak_reserved_bytes,
        oom=session.oom_seen or session.simulator.oom_count > 0,
        oom_at=session.oom_at,
        oom_op=session.oom_op,
        oom_requested_bytes=session.oom_requested_bytes,
        oom_in_backward=session.oom_in_backward,
        oom_forward_at=session.oom_forward_at,
        stopped_at=stopped_at,
        stop_reason=stop_reason,
        snapshots=list(session.snapshot_paths),
        model=model,
        optimizer=optimizer,
        placeholder_values=session.placeholders_used,
        first_placeholder_at=session.first_placeholder_at,
        placeholder_sites=dict(session.placeholder_sites),
        error=error,
        error_traceback=error_traceback,
        interrupted=interrupted,
        used_cuda=bool(session.simulator.trace) or session.oom_seen,
        seconds=time.perf_counter() - started,
        value=value,
        snapshot=snapshot,
    )


def live_cuda_parameters() -> list[torch.Tensor]:
    """Every ``nn.Parameter`` on the simulated GPU still alive (found by the garbage collector).

    type() first: isinstance reads __class__, which deprecated module attributes
    (torch.distributed.reduce_op) answer with a warning. A parameter made from a FakeTensor is a
    FakeTensor marked ``_is_param`` (what isinstance(x, nn.Parameter) looks at). FSDP2's
    unsharded parameters between all-gathers are left out: their storage is released and the
    parameter is its sharded ``DTensor`` (counting both counted the model twice)."""
    tensor_type = torch.Tensor
    found = {
        id(obj): obj
        for obj in gc.get_objects()
        if issubclass(type(obj), tensor_type)
        and isinstance(obj, torch.nn.Parameter)
        and obj.device.type == "cuda"
        and not storage_released(obj)
    }
    return list(found.values())


def simulated_model_and_optimizer(
    parameters_alive: list[torch.Tensor] | None = None,
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The parameters on the simulated GPU that are still alive (the recorder's ``model`` stats:
    counts and bytes by dtype), and the optimizer holding most of them: what the budget needs.
    Found by the garbage collector at the end of the run, so a model that lived only in a
    function's locals is gone by then (None)."""
    from memlens.recorder.model_inspection import optimizer_stats

    if parameters_alive is None:
        parameters_alive = live_cuda_parameters()
    parameters = {id(param): param for param in parameters_alive}
    optimizer_type = torch.optim.Optimizer
    if not parameters:
        return None, None
    total = trainable = total_bytes = 0
    by_dtype: dict[str, int] = {}
    for param, count in model_parameter_counts(list(parameters.values())):
        size = count * param.element_size()
        total += count
        trainable += count if param.requires_grad else 0
        total_bytes += size
        by_dtype[str(param.dtype)] = by_dtype.get(str(param.dtype), 0) + size
    model = {
        "parameters_total": total,
        "parameters_trainable": trainable,
        "parameter_bytes_total": total_bytes,
        "parameter_bytes_by_dtype": dict(sorted(by_dtype.items())),
        "buffer_bytes_total": 0,
    }
    optimizers = [obj for obj in gc.get_objects() if issubclass(type(obj), optimizer_type)]
    best = max(
        optimizers,
        key=lambda o: sum(1 for group in o.param_groups for p in group["params"] if id(p) in parameters),
        default=None,
    )
    return model, optimizer_stats(best)


def _op_name(error: BaseException) -> str:
    func = getattr(error, "func", None)
    return str(func) if func is not None else type(error).__name__


__all__ = ["PredictResult", "PredictSession", "predict", "run_in_session", "user_location"]
