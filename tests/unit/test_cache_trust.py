"""The cache believes nothing it cannot prove: edited, planted, foreign, damaged or malformed
entries are ignored and rebuilt silently, and the answer is always the one the pickle gives."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import memlens
from memlens import cache_folder
from memlens.snapshot import cache
from memlens.synthetic import synthetic_snapshot

Members = dict[str, np.ndarray]
OTHER_UID = 54321


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache" / "memlens"
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(folder))
    monkeypatch.delenv(cache.CACHE_MAX_BYTES_ENV, raising=False)
    return folder


@pytest.fixture
def snapshot_file(tmp_path: Path, cache_home: Path) -> Path:
    path = tmp_path / "shared" / "run.pickle"
    path.parent.mkdir()
    path.write_bytes(pickle.dumps(synthetic_snapshot(3_000, seed=5), protocol=4))
    return path


def entry_of(snapshot_file: Path, cache_home: Path) -> Path:
    return cache_home / cache.entry_name(cache.fingerprint(snapshot_file))


def read_members(path: Path) -> Members:
    """An entry's members, copied out of it (its signature not checked)."""
    signed = bytearray(path.read_bytes()[: -cache.SIGNATURE_BYTES])
    return {name: column.copy() for name, column in cache._unpack(signed).items()}


def write_members(path: Path, members: Members, key: bytes | None = None) -> None:
    """``members`` as an entry signed with ``key``; without one, the entry keeps the signature it
    had (whoever edited it does not have the owner's key)."""
    old_signature = path.read_bytes()[-cache.SIGNATURE_BYTES:]
    with open(path, "wb") as handle:
        cache._write_members(handle, members, key or b"\0" * cache.KEY_BYTES)
    if key is None:
        with open(path, "r+b") as handle:
            handle.seek(-cache.SIGNATURE_BYTES, os.SEEK_END)
            handle.write(old_signature)


def owner_key(cache_home: Path) -> bytes:
    """What only the owner's memlens can sign with."""
    return (cache_home / cache.KEY_NAME).read_bytes()


def meta_of(members: Members) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads(members["__meta__"].tobytes())
    return meta


def with_meta(members: Members, meta: dict[str, Any]) -> Members:
    members["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    return members


def answer(snapshot: Any) -> str:
    return memlens.analyze(snapshot).to_json()


def assert_rebuilt(snapshot_file: Path) -> None:
    """The tampered entry is not used, the answer is the pickle's, and a good entry replaces it."""
    reloaded = memlens.load(snapshot_file, cache=True)
    assert not reloaded.from_cache
    assert answer(reloaded) == answer(memlens.load(snapshot_file, cache=False))
    assert memlens.load(snapshot_file, cache=True).from_cache


@pytest.fixture
def cached(snapshot_file: Path, cache_home: Path) -> Path:
    """A valid entry for ``snapshot_file``; returns its path."""
    memlens.load(snapshot_file, cache=True)
    path = entry_of(snapshot_file, cache_home)
    assert path.is_file()
    return path


# --------------------------------------------------------------------------- edits without the key


def scale(name: str, factor: int) -> Callable[[Members], None]:
    def edit(members: Members) -> None:
        members[name] = members[name] * factor

    return edit


def rename_a_frame(members: Members) -> None:
    meta = meta_of(members)
    meta["frames"][0][2] = "innocent"
    with_meta(members, meta)


@pytest.mark.parametrize("edit", [scale("d0_allocated", 1000), scale("d0_size", 2), rename_a_frame],
                         ids=["scaled allocated curve", "scaled size column", "renamed frame"])
def test_an_edited_entry_is_not_believed(snapshot_file: Path, cached: Path, edit: Callable[[Members], None]) -> None:
    members = read_members(cached)
    edit(members)  # keeps the old MAC: whoever edited it does not have the owner's key
    write_members(cached, members)
    assert_rebuilt(snapshot_file)


def test_an_entry_planted_with_another_key_is_not_believed(snapshot_file: Path, cached: Path) -> None:
    members = read_members(cached)
    members["d0_allocated"] = members["d0_allocated"] * 1000
    write_members(cached, members, b"k" * cache.KEY_BYTES)
    assert_rebuilt(snapshot_file)


def test_a_cache_beside_the_snapshot_is_never_read(snapshot_file: Path, tmp_path: Path, cache_home: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # Someone with write access to the shared folder builds a valid-looking entry with their own
    # cache and leaves it beside the snapshot under every name memlens has ever used.
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "attacker"))
    memlens.load(snapshot_file, cache=True)
    planted = next((tmp_path / "attacker").glob("v*.columns"))
    shutil.copy(planted, snapshot_file.parent / planted.name)
    shutil.copy(planted, snapshot_file.parent / f"{snapshot_file.name}.0123456789abcdef.memlens-cache.npz")
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(cache_home))
    assert not memlens.load(snapshot_file, cache=True).from_cache
    assert memlens.load(snapshot_file, cache=True).from_cache  # from the user's own folder


