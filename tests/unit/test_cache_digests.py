"""A snapshot's digest remembered by the file's identity (``memlens.cache_folder.remembered_digest``):
asking again about an unchanged file reads none of its bytes, and nothing that changes the file
(a rewrite of the same size with its modification time put back, a copy, a write within the racy
margin) or forges the entry lets a remembered digest stand for other bytes."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from memlens import cache_folder
from memlens.files import open_regular
from memlens.ops.triage import TriageOptions, triage
from tests.conftest import SAMPLE_SNAPSHOTS_DIR

SAMPLES = sorted(SAMPLE_SNAPSHOTS_DIR.glob("*.pickle"))
CACHED = TriageOptions(cache=True)


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "memlens-cache"
    monkeypatch.setenv(cache_folder.CACHE_DIR_ENV, str(folder))
    monkeypatch.delenv(cache_folder.CACHE_MAX_BYTES_ENV, raising=False)
    return folder


def remember_now(path: Path) -> str:
    """Hash ``path`` and remember its digest as a hash begun well after its last change would."""
    with open_regular(str(path)) as opened:
        hashed = cache_folder.hash_fd(opened.fd)
        later = time.time_ns() + cache_folder.RACY_MARGIN_NS + 1
        cache_folder.remember_digest(opened.fd, hashed, later)
        return hashed[0]


def remembered(path: Path) -> str | None:
    with open_regular(str(path)) as opened:
        found = cache_folder.remembered_digest(opened.fd)
        return found[0] if found is not None else None


def test_an_unchanged_file_is_known_by_its_identity(tmp_path: Path) -> None:
    path = tmp_path / "run.pickle"
    shutil.copyfile(SAMPLES[0], path)
    assert remembered(path) is None
    digest = remember_now(path)
    assert remembered(path) == digest
    with open_regular(str(path)) as opened:
        hashed = cache_folder.hash_opened(opened)
        assert hashed.known and hashed.result() == (digest, cache_folder.file_identity(os.fstat(opened.fd)))


def test_a_same_size_rewrite_with_its_time_put_back_is_another_file(tmp_path: Path) -> None:
    """The modification time can be set back with utime; the change time cannot."""
    path = tmp_path / "run.pickle"
    data = SAMPLES[0].read_bytes()
    path.write_bytes(data)
    remember_now(path)
    before = os.stat(path)
    with open(path, "r+b") as handle:  # the same size, one byte different, in place (same inode)
        handle.seek(len(data) // 2)
        handle.write(bytes([data[len(data) // 2] ^ 1]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_ino == before.st_ino and os.stat(path).st_mtime_ns == before.st_mtime_ns
    assert remembered(path) is None


def test_a_copy_is_hashed_again(tmp_path: Path) -> None:
    path = tmp_path / "run.pickle"
    shutil.copyfile(SAMPLES[0], path)
    remember_now(path)
    copy = tmp_path / "copy.pickle"
    shutil.copy2(path, copy)  # the same bytes and times, another inode
    assert remembered(copy) is None


def test_a_file_written_within_the_racy_margin_is_not_remembered(tmp_path: Path) -> None:
    path = tmp_path / "run.pickle"
    shutil.copyfile(SAMPLES[0], path)
    with open_regular(str(path)) as opened:
        cache_folder.remember_digest(opened.fd, cache_folder.hash_fd(opened.fd), time.time_ns())
    assert remembered(path) is None


def test_a_forged_or_misplaced_entry_is_ignored(tmp_path: Path, private_cache: Path) -> None:
    path = tmp_path / "run.pickle"
    shutil.copyfile(SAMPLES[0], path)
    remember_now(path)
    (entry,) = private_cache.glob("d*.digest")
    signed = entry.read_bytes()
    body = signed[: -cache_folder.SIGNATURE_BYTES]
    forged = body[:-1] + (b"0" if body[-1:] != b"0" else b"1")
    entry.write_bytes(forged + signed[-cache_folder.SIGNATURE_BYTES:])  # another digest, the old MAC
    assert remembered(path) is None
    other = tmp_path / "other.pickle"
    shutil.copyfile(SAMPLES[1], other)
    with open_regular(str(other)) as opened:
        name, _ = cache_folder._digest_entry(cache_folder.file_identity(os.fstat(opened.fd)))
    entry.write_bytes(signed)
    os.replace(entry, private_cache / name)  # a valid entry, under another file's name
    os.chmod(private_cache / name, 0o600)
    assert remembered(other) is None


def test_a_remembered_digest_gives_the_answer_a_hash_gives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triage remembers the digest of a file older than the margin, answers from it next time,
    and answers for the new bytes once the file is rewritten in place (its time put back)."""
    monkeypatch.setattr(cache_folder, "RACY_MARGIN_NS", -(10**12))  # every file counts as old
    path = tmp_path / "run.pickle"
    shutil.copyfile(SAMPLES[0], path)
    first = triage(str(path), CACHED).to_json()
    assert remembered(path) is not None
    assert triage(str(path), CACHED).to_json() == first
    before = os.stat(path)
    with open(path, "r+b") as handle, open(SAMPLES[1], "rb") as other:
        handle.truncate(0)
        handle.write(other.read())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert triage(str(path), CACHED).to_json() == triage(str(path), TriageOptions(cache=False)).to_json()
    assert triage(str(path), CACHED).to_json() != first
