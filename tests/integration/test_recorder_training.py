"""Real training loops on the CPU under memlens.record: the output loads in memlens and in PyTorch's
own consumer (torch.cuda._memory_viz), and shows what happened (a leak's staircase, checkpointing)."""

from __future__ import annotations

import itertools
import json
import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import memlens
from memlens.recorder import record
from tests.examples import TRAIN_TINY, load_train_tiny

REPO = Path(__file__).resolve().parents[2]


tiny = load_train_tiny()


def step_end_levels(path: Path) -> list[int]:
    """Allocated bytes at the END annotation of each memlens step, from the memlens reader."""
    snapshot = memlens.load(path)
    trace = snapshot.devices[0]
    ends = [a.time_us for a in snapshot.annotations if a.name.startswith("memlens.step#") and a.stage == "END"]
    indices = [int(np.searchsorted(trace.time_us, t, side="right")) - 1 for t in ends]
    return [int(trace.allocated[i]) for i in indices]


def train(out: Path, steps: int = 4, leak: bool = False, batch: int = 4, seq: int = 32, **options: Any) -> Any:
    torch.manual_seed(0)
    model = tiny.TinyLM(d_model=32, n_layers=2)
    model.checkpointing = options.pop("checkpointing", False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    held_out = torch.randint(0, 256, (batch, seq + 1))
    losses = []
    clock = itertools.count(1_700_000_000_000_000).__next__
    with record(out, model=model, optimizer=optimizer, clock=clock, **options) as rec:
        for _ in range(steps):
            with rec.step():
                tiny.train_step(model, optimizer, torch.randint(0, 256, (batch, seq + 1)))
                if leak:
                    logits = model(held_out[:, :-1])
                    losses.append(logits.logsumexp(-1).mean())  # kept with its graph: a leak
    return rec


def test_training_run_loads_in_memlens_and_memory_viz(tmp_path: Path) -> None:
    from torch.cuda import _memory_viz

    rec = train(tmp_path, steps=3, batch=8, seq=160)  # logits over 1 MiB: large-pool segments
    path = rec.paths[-1]
    snapshot = memlens.load(path)
    trace = snapshot.devices[0]
    assert trace.has_time and trace.events > 100
    assert snapshot.sidecar["optimizer"]["class"] == "AdamW"
    names = [a.name for a in snapshot.annotations if a.stage == "START"]
    assert names == ["memlens.step#0", "memlens.step#1", "memlens.step#2"]
    assert snapshot.segments and all(s.total_size % 512 == 0 for s in snapshot.segments)
    assert (trace.allocated <= trace.reserved).all()
    # segment_alloc events, frames and user_metadata like a CUDA snapshot
    with open(path, "rb") as handle:
        raw = pickle.load(handle)
    entries = raw["device_traces"][0]
    assert {"alloc", "free_requested", "free_completed", "segment_alloc"} <= {e["action"] for e in entries}
    alloc_frames = [e["frames"] for e in entries if e["action"] == "alloc"]
    assert all(frames for frames in alloc_frames)
    assert any(f["filename"].endswith("train_tiny.py") for frames in alloc_frames for f in frames)
    # PyTorch's own consumer accepts it (segsum checks the segment accounting identity)
    assert "total_reserved" in _memory_viz.segsum(raw)
    assert "entries" in _memory_viz.trace(raw)
    assert "<html>" in _memory_viz.trace_plot(raw)
    assert "<html>" in _memory_viz.trace_plot(raw, plot_segments=True)


def test_leak_rises_step_over_step_and_healthy_does_not(tmp_path: Path) -> None:
    healthy = step_end_levels(train(tmp_path / "healthy", steps=4).paths[-1])
    leaky = step_end_levels(train(tmp_path / "leak", steps=4, leak=True).paths[-1])
    assert len(healthy) == len(leaky) == 4
    assert len(set(healthy[1:])) == 1  # after the first step (AdamW state appears) it is flat
    growth = np.diff(leaky)
    assert (growth > 0).all() and growth.min() > 64 * 1024  # each step keeps a held-out graph


def test_checkpointing_lowers_the_peak(tmp_path: Path) -> None:
    plain = train(tmp_path / "plain", steps=2, batch=8, seq=64)
    checkpointed = train(tmp_path / "ckpt", steps=2, batch=8, seq=64, checkpointing=True)
    assert checkpointed.peak_bytes[0] < plain.peak_bytes[0]


def test_fake_tensor_mode_sizes_a_model_without_its_memory(tmp_path: Path) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = tiny.TinyLM(d_model=512, n_layers=2)
        optimizer = torch.optim.AdamW(model.parameters())
        with record(tmp_path, model=model, optimizer=optimizer, capacity="80GiB") as rec, rec.step():
            tiny.train_step(model, optimizer, torch.randint(0, 256, (16, 513)))
    parameter_bytes = 4 * sum(p.numel() for p in model.parameters())
    peak_allocated, _ = rec.peak_bytes
    assert peak_allocated > 3 * parameter_bytes  # params + grads + AdamW's two moments, at least
    assert memlens.load(rec.paths[-1]).devices[0].events > 0


def test_cli_records_an_unmodified_script(tmp_path: Path) -> None:
    from memlens.cli.main import cli

    out = tmp_path / "run"
    result = CliRunner().invoke(
        cli,
        ["record", "--out", str(out), "--", "python", str(TRAIN_TINY), "--steps", "3", "--seq", "16"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    assert "trained 3 steps" in result.output
    snapshot = memlens.load(out / "snapshot.pickle")
    starts = [a.name for a in snapshot.annotations if a.stage == "START"]
    # one step per optimizer.step(); the tail after the last one is not a step
    assert starts == ["memlens.step#0", "memlens.step#1", "memlens.step#2"]
    sidecar = json.loads((out / "snapshot.memlens.json").read_text())
    assert sidecar["reason"] == "exit" and [s["index"] for s in sidecar["steps"]] == [0, 1, 2]
    report = memlens.analyze(snapshot).device()
    assert report.step_source == "memlens" and len(report.steps) == 3
    assert f"wrote {out / 'snapshot.pickle'} (3 steps;" in result.output
    assert sys.argv[0] != str(TRAIN_TINY)  # restored


def test_cli_simulated_oom_exits_nonzero_with_a_snapshot(tmp_path: Path) -> None:
    from memlens.cli.main import cli

    out = tmp_path / "oom"
    result = CliRunner().invoke(
        cli,
        ["record", "--out", str(out), "--capacity", "2MiB", "--", "python", str(TRAIN_TINY), "--steps", "3"],
    )
    assert result.exit_code == 1
    assert "OutOfMemoryError" in result.output
    sidecar = json.loads((out / "snapshot.memlens.json").read_text())
    assert sidecar["reason"] == "oom"
    trace = memlens.load(out / "snapshot.pickle").devices[0]
    assert trace.action[-1] == int(memlens.snapshot.model.Action.OOM)


@pytest.mark.slow
def test_memlens_record_subprocess(tmp_path: Path) -> None:
    import subprocess

    out = tmp_path / "sub"
    completed = subprocess.run(
        [sys.executable, "-m", "memlens", "record", "--out", str(out), "--", "python", str(TRAIN_TINY), "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert "memlens: wrote" in completed.stderr
    assert (out / "snapshot.pickle").stat().st_size > 0
