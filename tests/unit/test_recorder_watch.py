"""``Recorder.watch``: a model and optimizer attached after the session started."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from memlens.recorder import record
from memlens.sidecar.writer import sidecar_path

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow


def tiny() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_watch_after_start_fills_the_sidecar(tmp_path: Path) -> None:
    model, optimizer = tiny()
    with record(tmp_path, device="cpu") as rec:
        assert rec.models == [] and rec.optimizers == []
        rec.watch(model=model)
        rec.watch(optimizer=optimizer)
        rec.watch(model=model, optimizer=optimizer)  # twice: nothing changes
        assert rec.models == [model] and rec.optimizers == [optimizer]
        for _ in range(2):
            with rec.step():
                model(torch.randn(8, 16)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    sidecar = json.loads(sidecar_path(tmp_path / "snapshot.pickle").read_text())
    assert sidecar["model"]["parameters_total"] == sum(p.numel() for p in model.parameters())
    assert sidecar["optimizer"] == {"class": "SGD", "param_groups": 1, "momentum": 0.9, "state_dtype": "torch.float32"}


def test_watch_holds_no_strong_reference(tmp_path: Path) -> None:
    model, optimizer = tiny()
    with record(tmp_path, device="cpu") as rec:
        rec.watch(model=model, optimizer=optimizer)
        del model, optimizer
        gc.collect()
        assert rec.models == [] and rec.optimizers == []


def test_watch_after_close_adds_no_hooks(tmp_path: Path) -> None:
    model, optimizer = tiny()
    with record(tmp_path, device="cpu") as rec, rec.step():
        model(torch.randn(2, 16))
    rec.watch(model=model, optimizer=optimizer)  # e.g. a framework callback firing late
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not any(m._forward_hooks for m in model.modules())