# --------------------------------------------------------------------------- malformed, with a valid MAC


def set_value(name: str, index: int, value: int) -> Callable[[Members, dict[str, Any]], None]:
    def edit(members: Members, meta: dict[str, Any]) -> None:
        column = members[name].copy()
        column[index] = value
        members[name] = column

    return edit


def out_of_range_stack_id(members: Members, meta: dict[str, Any]) -> None:
    set_value("d0_stack_id", 7, members["stack_offsets"].size + 10)(members, meta)


def out_of_range_metadata_id(members: Members, meta: dict[str, Any]) -> None:
    column = np.full(meta["devices"][0]["events"], 5, dtype=np.int32)
    meta["devices"][0]["constant_columns"] = [c for c in meta["devices"][0]["constant_columns"]
                                              if c != "metadata_id"]
    members["d0_metadata_id"] = column


def short_column(members: Members, meta: dict[str, Any]) -> None:
    members["d0_size"] = members["d0_size"][:-1]


def wrong_dtype(members: Members, meta: dict[str, Any]) -> None:
    members["d0_address"] = members["d0_address"].astype(np.int32)


def decreasing_offsets(members: Members, meta: dict[str, Any]) -> None:
    offsets = members["stack_offsets"].copy()
    offsets[1], offsets[2] = offsets[2], offsets[1]
    members["stack_offsets"] = offsets


def offsets_past_the_end(members: Members, meta: dict[str, Any]) -> None:
    offsets = members["stack_offsets"].copy()
    offsets[-1] += 100
    members["stack_offsets"] = offsets


def out_of_range_frame(members: Members, meta: dict[str, Any]) -> None:
    set_value("stack_frames", 0, len(meta["frames"]))(members, meta)


def bad_block(members: Members, meta: dict[str, Any]) -> None:
    set_value("blocks_state", 0, 3)(members, meta)  # past the three block states


def negative_block_size(members: Members, meta: dict[str, Any]) -> None:
    set_value("blocks_size", 0, -512)(members, meta)


def block_stack_out_of_range(members: Members, meta: dict[str, Any]) -> None:
    set_value("blocks_stack_id", 0, members["stack_offsets"].size + 10)(members, meta)


def block_offsets_past_the_end(members: Members, meta: dict[str, Any]) -> None:
    offsets = members["segment_block_offsets"].copy()
    offsets[-1] += 1
    members["segment_block_offsets"] = offsets


def block_columns_of_different_lengths(members: Members, meta: dict[str, Any]) -> None:
    members["blocks_requested_size"] = members["blocks_requested_size"][:-1]


def segment_stack_out_of_range(members: Members, meta: dict[str, Any]) -> None:
    meta["segments"][0][7] = 10**6


def other_bytes(members: Members, meta: dict[str, Any]) -> None:
    meta["content_hash"] = "0" * 64


def old_version(members: Members, meta: dict[str, Any]) -> None:
    meta["version"] = cache.CACHE_VERSION - 1


def extra_member(members: Members, meta: dict[str, Any]) -> None:
    members["d9_size"] = np.zeros(3, dtype=np.int64)


def missing_member(members: Members, meta: dict[str, Any]) -> None:
    del members["d0_reserved"]


def frames_not_a_list(members: Members, meta: dict[str, Any]) -> None:
    meta["frames"] = {"0": 1}


def text_where_an_int_belongs(members: Members, meta: dict[str, Any]) -> None:
    meta["devices"][0]["baseline_allocated"] = "27 GiB"


MALFORMED = [out_of_range_stack_id, out_of_range_metadata_id, set_value("d0_action", 3, 42),
             set_value("d0_size", 3, -512), short_column, wrong_dtype, decreasing_offsets,
             offsets_past_the_end, out_of_range_frame, bad_block, negative_block_size, block_stack_out_of_range,
             block_offsets_past_the_end, block_columns_of_different_lengths, segment_stack_out_of_range, other_bytes,
             old_version, extra_member, missing_member, frames_not_a_list, text_where_an_int_belongs]


