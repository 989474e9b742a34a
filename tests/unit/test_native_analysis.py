"""The native core's analysis passes against their Python references (differential tests).

``memlens.snapshot._kernels.group_memory_rows`` and ``sweep_large_blocks`` are
``memlens.snapshot.blocks._group_rows`` and ``_sweep_large_blocks`` in C++: the block-size column
they give must be the Python passes' (the reference sweep in row order and the vectorised one) on
every sample and real snapshot, on random allocator runs cut at random rows (a window that opens
mid-run), and on crafted histories; where an address lies beyond what its int64 sums hold the
sweep declines and the Python pass measures. ``history_allocates_first`` is
``memlens.snapshot.curves._window_complete``'s test of the rows, and ``pair_lifetime_rows``
``memlens.analysis.lifetimes._pair_rows``. ``curve_changes`` is ``_curve_changes``, numpy's running
sums: ``build_curves`` on either must give the same trace, every array byte for byte, and the same
``CurveOverflow`` (sums past 2**56, and past int64, where numpy wraps without a word) on the same
files, windows and crafted histories. ``block_sizes`` rounds by the default rule in place
(``_round_in_place``): it must give ``round_sizes``'s sizes, at the 512 B edges and int64's ends.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from memlens.allocator import AllocatorSettings, CachingAllocatorSimulator
from memlens.analysis.lifetimes import _pair_rows
from memlens.snapshot.allocator_settings import RecordedAllocatorSettings
from memlens.snapshot.blocks import _round_in_place, block_sizes, round_sizes
from memlens.snapshot.curves import _curve_changes, _native_curve_changes, build_curves
from memlens.snapshot.engine import native_kernels
from memlens.snapshot.model import Action, Block, DeviceTrace, Segment
from memlens.snapshot.reader import _rounding_settings, load, parse
from memlens.snapshot.validate import PLAUSIBLE_BYTES
from memlens.units import MiB
from tests.conftest import REPO_ROOT, real_snapshot_paths

pytestmark = pytest.mark.skipif(native_kernels() is None,
                                reason="the native kernels are not built (or MEMLENS_PURE_PYTHON)")

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
    from memlens.snapshot import _kernels

    n = 2
    out = np.array([20 * MiB, 3 * MiB], dtype=np.int64)
    before = out.copy()
    handled = _kernels.sweep_large_blocks(
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
    # The columns gathered from the trace on demand are compared as the arrays they give.
    names = [f.name for f in dataclasses.fields(python) if not f.name.endswith("_column")] + ["address", "requested"]
    for name in names:
        expected, got = getattr(python, name), getattr(native, name)
        if isinstance(expected, np.ndarray):
            assert got.dtype == expected.dtype and got.tolist() == expected.tolist(), name
        else:
            assert got == expected, name


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


# ------------------------------------------------------------------ the curves
def _curves_agree(
    trace: DeviceTrace, segments: list, settings: RecordedAllocatorSettings | None = None
) -> str | None:
    """``build_curves`` on the native core and on the Python reference (``native=False``), each on
    its own copy of ``trace``: every field the same, the arrays byte for byte, or the same
    exception with the same message. Returns the exception's name (None: none was raised)."""
    outcomes = []
    for native in (True, False):
        built = copy.deepcopy(trace)
        try:
            build_curves(built, segments, settings, native=native)
            raised = None
        except Exception as exc:  # the reference's exceptions, whatever they are, must be the pass's
            raised = (type(exc).__name__, str(exc))
        outcomes.append((built, raised))
    (native_trace, native_raised), (python_trace, python_raised) = outcomes
    assert native_raised == python_raised
    for field in dataclasses.fields(DeviceTrace):
        expected, got = getattr(python_trace, field.name), getattr(native_trace, field.name)
        if isinstance(expected, np.ndarray):
            assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes(), field.name
        else:
            assert got == expected, field.name
    return None if python_raised is None else python_raised[0]


def _changes_agree(trace: DeviceTrace) -> None:
    """The native pass itself (not declined) against ``_curve_changes``, on ``trace``'s columns."""
    requested = trace.action == Action.FREE_REQUESTED
    completed = trace.action == Action.FREE_COMPLETED
    native = _native_curve_changes(trace, bool(requested.any()), bool(completed.any()))
    assert native is not None
    python = _curve_changes(trace, requested, completed)
    for name, expected in python._asdict().items():
        got = getattr(native, name)
        if isinstance(expected, np.ndarray):
            assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes(), name
        else:
            assert got == expected, name


