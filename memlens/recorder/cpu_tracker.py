"""Recording without a GPU: every tensor storage a training loop creates, fed to the simulator.

How storages are seen
---------------------
A ``TorchDispatchMode`` sees the outputs of every aten op that runs while it is on the mode
stack, including the ops the autograd engine runs for ``backward()`` (the mode stack is part of
the thread-local state the engine carries into its work) and the optimizer's ops. Each output's
``untyped_storage()`` is one allocation: views share their base's storage object (PyTorch keeps
one Python object per live storage), so a storage is counted once however many views it has. A
``weakref.finalize`` on that storage object reports the free when the last view dies.

Why not the profiler's memory events (``profile_memory=True``)
---------------------------------------------------------------
- They arrive only after the profiler stops, so nothing can happen *at* the allocation: no
  simulated out-of-memory raised at the op that did not fit, no snapshot dumped at that moment.
- They carry no Python stack of their own (``with_stack`` attaches stacks to ops, and costs more
  than the whole dispatch mode).
- They see only real allocations: under ``FakeTensorMode``/meta there is no memory to report,
  while the dispatch mode still sees every storage and its size, so a model bigger than the
  machine can be sized.
The price: allocations that never become a tensor (kernel scratch space inside one op) are not
seen; CUDA's allocator would see cuBLAS workspaces. For training memory the tensors dominate.

Tensors alive before recording (parameters, buffers, gradients, optimizer state, anything
``gc`` can find) are malloc'd in the simulator with history off, so the snapshot shows them as
live blocks with no ``alloc`` event, exactly like a real CUDA snapshot whose history started
late.
"""

from __future__ import annotations

import gc
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memlens.allocator import AllocatorSettings, CachingAllocatorSimulator, SimulatedOOM
from memlens.recorder.stacks import StackCapture

OomHandler = Callable[[SimulatedOOM], None]

# Ops whose output aliases an input by schema but whose storage is new to us: ``torch.tensor``
# builds its data outside dispatch and then hands it through ``lift_fresh``.
_FRESH_ALIASING_OPS = frozenset({"aten::lift_fresh", "aten::lift_fresh_copy", "aten::lift"})


class StorageTracker:
    """Turns storage births and deaths into ``malloc``/``free`` calls on a simulator.

    Frees are queued by the finalizer and applied at the next op, step boundary or snapshot:
    a finalizer can fire in the middle of a simulator call (a garbage collection triggered by an
    allocation), and the simulator must not be re-entered.
    """

    def __init__(
        self,
        simulator: CachingAllocatorSimulator,
        stacks: StackCapture | None,
        on_oom: OomHandler | None = None,
    ) -> None:
        self.simulator = simulator
        self.stacks = stacks
        self.on_oom = on_oom
        self.active = False
        self._live: dict[int, int] = {}  # id(storage) -> simulated address
        self._finalizers: dict[int, weakref.finalize[Any, Any]] = {}
        self._pending: deque[tuple[int, int, list[dict[str, object]] | None]] = deque()
        self._aliasing: dict[Any, bool] = {}
        self._lock = threading.RLock()
        self.peak_allocated_bytes = 0
        self.free_stacks = True  # False: frees carry no stack (context "alloc" / "state")

    # ----------------------------------------------------------------- lifecycle
    def seed(self, tensors: Iterable[object]) -> int:
        """Malloc the storages of already-live tensors without history; returns how many."""
        simulator = self.simulator
        was_recording = simulator.record_history
        simulator.record_history = False
        count = 0
        try:
            for obj in tensors:
                if isinstance(obj, torch.Tensor) and self._register(obj, None) is not None:
                    count += 1
        finally:
            simulator.record_history = was_recording
        return count

    def close(self) -> None:
        """Stop tracking: drop every finalizer so nothing calls back into the simulator."""
        with self._lock:
            self.drain()
            self.active = False
            for finalizer in self._finalizers.values():
                finalizer.detach()
            self._finalizers.clear()
            self._live.clear()

    # ----------------------------------------------------------------- events
    def storage_address(self, storage: Any) -> tuple[int, int] | None:
        """(device 0, simulated address) of a live tracked storage, None for one not tracked: what
        ``memlens.recorder.roles.RoleRecorder`` notes tensors by."""
        address = self._live.get(id(storage))
        return None if address is None else (0, address)

    def drain(self) -> None:
        """Apply the frees the finalizers queued."""
        pending = self._pending
        if not pending:
            return
        with self._lock:
            live = self._live
            free = self.simulator.free
            while pending:
                key, address, frames = pending.popleft()
                if live.get(key) == address:
                    del live[key]
                    self._finalizers.pop(key, None)
                    free(address, frames)

    def on_outputs(self, func: Any, outputs: Any) -> None:
        """Register the new storages among an op's outputs."""
        self.drain()
        if isinstance(outputs, torch.Tensor):
            self._on_tensor(func, outputs)
        elif isinstance(outputs, tuple | list):
            for item in outputs:
                if isinstance(item, torch.Tensor):
                    self._on_tensor(func, item)
                elif isinstance(item, tuple | list):
                    for inner in item:
                        if isinstance(inner, torch.Tensor):
                            self._on_tensor(func, inner)

    def _on_tensor(self, func: Any, tensor: torch.Tensor) -> None:
        if tensor.layout is not torch.strided:
            return
        storage = tensor.untyped_storage()
        if id(storage) in self._live:
            return
        if self._returns_alias(func):
            # A view or in-place result of a storage we never saw born: it predates recording.
            self.seed((tensor,))
            return
        frames = self.stacks.capture(sys._getframe(1)) if self.stacks is not None else None
        self._register(tensor, frames)

    def _returns_alias(self, func: Any) -> bool:
        aliasing = self._aliasing.get(func)
        if aliasing is None:
            schema = getattr(func, "_schema", None)
            aliasing = bool(
                schema is not None
                and schema.name not in _FRESH_ALIASING_OPS
                and any(ret.alias_info is not None for ret in schema.returns)
            )
            self._aliasing[func] = aliasing
        return aliasing

    def _register(self, tensor: torch.Tensor, frames: list[dict[str, object]] | None) -> int | None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested, opaque subclasses
            return None
        return self._register_storage(storage, frames)

    def _register_storage(self, storage: Any, frames: list[dict[str, object]] | None) -> int | None:
        key = id(storage)
        if key in self._live:
            return None
        size = storage.nbytes()
        if size <= 0:
            return None  # the caching allocator hands out no block for an empty tensor
        with self._lock:
            try:
                address = self.simulator.malloc(size, 0, frames)
            except SimulatedOOM as oom:
                if self.on_oom is not None:
                    self.on_oom(oom)
                raise torch.OutOfMemoryError(
                    f"memlens: {oom} (while recording on the CPU against a simulated device)"
                ) from None
            allocated = self.simulator.allocated_bytes
            if allocated > self.peak_allocated_bytes:
                self.peak_allocated_bytes = allocated
            self._live[key] = address
            self._finalizers[key] = weakref.finalize(storage, self._on_storage_freed, key, address)
        return address

    def _on_storage_freed(self, key: int, address: int) -> None:
        frames = self.stacks.capture(sys._getframe(1)) if self.stacks is not None and self.free_stacks else None
        self._pending.append((key, address, frames))

    @property
    def live_storages(self) -> int:
        return len(self._live)