@pytest.mark.parametrize("edit", MALFORMED, ids=lambda f: f.__name__ if hasattr(f, "__name__") else str(f))
def test_a_malformed_entry_is_rebuilt_even_when_signed(snapshot_file: Path, cached: Path, cache_home: Path,
                                                       edit: Callable[[Members, dict[str, Any]], None]) -> None:
    members = read_members(cached)
    meta = meta_of(members)
    edit(members, meta)
    write_members(cached, with_meta(members, meta), owner_key(cache_home))
    assert_rebuilt(snapshot_file)


def test_the_signing_helper_itself_keeps_a_good_entry_good(snapshot_file: Path, cached: Path,
                                                           cache_home: Path) -> None:
    # Without this, every test above could pass because re-signing alone broke the entry.
    members = read_members(cached)
    write_members(cached, members, owner_key(cache_home))
    assert memlens.load(snapshot_file, cache=True).from_cache


def write_layout(path: Path, table_text: bytes, data: bytes, key: bytes, magic: bytes = cache._MAGIC,
                 table_length: int | None = None) -> None:
    """An entry laid out by hand (magic, table, members' bytes), validly signed with ``key``."""
    length = len(table_text) if table_length is None else table_length
    head = magic + length.to_bytes(8, "little") + table_text
    body = head + bytes(cache._aligned(len(head)) - len(head)) + data
    mac = cache_folder.signer(key, "v")
    mac.update(body)
    path.write_bytes(body + mac.digest())


def entry_layout(path: Path) -> tuple[list[list[Any]], bytes]:
    """An entry's table and the bytes after it (its members, from the first aligned offset)."""
    data = path.read_bytes()[: -cache.SIGNATURE_BYTES]
    start = len(cache._MAGIC) + 8
    length = int.from_bytes(data[len(cache._MAGIC):start], "little")
    table: list[list[Any]] = json.loads(data[start:start + length])
    return table, data[cache._aligned(start + length):]


def edit_row(row: int, field: int, value: Any) -> Callable[[list[list[Any]]], None]:
    def edit(table: list[list[Any]]) -> None:
        table[row][field] = value

    return edit


def overlap(table: list[list[Any]]) -> None:
    first_nonempty = next(i for i, row in enumerate(table) if row[2] > 0)
    table[first_nonempty + 1][3] = table[first_nonempty][3]


LAYOUT_DAMAGE: dict[str, Callable[[list[list[Any]]], None]] = {
    "a float member": edit_row(0, 1, "<f8"),
    "an object member": edit_row(0, 1, "|O"),
    "a misaligned member": edit_row(1, 3, 8),
    "overlapping members": overlap,
    "a member past the end": edit_row(-1, 2, 10**9),
    "a negative count": edit_row(0, 2, -1),
    "a duplicate name": lambda table: edit_row(1, 0, table[0][0])(table),
    "a short row": lambda table: table[0].pop(),
    "a text count": edit_row(0, 2, "12"),
}


@pytest.mark.parametrize("damage", list(LAYOUT_DAMAGE))
def test_a_badly_laid_out_entry_is_refused_even_when_signed(snapshot_file: Path, cached: Path, cache_home: Path,
                                                           damage: str) -> None:
    # The signature proves who wrote an entry, not that the memlens that wrote it had no bug: the
    # table is checked before any column is made a view of the bytes.
    table, data = entry_layout(cached)
    LAYOUT_DAMAGE[damage](table)
    write_layout(cached, json.dumps(table).encode(), data, owner_key(cache_home))
    assert_rebuilt(snapshot_file)


@pytest.mark.parametrize("damage", ["magic", "table not JSON", "table not a list", "table past the end",
                                    "table not text"])
def test_a_damaged_head_is_refused_even_when_signed(snapshot_file: Path, cached: Path, cache_home: Path,
                                                    damage: str) -> None:
    table, data = entry_layout(cached)
    text = json.dumps(table).encode()
    key = owner_key(cache_home)
    if damage == "magic":
        write_layout(cached, text, data, key, magic=b"PK\x03\x04" + cache._MAGIC[4:])
    elif damage == "table not JSON":
        write_layout(cached, b"[[" + text, data, key)
    elif damage == "table not a list":
        write_layout(cached, json.dumps({"members": table}).encode(), data, key)
    elif damage == "table past the end":
        write_layout(cached, text, data, key, table_length=len(text) + len(data) + 1000)
    else:
        write_layout(cached, b"\xff\xfe" + text, data, key)
    assert_rebuilt(snapshot_file)


