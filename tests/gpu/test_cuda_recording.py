"""On a real GPU only (``pytest -m gpu``; skipped everywhere else, CI included).

Records the tiny LM on CUDA through the real ``_record_memory_history`` path and checks what the
CPU tests can only check against a fake: the snapshot loads, carries memlens' step markers
(PyTorch's own ``record_function`` annotations and ``user_metadata``), analyses into steps
found from those markers; ``stacks="none"`` passes PyTorch's argument checks and records a
history without tracebacks; a recorded OOM (a per-process memory cap) leaves a snapshot with an
``oom`` entry, written by the OOM observer, and the cap ends with the session.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import memlens
from memlens.recorder.cuda_adapter import CudaBackend, CudaMemoryBackend, _accepts
from tests.examples import load_train_tiny

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def raw_snapshot(path: Path) -> dict[str, Any]:
    with open(path, "rb") as handle:
        snapshot = pickle.load(handle)
    assert isinstance(snapshot, dict)
    return snapshot


def train(rec: Any, steps: int, d_model: int = 256, layers: int = 4, batch: int = 16, seq: int = 256) -> None:
    tiny = load_train_tiny()
    device = torch.device("cuda")
    model = tiny.TinyLM(d_model=d_model, n_layers=layers).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        with rec.step():
            tiny.train_step(model, optimizer, torch.randint(0, 256, (batch, seq + 1), device=device))


def test_cuda_recording_has_steps_and_analyses(tmp_path: Path) -> None:
    tiny = load_train_tiny()
    device = torch.device("cuda")
    model = tiny.TinyLM(d_model=256, n_layers=4).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with memlens.record(tmp_path / "run", device="cuda", model=model, optimizer=optimizer) as rec:
        for _ in range(4):
            with rec.step():
                tiny.train_step(model, optimizer, torch.randint(0, 256, (16, 257), device=device))
    (path,) = sorted((tmp_path / "run").glob("*.pickle"))
    snapshot = memlens.load(path)
    names = {a.name for a in snapshot.annotations}
    assert any(n.startswith("memlens.step#") for n in names), names
    report = memlens.analyze(snapshot)
    device_report = report.device()
    assert device_report.step_source == "memlens" and len(device_report.steps) == 4
    assert device_report.categories_at_peak["optimizer_state"] > 0
    sidecar = json.loads(path.with_name(path.stem + ".memlens.json").read_text())
    assert sidecar["backend"] == "cuda" and sidecar["device"]["total_memory_bytes"] > 0
    (trace,) = [t for t in raw_snapshot(path)["device_traces"] if t]
    assert any(
        frame["filename"].endswith("train_tiny.py") for entry in trace for frame in entry.get("frames", [])
    ), "stacks='python' records Python frames"


def test_record_function_annotations_and_metadata_come_from_pytorch() -> None:
    """Before memlens adds any annotation of its own: what PyTorch itself put in the snapshot."""
    adapter = CudaMemoryBackend()
    if not _accepts(torch.cuda.memory._record_memory_history, "global_record_annotations"):
        pytest.skip(f"torch {torch.__version__} has no global_record_annotations")
    backend = CudaBackend(adapter, max_entries=10_000)
    backend.install()
    try:
        backend.start_history()
        backend.begin_step(7)
        kept = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        backend.end_step(7)
        snapshot = backend.snapshot()
    finally:
        backend.uninstall()
    del kept
    stages = {(a["name"], a["stage"]) for a in snapshot.get("external_annotations", [])}
    assert {("memlens.step#7", "START"), ("memlens.step#7", "END")} <= stages, stages
    if hasattr(torch.cuda.memory, "_set_memory_metadata"):
        allocs = [e for trace in snapshot["device_traces"] for e in trace if e["action"] == "alloc"]
        assert any(e.get("user_metadata") == "memlens.step#7" for e in allocs), allocs[-3:]


def test_stacks_none_passes_pytorchs_checks_and_records_no_frames(tmp_path: Path) -> None:
    with memlens.record(tmp_path / "bare", device="cuda", stacks="none") as rec:
        train(rec, steps=2, d_model=128, layers=2)
    (path,) = sorted((tmp_path / "bare").glob("*.pickle"))
    (trace,) = [t for t in raw_snapshot(path)["device_traces"] if t]
    assert sum(entry["action"] == "alloc" for entry in trace) > 10
    assert all(not entry.get("frames") for entry in trace)
    report = memlens.analyze(memlens.load(path))
    assert report.device().step_source == "memlens" and len(report.device().steps) == 2


def test_cuda_oom_is_captured_and_the_cap_ends_with_the_session(tmp_path: Path) -> None:
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    before = getter(0) if getter is not None else 1.0
    tiny = load_train_tiny()
    device = torch.device("cuda")
    model = tiny.TinyLM(d_model=256, n_layers=2).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(torch.OutOfMemoryError), memlens.record(
        tmp_path / "oom", device="cuda", capacity="1GiB", model=model, optimizer=optimizer
    ) as rec:
        if getter is not None:
            assert getter(0) < 0.5
        for _ in range(3):
            with rec.step():
                tiny.train_step(model, optimizer, torch.randint(0, 256, (4096, 1025), device=device))
    (path,) = sorted((tmp_path / "oom").glob("*.pickle"))
    sidecar = json.loads(path.with_name(path.stem + ".memlens.json").read_text())
    assert sidecar["reason"] == "oom" and sidecar["oom"]["requested_bytes"] > 0  # the observer's dump
    assert any(entry["action"] == "oom" for trace in raw_snapshot(path)["device_traces"] for entry in trace)
    report = memlens.analyze(memlens.load(path))
    assert any(f.kind == "oom" for f in report.findings)
    if getter is not None:
        assert getter(0) == before
    torch.cuda.empty_cache()
    big = torch.empty(2 << 30, dtype=torch.uint8, device=device)  # above the session's 1 GiB cap
    assert big.numel() == 2 << 30
