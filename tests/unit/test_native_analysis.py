"""The native core's analysis passes against their Python references (differential tests).

``memlens._native.group_memory_rows`` and ``sweep_large_blocks`` are
``memlens.snapshot.blocks._group_rows`` and ``_sweep_large_blocks`` in C++: the block-size column
they give must be the Python passes' (the reference sweep in row order and the vectorised one) on
every sample and real snapshot, on random allocator runs cut at random rows (a window that opens
mid-run), and on crafted histories; where an address lies beyond what its int64 sums hold the
sweep declines and the Python pass measures. ``history_allocates_first`` is
``memlens.snapshot.curves._window_complete``'s test of the rows, and ``pair_lifetime_rows``
``memlens.analysis.lifetimes._pair_rows``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from memlens.allocator import AllocatorSettings, CachingAllocatorSimulator
from memlens.allocator.engine import native_module
from memlens.snapshot.blocks import block_sizes
from memlens.snapshot.reader import load, parse
from memlens.units import MiB
from tests.conftest import REPO_ROOT, real_snapshot_paths

pytestmark = pytest.mark.skipif(native_module() is None, reason="the native core is not built (or MEMLENS_PURE_PYTHON)")

SAMPLES = sorted((REPO_ROOT / "sample_snapshots").glob("*.pickle"))


def _all_ways(action: np.ndarray, address: np.ndarray, size: np.ndarray, segments: list, settings: AllocatorSettings,
              use_final_state: bool = True) -> list[list[int]]:
    return [block_sizes(action, address, size, segments, settings, use_final_state=use_final_state, **kw).tolist()
            for kw in ({}, {"native": False}, {"sweep": True})]


@pytest.mark.parametrize("path", [pytest.param(p, id=p.name) for p in [*real_snapshot_paths(), *SAMPLES]])
def test_native_block_sizes_match_python_on_every_snapshot(path: Path) -> None:
    snapshot = load(path)
    settings = AllocatorSettings.from_snapshot_dict(snapshot.allocator_settings)
    for trace in snapshot.devices.values():
        segments = snapshot.segments_on(trace.device)
        for use_final_state in (True, False):
            native, vectorised, swept = _all_ways(trace.action, trace.address, trace.size, segments, settings,
                                                  use_final_state)
            assert native == swept
            assert vectorised == swept


def _random_run(seed: int, max_split: int | None) -> dict:
    rng = random.Random(seed)
    sim = CachingAllocatorSimulator(AllocatorSettings(max_split_size=max_split), capacity=600 * MiB)
    live: list[int] = []
    for _ in range(400):
        if live and rng.random() < 0.45:
            address = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.5:
                sim.free(address)
            else:
                sim.request_free(address)
                sim.complete_free(address)
        elif rng.random() < 0.03:
            sim.empty_cache()
        else:
            size = rng.choice([rng.randint(1, MiB), rng.randint(MiB + 1, 12 * MiB), rng.randint(12 * MiB, 90 * MiB)])
            try:
                live.append(sim.malloc(size))
            except Exception:  # SimulatedOOM: the run goes on, as a program that catches it
                continue
    return sim.snapshot()


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("max_split", [None, 40 * MiB])
def test_native_block_sizes_match_python_on_random_runs_and_windows(seed: int, max_split: int | None) -> None:
    raw = _random_run(seed, max_split)
    entries = raw["device_traces"][0]
    for cut in (0, len(entries) // 5, len(entries) // 2):
        raw["device_traces"][0] = entries[cut:]
        snapshot = parse(raw)
        trace = snapshot.device(0)
        settings = AllocatorSettings.from_snapshot_dict(snapshot.allocator_settings)
        for use_final_state in (True, False):
            native, vectorised, swept = _all_ways(trace.action, trace.address, trace.size, snapshot.segments,
                                                  settings, use_final_state)
            assert native == swept
            assert vectorised == swept


@pytest.mark.parametrize("inner", [4096, 3 * MiB])
def test_a_block_inside_another_ones_tail_is_cut_alike(inner: int) -> None:
    """A history no allocator of PyTorch's rules writes: an alloc inside a live block's tail (a
    small-pool one, which the sweep never saw and the vectorised pass once cut the block at, and
    a large one). Every pass, and so every engine, gives the same blocks."""
    base = 0x7F00_0000_0000
    entries = [
        {"action": "segment_alloc", "addr": base, "size": 20 * MiB, "stream": 0},
        {"action": "alloc", "addr": base, "size": 19 * MiB + 100, "stream": 0},
        {"action": "alloc", "addr": base + 19 * MiB + 512, "size": inner, "stream": 0},
        {"action": "free_completed", "addr": base, "size": 19 * MiB + 100, "stream": 0},
        {"action": "alloc", "addr": base, "size": 3 * MiB, "stream": 0},
    ]
    raw = {"segments": [], "device_traces": [entries],
           "allocator_settings": {"expandable_segments": False, "max_split_size": -1}}
    snapshot = parse(raw)
    trace = snapshot.device(0)
    settings = AllocatorSettings.from_snapshot_dict(snapshot.allocator_settings)
    native, vectorised, swept = _all_ways(trace.action, trace.address, trace.size, snapshot.segments, settings)
    assert native == swept == vectorised


def test_the_native_sweep_declines_addresses_its_sums_cannot_hold() -> None:
    from memlens import _native

    n = 2
    out = np.array([20 * MiB, 3 * MiB], dtype=np.int64)
    before = out.copy()
    handled = _native.sweep_large_blocks(
        out, np.array([3, 0], dtype=np.int8), np.array([(1 << 63) - 40 * MiB] * n, dtype=np.int64),
        np.ones(n, dtype=np.uint8), 2, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), (1 << 63) - 1,
        np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    assert handled is False
    assert out.tolist() == before.tolist()


def _window_complete_both(trace: Any, segments: list) -> tuple[bool, bool]:
    from memlens.snapshot.curves import _window_complete, window_complete
    from memlens.snapshot.model import Action

    requested = trace.action == Action.FREE_REQUESTED
    freed = requested if requested.any() else trace.action == Action.FREE_COMPLETED
    live = [b for s in segments for b in s.blocks if b.is_active]
    return window_complete(trace, freed, live), _window_complete(trace, freed, live)


@pytest.mark.parametrize("path", [pytest.param(p, id=p.name) for p in [*real_snapshot_paths(), *SAMPLES]])
def test_native_window_completeness_matches_python_on_every_snapshot(path: Path) -> None:
    snapshot = load(path)
    for trace in snapshot.devices.values():
        native, python = _window_complete_both(trace, snapshot.segments_on(trace.device))
        assert native == python == trace.window_complete


@pytest.mark.parametrize("seed", range(8))
def test_native_window_completeness_matches_python_on_windows(seed: int) -> None:
    raw = _random_run(seed, None)
    entries = raw["device_traces"][0]
    answers = set()
    for cut in (0, 1, len(entries) // 3, len(entries) - 5):
        raw["device_traces"][0] = entries[cut:]
        snapshot = parse(raw)
        trace = snapshot.device(0)
        # The baseline check answers first; zero it to reach the rows' test on a cut window too.
        trace.baseline_allocated = trace.baseline_reserved = 0
        native, python = _window_complete_both(trace, snapshot.segments)
        assert native == python
        answers.add(native)
    assert answers == {True, False}  # both answers reached


def _lifetimes_agree(trace: Any, segments: list) -> None:
    import dataclasses

    from memlens.analysis.lifetimes import build_lifetimes

    python, native = build_lifetimes(trace, segments, native=False), build_lifetimes(trace, segments)
    for field in dataclasses.fields(python):
        expected, got = getattr(python, field.name), getattr(native, field.name)
        if isinstance(expected, np.ndarray):
            assert got.dtype == expected.dtype and got.tolist() == expected.tolist(), field.name
        else:
            assert got == expected, field.name


@pytest.mark.parametrize("path", [pytest.param(p, id=p.name) for p in [*real_snapshot_paths(), *SAMPLES]])
def test_native_lifetimes_match_python_on_every_snapshot(path: Path) -> None:
    snapshot = load(path)
    for trace in snapshot.devices.values():
        _lifetimes_agree(trace, snapshot.segments_on(trace.device))


@pytest.mark.parametrize("seed", range(8))
def test_native_lifetimes_match_python_on_windows(seed: int) -> None:
    """Cut windows: frees whose alloc the window lost, allocs never freed, addresses reused."""
    raw = _random_run(seed, None)
    entries = raw["device_traces"][0]
    for cut in (0, 1, len(entries) // 3, len(entries) - 5):
        raw["device_traces"][0] = entries[cut:]
        snapshot = parse(raw)
        _lifetimes_agree(snapshot.device(0), snapshot.segments)
    # A history that lost frees (two allocs in a row at one address) and only free_completed rows.
    raw["device_traces"][0] = [e for e in entries if e["action"] != "free_requested"][::2]
    snapshot = parse(raw)
    _lifetimes_agree(snapshot.device(0), snapshot.segments)
