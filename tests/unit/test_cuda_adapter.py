"""The CUDA recording path, against a recorded fake standing in for torch.cuda.memory / torch.cuda /
torch._C (same method names). No GPU is needed; on a GPU the same adapter calls the real ones."""

from __future__ import annotations

import itertools
import json
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from memlens.recorder import record
from memlens.recorder.cuda_adapter import CudaBackend, CudaMemoryBackend
from memlens.recorder.sidecar import sidecar_path


class FakeCudaMemory:
    """Records every call; ``_snapshot`` returns a small CUDA-like snapshot."""

    def __init__(self, with_metadata: bool = True) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.observers: list[Any] = []
        self.metadata = ""
        if not with_metadata:
            self._set_memory_metadata = None  # type: ignore[assignment]

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
        max_entries: int = 0,
        device: Any = None,
        clear_history: bool = False,
        compile_context: bool = False,
        global_record_annotations: bool = False,
    ) -> None:
        self._log(
            "_record_memory_history",
            enabled,
            stacks=stacks,
            max_entries=max_entries,
            global_record_annotations=global_record_annotations,
        )

    def _snapshot(self) -> dict[str, Any]:
        self._log("_snapshot")
        return {
            "segments": [],
            "device_traces": [[{"action": "alloc", "addr": 1, "size": 512, "stream": 0, "time_us": 5}]],
            "allocator_settings": {"expandable_segments": False},
            "external_annotations": [],
        }

    def _set_memory_metadata(self, text: str) -> None:
        self._log("_set_memory_metadata", text)
        self.metadata = text

    def max_memory_allocated(self) -> int:
        return 3 << 30

    def max_memory_reserved(self) -> int:
        return 4 << 30

    def reset_peak_memory_stats(self) -> None:
        self._log("reset_peak_memory_stats")

    # torch.cuda
    def current_device(self) -> int:
        return 1

    def get_device_properties(self, index: int) -> Any:
        return SimpleNamespace(name="Fake H100", total_memory=80 << 30, major=9, minor=0)

    def set_per_process_memory_fraction(self, fraction: float, device: int) -> None:
        self._log("set_per_process_memory_fraction", fraction, device)

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
        {"stacks": "python", "max_entries": 1234, "global_record_annotations": True},
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


def test_snapshot_of_old_torch_list_is_wrapped() -> None:
    fake = FakeCudaMemory()
    fake._snapshot = lambda: []  # type: ignore[method-assign]
    adapter = CudaMemoryBackend(memory=fake, cuda=fake, c_api=fake)
    assert adapter.snapshot() == {"segments": [], "device_traces": []}
