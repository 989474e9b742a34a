"""A cache never changes an answer: every bundled sample and every real CUDA snapshot gives the
same JSON report from the pickle and from its cache entry."""

from __future__ import annotations

from pathlib import Path

import pytest

import memlens
from memlens.snapshot import cache
from tests.conftest import SAMPLE_SNAPSHOTS_DIR, needs_real_snapshots, real_snapshot_paths

SAMPLES = sorted(SAMPLE_SNAPSHOTS_DIR.glob("*.pickle"))


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "memlens-cache"
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(folder))
    monkeypatch.delenv(cache.CACHE_MAX_BYTES_ENV, raising=False)
    return folder


def assert_same_answer(path: Path) -> None:
    from_pickle = memlens.load(path, cache=False)
    memlens.load(path, cache=True)  # writes the entry
    from_cache = memlens.load(path, cache=True)
    assert from_cache.from_cache, f"{path.name} was not served from the cache"
    assert from_cache.sidecar == from_pickle.sidecar
    assert memlens.analyze(from_cache).to_json() == memlens.analyze(from_pickle).to_json(), path.name
    for device in from_pickle.device_ids:
        assert memlens.analyze(from_cache, device=device).to_json() == \
            memlens.analyze(from_pickle, device=device).to_json(), f"{path.name} device {device}"


def test_there_are_samples() -> None:
    assert len(SAMPLES) >= 5


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_samples_give_the_same_report_from_the_cache(path: Path) -> None:
    assert_same_answer(path)


@needs_real_snapshots
@pytest.mark.timeout(300)
def test_real_snapshots_give_the_same_report_from_the_cache() -> None:
    paths = real_snapshot_paths()
    assert paths
    for path in paths:
        assert_same_answer(path)
