"""The committed sample snapshots show what sample_snapshots/README.md says they show."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

import memlens
from memlens.sidecar import SIDECAR_VERSION
from memlens.snapshot.model import Action

SAMPLES = Path(__file__).resolve().parents[2] / "sample_snapshots"
NAMES = (
    "healthy",
    "leak",
    "activations",
    "activations_checkpointed",
    "fragmentation_oom",
    "ddp_rank0",
    "ddp_rank1",
)


def step_end_levels(snapshot: memlens.Snapshot) -> list[int]:
    trace = snapshot.devices[0]
    ends = [a.time_us for a in snapshot.annotations if a.name.startswith("memlens.step#") and a.stage == "END"]
    return [int(trace.allocated[int(np.searchsorted(trace.time_us, t, side="right")) - 1]) for t in ends]


@pytest.mark.parametrize("name", NAMES)
def test_sample_loads_with_steps_and_sidecar(name: str) -> None:
    path = SAMPLES / f"{name}.pickle"
    assert path.stat().st_size < 2 * 1024 * 1024
    assert path.read_bytes()[:2] == b"\x80\x04"  # protocol 4
    snapshot = memlens.load(path)
    names = [a.name for a in snapshot.annotations if a.stage == "START"]
    starts = [n for n in names if n.startswith("memlens.step#")]
    # the rest are the model's module scopes (memlens.recorder.module_scopes)
    assert starts and all(n.startswith(("memlens.forward#", "memlens.backward#")) for n in names if n not in starts)
    assert snapshot.devices[0].has_time
    # what the recorder knew puts every byte live at the peak in a category (issue 14: under 5%)
    device = memlens.analyze(snapshot).device(0)
    assert device.categories_at_peak["unknown"] < 0.05 * device.peak_allocated_bytes
    sidecar = snapshot.sidecar
    assert sidecar is not None and sidecar.optimizer is not None and sidecar.model is not None
    assert sidecar.backend == "cpu" and sidecar.optimizer.class_name == "AdamW"
    assert [s.index for s in sidecar.steps] == list(range(len(starts)))
    # the layout the recorder writes now, with the blocks' count (the samples' TinyLM blocks)
    assert sidecar.memlens_sidecar_version == SIDECAR_VERSION and sidecar.model.config.layers_module == "blocks"


@pytest.mark.parametrize("name", ["healthy", "fragmentation_oom"])
def test_sample_is_accepted_by_memory_viz(name: str) -> None:
    from torch.cuda import _memory_viz

    with open(SAMPLES / f"{name}.pickle", "rb") as handle:
        raw = pickle.load(handle)
    assert "total_reserved" in _memory_viz.segsum(raw)
    assert "entries" in _memory_viz.trace(raw)


def test_leak_rises_and_healthy_is_flat() -> None:
    healthy = step_end_levels(memlens.load(SAMPLES / "healthy.pickle"))
    leak = step_end_levels(memlens.load(SAMPLES / "leak.pickle"))
    assert len(set(healthy)) == 1
    assert (np.diff(leak) > 1 << 20).all()


def test_fragmentation_run_ends_in_oom_with_reserved_far_above_allocated() -> None:
    snapshot = memlens.load(SAMPLES / "fragmentation_oom.pickle")
    trace = snapshot.devices[0]
    assert trace.action[-1] == int(Action.OOM)
    allocated, reserved = int(trace.allocated[-1]), int(trace.reserved[-1])
    assert reserved > 1.5 * allocated
    assert reserved - allocated > int(trace.size[-1]) > int(trace.device_free[-1])  # enough cached, none usable
    assert snapshot.sidecar is not None and snapshot.sidecar.reason == "oom"


def test_checkpointing_lowers_the_peak() -> None:
    plain = memlens.load(SAMPLES / "activations.pickle").devices[0]
    checkpointed = memlens.load(SAMPLES / "activations_checkpointed.pickle").devices[0]
    assert checkpointed.allocated.max() < 0.5 * plain.allocated.max()


def test_ddp_summary_names_the_worst_rank() -> None:
    summary = json.loads((SAMPLES / "ddp_ranks.json").read_text())
    assert summary["complete"] and summary["world_size"] == 2 and summary["worst_rank"] == 1
    for rank in (0, 1):
        sidecar = json.loads((SAMPLES / f"ddp_rank{rank}.memlens.json").read_text())
        assert sidecar["rank"] == rank and sidecar["world_size"] == 2
