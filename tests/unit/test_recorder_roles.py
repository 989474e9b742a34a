"""What the recorder knows, recorded by role, and the categories the analysis takes from it."""

from __future__ import annotations

import itertools
import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import memlens
from memlens.analysis.categories import (
    ACTIVATIONS,
    GRADIENTS,
    PARAMETERS,
    UNKNOWN,
    RecordedRoles,
    apply_roles,
    recorded_roles,
)
from memlens.analysis.lifetimes import Lifetimes
from memlens.recorder import record
from memlens.recorder.module_scopes import ModuleScopes
from memlens.recorder.roles import RoleRecorder, find_model, model_state
from memlens.sidecar import sidecar_from_builtins
from memlens.sidecar.writer import sidecar_path

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow


def lifetimes(rows: list[tuple[int, int, int]], events: int) -> Lifetimes:
    """(address, alloc_event, free_event) rows, 512 bytes each."""
    address, alloc, free = (np.array(column, dtype=np.int64) for column in zip(*rows, strict=True))
    return Lifetimes(alloc, free, np.full(len(rows), 512, dtype=np.int64),
                     np.zeros(len(rows), dtype=np.int32), address, events, np.full(len(rows), 512, dtype=np.int64))


def test_a_note_names_the_block_live_at_its_row_not_an_earlier_one_at_the_same_address() -> None:
    # address 100 is used twice: rows 2..5, then 6..end; address 300 is live from before the trace
    lt = lifetimes([(100, 2, 5), (100, 6, 10), (200, 1, 3), (300, -1, 10)], events=10)
    category = np.full(4, UNKNOWN, dtype=np.int8)
    roles = RecordedRoles(
        row=np.array([7, -1, 4, 8], dtype=np.int64),
        address=np.array([100, 300, 200, 999], dtype=np.int64),
        category=np.array([GRADIENTS, PARAMETERS, ACTIVATIONS, PARAMETERS], dtype=np.int8),
    )
    assert apply_roles(category, lt, roles) == 2
    # the second use of 100, the ghost at 300; 200 was freed at row 3 (before the note at row 4)
    # and 999 names no block
    assert category.tolist() == [UNKNOWN, GRADIENTS, UNKNOWN, PARAMETERS]


def test_a_block_noted_twice_takes_the_stronger_role() -> None:
    lt = lifetimes([(100, 0, 10)], events=10)
    category = np.full(1, UNKNOWN, dtype=np.int8)
    roles = RecordedRoles(np.array([1, 2], dtype=np.int64), np.array([100, 100], dtype=np.int64),
                          np.array([ACTIVATIONS, PARAMETERS], dtype=np.int8))
    apply_roles(category, lt, roles)
    assert category.tolist() == [PARAMETERS]


def test_sidecar_notes_map_time_to_rows() -> None:
    """(A malformed record makes the sidecar's reader refuse it: tests/unit/test_sidecar.py.)"""
    time_us = np.array([10, 20, 30, 40], dtype=np.int64)
    sidecar = sidecar_from_builtins({"memlens_sidecar_version": 2, "tensor_roles": {"version": 1, "records": [
        {"time_us": 25, "at": "step#0.end", "device": 0, "parameters": [100, 512, 200, 512]},
        {"time_us": None, "at": "dump", "device": 0, "graph": [300, 512]},
        {"time_us": 5, "at": "step#0.start", "device": 0, "gradients": [400, 64]},
        {"time_us": 25, "at": "x", "device": 1, "parameters": [500, 512]},  # another device
    ]}})
    roles = recorded_roles(sidecar.tensor_roles, 0, time_us)
    assert roles is not None
    assert roles.address.tolist() == [100, 200, 300, 400]
    assert roles.row.tolist() == [1, 1, 3, -1]  # the last row at or before; the dump: the end
    assert roles.category.tolist() == [PARAMETERS, PARAMETERS, ACTIVATIONS, GRADIENTS]
    assert recorded_roles(None, 0, time_us) is None  # a snapshot from elsewhere


def test_role_recorder_notes_each_storage_once() -> None:
    addresses = itertools.count(4096, 4096)
    known: dict[int, int] = {}

    def address_of(storage: Any) -> tuple[int, int]:
        return 0, known.setdefault(id(storage), next(addresses))

    notes = RoleRecorder(address_of)
    weight = torch.zeros(8, 4)
    view = weight[1:]
    assert notes.note("step#0.start", 100, {"parameters": [weight, view]}) == 1
    assert notes.note("step#0.end", 200, {"parameters": [weight], "gradients": [torch.ones(3)]}) == 1
    records = notes.to_sidecar()["records"]
    assert [r["at"] for r in records] == ["step#0.start", "step#0.end"]
    assert records[0]["parameters"] == [4096, 8 * 4 * 4] and list(records[1]) == [
        "time_us", "at", "device", "gradients"]


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(inplace=True), torch.nn.Linear(64, 8))


