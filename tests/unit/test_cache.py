"""The .npz cache: an exact round trip, used on the second open, ignored when stale."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest

import memlens
from memlens.snapshot import cache
from memlens.synthetic import synthetic_snapshot


@pytest.fixture
def snapshot_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = tmp_path / "big.pickle"
    path.write_bytes(pickle.dumps(synthetic_snapshot(5_000, seed=3), protocol=4))
    return path


def test_round_trip_is_exact(snapshot_file: Path) -> None:
    first = memlens.load(snapshot_file, cache=True)
    assert not first.from_cache
    second = memlens.load(snapshot_file, cache=True)
    assert second.from_cache
    a, b = first.device(0), second.device(0)
    for column in ("action", "address", "size", "stream", "time_us", "stack_id", "allocated", "reserved"):
        np.testing.assert_array_equal(getattr(a, column), getattr(b, column))
        assert getattr(a, column).dtype == getattr(b, column).dtype
    assert (a.baseline_allocated, a.baseline_reserved, a.window_complete) == (
        b.baseline_allocated, b.baseline_reserved, b.window_complete)
    assert a.user_metadata == b.user_metadata
    assert first.stacks.frames == second.stacks.frames and first.stacks.stacks == second.stacks.stacks
    assert first.segments == second.segments
    assert first.annotations == second.annotations
    assert first.format_guess == second.format_guess


def test_stale_cache_is_rebuilt(snapshot_file: Path) -> None:
    memlens.load(snapshot_file, cache=True)
    snapshot_file.write_bytes(pickle.dumps(synthetic_snapshot(3_000, seed=4), protocol=4))
    os.utime(snapshot_file, ns=(1, 1))
    reloaded = memlens.load(snapshot_file, cache=True)
    assert not reloaded.from_cache


def test_damaged_cache_is_ignored(snapshot_file: Path) -> None:
    memlens.load(snapshot_file, cache=True)
    for path in cache.candidate_paths(str(snapshot_file)):
        if path.exists():
            path.write_bytes(b"garbage")
    assert not memlens.load(snapshot_file, cache=True).from_cache


def test_read_only_folder_falls_back_to_user_cache(snapshot_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    beside, user = cache.candidate_paths(str(snapshot_file))
    real_mkstemp = cache.tempfile.mkstemp

    def refuse_beside(dir: str, **kwargs: str) -> tuple[int, str]:
        if Path(dir) == beside.parent:
            raise PermissionError("read-only")
        return real_mkstemp(dir=dir, **kwargs)

    monkeypatch.setattr(cache.tempfile, "mkstemp", refuse_beside)
    assert cache.write(str(snapshot_file), memlens.load(snapshot_file, cache=False)) == user
    assert memlens.load(snapshot_file, cache=True).from_cache
