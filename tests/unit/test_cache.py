"""The snapshot cache: an exact round trip, keyed by content, kept in a private folder, bounded."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import memlens
from memlens.snapshot import cache
from memlens.snapshot.model import DeviceTrace, Snapshot
from memlens.synthetic import synthetic_snapshot


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache" / "memlens"
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(folder))
    monkeypatch.delenv(cache.CACHE_MAX_BYTES_ENV, raising=False)
    return folder


def write_snapshot(path: Path, events: int = 3_000, seed: int = 3) -> Path:
    path.write_bytes(pickle.dumps(synthetic_snapshot(events, seed=seed), protocol=4))
    return path


@pytest.fixture
def snapshot_file(tmp_path: Path, cache_home: Path) -> Path:
    folder = tmp_path / "data"  # a folder of its own, to see that nothing is written beside the file
    folder.mkdir()
    return write_snapshot(folder / "big.pickle")


def entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("v*-*.columns"))


def assert_same_value(a: object, b: object, where: str) -> None:
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype, where
        np.testing.assert_array_equal(a, b, err_msg=where)
        # Loaded columns are writable, as parsed ones are (views of the entry's bytes, which the
        # loader read into memory of its own, never a read-only map of the file); a column that
        # holds one value throughout is one element (model.constant_column), read-only as the
        # native reader gives it.
        assert b.flags.writeable or b.strides == (0,), where
    else:
        assert a == b, where


def test_round_trip_is_exact_for_every_field(snapshot_file: Path) -> None:
    # Every dataclass field, so that a field added to the model later cannot be left out of the
    # cache unnoticed (a cache that drops one would change answers).
    first = memlens.load(snapshot_file, cache=True)
    assert not first.from_cache
    second = memlens.load(snapshot_file, cache=True)
    assert second.from_cache
    assert second.source == str(snapshot_file)
    assert first.devices.keys() == second.devices.keys()
    for device in first.devices:
        for field in dataclasses.fields(DeviceTrace):
            assert_same_value(getattr(first.device(device), field.name), getattr(second.device(device), field.name),
                              f"device {device} {field.name}")
    for field in dataclasses.fields(Snapshot):
        if field.name not in ("devices", "from_cache"):
            assert_same_value(getattr(first, field.name), getattr(second, field.name), field.name)


def test_entry_holds_the_content_hash_in_a_private_folder(snapshot_file: Path, cache_home: Path) -> None:
    beside_before = sorted(os.listdir(snapshot_file.parent))
    memlens.load(snapshot_file, cache=True)
    data = snapshot_file.read_bytes()
    quick = hashlib.sha256(f"{len(data)}|".encode() + data[: cache.FINGERPRINT_BYTES]
                           + data[max(cache.FINGERPRINT_BYTES, len(data) - cache.FINGERPRINT_BYTES):]).hexdigest()
    assert [p.name for p in entries(cache_home)] == [f"v{cache.CACHE_VERSION}-{quick}.columns"]
    signed = bytearray(entries(cache_home)[0].read_bytes()[: -cache.SIGNATURE_BYTES])
    meta = json.loads(cache._unpack(signed)["__meta__"].tobytes())
    assert meta["content_hash"] == hashlib.sha256(data).hexdigest()
    assert meta["version"] == cache.CACHE_VERSION
    assert stat.S_IMODE(cache_home.stat().st_mode) == 0o700
    assert stat.S_IMODE(entries(cache_home)[0].stat().st_mode) == 0o600
    assert stat.S_IMODE((cache_home / cache.KEY_NAME).stat().st_mode) == 0o600
    assert sorted(os.listdir(snapshot_file.parent)) == beside_before  # nothing written beside the snapshot


def test_the_same_bytes_elsewhere_share_one_entry(snapshot_file: Path, tmp_path: Path, cache_home: Path) -> None:
    memlens.load(snapshot_file, cache=True)
    copy = tmp_path / "copy.pickle"
    copy.write_bytes(snapshot_file.read_bytes())
    again = memlens.load(copy, cache=True)
    assert again.from_cache and again.source == str(copy)
    assert len(entries(cache_home)) == 1


def test_replacement_with_the_same_size_and_mtime_is_not_served_from_cache(snapshot_file: Path) -> None:
    raw = synthetic_snapshot(3_000, seed=3)
    memlens.load(snapshot_file, cache=True)
    before = snapshot_file.stat()
    # Same pickle layout, different sizes: every 4-byte int stays a 4-byte int.
    for entry in raw["device_traces"][0]:
        if 65536 <= entry["size"] < 1 << 30:
            entry["size"] += 512
    replacement = pickle.dumps(raw, protocol=4)
    assert len(replacement) == before.st_size
    snapshot_file.write_bytes(replacement)
    os.utime(snapshot_file, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert snapshot_file.stat().st_mtime_ns == before.st_mtime_ns
    reloaded = memlens.load(snapshot_file, cache=True)
    assert not reloaded.from_cache
    fresh = memlens.load(snapshot_file, cache=False)
    np.testing.assert_array_equal(reloaded.device(0).allocated, fresh.device(0).allocated)
    assert memlens.load(snapshot_file, cache=True).from_cache  # and the new bytes get their own entry


def test_a_file_that_shares_the_fingerprint_is_told_apart_by_its_full_hash(tmp_path: Path, cache_home: Path) -> None:
    path = tmp_path / "long.pickle"
    raw = synthetic_snapshot(20_000, seed=6)
    original = pickle.dumps(raw, protocol=4)
    trace = raw["device_traces"][0]
    for entry in trace[len(trace) // 2 - 50: len(trace) // 2 + 50]:  # the middle of the file only
        if 65536 <= entry["size"] < 1 << 30:
            entry["size"] += 512  # a 4-byte int stays a 4-byte int
    changed = pickle.dumps(raw, protocol=4)
    differing = [i for i, (a, b) in enumerate(zip(original, changed, strict=True)) if a != b]
    tail_starts = len(original) - cache.FINGERPRINT_BYTES
    assert differing and cache.FINGERPRINT_BYTES < differing[0] <= differing[-1] < tail_starts
    path.write_bytes(original)
    memlens.load(path, cache=True)
    slot = cache.fingerprint(path)
    path.write_bytes(changed)
    assert cache.fingerprint(path) == slot  # the same slot...
    reloaded = memlens.load(path, cache=True)
    assert not reloaded.from_cache  # ...but not the same bytes
    np.testing.assert_array_equal(reloaded.device(0).allocated, memlens.load(path, cache=False).device(0).allocated)
    assert memlens.load(path, cache=True).from_cache


def test_file_changed_while_parsing_is_not_cached(snapshot_file: Path, cache_home: Path) -> None:
    entry = cache.CacheEntry.for_file(snapshot_file)
    assert entry is not None
    parsed = memlens.load(snapshot_file, cache=False)
    write_snapshot(snapshot_file, seed=4)  # the file now holds other bytes than the ones hashed
    assert entry.write(parsed) is None
    assert entries(cache_home) == []


def test_below_the_size_threshold_nothing_is_cached_by_default(snapshot_file: Path, cache_home: Path) -> None:
    assert snapshot_file.stat().st_size < cache.CACHE_MIN_BYTES
    memlens.load(snapshot_file)
    assert not cache_home.exists() or entries(cache_home) == []


def test_no_cache_flag_neither_reads_nor_writes(snapshot_file: Path, cache_home: Path) -> None:
    memlens.load(snapshot_file, cache=False)
    assert not cache_home.exists()
    memlens.load(snapshot_file, cache=True)
    assert not memlens.load(snapshot_file, cache=False).from_cache


# --------------------------------------------------------------------------- pruning


def age(path: Path, seconds_ago: float) -> None:
    then = time.time() - seconds_ago
    os.utime(path, (then, then))


def test_least_recently_used_entries_are_pruned(tmp_path: Path, cache_home: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    files = [write_snapshot(tmp_path / f"s{i}.pickle", events=2_000, seed=i) for i in range(3)]
    memlens.load(files[0], cache=True)
    entry_size = entries(cache_home)[0].stat().st_size
    monkeypatch.setenv(cache.CACHE_MAX_BYTES_ENV, str(int(entry_size * 2.5)))
    memlens.load(files[1], cache=True)
    first, second = (cache_home / cache.entry_name(cache.fingerprint(f)) for f in files[:2])
    age(first, 300)
    age(second, 200)
    assert memlens.load(files[0], cache=True).from_cache  # a hit makes files[0] the most recent
    memlens.load(files[2], cache=True)
    names = {p.name for p in entries(cache_home)}
    assert names == {cache.entry_name(cache.fingerprint(files[0])), cache.entry_name(cache.fingerprint(files[2]))}


def test_a_limit_of_zero_turns_caching_off(snapshot_file: Path, cache_home: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cache.CACHE_MAX_BYTES_ENV, "0")
    memlens.load(snapshot_file, cache=True)
    assert not memlens.load(snapshot_file, cache=True).from_cache
    assert not cache_home.exists() or entries(cache_home) == []


def test_old_formats_and_stale_temporaries_are_removed(snapshot_file: Path, tmp_path: Path, cache_home: Path) -> None:
    cache_home.mkdir(parents=True, mode=0o700)
    old_version = cache_home / f"v1-{'0' * 64}.npz"  # formats up to 6 were .npz files
    previous = cache_home / f"v{cache.CACHE_VERSION - 1}-{'2' * 64}.npz"
    legacy = cache_home / "big.pickle.0123456789abcdef.memlens-cache.npz"
    newer = cache_home / f"v{cache.CACHE_VERSION + 1}-{'1' * 64}.columns"
    unrelated = cache_home / "notes.txt"
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True)
    dead_writer = cache_home / f".tmp-{int(finished.stdout)}-00ff.npz"
    abandoned_own = cache_home / f".tmp-{os.getpid()}-0a0b.npz"
    live_own = cache_home / f".tmp-{os.getpid()}-0c0d.npz"  # another thread of this process, still writing
    for path in (old_version, previous, legacy, newer, unrelated, dead_writer, abandoned_own, live_own):
        path.write_bytes(b"x" * 10)
    age(abandoned_own, cache.STALE_TEMP_SECONDS + 60)
    memlens.load(snapshot_file, cache=True)
    left = set(os.listdir(cache_home))
    assert not {old_version.name, previous.name, legacy.name, dead_writer.name, abandoned_own.name} & left
    assert {newer.name, unrelated.name, live_own.name} <= left


def test_prune_without_writing(snapshot_file: Path, cache_home: Path) -> None:
    memlens.load(snapshot_file, cache=True)
    cache.prune(0)
    assert entries(cache_home) == []
    assert not memlens.load(snapshot_file, cache=True).from_cache


# --------------------------------------------------------------------------- concurrent writers


@pytest.mark.timeout(120)
def test_concurrent_first_opens_agree_on_one_key_and_one_entry(snapshot_file: Path, cache_home: Path) -> None:
    results: list[bool] = []

    def open_it() -> None:
        results.append(memlens.load(snapshot_file, cache=True).from_cache)

    threads = [threading.Thread(target=open_it) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4
    assert sorted(os.listdir(cache_home)) == sorted([cache.KEY_NAME, entries(cache_home)[0].name])
    assert memlens.load(snapshot_file, cache=True).from_cache


def test_a_file_system_without_hard_links_still_gets_a_key(snapshot_file: Path, cache_home: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def no_links(*args: object, **kwargs: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    memlens.load(snapshot_file, cache=True)
    assert len((cache_home / cache.KEY_NAME).read_bytes()) == cache.KEY_BYTES
    assert memlens.load(snapshot_file, cache=True).from_cache


@pytest.mark.timeout(60)
def test_a_pipe_is_neither_opened_nor_hashed(tmp_path: Path, cache_home: Path) -> None:
    fifo = tmp_path / "snapshot.fifo"
    os.mkfifo(fifo)  # with no writer, opening it to read would block for ever
    assert cache.CacheEntry.for_file(fifo) is None


# --------------------------------------------------------------------------- read ahead


def test_an_entry_read_ahead_is_the_one_loaded(snapshot_file: Path, cache_home: Path) -> None:
    from memlens import cache_folder
    from memlens.files import open_regular

    fresh = memlens.load(snapshot_file, cache=True)
    with open_regular(snapshot_file) as opened:
        cache_folder.hash_opened(opened, read_ahead=True).result()
        ahead = cache_folder._AHEAD[opened]
        assert ahead.data is not None and ahead.error is None  # read and checked on the hashing thread
        loaded = memlens.load(opened, cache=True)
        assert cache_folder.entry_read_ahead(opened) is None  # taken by the loader, once
    assert loaded.from_cache
    assert memlens.analyze(loaded).to_json() == memlens.analyze(fresh).to_json()


def test_nothing_is_read_ahead_without_an_entry(snapshot_file: Path, cache_home: Path) -> None:
    from memlens import cache_folder
    from memlens.files import open_regular

    with open_regular(snapshot_file) as opened:
        cache_folder.hash_opened(opened, read_ahead=True).result()
        assert cache_folder.entry_read_ahead(opened) is None
        assert not memlens.load(opened, cache=True).from_cache  # and the first open writes it


def test_an_entry_edited_before_it_is_read_ahead_is_not_believed(snapshot_file: Path, cache_home: Path) -> None:
    from memlens import cache_folder
    from memlens.files import open_regular

    memlens.load(snapshot_file, cache=True)
    entry = entries(cache_home)[0]
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 1
    entry.write_bytes(bytes(data))
    with open_regular(snapshot_file) as opened:
        cache_folder.hash_opened(opened, read_ahead=True).result()
        assert isinstance(cache_folder._AHEAD[opened].error, cache_folder.EntryRefused)
        assert not memlens.load(opened, cache=True).from_cache
    assert memlens.load(snapshot_file, cache=True).from_cache  # rebuilt


def test_an_entry_read_ahead_under_a_key_since_replaced_is_read_again(snapshot_file: Path, cache_home: Path) -> None:
    from memlens import cache_folder
    from memlens.files import open_regular

    memlens.load(snapshot_file, cache=True)
    with open_regular(snapshot_file) as opened:
        cache_folder.hash_opened(opened, read_ahead=True).result()
        assert cache_folder._AHEAD[opened].data is not None
        (cache_home / cache.KEY_NAME).write_bytes(b"k" * cache.KEY_BYTES)  # the owner's memlens made a new key
        # Not the bytes read ahead (checked under the old key): the entry read again fails the new one.
        assert not memlens.load(opened, cache=True).from_cache