def test_model_state_and_find_model() -> None:
    model = tiny_model()
    wrapper = torch.nn.Sequential(model)  # as DistributedDataParallel holds its module
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 32)).sum().backward()
    optimizer.step()
    state = model_state([model], [optimizer])
    assert len(state["parameters"]) == 8 and len(state["gradients"]) == 8
    assert len(state["optimizer_state"]) == 3 * 4  # step, exp_avg, exp_avg_sq per parameter
    assert find_model(optimizer) is model  # the innermost module holding them all, not the wrapper
    assert wrapper[0] is model
    other = tiny_model()
    both = torch.optim.SGD([*model.parameters(), *other.parameters()])
    assert find_model(both) is None  # no one module owns them


def run_loop(out: Path, *, leak: bool, keep_grads: bool, **options: Any) -> Path:
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters())
    kept = []
    clock = itertools.count(1_700_000_000_000_000).__next__
    with record(out, model=model, optimizer=optimizer, clock=clock, device="cpu", **options) as rec:
        for _ in range(4):
            with rec.step():
                model(torch.randn(64, 32)).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=not keep_grads)
                if leak:
                    kept.append(model(torch.randn(64, 32)).sum())  # kept with its graph
    return rec.paths[-1]


@pytest.mark.timeout(300)
def test_a_leaky_loop_has_no_unknown_at_the_peak_and_a_foreign_copy_keeps_the_heuristics(tmp_path: Path) -> None:
    path = run_loop(tmp_path, leak=True, keep_grads=True)
    sidecar = json.loads(sidecar_path(path).read_text())
    noted = {r["at"].split("#")[0] for r in sidecar["tensor_roles"]["records"]}
    assert {"step", "optimizer.pre", "optimizer.post", "forward", "forward.end", "dump"} <= noted
    device = memlens.analyze(path).devices[0]
    cats = device.categories_at_peak
    assert cats["unknown"] < 0.05 * device.peak_allocated_bytes
    # Block bytes, as memory_allocated counts them: each small tensor in its 512-byte block.
    parameter_bytes = sum(-(-p.nbytes // 512) * 512 for p in tiny_model().parameters())
    assert cats["gradients"] == parameter_bytes > 0  # kept (set_to_none=False): one per parameter
    # Every parameter is one by its role; a tensor another library made before the recording
    # (an imported framework's module-level scalar) and held to the end is one by the heuristics.
    assert parameter_bytes <= cats["parameters"] < parameter_bytes + 4096
    # the same file without its sidecar is a snapshot from elsewhere: inference only
    foreign = tmp_path / "foreign.pickle"
    foreign.write_bytes(path.read_bytes())
    assert memlens.analyze(foreign).devices[0].categories_at_peak["unknown"] > cats["unknown"]


def test_module_scopes_nest_and_skip_what_has_no_backward() -> None:
    model = torch.nn.Sequential(
        torch.nn.Embedding(10, 8), torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(inplace=True)),
        torch.nn.Linear(8, 2),
    )
    scopes = ModuleScopes(itertools.count().__next__, device=0, active=lambda: True)
    assert scopes.attach(model) == 6
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    edges = [(a["name"].removeprefix("memlens."), a["stage"]) for a in scopes.annotations]
    assert edges[:2] == [("forward#<root>", "START"), ("forward#0", "START")]
    backward = [edge for edge in edges if edge[0].startswith("backward")]
    assert backward == [
        ("backward#2", "START"), ("backward#2", "END"),
        ("backward#1", "START"), ("backward#1.0", "START"), ("backward#1.0", "END"), ("backward#1", "END"),
    ]  # the embedding (fed ids) and the in-place ReLU have none; the root's input is ids too
    times = [a["time_us"] for a in scopes.annotations]
    assert times == sorted(times)
    scopes.detach()
    model(torch.tensor([[1]]))
    assert len(scopes.annotations) == len(edges)


def test_module_scopes_option(tmp_path: Path) -> None:
    def names(path: Path) -> set[str]:
        with open(path, "rb") as handle:
            return {a["name"] for a in pickle.load(handle)["external_annotations"]}

    model = tiny_model()
    for option, expected in ((False, set()), (0, {"memlens.forward#<root>"}),
                             (True, {"memlens.forward#<root>", "memlens.forward#0", "memlens.backward#2"})):
        with record(tmp_path / str(option), model=model, device="cpu", module_scopes=option) as rec, rec.step():
            model(torch.randn(4, 32)).sum().backward()
        scoped = {name for name in names(rec.paths[-1]) if not name.startswith("memlens.step#")}
        assert scoped == expected if option is not True else expected <= scoped


def test_context_state_keeps_stacks_on_live_blocks_only(tmp_path: Path) -> None:
    model = tiny_model()
    with record(tmp_path, model=model, device="cpu", context="state") as rec, rec.step():
        kept = model(torch.randn(4, 32))
    with open(rec.paths[-1], "rb") as handle:
        raw = pickle.load(handle)
    assert not any(entry["frames"] for entry in raw["device_traces"][0])
    live = [b for s in raw["segments"] for b in s["blocks"] if b["state"] == "active_allocated" and b.get("frames")]
    assert live and kept is not None

