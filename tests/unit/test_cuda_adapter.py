"""The CUDA recording path, against a recorded fake standing in for torch.cuda.memory / torch.cuda /
torch._C (same method names). No GPU is needed; on a GPU the same adapter calls the real ones."""

from __future__ import annotations

import contextlib
import itertools
import json
import pickle
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from memlens.recorder import record
from memlens.recorder.cuda_adapter import CudaBackend, CudaMemoryBackend
from memlens.sidecar.writer import sidecar_path


class FakeCudaMemory:
    """Stands in for torch.cuda.memory, torch.cuda and torch._C, as strict as PyTorch 2.13.

    Argument checks raise what PyTorch raises, with its messages (the ``TORCH_CHECK``s of
    ``_record_memory_history`` in torch/csrc/cuda/memory_snapshot.cpp, the Python checks of
    ``set_per_process_memory_fraction``); turning history off clears the recorded entries, as
    ``recordHistory(false)`` does, so a snapshot taken after ``stop`` has an empty trace.
    ``allocate`` adds a trace entry the way the allocator would, with frames only when a
    context was asked for. Every call is logged.
    """

    def __init__(
        self, with_metadata: bool = True, with_fraction_getter: bool = True, with_mem_get_info: bool = True
    ) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.observers: list[Any] = []
        self.metadata = ""
        self.history_enabled: str | None = None
        self.context: str | None = None
        self.trace: list[dict[str, Any]] = []
        self.fractions: dict[int, float] = {}
        if not with_metadata:
            self._set_memory_metadata = None  # type: ignore[assignment]
        if not with_fraction_getter:
            self.get_per_process_memory_fraction = None  # type: ignore[assignment]
        if not with_mem_get_info:
            self.mem_get_info = None  # type: ignore[assignment]
        # What the device and the caching allocator hold; tests move them between steps.
        self.device_used = 6 << 30
        self.reserved = 4 << 30

    def _log(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.calls.append((name, args, kwargs))

    def names(self) -> list[str]:
        return [name for name, _, _ in self.calls]

    # torch.cuda.memory
    def _record_memory_history(
        self,
        enabled: str | None = "all",
        context: str | None = "all",
        stacks: str = "all",
        max_entries: int = sys.maxsize,
        device: Any = None,
        clear_history: bool = False,
        compile_context: bool = False,
        global_record_annotations: bool = False,
        skip_actions: list[str] | None = None,
    ) -> None:
        self._log(
            "_record_memory_history",
            enabled,
            context=context,
            stacks=stacks,
            max_entries=max_entries,
            global_record_annotations=global_record_annotations,
        )
        if not isinstance(max_entries, int) or not isinstance(stacks, str):
            raise TypeError("_cuda_record_memory_history(): incompatible function arguments.")
        if enabled is not None and enabled not in ("state", "all"):
            raise RuntimeError("expected state to be 'state', 'all', or None")
        if context is not None and context not in ("state", "alloc", "all"):
            raise RuntimeError("expected context to be 'state', 'alloc', 'all', or None")
        if stacks not in ("python", "all"):
            raise RuntimeError("expected stacks to be 'python', or 'all'")
        self.history_enabled, self.context = enabled, context if enabled is not None else None
        if enabled is None or clear_history:
            self.trace = []

    def allocate(self, size: int) -> None:
        """What the allocator appends to the history for one allocation."""
        if self.history_enabled != "all":
            return
        frames = [{"filename": "train.py", "line": 7, "name": "forward"}] if self.context in ("alloc", "all") else []
        self.trace.append(
            {"action": "alloc", "addr": 1 + len(self.trace) * size, "size": size, "stream": 0,
             "time_us": 5 + len(self.trace), "frames": frames}
        )

    def _snapshot(self) -> dict[str, Any]:
        self._log("_snapshot")
        return {
            "segments": [],
            "device_traces": [list(self.trace)],
            "allocator_settings": {"expandable_segments": False},
            "external_annotations": [],
        }

    def _set_memory_metadata(self, text: str) -> None:
        if not isinstance(text, str):
            raise TypeError("_cuda_setMemoryMetadata(): incompatible function arguments.")
        self._log("_set_memory_metadata", text)
        self.metadata = text

    def max_memory_allocated(self) -> int:
        return 3 << 30

    def max_memory_reserved(self) -> int:
        return 4 << 30

    def reset_peak_memory_stats(self) -> None:
        self._log("reset_peak_memory_stats")

    def memory_reserved(self, device: Any = None) -> int:
        self._log("memory_reserved", device)
        if device is not None and not isinstance(device, int):
            raise TypeError("Invalid device argument")
        return self.reserved

    # torch.cuda
    def current_device(self) -> int:
        return 1

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        """(free, total) of the whole device, as cudaMemGetInfo: every process's memory counts."""
        self._log("mem_get_info", device)
        if device is not None and not isinstance(device, int):
            raise TypeError("Invalid device argument")
        total = 80 << 30
        return total - self.device_used, total

    def get_device_properties(self, index: int) -> Any:
        return SimpleNamespace(name="Fake H100", total_memory=80 << 30, major=9, minor=0)

    def set_per_process_memory_fraction(self, fraction: float, device: int | None = None) -> None:
        self._log("set_per_process_memory_fraction", fraction, device)
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.fractions[self.current_device() if device is None else device] = fraction

    def get_per_process_memory_fraction(self, device: int | None = None) -> float:
        return self.fractions.get(self.current_device() if device is None else device, 1.0)

    # torch._C
    def _cuda_attach_out_of_memory_observer(self, observer: Any) -> None:
        self._log("_cuda_attach_out_of_memory_observer")
        self.observers.append(observer)

    def raise_oom(self) -> None:
        for observer in self.observers:
            observer(1, 2 << 30, 70 << 30, 1 << 30)


def cuda_recorder(tmp_path: Path, fake: FakeCudaMemory, **options: Any) -> Any:
    adapter = CudaMemoryBackend(memory=fake, cuda=fake, c_api=fake)
    clock = itertools.count(100).__next__
    return record(tmp_path, backend=CudaBackend(adapter, max_entries=1234, clock=clock), **options)


def test_history_is_started_with_python_stacks_and_stopped(tmp_path: Path) -> None:
    fake = FakeCudaMemory()
    with cuda_recorder(tmp_path, fake) as rec, rec.step():
        pass
    history = [call for call in fake.calls if call[0] == "_record_memory_history"]
    assert history[0] == (
        "_record_memory_history",
        ("all",),
        {"context": "all", "stacks": "python", "max_entries": 1234, "global_record_annotations": True},
    )
    assert history[-1][1] == (None,)
    names = fake.names()
    last_history_call = max(i for i, name in enumerate(names) if name == "_record_memory_history")
    assert names.index("_snapshot") < last_history_call  # dumped before recording was switched off


def test_steps_set_memory_metadata_and_sidecar(tmp_path: Path) -> None:
    fake = FakeCudaMemory()
    with cuda_recorder(tmp_path, fake) as rec:
        for _ in range(2):
            with rec.step():
                assert fake.metadata.startswith("memlens.step#")
    metadata = [args[0] for name, args, _ in fake.calls if name == "_set_memory_metadata"]
    assert metadata[:4] == ["memlens.step#0", "", "memlens.step#1", ""]
    sidecar = json.loads(sidecar_path(rec.paths[-1]).read_text())
    assert sidecar["backend"] == "cuda"
    assert sidecar["device"] == {
        "type": "cuda",
        "index": 1,
        "name": "Fake H100",
        "total_memory_bytes": 80 << 30,
        "compute_capability": "9.0",
        "simulated": False,
    }
    assert sidecar["peak_allocated_bytes"] == 3 << 30 and sidecar["peak_reserved_bytes"] == 4 << 30
    assert [s["index"] for s in sidecar["steps"]] == [0, 1]


def test_mark_steps_are_added_to_external_annotations(tmp_path: Path) -> None:
    fake = FakeCudaMemory()
    with cuda_recorder(tmp_path, fake) as rec:
        rec.mark_step()
    with open(rec.paths[-1], "rb") as handle:
        raw = pickle.load(handle)
    names = [(a["name"], a["stage"], a["device"]) for a in raw["external_annotations"]]
    assert ("memlens.step#0", "START", 1) in names and ("memlens.step#0", "END", 1) in names


def test_oom_observer_dumps_then_recording_stops(tmp_path: Path) -> None:
    fake = FakeCudaMemory()
    with pytest.raises(RuntimeError), cuda_recorder(tmp_path, fake) as rec, rec.step():
        fake.raise_oom()
        assert rec.oom == {"requested_bytes": 2 << 30, "device_free_bytes": 1 << 30}
        assert len(rec.paths) == 1
        raise RuntimeError("CUDA out of memory")  # what the allocator raises after its observers
    sidecar = json.loads(sidecar_path(rec.paths[-1]).read_text())
    assert sidecar["reason"] == "oom" and sidecar["oom"]["requested_bytes"] == 2 << 30
    assert len(rec.paths) == 1  # not dumped again on the way out
    assert fake.calls[-1][:2] == ("_record_memory_history", (None,))  # stopped once outside the callback
    fake.raise_oom()  # disarmed: nothing more is written
    assert len(rec.paths) == 1


def test_without_set_memory_metadata(tmp_path: Path) -> None:
    fake = FakeCudaMemory(with_metadata=False)
    adapter = CudaMemoryBackend(memory=fake, cuda=fake, c_api=fake)
    fake._set_memory_metadata = None  # type: ignore[assignment]
    assert adapter.set_metadata("x") is False


def test_limit_capacity_sets_a_memory_fraction() -> None:
    fake = FakeCudaMemory()
    adapter = CudaMemoryBackend(memory=fake, cuda=fake, c_api=fake)
    adapter.limit_capacity(20 << 30)
    assert ("set_per_process_memory_fraction", (0.25, 1), {}) in fake.calls
    adapter.limit_capacity(200 << 30)  # more than the device: no cap (a float, as PyTorch demands)
    assert fake.fractions[1] == 1.0


def cuda_backend(fake: FakeCudaMemory, **options: Any) -> CudaBackend:
    clock = itertools.count(100).__next__
    return CudaBackend(CudaMemoryBackend(memory=fake, cuda=fake, c_api=fake), clock=clock, **options)


@pytest.mark.parametrize("failed", [False, True])
def test_capacity_is_the_sessions_only(tmp_path: Path, failed: bool) -> None:
    fake = FakeCudaMemory()
    fake.set_per_process_memory_fraction(0.5, 1)  # the script's own cap, set before recording
    with contextlib.suppress(RuntimeError), record(tmp_path, backend=cuda_backend(fake, capacity=8 << 30)) as rec:
        with rec.step():
            assert fake.fractions[1] == 0.1
        if failed:
            raise RuntimeError("the training loop failed")
    assert fake.fractions[1] == 0.5
    assert not fake.observers or all(observer is not None for observer in fake.observers)


def test_capacity_restored_to_the_default_without_a_getter(tmp_path: Path) -> None:
    fake = FakeCudaMemory(with_fraction_getter=False)  # torch versions before the getter
    with record(tmp_path, backend=cuda_backend(fake, capacity=40 << 30)) as rec, rec.step():
        assert fake.fractions[1] == 0.5
    assert fake.fractions[1] == 1.0


def test_stacks_none_records_history_without_tracebacks(tmp_path: Path) -> None:
    fake = FakeCudaMemory()
    with record(tmp_path, stacks="none", backend=cuda_backend(fake, stacks="none")) as rec, rec.step():
        fake.allocate(512)
    history = [call for call in fake.calls if call[0] == "_record_memory_history"]
    assert history[0][1] == ("all",)
    assert history[0][2]["context"] is None and history[0][2]["stacks"] == "python"
    with open(rec.paths[-1], "rb") as handle:
        (trace,) = pickle.load(handle)["device_traces"]
    assert [entry["size"] for entry in trace] == [512] and trace[0]["frames"] == []


@pytest.mark.parametrize("stacks", ["python", "all"])
def test_stacks_with_tracebacks(tmp_path: Path, stacks: str) -> None:
    fake = FakeCudaMemory()
    with record(tmp_path, stacks=stacks, backend=cuda_backend(fake, stacks=stacks)) as rec, rec.step():
        fake.allocate(512)
    with open(rec.paths[-1], "rb") as handle:
        (trace,) = pickle.load(handle)["device_traces"]
    assert trace[0]["frames"][0]["name"] == "forward"


def test_the_fake_is_as_strict_as_pytorch() -> None:
    """What the adapter must never pass: these are PyTorch's own errors."""
    fake = FakeCudaMemory()
    with pytest.raises(RuntimeError, match="expected stacks to be 'python', or 'all'"):
        fake._record_memory_history("all", context="all", stacks="none")
    with pytest.raises(RuntimeError, match="expected context to be 'state', 'alloc', 'all', or None"):
        fake._record_memory_history("all", context="python")
    with pytest.raises(RuntimeError, match="expected state to be 'state', 'all', or None"):
        fake._record_memory_history("alloc")
    with pytest.raises(TypeError):
        fake._record_memory_history("all", unknown_option=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="must be `float`"):
        fake.set_per_process_memory_fraction(1, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Allowed range"):
        fake.set_per_process_memory_fraction(1.5, 0)
    adapter = CudaMemoryBackend(memory=fake, cuda=fake, c_api=fake)
    with pytest.raises(ValueError, match="stacks must be"):
        adapter.start(10, stacks="cpp")


def test_history_is_cleared_when_switched_off() -> None:
    """Why every dump happens before ``stop``: PyTorch drops the history when it is turned off."""
    fake = FakeCudaMemory()
    adapter = CudaMemoryBackend(memory=fake, cuda=fake, c_api=fake)
    adapter.start(100)
    fake.allocate(512)
    assert len(adapter.snapshot()["device_traces"][0]) == 1
    adapter.stop()
    assert adapter.snapshot()["device_traces"] == [[]]


def test_snapshot_of_old_torch_list_is_wrapped() -> None:
    fake = FakeCudaMemory()
    fake._snapshot = lambda: []  # type: ignore[method-assign]
    adapter = CudaMemoryBackend(memory=fake, cuda=fake, c_api=fake)
    assert adapter.snapshot() == {"segments": [], "device_traces": []}


def test_outside_pytorch_is_measured_at_every_step_boundary(tmp_path: Path) -> None:
    fake = FakeCudaMemory()
    with record(tmp_path, backend=cuda_backend(fake)) as rec:
        for step in range(2):
            with rec.step():
                fake.device_used += 1 << 30  # e.g. NCCL buffers made in the step, outside the allocator
                fake.reserved += step << 30
    sidecar = json.loads(sidecar_path(rec.paths[-1]).read_text())
    figures = [(f["at"], f["device_used_bytes"] >> 30, f["reserved_bytes"] >> 30, f["outside_pytorch_bytes"] >> 30)
               for f in sidecar["outside_pytorch"]]
    assert figures == [("step#0.start", 6, 4, 2), ("step#0.end", 7, 4, 3), ("step#1.start", 7, 4, 3),
                       ("step#1.end", 8, 5, 3)]
    assert all(f["device"] == 1 and isinstance(f["time_us"], int) for f in sidecar["outside_pytorch"])
    assert ("mem_get_info", (1,), {}) in fake.calls  # asked about the recorded device


def test_outside_pytorch_without_mem_get_info(tmp_path: Path) -> None:
    fake = FakeCudaMemory(with_mem_get_info=False)
    assert CudaMemoryBackend(memory=fake, cuda=fake, c_api=fake).outside_pytorch() is None
    with record(tmp_path, backend=cuda_backend(fake)) as rec, rec.step():
        pass
    assert json.loads(sidecar_path(rec.paths[-1]).read_text())["outside_pytorch"] == []


@pytest.mark.parametrize("context", ["alloc", "state"])
def test_context_is_passed_to_pytorch(tmp_path: Path, context: str) -> None:
    fake = FakeCudaMemory()
    with record(tmp_path, context=context, backend=cuda_backend(fake, context=context)) as rec, rec.step():
        fake.allocate(512)
    history = [call for call in fake.calls if call[0] == "_record_memory_history"]
    assert history[0][2]["context"] == context
    with open(rec.paths[-1], "rb") as handle:
        (trace,) = pickle.load(handle)["device_traces"]
    assert bool(trace[0]["frames"]) == (context == "alloc")
    with pytest.raises(ValueError, match="context must be"):
        CudaMemoryBackend(memory=fake, cuda=fake, c_api=fake).start(10, context="python")


def test_launcher_frames_are_dropped_from_cuda_stacks(tmp_path: Path) -> None:
    """CUDA records the whole Python stack, memlens record's own frames included: they go at dump."""
    from memlens.recorder import stacks

    def run_program() -> None:  # stands in for memlens.cli.record.run_program
        stacks.hide_frames_outward(sys._getframe())

    fake = FakeCudaMemory()
    launcher = {"filename": __file__, "line": 1, "name": "run_program"}
    frozen = {"filename": "<frozen runpy>", "line": 88, "name": "_run_code"}
    saved = set(stacks._HIDDEN_CODES)
    try:
        run_program()
        with record(tmp_path, backend=cuda_backend(fake)) as rec, rec.step():
            fake.allocate(512)
            fake.trace[-1]["frames"] = [*fake.trace[-1]["frames"], frozen, launcher]
    finally:
        stacks._HIDDEN_CODES.clear()
        stacks._HIDDEN_CODES.update(saved)
    with open(rec.paths[-1], "rb") as handle:
        (trace,) = pickle.load(handle)["device_traces"]
    assert [frame["name"] for frame in trace[0]["frames"]] == ["forward"]