def test_the_layout_helpers_keep_a_good_entry_good(snapshot_file: Path, cached: Path, cache_home: Path) -> None:
    table, data = entry_layout(cached)
    write_layout(cached, json.dumps(table).encode(), data, owner_key(cache_home))
    assert memlens.load(snapshot_file, cache=True).from_cache


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "one byte flipped"])
def test_a_damaged_entry_is_rebuilt(snapshot_file: Path, cached: Path, damage: str) -> None:
    data = bytearray(cached.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "garbage":
        data = bytearray(b"garbage" * 100)
    elif damage == "empty":
        data = bytearray()
    else:
        data[len(data) // 3] ^= 0x40
    cached.write_bytes(bytes(data))
    assert_rebuilt(snapshot_file)


# --------------------------------------------------------------------------- the folder and its files


def make_foreign(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Owned by another user: really (chown, as root), or as this process sees it otherwise."""
    if os.geteuid() == 0:
        os.chown(path, OTHER_UID, OTHER_UID)
    else:
        real_uid = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: real_uid + 1)


def test_a_folder_owned_by_someone_else_is_not_used(snapshot_file: Path, cached: Path, cache_home: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    make_foreign(cache_home, monkeypatch)
    assert not memlens.load(snapshot_file, cache=True).from_cache
    before = sorted(os.listdir(cache_home))
    assert cache.write(snapshot_file, memlens.load(snapshot_file, cache=False)) is None
    assert sorted(os.listdir(cache_home)) == before


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_folder_others_can_write_is_not_used(snapshot_file: Path, cached: Path, cache_home: Path,
                                               mode: int) -> None:
    cache_home.chmod(mode)
    assert not memlens.load(snapshot_file, cache=True).from_cache
    assert cache.write(snapshot_file, memlens.load(snapshot_file, cache=False)) is None


def test_an_entry_owned_by_someone_else_is_not_used(snapshot_file: Path, cached: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() != 0:
        pytest.skip("changing a file's owner needs root; the folder-owner test covers the check otherwise")
    os.chown(cached, OTHER_UID, OTHER_UID)
    assert not memlens.load(snapshot_file, cache=True).from_cache


def test_an_entry_that_is_a_symlink_is_not_followed(snapshot_file: Path, cached: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.columns"
    cached.rename(elsewhere)
    cached.symlink_to(elsewhere)
    assert_rebuilt(snapshot_file)


@pytest.mark.parametrize("problem", ["readable by others", "wrong length", "symlink"])
def test_an_unusable_key_is_replaced(snapshot_file: Path, cached: Path, cache_home: Path, tmp_path: Path,
                                     problem: str) -> None:
    key = cache_home / cache.KEY_NAME
    if problem == "readable by others":
        key.chmod(0o644)
    elif problem == "wrong length":
        key.write_bytes(key.read_bytes()[:8])
    else:
        outside = tmp_path / "outside-key"
        outside.write_bytes(key.read_bytes())
        key.unlink()
        key.symlink_to(outside)
    assert_rebuilt(snapshot_file)
    assert not key.is_symlink() and len(key.read_bytes()) == cache.KEY_BYTES
    assert key.stat().st_mode & 0o077 == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("planted", ["key", "entry"])
def test_a_fifo_planted_in_the_cache_folder_does_not_block(snapshot_file: Path, cached: Path, cache_home: Path,
                                                           planted: str) -> None:
    """Opening a FIFO for reading waits for a writer that never comes: cache files are opened
    without blocking and refused unless regular, so every load still answers."""
    target = cache_home / cache.KEY_NAME if planted == "key" else cached
    target.unlink()
    os.mkfifo(target, 0o600)
    assert_rebuilt(snapshot_file)


# --------------------------------------------------------------------------- what the writer will store


def temporaries(folder: Path) -> list[str]:
    return [name for name in os.listdir(folder) if name.startswith(".tmp-")] if folder.exists() else []


def self_referencing() -> list[Any]:
    loop: list[Any] = []
    loop.append(loop)
    return loop


def deeply_nested() -> list[Any]:
    value: list[Any] = []
    for _ in range(100_000):
        value = [value]
    return value


def wide_and_shared() -> list[Any]:
    value: list[Any] = [1]
    for _ in range(30):  # shallow enough for the depth limit, 2**30 paths through 30 shared lists
        value = [value, value]
    return value


@pytest.mark.timeout(60)
@pytest.mark.parametrize("settings", [
    {"loop": self_referencing()}, {"deep": deeply_nested()}, {"shared": wide_and_shared()},
    {"pair": (1, 2)}, {1: "int key"}, {"nan": float("nan")}, {"object": object()},
], ids=["self-referencing", "deep", "exponential", "tuple", "int key", "nan", "object"])
def test_settings_that_would_not_come_back_exactly_are_not_cached(snapshot_file: Path, cache_home: Path,
                                                                  settings: dict[Any, Any]) -> None:
    snapshot = memlens.load(snapshot_file, cache=False)
    snapshot.allocator_settings = settings
    assert cache.write(snapshot_file, snapshot) is None
    snapshot.allocator_settings = {}
    snapshot.extra = settings
    assert cache.write(snapshot_file, snapshot) is None
    assert temporaries(cache_home) == []
    assert not memlens.load(snapshot_file, cache=True).from_cache


@pytest.mark.timeout(60)
def test_a_snapshot_with_a_self_referencing_setting_loads_without_hanging(tmp_path: Path, cache_home: Path) -> None:
    raw = synthetic_snapshot(2_000, seed=1)
    raw["allocator_settings"]["loop"] = self_referencing()
    path = tmp_path / "loop.pickle"
    path.write_bytes(pickle.dumps(raw, protocol=4))
    try:
        first = memlens.load(path, cache=True)
    except memlens.MemlensFormatError:
        first = None  # a reader may refuse such a file outright; then there is nothing to cache
    if first is not None:  # cached or not (the reader may have made the value plain), the answer holds
        again = memlens.load(path, cache=True)
        fresh = memlens.load(path, cache=False)
        assert again.allocator_settings == fresh.allocator_settings
        assert answer(again) == answer(fresh)
    assert temporaries(cache_home) == []


def test_a_failed_write_leaves_no_temporary_and_no_entry(snapshot_file: Path, cache_home: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def disk_full(handle: Any, members: Any, key: bytes) -> None:
        handle.write(b"PK\x03\x04 partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache, "_write_members", disk_full)
    snapshot = memlens.load(snapshot_file, cache=True)  # the load itself still succeeds
    assert not snapshot.from_cache
    assert temporaries(cache_home) == []
    assert list(cache_home.glob("v*.columns")) == []


def test_an_unexpected_error_while_writing_still_removes_the_temporary(snapshot_file: Path, cache_home: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(handle: Any, members: Any, key: bytes) -> None:
        handle.write(b"PK\x03\x04 partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(cache, "_write_members", interrupted)
    with pytest.raises(KeyboardInterrupt):
        memlens.load(snapshot_file, cache=True)
    assert temporaries(cache_home) == []


def test_a_bug_while_writing_costs_the_cache_not_the_load(snapshot_file: Path, cache_home: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(handle: Any, members: Any, key: bytes) -> None:
        handle.write(b"PK\x03\x04 partial")
        raise ValueError("a writer with a bug")

    monkeypatch.setattr(cache, "_write_members", broken)
    snapshot = memlens.load(snapshot_file, cache=True)
    assert answer(snapshot) == answer(memlens.load(snapshot_file, cache=False))
    assert temporaries(cache_home) == []


def test_a_failed_hash_means_no_cache(snapshot_file: Path, cache_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def unreadable(fd: int) -> Any:
        raise MemoryError

    memlens.load(snapshot_file, cache=True)
    monkeypatch.setattr(cache_folder, "hash_fd", unreadable)
    assert not memlens.load(snapshot_file, cache=True).from_cache


def test_a_model_field_the_cache_does_not_know_turns_caching_off(snapshot_file: Path, cache_home: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache, "_TRACE_SCALARS", tuple(n for n in cache._TRACE_SCALARS if n != "has_time"))
    snapshot = memlens.load(snapshot_file, cache=True)
    assert cache.write(snapshot_file, snapshot) is None
    assert not memlens.load(snapshot_file, cache=True).from_cache


def test_an_entry_over_the_size_limit_is_not_read(snapshot_file: Path, cached: Path, cache_home: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # The pruning after each write keeps no entry over the limit: one that is (a limit lowered
    # since, or a file grown by other means) is refused before it is read into memory.
    size = cached.stat().st_size
    monkeypatch.setenv(cache.CACHE_MAX_BYTES_ENV, str(size - 1))
    assert not memlens.load(snapshot_file, cache=True).from_cache
    assert not cached.exists()  # rebuilt, and pruned again as over the limit
    monkeypatch.setenv(cache.CACHE_MAX_BYTES_ENV, str(size))
    assert not memlens.load(snapshot_file, cache=True).from_cache  # written anew, within the limit
    assert memlens.load(snapshot_file, cache=True).from_cache
