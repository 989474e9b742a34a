"""``torch.cuda`` as a script sees it during a prediction: answers from the simulator.

Each function mirrors the real one's signature closely enough for training scripts; memory
figures come from the caching-allocator simulator (the numbers a real run's allocator keeps),
so ``torch.cuda.max_memory_allocated()`` in the user's own script prints the prediction.
"""

from __future__ import annotations

import contextlib
import pickle
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from memlens.allocator import CachingAllocatorSimulator
    from memlens.predict.gpus import GpuSpec
    from memlens.predict.tracking import CudaStorageTracker


# A CUDA generator's state as torch.cuda.get_rng_state returns it: Philox's seed and offset,
# 8 bytes each (c10/cuda/CUDAGeneratorImpl.cpp, get_state).
PHILOX_STATE_BYTES = 16


class EmulatedDevice(Protocol):
    """What the patched ``torch.cuda`` reads and asks of the device it emulates: a prediction's
    session (``memlens.predict.session.PredictSession``) is one. Declared here, by its user, so
    this module needs nothing of the session's."""

    gpu: GpuSpec
    reserve_outside: int
    simulator: CachingAllocatorSimulator
    tracker: CudaStorageTracker
    snapshot_paths: list[str]

    def allocator_state(self) -> dict[str, int]: ...

    def reset_peaks(self) -> None: ...

    def empty_cache(self) -> None: ...

    def start_script_history(self, max_entries: int | None) -> None: ...

    def stop_script_history(self) -> None: ...

    def script_snapshot(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class SimulatedDeviceProperties:
    """The fields of ``torch.cuda.get_device_properties`` scripts read."""

    name: str
    total_memory: int
    major: int
    minor: int
    multi_processor_count: int
    is_integrated: bool = False
    is_multi_gpu_board: bool = False
    L2_cache_size: int = 50 * 1024 * 1024
    warp_size: int = 32
    uuid: str = "00000000-0000-0000-0000-000000000000"

    def __repr__(self) -> str:
        return (
            f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
            f"total_memory={self.total_memory // (1 << 20)}MB, multi_processor_count={self.multi_processor_count}, "
            "simulated=True)"
        )


class SimulatedStream:
    """``torch.cuda.Stream``: everything runs in order on the CPU, so waits are no-ops."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.device = torch.device("cuda", 0)
        self.priority = priority
        self.cuda_stream = 0
        self.stream_id = 0

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> SimulatedEvent:
        event = event if event is not None else SimulatedEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SimulatedStream)

    def __hash__(self) -> int:
        return 0

    def __enter__(self) -> SimulatedStream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class SimulatedEvent:
    """``torch.cuda.Event``: recorded and complete at once; no kernel takes time here."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


class SimulatedDevice:
    """``torch.cuda.device(i)`` as a context manager: there is only device 0."""

    def __init__(self, device: Any) -> None:
        self.idx = 0

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _noop() -> Any:
    """A fresh do-nothing function per name (dynamo indexes torch.cuda by object identity)."""

    def noop(*args: Any, **kwargs: Any) -> None:
        return None

    return noop


class CudaApi:
    """The functions patched into ``torch.cuda`` and ``torch.cuda.memory`` for one session."""

    def __init__(self, session: EmulatedDevice) -> None:
        self.session = session
        self._default_stream = SimulatedStream()

    # ------------------------------------------------------------------ device
    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def set_device(self, device: Any) -> None:
        return None

    def get_device_name(self, device: Any = None) -> str:
        return self.session.gpu.name

    def get_device_capability(self, device: Any = None) -> tuple[int, int]:
        return self.session.gpu.capability

    def get_device_properties(self, device: Any = None) -> SimulatedDeviceProperties:
        gpu = self.session.gpu
        return SimulatedDeviceProperties(gpu.name, gpu.total_memory, gpu.major, gpu.minor, gpu.multi_processor_count)

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        return self.session.gpu.major >= 8 or including_emulation

    def is_initialized(self) -> bool:
        return True

    # ------------------------------------------------------------------ random state
    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        """A CUDA generator's state as torch returns it: a CPU byte tensor (Philox: the seed and
        the offset, 8 bytes each), nothing on the device. ``torch.random.fork_rng`` takes it (a
        pipeline schedule's first step, checkpointing's ``preserve_rng_state``); the simulated
        device draws no random values, so the state is a constant."""
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            return torch.zeros(PHILOX_STATE_BYTES, dtype=torch.uint8)

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [self.get_rng_state(index) for index in range(self.device_count())]

    def set_rng_state(self, new_state: Any, device: Any = "cuda") -> None:
        return None

    def set_rng_state_all(self, new_states: Any) -> None:
        return None

    def synchronize(self, device: Any = None) -> None:
        self.session.tracker.drain()

    # ------------------------------------------------------------------ streams
    def current_stream(self, device: Any = None) -> SimulatedStream:
        return self._default_stream

    def default_stream(self, device: Any = None) -> SimulatedStream:
        return self._default_stream

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        yield

    # ------------------------------------------------------------------ memory
    def memory_allocated(self, device: Any = None) -> int:
        return self.session.allocator_state()["allocated"]

    def max_memory_allocated(self, device: Any = None) -> int:
        return self.session.allocator_state()["peak_allocated"]

    def memory_reserved(self, device: Any = None) -> int:
        return self.session.allocator_state()["reserved"]

    def max_memory_reserved(self, device: Any = None) -> int:
        return self.session.allocator_state()["peak_reserved"]

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self.session.reset_peaks()

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        state = self.session.allocator_state()
        total = self.session.gpu.total_memory
        return (max(0, total - self.session.reserve_outside - state["reserved"]), total)

    def empty_cache(self) -> None:
        self.session.empty_cache()

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        state = self.session.allocator_state()
        simulator = self.session.simulator
        return {
            "allocated_bytes.all.current": state["allocated"],
            "allocated_bytes.all.peak": state["peak_allocated"],
            "active_bytes.all.current": state["allocated"],
            "active_bytes.all.peak": state["peak_allocated"],
            "reserved_bytes.all.current": state["reserved"],
            "reserved_bytes.all.peak": state["peak_reserved"],
            "requested_bytes.all.current": state["requested"],
            "num_alloc_retries": simulator.alloc_retries,
            "num_ooms": simulator.oom_count,
            "num_device_alloc": simulator.segment_alloc_count,
            "num_device_free": simulator.segment_free_count,
        }

    def memory_summary(self, device: Any = None, abbreviated: bool = False) -> str:
        stats = self.memory_stats()
        lines = ["memlens predict: simulated caching allocator"]
        lines += [f"  {key}: {value}" for key, value in stats.items()]
        return "\n".join(lines)

    # ------------------------------------------------------------------ history and snapshots
    def record_memory_history(
        self,
        enabled: Any = "all",
        context: Any = "all",
        stacks: str = "all",
        max_entries: int = sys.maxsize,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        # Before PyTorch 2.1 the ring buffer's size was ``trace_alloc_max_entries``.
        max_entries = int(kwargs.get("trace_alloc_max_entries", max_entries))
        if enabled is None or enabled is False:
            self.session.stop_script_history()
        else:
            self.session.start_script_history(max_entries)

    def snapshot(self, device: Any = None, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.session.script_snapshot()

    def dump_snapshot(self, filename: str = "dump_snapshot.pickle") -> None:
        snapshot = self.session.script_snapshot()
        path = Path(filename)
        with open(path, "wb") as handle:
            pickle.dump(snapshot, handle)
        self.session.snapshot_paths.append(str(path.resolve()))

    # ------------------------------------------------------------------ the patch list
    def patches(self) -> list[tuple[Any, str, Any]]:
        """``(owner, attribute, replacement)`` for every patched name."""
        cuda = torch.cuda
        memory = torch.cuda.memory
        functions: dict[str, Any] = {
            "is_available": self.is_available,
            "device_count": self.device_count,
            "current_device": self.current_device,
            "set_device": self.set_device,
            "get_device_name": self.get_device_name,
            "get_device_capability": self.get_device_capability,
            "get_device_properties": self.get_device_properties,
            "is_bf16_supported": self.is_bf16_supported,
            "is_initialized": self.is_initialized,
            "init": _noop(),
            "_lazy_init": _noop(),
            "synchronize": self.synchronize,
            "get_rng_state": self.get_rng_state,
            "get_rng_state_all": self.get_rng_state_all,
            "set_rng_state": self.set_rng_state,
            "set_rng_state_all": self.set_rng_state_all,
            "manual_seed": _noop(),
            "manual_seed_all": _noop(),
            "seed": _noop(),
            "seed_all": _noop(),
            "current_stream": self.current_stream,
            "default_stream": self.default_stream,
            "stream": self.stream,
            "Stream": SimulatedStream,
            "Event": SimulatedEvent,
            "device": SimulatedDevice,
            "memory_allocated": self.memory_allocated,
            "max_memory_allocated": self.max_memory_allocated,
            "memory_reserved": self.memory_reserved,
            "max_memory_reserved": self.max_memory_reserved,
            "memory_cached": self.memory_reserved,
            "max_memory_cached": self.max_memory_reserved,
            "reset_peak_memory_stats": self.reset_peak_memory_stats,
            "reset_max_memory_allocated": self.reset_peak_memory_stats,
            "reset_max_memory_cached": self.reset_peak_memory_stats,
            "mem_get_info": self.mem_get_info,
            "empty_cache": self.empty_cache,
            "memory_stats": self.memory_stats,
            "memory_summary": self.memory_summary,
        }
        patched: list[tuple[Any, str, Any]] = [(cuda, name, value) for name, value in functions.items()]
        for name, value in functions.items():
            if hasattr(memory, name):
                patched.append((memory, name, value))
        patched += [
            (memory, "_record_memory_history", self.record_memory_history),
            (memory, "_snapshot", self.snapshot),
            (memory, "_dump_snapshot", self.dump_snapshot),
            # bitsandbytes' CUDA backend takes it at import (every kernel's stream argument): the
            # emulated device's one stream is the default stream, whose raw handle is null.
            (torch._C, "_cuda_getCurrentRawStream", _default_raw_stream),
        ]
        return patched


def _default_raw_stream(device_index: int = 0) -> int:
    return 0


__all__ = ["CudaApi", "SimulatedDeviceProperties", "SimulatedEvent", "SimulatedStream"]