class TrackingMode(TorchDispatchMode):
    """The dispatch mode: runs every op, then shows its outputs to the tracker when active."""

    def __init__(self, tracker: StorageTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        outputs = func(*args, **(kwargs or {}))
        tracker = self.tracker
        if tracker.active:
            tracker.on_outputs(func, outputs)
        return outputs


def live_tensors(roots: Iterable[object] = ()) -> list[torch.Tensor]:
    """Tensors alive now: those reachable from ``roots`` (modules, optimizers, tensors) first,
    in a stable order, then every other tensor the garbage collector tracks."""
    found: list[torch.Tensor] = []
    for root in roots:
        if isinstance(root, torch.nn.Module):
            found.extend(root.parameters())
            found.extend(root.buffers())
            found.extend(p.grad for p in root.parameters() if p.grad is not None)
        elif isinstance(root, torch.optim.Optimizer):
            for group in root.param_groups:
                for param in group["params"]:
                    found.append(param)
                    if param.grad is not None:
                        found.append(param.grad)
            for state in root.state.values():
                found.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        elif isinstance(root, torch.Tensor):
            found.append(root)
    # type() rather than isinstance(): isinstance reads __class__, which deprecated module
    # attributes (torch.distributed.reduce_op) answer with a warning.
    tensor_type = torch.Tensor
    # Garbage first: a tensor kept only by an unreachable reference cycle (earlier code's, a test
    # process's) is no memory the program holds. Seeded, it would count as live when history
    # starts and then be "freed" inside the first step whenever the collector reached it, raising
    # the window's starting level (the peak at event 0) with memory the run never used.
    gc.collect()
    found.extend(obj for obj in gc.get_objects() if issubclass(type(obj), tensor_type))
    return found


class CpuSimulatedBackend:
    """Records on the CPU: tracker + caching-allocator simulator + step annotations."""

    kind = "cpu"

    def __init__(
        self,
        capacity: int | None = None,
        settings: AllocatorSettings | None = None,
        clock: Callable[[], int] | None = None,
        stacks: StackCapture | None = None,
        max_entries: int | None = None,
        roots: Iterable[object] = (),
        context: str = "all",
    ) -> None:
        self.clock = clock if clock is not None else monotonic_epoch_clock()
        self.settings = settings or AllocatorSettings()
        self.capacity = capacity
        self.max_entries = max_entries
        self.simulator = CachingAllocatorSimulator(
            settings=self.settings, capacity=capacity, device=0, record_history=False, clock=self.clock
        )
        self.tracker = StorageTracker(self.simulator, stacks)
        # PyTorch's context= options: "all" stacks on allocations and frees, "alloc" on
        # allocations only, "state" on the live blocks only (the trace entries carry none).
        self.context = context
        self.tracker.free_stacks = context == "all"
        self.mode = TrackingMode(self.tracker)
        self._roots = list(roots)
        self._annotations: list[dict[str, Any]] = []
        # (trace index where the step starts, its user_metadata); "" after a step ends.
        self._metadata_marks: list[tuple[int, str]] = []
        self._installed = False

    def add_root(self, root: object) -> None:
        """A model, optimizer or tensor whose tensors come first among the seeded live blocks
        (kept only until history starts; later ones are already tracked)."""
        if not self.tracker.active:
            self._roots.append(root)

    # ------------------------------------------------------------- backend protocol
    def install(self) -> None:
        self.mode.__enter__()
        self._installed = True

    def uninstall(self) -> None:
        self.tracker.close()
        if self._installed:
            self._installed = False
            self.mode.__exit__(None, None, None)

    def start_history(self) -> None:
        tracker = self.tracker
        tracker.seed(live_tensors(self._roots))
        self._roots = []  # do not keep the user's model alive through us
        self.simulator.record_history = True
        tracker.active = True

    def stop_history(self, in_oom_callback: bool = False) -> None:
        self.tracker.drain()
        self.simulator.record_history = False
        self.tracker.close()

    def set_oom_handler(self, handler: Callable[[dict[str, Any]], None]) -> None:
        def on_oom(oom: SimulatedOOM) -> None:
            handler({"device": 0, "requested": oom.requested, "device_free": oom.device_free})

        self.tracker.on_oom = on_oom

    def begin_step(self, index: int, provisional: bool = False) -> int:
        return self._annotate(f"memlens.step#{index}", "START")

    def cancel_step(self, index: int) -> None:
        """Forget a step that was begun but turned out not to be one (see Recorder.start)."""
        name = f"memlens.step#{index}"
        if self._annotations and self._annotations[-1]["name"] == name:
            self._annotations.pop()
        if self._metadata_marks and self._metadata_marks[-1][1] == name:
            self._metadata_marks.pop()

    def end_step(self, index: int) -> int:
        return self._annotate(f"memlens.step#{index}", "END")

    def _annotate(self, name: str, stage: str) -> int:
        self.tracker.drain()
        time_us = self.clock()
        self._annotations.append({"name": name, "stage": stage, "device": 0, "time_us": time_us})
        self._metadata_marks.append((len(self.simulator.trace), name if stage == "START" else ""))
        return time_us

    def snapshot(self) -> dict[str, Any]:
        self.tracker.drain()
        snapshot = self.simulator.snapshot()
        trace = snapshot["device_traces"][0]
        _apply_user_metadata(trace, self._metadata_marks)
        if self.max_entries is not None and len(trace) > self.max_entries:
            del trace[: len(trace) - self.max_entries]  # a ring buffer keeps the newest entries
        if self.context == "state":
            for entry in trace:
                entry["frames"] = []
        snapshot["external_annotations"] = list(self._annotations)
        return snapshot

    def device_info(self) -> dict[str, Any]:
        return {
            "type": "cpu",
            "index": 0,
            "name": "cpu (memlens simulated caching allocator)",
            "total_memory_bytes": self.capacity,
            "simulated": True,
        }

    def allocator_settings(self) -> dict[str, Any]:
        return self.settings.to_snapshot_dict()

    def now(self) -> int:
        """The trace's clock, after the queued frees are applied (so they come before it)."""
        self.tracker.drain()
        return self.clock()

    def storage_address(self, storage: Any) -> tuple[int, int] | None:
        """(device, simulated address) of a tracked storage, None for one never tracked."""
        return self.tracker.storage_address(storage)

    def peak_bytes(self) -> tuple[int, int]:
        return self.tracker.peak_allocated_bytes, self.simulator.peak_reserved_bytes


def _apply_user_metadata(trace: list[dict[str, Any]], marks: list[tuple[int, str]]) -> None:
    """Stamp each entry with the step name in force when it was recorded (CUDA's
    ``_set_memory_metadata`` semantics: a string attached to every later entry)."""
    range_start, name_in_force = 0, ""
    for boundary, name in [*marks, (len(trace), "")]:
        for index in range(range_start, boundary):
            trace[index]["user_metadata"] = name_in_force
        range_start, name_in_force = max(range_start, boundary), name


def monotonic_epoch_clock() -> Callable[[], int]:
    """Microseconds since the epoch, strictly increasing, so step boundaries order exactly."""
    import time

    last = 0

    def clock() -> int:
        nonlocal last
        now = time.time_ns() // 1000
        last = now if now > last else last + 1
        return last

    return clock


__all__ = ["CpuSimulatedBackend", "StorageTracker", "TrackingMode", "live_tensors"]
