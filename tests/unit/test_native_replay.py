"""The native what-if replay against the Python one, on every real snapshot (differential tests).

Each device history of each snapshot in the real-snapshot folder (``MEMLENS_REAL_SNAPSHOTS``) and
each sample is replayed through both engines under the recorded settings and under settings that
exercise the other rules (expandable segments, max_split_size, a capacity that forces the release
and retry path and the OOM); the two must agree on the whole result, on every block at every
cudaMalloc and OOM row the observer sees, and on every block at the end.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from memlens.allocator import replay as replay_module
from memlens.allocator.engine import native_module
from memlens.allocator.replay import Watch, whatif
from memlens.allocator.settings import AllocatorSettings
from memlens.allocator.simulator import CachingAllocatorSimulator as PythonSimulator
from memlens.errors import MemlensError
from memlens.snapshot.model import Action
from memlens.snapshot.reader import load
from memlens.units import MiB
from tests.conftest import REPO_ROOT, real_snapshot_paths

pytestmark = [
    pytest.mark.skipif(native_module() is None, reason="the native core is not built (or MEMLENS_PURE_PYTHON)"),
    pytest.mark.slow,
]

SAMPLES = sorted((REPO_ROOT / "sample_snapshots").glob("*.pickle"))
VARIANTS: dict[str, dict[str, Any]] = {
    "recorded": {},
    "expandable": {"expandable_segments": True},
    "max_split": {"max_split_size": 64 * MiB},
    "rounded": {"roundup_power2_divisions": 4},
}


def _replay(monkeypatch: pytest.MonkeyPatch, engine: str, path: Path, device: int, settings: AllocatorSettings | None,
            capacity: int | None) -> dict[str, Any]:
    """One replay on ``engine``, with the blocks the observer saw and the simulator's final blocks."""
    if engine == "python":
        monkeypatch.setattr(replay_module, "native_module", lambda: None)
        simulator_type: Any = PythonSimulator
    else:
        monkeypatch.setattr(replay_module, "native_module", native_module)
        from memlens.allocator.native import NativeCachingAllocatorSimulator

        simulator_type = NativeCachingAllocatorSimulator
    created: list[Any] = []

    def make(*args: Any, **kwargs: Any) -> Any:
        created.append(simulator_type(*args, **kwargs))
        return created[-1]

    monkeypatch.setattr(replay_module, "simulator_class", lambda: make)
    seen: list[Any] = []

    def observe(row: int, sim: Any) -> None:
        seen.append((row, sim.reserved_bytes, sim.allocated_bytes, list(sim.iter_blocks()),
                     sim.cached_blocks(True, 0), sim.cached_blocks(False, 0)))

    try:
        result = whatif(load(path), settings=settings, capacity=capacity, device=device, observer=observe)
    except MemlensError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"result": result.to_json(), "seen": seen, "final": [list(sim.iter_blocks()) for sim in created]}


def _cases() -> list[Any]:
    return [pytest.param(path, id=path.name) for path in [*real_snapshot_paths(), *SAMPLES]]


@pytest.mark.slow
@pytest.mark.parametrize("path", _cases())
def test_native_replay_matches_python_block_by_block(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    snapshot = load(path)
    recorded = AllocatorSettings.from_snapshot_dict(snapshot.allocator_settings)
    compared = 0
    for trace in snapshot.devices.values():
        if not len(trace):
            continue
        peak = int(trace.reserved.max())
        for name, changes in VARIANTS.items():
            settings = dataclasses.replace(recorded, **changes) if changes else None
            # no capacity, and one a little below the recorded peak: the release-and-retry path and the OOM
            for capacity in (None, max(peak - peak // 8, 2 * MiB)):
                python = _replay(monkeypatch, "python", path, trace.device, settings, capacity)
                native = _replay(monkeypatch, "native", path, trace.device, settings, capacity)
                assert native == python, (name, capacity)
                compared += 1
    assert compared or not any(len(t) for t in snapshot.devices.values())


def _watched(monkeypatch: pytest.MonkeyPatch, engine: str, snapshot: Any, device: int, capacity: int | None,
             stop_after: int) -> dict[str, Any]:
    """A watched replay on ``engine``, every segment_alloc and oom row watched on both pools."""
    monkeypatch.setattr(replay_module, "native_module", (lambda: None) if engine == "python" else native_module)
    if engine == "python":
        monkeypatch.setattr(replay_module, "simulator_class", lambda: PythonSimulator)
    else:
        from memlens.allocator.native import NativeCachingAllocatorSimulator

        monkeypatch.setattr(replay_module, "simulator_class", lambda: NativeCachingAllocatorSimulator)
    trace = snapshot.device(device)
    rows = np.flatnonzero((trace.action == Action.SEGMENT_ALLOC) | (trace.action == Action.OOM))
    watch = Watch(rows=rows, small=(rows % 2).astype(np.uint8), streams=trace.stream[rows].astype(np.int64),
                  pieces_only=(rows % 3 == 0).astype(np.uint8), stop_after=stop_after)
    seen: list[tuple[int, int, tuple[int, int, int, int]]] = []

    def observe(row: int, sim: Any) -> None:
        seen.append((row, sim.reserved_bytes, tuple(sim.cached_summary(bool(row % 2), int(trace.stream[row]),
                                                                       pieces_only=row % 3 == 0))))

    def notes(watch: Watch) -> tuple[Any, ...]:
        return (list(zip(watch.noted_rows.tolist(), watch.noted_reserved.tolist(), strict=True)), watch.summaries,
                watch.stopped)

    try:
        whatif(snapshot, capacity=capacity, device=device, observer=observe, watch=watch)
    except MemlensError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    alone = dataclasses.replace(watch)  # the same request, with no observer (the native loop lets the GIL go)
    whatif(snapshot, capacity=capacity, device=device, watch=alone)
    assert notes(alone) == notes(watch)
    noted, summaries, stopped = notes(watch)
    return {"seen": seen, "noted": noted, "summaries": summaries, "stopped": stopped}


@pytest.mark.parametrize("path", _cases())
def test_a_watch_notes_what_an_observer_sees_on_both_engines(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """A ``Watch`` (the allocator evidence's replay, native and without the GIL) notes at every
    segment_alloc and oom row what an observer called there sees, on both engines, and stops
    where it is told to."""
    snapshot = load(path)
    for trace in snapshot.devices.values():
        rows = np.flatnonzero((trace.action == Action.SEGMENT_ALLOC) | (trace.action == Action.OOM))
        if not rows.size:
            continue
        peak = int(trace.reserved.max())
        for capacity in (None, max(peak - peak // 8, 2 * MiB)):
            for stop_after in (-1, int(rows[rows.size // 2])):
                native = _watched(monkeypatch, "native", snapshot, trace.device, capacity, stop_after)
                python = _watched(monkeypatch, "python", snapshot, trace.device, capacity, stop_after)
                assert native == python, (capacity, stop_after)
                if "error" in native:
                    continue
                assert [(row, reserved) for row, reserved, _ in native["seen"]] == native["noted"]
                reached = {row: summary for row, _, summary in native["seen"]}
                expected = [reached.get(int(row)) if int(row) <= native["noted"][-1][0] else None for row in rows]
                assert native["summaries"] == expected
                assert native["stopped"] == (stop_after >= 0 and native["noted"][-1][0] >= stop_after)