@pytest.mark.parametrize("path", [pytest.param(p, id=p.name) for p in [*real_snapshot_paths(), *SAMPLES]])
def test_native_curves_match_python_on_every_snapshot(path: Path) -> None:
    snapshot = load(path)
    settings, _ = _rounding_settings(snapshot.allocator_settings)
    for trace in snapshot.devices.values():
        assert _curves_agree(trace, snapshot.segments_on(trace.device), settings) is None
        if len(trace):
            _changes_agree(trace)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("max_split", [None, 40 * MiB])
def test_native_curves_match_python_on_random_runs_and_windows(seed: int, max_split: int | None) -> None:
    """Windows cut mid-run (a baseline, lifted curves), and the same runs with one kind of free row."""
    raw = _random_run(seed, max_split)
    entries = raw["device_traces"][0]
    for kept in (entries, [e for e in entries if e["action"] != "free_requested"],
                 [e for e in entries if e["action"] != "free_completed"]):
        for cut in (0, 1, len(kept) // 5, len(kept) // 2, len(kept) - 5):
            raw["device_traces"][0] = kept[cut:]
            snapshot = parse(raw)
            settings, _ = _rounding_settings(snapshot.allocator_settings)
            trace = snapshot.device(0)
            assert _curves_agree(trace, snapshot.segments, settings) is None
            _changes_agree(trace)


_BASE = 0x7F00_0000_0000


def _row(action: str, offset: int, size: int) -> dict[str, Any]:
    return {"action": action, "addr": _BASE + offset, "size": size, "stream": 0}


def _segment(blocks: list[tuple[int, int, str]], total: int = 2 * MiB) -> dict[str, Any]:
    return {"device": 0, "address": _BASE, "total_size": total, "stream": 0, "segment_type": "small",
            "blocks": [{"address": _BASE + offset, "size": size, "requested_size": size, "state": state, "frames": []}
                       for offset, size, state in blocks]}


_CRAFTED = {
    "empty": ([], [_segment([(0, 4096, "active_allocated"), (4096, 2 * MiB - 4096, "inactive")])]),
    "empty, nothing held": ([], []),
    "only free_requested": (
        [_row("alloc", 0, 4096), _row("alloc", 4096, 1000), _row("free_requested", 0, 4096)],
        [_segment([(0, 4096, "inactive"), (4096, 1024, "active_allocated"), (5120, 2 * MiB - 5120, "inactive")])]),
    "only free_completed": (
        [_row("alloc", 0, 4096), _row("alloc", 4096, 1000), _row("free_completed", 0, 4096)],
        [_segment([(0, 4096, "inactive"), (4096, 1024, "active_allocated"), (5120, 2 * MiB - 5120, "inactive")])]),
    "both, one pending at the dump": (
        [_row("alloc", 0, 4096), _row("alloc", 4096, 1000), _row("free_requested", 0, 4096),
         _row("free_requested", 4096, 1000), _row("free_completed", 4096, 1000)],
        [_segment([(0, 4096, "active_pending_free"), (4096, 2 * MiB - 4096, "inactive")])]),
    "both, pending before the window": (
        [_row("free_completed", 8192, 512), _row("alloc", 0, 4096), _row("free_requested", 0, 4096),
         _row("free_completed", 0, 4096)],
        [_segment([(0, 2 * MiB, "inactive")])]),
    "a negative baseline, lifted": (  # allocates what the final state does not hold, on a segment it lacks
        [_row("segment_alloc", 0, 2 * MiB), _row("alloc", 0, 4096)], []),
    "a negative curve, lifted": (  # frees a block from before the window, then allocs two where one stays
        [_row("free_completed", 0, 4096), _row("alloc", 0, 4096), _row("alloc", 4096, 4096)],
        [_segment([(0, 4096, "active_allocated"), (4096, 2 * MiB - 4096, "inactive")])]),
    "segments mapped and unmapped": (
        [_row("segment_map", 0, 2 * MiB), _row("alloc", 0, 4096), _row("segment_unmap", 2 * MiB, 2 * MiB),
         _row("oom", 0, 64 * MiB)],
        [_segment([(0, 4096, "active_allocated"), (4096, 2 * MiB - 4096, "inactive")])]),
}


@pytest.mark.parametrize("case", _CRAFTED)
def test_native_curves_match_python_on_crafted_histories(case: str) -> None:
    entries, segments = _CRAFTED[case]
    snapshot = parse({"segments": segments, "device_traces": [entries]})
    trace = snapshot.device(0)
    assert _curves_agree(trace, snapshot.segments) is None
    if entries:
        _changes_agree(trace)
    if "lifted" in case:
        assert any("curve lifted" in note for note in trace.curve_warnings)


def _columns(rows: list[tuple[Action, int, int]]) -> DeviceTrace:
    """A trace straight from columns, past the reader's checks (sizes no file is read with)."""
    return DeviceTrace(device=0, action=np.array([a for a, _, _ in rows], dtype=np.int8),
                       address=np.array([_BASE + offset for _, offset, _ in rows], dtype=np.int64),
                       size=np.array([size for _, _, size in rows], dtype=np.int64))


_HUGE = 1 << 55  # three of them pass MAX_TOTAL_BYTES (2**56)
_OVERFLOWING = {
    "allocated, up": [(Action.ALLOC, k * _HUGE, _HUGE) for k in range(3)],
    "allocated, down": [(Action.FREE_COMPLETED, k * _HUGE, _HUGE) for k in range(3)],
    "allocated, down at the request": [
        *[(Action.FREE_REQUESTED, k * _HUGE, _HUGE) for k in range(3)], (Action.FREE_COMPLETED, 0, _HUGE)],
    "reserved, up": [(Action.SEGMENT_ALLOC, k * _HUGE, _HUGE) for k in range(3)],
    "reserved, down": [(Action.SEGMENT_UNMAP, k * _HUGE, _HUGE) for k in range(3)],
    # Sums of 2**56 at most: only the baseline (the final state's 2**55 less them) passes it.
    "allocated baseline": [(Action.FREE_COMPLETED, k * _HUGE, _HUGE) for k in range(2)],
    "reserved baseline": [(Action.SEGMENT_FREE, 0, 2 * _HUGE)],
    "allocated, wrapping int64": [(Action.ALLOC, k << 44, 1 << 62) for k in range(5)],
    "reserved, wrapping int64": [(Action.SEGMENT_ALLOC, k << 44, 1 << 62) for k in range(5)],
}


@pytest.mark.parametrize("case", _OVERFLOWING)
def test_native_curves_overflow_as_python_does(case: str) -> None:
    """Sums past MAX_TOTAL_BYTES, and sums past int64 (numpy's cumsum wraps them silently):
    CurveOverflow on both engines, from the same sums. The final state holds 2**55 bytes."""
    trace = _columns(_OVERFLOWING[case])
    held = _BASE + (1 << 58)
    segments = [Segment(device=0, address=held, total_size=_HUGE, stream=0, segment_type="large", pool_id=(0, 0),
                        is_expandable=False, blocks=[Block(held, _HUGE, _HUGE, "active_allocated")])]
    assert _curves_agree(trace, segments) == "CurveOverflow"
    built = copy.deepcopy(trace)
    built.block_size = block_sizes(built.action, built.address, built.size, segments, AllocatorSettings())
    _changes_agree(built)


def test_native_curves_wrap_as_numpy_does() -> None:
    """Steps no file is read with (one size of -2**63, whose magnitude numpy wraps to itself): the
    running sums, their magnitudes and so the verdict are numpy's, byte for byte, whatever they are."""
    lowest = -(1 << 63)
    verdicts = {
        _curves_agree(_columns([(Action.SEGMENT_ALLOC, 0, lowest), (Action.SEGMENT_ALLOC, 1 << 40, lowest), *tail]), [])
        for tail in ([(Action.SEGMENT_FREE, 0, lowest), (Action.ALLOC, 0, 4096)], [(Action.ALLOC, 0, 4096)])
    }
    assert verdicts == {"CurveOverflow", None}  # both verdicts reached (the second sum wraps back to 0)
    for block_size in ([lowest, 0, lowest, 0], [(1 << 63) - 1, 1, lowest, -1], [1 << 62, 1 << 62, 1 << 62, 1]):
        for actions in ([Action.ALLOC, Action.ALLOC, Action.FREE_REQUESTED, Action.FREE_COMPLETED],
                        [Action.ALLOC, Action.FREE_COMPLETED, Action.ALLOC, Action.ALLOC]):
            wrapped = _columns([(a, 0, 512) for a in actions])
            wrapped.block_size = np.array(block_size, dtype=np.int64)
            _changes_agree(wrapped)


def test_native_curves_decline_codes_that_are_not_actions() -> None:
    """The reference indexes its tables with the action codes: it alone says what a foreign one
    gives (-1 reads as the last code, 12 raises), so the pass declines and the reference answers."""
    for code in (-1, 12):
        trace = _columns([(Action.ALLOC, 0, 4096), (Action.FREE_COMPLETED, 0, 4096)])
        trace.action[1] = code
        trace.block_size = trace.size.copy()
        assert _native_curve_changes(trace, False, True) is None
        _curves_agree(trace, [])


# ------------------------------------------------------------------ rounding in place
_EDGE_SIZES = [0, 1, 2, 511, 512, 513, 1023, 1024, 1025, MiB - 1, MiB, MiB + 1, PLAUSIBLE_BYTES - 513,
               PLAUSIBLE_BYTES - 1, PLAUSIBLE_BYTES, PLAUSIBLE_BYTES + 1, PLAUSIBLE_BYTES + 511, PLAUSIBLE_BYTES + 512]


def _random_sizes(seed: int, extremes: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pieces = [np.array(_EDGE_SIZES, dtype=np.int64), rng.integers(0, 4096, 500), rng.integers(0, 64 * MiB, 500),
              rng.integers(PLAUSIBLE_BYTES - 4096, PLAUSIBLE_BYTES + 4096, 500), rng.integers(0, PLAUSIBLE_BYTES, 500)]
    if extremes:  # past what the reader lets through: the wrapping must be the formula's too
        highest, lowest = np.iinfo(np.int64).max, np.iinfo(np.int64).min
        pieces += [np.array([-1, -511, -512, -513, highest, highest - 511, highest - 512, lowest, lowest + 1]),
                   rng.integers(lowest, highest, 500, endpoint=True)]
    return rng.permutation(np.concatenate(pieces).astype(np.int64))


@pytest.mark.parametrize("seed", range(4))
def test_rounding_in_place_matches_round_sizes(seed: int) -> None:
    sizes = _random_sizes(seed, extremes=True)
    rows = np.random.default_rng(seed).random(sizes.size) < 0.7
    expected = sizes.copy()
    expected[rows] = round_sizes(sizes[rows], AllocatorSettings())
    rounded = sizes.copy()
    _round_in_place(rounded, rows)
    assert rounded.tobytes() == expected.tobytes()


@pytest.mark.parametrize("divisions", [None, 4, {64: 8, 512: 2}])
@pytest.mark.parametrize("seed", range(3))
def test_block_sizes_round_as_round_sizes(divisions: Any, seed: int) -> None:
    """Allocs and frees at their own addresses on no segment (so no tail to measure), between
    rows of other actions: the rounding alone, on the memory rows only, by the default rule
    (in place) and by ``roundup_power2_divisions`` (``round_sizes``), from int64 and int32 sizes."""
    settings = AllocatorSettings(roundup_power2_divisions=divisions)
    sizes = _random_sizes(seed, extremes=False)
    n = sizes.size
    action = np.random.default_rng(seed).choice(
        np.array([Action.ALLOC, Action.FREE_COMPLETED, Action.OOM, Action.SEGMENT_ALLOC], dtype=np.int8), n)
    address = _BASE + np.arange(n, dtype=np.int64) * (1 << 45)
    for column in (sizes, (sizes % (1 << 31)).astype(np.int32)):
        memory = (action == Action.ALLOC) | (action == Action.FREE_COMPLETED)
        expected = column.astype(np.int64)
        expected[memory] = round_sizes(column[memory], settings)
        for kw in ({}, {"native": False}, {"sweep": True}):
            got = block_sizes(action, address, column, [], settings, **kw)
            assert got.dtype == np.int64 and got.tobytes() == expected.tobytes(), kw


@pytest.mark.parametrize("seed", range(4))
def test_native_pairing_matches_python_on_random_histories(seed: int) -> None:
    """Random alloc/free/segment rows over a dozen addresses (frees before any alloc, allocs that
    follow allocs at one address, both kinds of free as the end): the native counting sort pairs
    the rows as the reference's lexsort does, in its order."""
    core = native_kernels()
    if core is None:
        pytest.skip("the native core is not built")
    rng = np.random.default_rng(seed)
    for _ in range(100):
        n = int(rng.integers(0, 400))
        action = rng.choice([0, 1, 2, 3, 4], size=n).astype(np.int8)
        address = rng.integers(0, 12, size=n).astype(np.int64) * 512
        trace = DeviceTrace(device=0, action=action, address=address)
        for ends in (int(Action.FREE_REQUESTED), int(Action.FREE_COMPLETED)):
            expected = _pair_rows(trace, ends)
            got = core.pair_lifetime_rows(action, address, ends)
            for reference, native in zip(expected, got, strict=True):
                assert np.array_equal(reference, native) and native.dtype == np.int64
