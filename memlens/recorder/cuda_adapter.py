"""Recording on a CUDA device: every CUDA call the recorder makes goes through ``CudaMemoryBackend``.

``CudaMemoryBackend`` is a thin adapter over ``torch.cuda.memory`` (history, snapshot, memory
metadata, peak counters), ``torch.cuda`` (device properties) and ``torch._C`` (the
out-of-memory observer). Each of the three can be replaced by a stand-in with the same method
names, which is how the tests exercise this path on machines without a GPU.

``CudaBackend`` is the recorder's CUDA backend built on it: history on/off, step boundaries as
``torch.profiler.record_function("memlens.step#N")`` scopes (PyTorch writes them into
``external_annotations``) plus ``_set_memory_metadata("memlens.step#N")`` where the running torch
has it, so every trace entry also carries its step in ``user_metadata``.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

OomObserver = Callable[[int, int, int, int], None]  # (device, requested, device_allocated, device_free)


class CudaMemoryBackend:
    """The only place the recorder touches CUDA.

    PyTorch has no call that removes an out-of-memory observer, so ``detach_oom_observer``
    disarms ours: it stays registered but does nothing.
    """

    def __init__(self, memory: Any = None, cuda: Any = None, c_api: Any = None) -> None:
        if memory is None or cuda is None or c_api is None:
            import torch

            memory = memory if memory is not None else torch.cuda.memory
            cuda = cuda if cuda is not None else torch.cuda
            c_api = c_api if c_api is not None else torch._C
        self._memory = memory
        self._cuda = cuda
        self._c_api = c_api
        self._observer: OomObserver | None = None
        self._observer_registered = False
        self._saved_fraction: tuple[int, float] | None = None  # (device, fraction) to restore
        self.recording = False

    def start(self, max_entries: int, stacks: str = "python", context: str = "all") -> None:
        """``_record_memory_history``: alloc/free/segment events, with stacks unless ``stacks="none"``.

        PyTorch's own check accepts ``stacks`` "python" or "all" only; whether a traceback is
        taken at all is its ``context`` argument. So memlens' ``stacks="none"`` is
        ``context=None`` (no traceback on any entry, the history itself still recorded) with
        ``stacks="python"`` (the value PyTorch ignores when there is no context).
        """
        if stacks not in ("python", "all", "none"):
            raise ValueError(f"stacks must be 'python', 'all' or 'none', got {stacks!r}")
        if context not in ("all", "alloc", "state"):
            raise ValueError(f"context must be 'all', 'alloc' or 'state', got {context!r}")
        kwargs: dict[str, Any] = {
            "context": None if stacks == "none" else context,
            "stacks": "python" if stacks == "none" else stacks,
            "max_entries": int(max_entries),
        }
        if _accepts(self._memory._record_memory_history, "global_record_annotations"):
            # record_function scopes reach external_annotations without a profiler running.
            kwargs["global_record_annotations"] = True
        self._memory._record_memory_history("all", **kwargs)
        self.recording = True

    def stop(self) -> None:
        self._memory._record_memory_history(None)
        self.recording = False

    def snapshot(self) -> dict[str, Any]:
        """``_snapshot()``, the dictionary ``_dump_snapshot`` pickles.

        The recorder writes the file itself rather than calling ``_dump_snapshot(filename)``:
        it adds its step annotations first, pickles with protocol 4 (the web viewer's) and
        writes atomically (``_dump_snapshot`` opens the final name and writes into it).
        """
        snapshot = self._memory._snapshot()
        return snapshot if isinstance(snapshot, dict) else {"segments": snapshot, "device_traces": []}

    def attach_oom_observer(self, callback: OomObserver) -> None:
        self._observer = callback
        if not self._observer_registered:
            self._c_api._cuda_attach_out_of_memory_observer(self._on_oom)
            self._observer_registered = True

    def detach_oom_observer(self) -> None:
        self._observer = None

    def _on_oom(self, device: int, requested: int, device_allocated: int, device_free: int) -> None:
        if self._observer is not None:
            self._observer(device, requested, device_allocated, device_free)

    def set_metadata(self, text: str) -> bool:
        """``_set_memory_metadata`` where this torch has it; False where it does not."""
        setter = getattr(self._memory, "_set_memory_metadata", None)
        if setter is None:
            return False
        setter(text)
        return True

    def current_device(self) -> int:
        return int(self._cuda.current_device())

    def device_properties(self) -> dict[str, Any]:
        index = self.current_device()
        props = self._cuda.get_device_properties(index)
        return {
            "type": "cuda",
            "index": index,
            "name": str(props.name),
            "total_memory_bytes": int(props.total_memory),
            "compute_capability": f"{props.major}.{props.minor}",
            "simulated": False,
        }

    def peak_bytes(self) -> tuple[int, int]:
        return int(self._memory.max_memory_allocated()), int(self._memory.max_memory_reserved())

    def limit_capacity(self, capacity: int) -> None:
        """Cap this process's caching allocator at ``capacity`` bytes (a memory fraction).

        ``restore_capacity`` puts back the fraction in force before: read with
        ``get_per_process_memory_fraction`` where this torch has it, else 1.0 (PyTorch's
        default; older versions have no getter, so a fraction set by the script itself before
        recording began is not known and becomes 1.0 again).
        """
        index = self.current_device()
        if self._saved_fraction is None:
            getter = getattr(self._cuda, "get_per_process_memory_fraction", None)
            self._saved_fraction = (index, float(getter(index)) if getter is not None else 1.0)
        total = int(self._cuda.get_device_properties(index).total_memory)
        self._cuda.set_per_process_memory_fraction(min(1.0, float(capacity) / total), index)

    def restore_capacity(self) -> None:
        """Undo ``limit_capacity`` (nothing to do when it was not called)."""
        if self._saved_fraction is None:
            return
        index, fraction = self._saved_fraction
        self._saved_fraction = None
        self._cuda.set_per_process_memory_fraction(fraction, index)

    def reset_peak(self) -> None:
        self._memory.reset_peak_memory_stats()

    def outside_pytorch(self) -> dict[str, int] | None:
        """Device memory in use beyond what PyTorch's caching allocator holds, now.

        ``mem_get_info`` (cudaMemGetInfo) counts every byte in use on the device: this
        process's CUDA context, NCCL's buffers, cuBLAS/cuDNN workspaces allocated outside the
        caching allocator, and other processes on the same GPU. ``memory_reserved`` is what the
        caching allocator holds. The difference is the memory a snapshot cannot show. None where
        this torch (or a stand-in) lacks either call.
        """
        mem_get_info = getattr(self._cuda, "mem_get_info", None)
        memory_reserved = getattr(self._memory, "memory_reserved", None)
        if mem_get_info is None or memory_reserved is None:
            return None
        index = self.current_device()
        free, total = mem_get_info(index)
        used = int(total) - int(free)
        reserved = int(memory_reserved(index))
        return {
            "device": index,
            "device_used_bytes": used,
            "reserved_bytes": reserved,
            "outside_pytorch_bytes": max(0, used - reserved),
        }


def _accepts(function: Any, parameter: str) -> bool:
    try:
        return parameter in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


class CudaBackend:
    """The recorder's backend for a real GPU (see the module docstring)."""

    kind = "cuda"

    def __init__(
        self,
        adapter: CudaMemoryBackend | None = None,
        max_entries: int = 200_000,
        stacks: str = "python",
        clock: Callable[[], int] | None = None,
        capacity: int | None = None,
        context: str = "all",
    ) -> None:
        self.adapter = adapter if adapter is not None else CudaMemoryBackend()
        self.max_entries = max_entries
        self.stacks = stacks
        self.context = context
        self.capacity = capacity  # a per-process cap for the session only (see install/uninstall)
        self.clock = clock if clock is not None else (lambda: time.time_ns() // 1000)
        self._scopes: dict[int, Any] = {}
        self._oom_handler: Callable[[Any], None] | None = None
        self._stop_pending = False

    def install(self) -> None:
        self.adapter.reset_peak()
        if self.capacity is not None:
            self.adapter.limit_capacity(self.capacity)

    def uninstall(self) -> None:
        self.adapter.detach_oom_observer()
        for scope in self._scopes.values():
            scope.__exit__(None, None, None)
        self._scopes.clear()
        try:
            if self.adapter.recording:
                self.adapter.stop()
        finally:
            # The cap was the session's: the rest of the process gets its memory back.
            self.adapter.restore_capacity()

    def start_history(self) -> None:
        self.adapter.start(self.max_entries, self.stacks, self.context)
        if self._oom_handler is not None:
            self.adapter.attach_oom_observer(self._on_oom)

    def stop_history(self, in_oom_callback: bool = False) -> None:
        self.adapter.detach_oom_observer()
        self.adapter.set_metadata("")
        if in_oom_callback:
            # Turning history off takes the allocator's locks; inside its OOM path that is not
            # safe, so the session stops it at the next step boundary or on exit.
            self._stop_pending = True
        elif self.adapter.recording:
            self.adapter.stop()

    def set_oom_handler(self, handler: Callable[[Any], None]) -> None:
        self._oom_handler = handler

    def _on_oom(self, device: int, requested: int, device_allocated: int, device_free: int) -> None:
        if self._oom_handler is not None:
            self._oom_handler({"device": device, "requested": requested, "device_free": device_free})

    def begin_step(self, index: int, provisional: bool = False) -> int:
        if provisional:
            # Step 0 opened on entering the session may be cancelled; its annotations are added
            # to the snapshot at dump time only if it turns out to be a step.
            return self.clock()
        from torch.profiler import record_function

        name = f"memlens.step#{index}"
        scope = record_function(name)
        scope.__enter__()
        self._scopes[index] = scope
        self.adapter.set_metadata(name)
        return self.clock()

    def cancel_step(self, index: int) -> None:
        """Close a step that turned out not to be one; the session drops its annotations."""
        scope = self._scopes.pop(index, None)
        if scope is not None:  # a provisional step opened no scope and set no metadata
            scope.__exit__(None, None, None)
            self.adapter.set_metadata("")

    def end_step(self, index: int) -> int:
        scope = self._scopes.pop(index, None)
        if scope is not None:
            scope.__exit__(None, None, None)
        self.adapter.set_metadata("")
        if self._stop_pending and self.adapter.recording:
            self.adapter.stop()
        return self.clock()

    def snapshot(self) -> dict[str, Any]:
        return self.adapter.snapshot()

    def device_info(self) -> dict[str, Any]:
        return self.adapter.device_properties()

    def allocator_settings(self) -> dict[str, Any]:
        return {}  # the snapshot itself carries them (PyTorch >= 2.3)

    def now(self) -> int:
        return self.clock()

    def outside_pytorch(self) -> dict[str, int] | None:
        """At a step boundary: device memory used outside PyTorch's allocator (see the adapter)."""
        return self.adapter.outside_pytorch()

    def storage_address(self, storage: Any) -> tuple[int, int] | None:
        from memlens.recorder.roles import cuda_address_of

        return cuda_address_of(storage)

    def peak_bytes(self) -> tuple[int, int]:
        return self.adapter.peak_bytes()


__all__ = ["CudaBackend", "CudaMemoryBackend"]
