"""On a real GPU only (``pytest -m gpu``; skipped everywhere else, CI included).

Records the tiny LM on CUDA through the real ``_record_memory_history`` path and checks what the
CPU tests can only check against a fake: the snapshot PyTorch dumps loads, carries memlens' step
markers (``external_annotations`` and ``user_metadata``), analyses into steps found from those
markers, and a recorded OOM (a per-process memory cap) leaves a snapshot with an ``oom`` entry.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import memlens
from tests.examples import load_train_tiny

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


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
    assert device_report.step_source == "memlens" and len(device_report.steps) >= 3
    assert device_report.categories_at_peak["optimizer_state"] > 0
    sidecar = json.loads(path.with_name(path.stem + ".memlens.json").read_text())
    assert sidecar["backend"] == "cuda" and sidecar["device"]["total_memory_bytes"] > 0


def test_cuda_oom_is_captured(tmp_path: Path) -> None:
    tiny = load_train_tiny()
    device = torch.device("cuda")
    model = tiny.TinyLM(d_model=256, n_layers=2).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(torch.OutOfMemoryError), memlens.record(
        tmp_path / "oom", device="cuda", capacity="1GiB", model=model, optimizer=optimizer
    ) as rec:
        for _ in range(3):
            with rec.step():
                tiny.train_step(model, optimizer, torch.randint(0, 256, (4096, 1025), device=device))
    (path,) = sorted((tmp_path / "oom").glob("*.pickle"))
    snapshot = memlens.load(path)
    report = memlens.analyze(snapshot)
    assert any(f.kind == "oom" for f in report.findings)
