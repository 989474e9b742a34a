"""The triage report cache (memlens.report_cache): a cached triage gives the answer an uncached
one gives, on every sample and real snapshot; anything that could make a stored report the
wrong answer (other bytes, another sidecar, another capacity, an edited entry) makes it unused;
and a cached triage imports neither numpy nor the analysis."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memlens import cache_folder, report_cache
from memlens.files import open_regular
from memlens.ops.triage import TriageOptions, triage
from memlens.sidecar import sidecar_name
from tests.conftest import REPO_ROOT, SAMPLE_SNAPSHOTS_DIR, needs_real_snapshots, real_snapshot_paths

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow

SAMPLES = sorted(SAMPLE_SNAPSHOTS_DIR.glob("*.pickle"))
CACHED = TriageOptions(cache=True)


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "memlens-cache"
    monkeypatch.setenv(cache_folder.CACHE_DIR_ENV, str(folder))
    monkeypatch.delenv(cache_folder.CACHE_MAX_BYTES_ENV, raising=False)
    return folder


def report_entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("r*.json")) if folder.is_dir() else []


def served_from_cache(path: Path, options: TriageOptions, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether ``triage`` answered without analysing (the analysis is made to fail if it runs)."""
    import memlens.ops.triage as ops_triage

    def no_analysis(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("analysed")

    with monkeypatch.context() as patch:
        patch.setattr(ops_triage, "analyse", no_analysis)
        try:
            triage(str(path), options)
        except AssertionError:
            return False
    return True


def assert_same_answer(path: Path, options: TriageOptions = CACHED) -> None:
    fresh = triage(str(path), TriageOptions(cache=False, capacity=options.capacity)).to_json()
    written = triage(str(path), options).to_json()  # analyses, then stores the report
    cached = triage(str(path), options).to_json()
    assert written == fresh, path.name
    assert cached == fresh, path.name


@pytest.mark.timeout(300)
def test_samples_give_the_same_report_from_the_cache(private_cache: Path) -> None:
    assert len(SAMPLES) >= 5
    for path in SAMPLES:
        assert_same_answer(path)
    assert len(report_entries(private_cache)) == len(SAMPLES)


@needs_real_snapshots
@pytest.mark.timeout(600)
def test_real_snapshots_give_the_same_report_from_the_cache() -> None:
    paths = real_snapshot_paths()
    assert paths
    for path in paths:
        assert_same_answer(path)


def test_a_second_triage_does_not_analyse(monkeypatch: pytest.MonkeyPatch) -> None:
    path = SAMPLES[0]
    assert not served_from_cache(path, CACHED, monkeypatch)  # nothing stored yet: it must analyse
    triage(str(path), CACHED)
    assert served_from_cache(path, CACHED, monkeypatch)
    assert not served_from_cache(path, TriageOptions(cache=False), monkeypatch)


def test_no_cache_neither_reads_nor_writes(private_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    triage(str(SAMPLES[0]), TriageOptions(cache=False))
    assert report_entries(private_cache) == []
    monkeypatch.setenv(cache_folder.CACHE_MAX_BYTES_ENV, "0")  # caching off
    triage(str(SAMPLES[0]), CACHED)
    assert report_entries(private_cache) == []


def test_small_files_are_not_cached_by_default(private_cache: Path) -> None:
    assert SAMPLES[0].stat().st_size < cache_folder.CACHE_MIN_BYTES
    triage(str(SAMPLES[0]), TriageOptions())
    assert report_entries(private_cache) == []


def copy_of(source: Path, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / source.name
    target.write_bytes(source.read_bytes())
    return target


def test_other_bytes_are_another_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = SAMPLES[0], SAMPLES[1]
    path = copy_of(first, tmp_path / "run")
    triage(str(path), CACHED)
    path.write_bytes(second.read_bytes())  # the same name, other bytes
    assert not served_from_cache(path, CACHED, monkeypatch)
    assert triage(str(path), CACHED).to_json() == triage(str(path), TriageOptions(cache=False)).to_json()
    assert triage(str(path), CACHED).to_json() != triage(str(first), TriageOptions(cache=False)).to_json()


def test_a_capacity_is_part_of_the_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    path = SAMPLES[0]
    triage(str(path), CACHED)
    other = TriageOptions(cache=True, capacity=3 << 30)
    assert not served_from_cache(path, other, monkeypatch)
    assert_same_answer(path, other)


def recorded_run_with_sidecar() -> Path:
    for path in SAMPLES:
        if Path(sidecar_name(str(path))).is_file():
            return path
    pytest.skip("no sample snapshot has a sidecar")


def test_a_changed_sidecar_is_another_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sample = recorded_run_with_sidecar()
    path = copy_of(sample, tmp_path / "run")
    sidecar = Path(sidecar_name(str(path)))
    sidecar.write_bytes(Path(sidecar_name(str(sample))).read_bytes())
    with_sidecar = triage(str(path), CACHED).to_json()
    assert with_sidecar["sidecar"] is not None
    sidecar.write_text("{not json")  # now unusable: the report must say so, not reuse the old one
    assert not served_from_cache(path, CACHED, monkeypatch)
    broken = triage(str(path), CACHED).to_json()
    assert broken["sidecar"] is None
    assert broken == triage(str(path), TriageOptions(cache=False)).to_json()
    sidecar.unlink()  # gone: another answer again
    assert not served_from_cache(path, CACHED, monkeypatch)


@pytest.mark.parametrize("damage", ["payload", "mac", "truncate", "empty"])
def test_a_damaged_entry_is_ignored(damage: str, private_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = SAMPLES[0]
    expected = triage(str(path), CACHED).to_json()
    (entry,) = report_entries(private_cache)
    data = bytearray(entry.read_bytes())
    if damage == "payload":  # a number changed, the JSON still valid: only the MAC can tell
        text = data[report_cache.MAC_BYTES:].decode()
        peak = expected["devices"]["0"]["peak_allocated_bytes"] if "0" in expected["devices"] else None
        assert peak is not None
        edited = text.replace(f'"peak_allocated_bytes":{peak}', f'"peak_allocated_bytes":{peak * 2}', 1)
        assert edited != text
        data[report_cache.MAC_BYTES:] = edited.encode()
    elif damage == "mac":
        data[0] ^= 1
    elif damage == "truncate":
        del data[len(data) // 2:]
    else:
        del data[:]
    entry.write_bytes(bytes(data))
    assert not served_from_cache(path, CACHED, monkeypatch)
    assert triage(str(path), CACHED).to_json() == expected


def test_an_entry_from_another_users_key_is_ignored(private_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = SAMPLES[0]
    triage(str(path), CACHED)
    key = private_cache / cache_folder.KEY_NAME
    key.write_bytes(os.urandom(cache_folder.KEY_BYTES))  # the entry was signed with the old key
    assert not served_from_cache(path, CACHED, monkeypatch)


def test_an_entry_that_is_not_a_regular_file_is_ignored(private_cache: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path = SAMPLES[0]
    triage(str(path), CACHED)
    (entry,) = report_entries(private_cache)
    entry.unlink()
    os.mkfifo(entry)  # opening a FIFO to read would wait for ever
    assert not served_from_cache(path, CACHED, monkeypatch)


def test_the_code_identity_names_the_engine() -> None:
    pytest.importorskip("memlens._native", reason="one engine only: the native core is not built")
    script = "from memlens.report_cache import code_identity; print(code_identity())"

    def identity(pure_python: str) -> str:
        return subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True, env={**os.environ, "MEMLENS_PURE_PYTHON": pure_python}).stdout.strip()

    assert identity("1") != identity("0")


def test_the_code_identity_covers_every_module(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    package = tmp_path / "memlens"
    (package / "analysis").mkdir(parents=True)
    (package / "a.py").write_text("x = 1\n")
    (package / "analysis" / "b.py").write_text("y = 1\n")
    monkeypatch.setattr(report_cache, "__file__", str(package / "report_cache.py"))
    report_cache.code_identity.cache_clear()
    try:
        identities = [report_cache.code_identity()]
        for edited in (package / "a.py", package / "analysis" / "b.py"):
            report_cache.code_identity.cache_clear()
            edited.write_text(edited.read_text().replace("1", "2"))  # same size, other source
            identities.append(report_cache.code_identity())
        assert len(set(identities)) == 3  # a module in a subpackage counts as much as one at the top
        report_cache.code_identity.cache_clear()
        (package / "analysis" / "notes.txt").write_text("not code")
        assert report_cache.code_identity() == identities[-1]
    finally:
        report_cache.code_identity.cache_clear()


def test_the_slot_hashes_the_bytes_read_through_its_descriptor(tmp_path: Path) -> None:
    path = copy_of(SAMPLES[0], tmp_path / "run")
    with open_regular(str(path)) as opened:
        slot = report_cache.ReportSlot.for_opened(opened, None)
        assert slot is not None
        first = slot.name
        slot.close()
    path.write_bytes(SAMPLES[1].read_bytes())
    with open_regular(str(path)) as opened:
        slot = report_cache.ReportSlot.for_opened(opened, None)
        assert slot is not None
        assert slot.name != first
        slot.close()


@pytest.mark.timeout(120)
def test_a_cached_triage_imports_neither_numpy_nor_the_analysis(tmp_path: Path) -> None:
    """A file the cache knows (its digest remembered: it was last written before the first triage
    began by more than the racy margin) is answered without hashing, scanning or importing the
    analysis. One younger than that is hashed and scanned too, as a first triage is."""
    path = copy_of(SAMPLES[0], tmp_path / "run")
    time.sleep(cache_folder.RACY_MARGIN_NS / 1e9 + 0.2)
    env = {**os.environ, cache_folder.CACHE_DIR_ENV: str(tmp_path / "cache")}
    triage_once = [sys.executable, "-m", "memlens", "triage", str(path), "--cache", "--no-color", "--width", "100"]
    first = subprocess.run(triage_once, capture_output=True, text=True, env=env, cwd=REPO_ROOT, check=True)
    probe = f"""
import sys, io, contextlib
from memlens.cli.launch import main
out = io.StringIO()
try:
    with contextlib.redirect_stdout(out):
        main({triage_once[3:]!r})  # the program's own path (given its arguments, it returns here)
except SystemExit:
    pass
heavy = sorted(m for m in ("numpy", "torch", "memlens.snapshot.model", "memlens.analysis.run") if m in sys.modules)
print(json.dumps({{"heavy": heavy, "text": out.getvalue()}}))
"""
    second = subprocess.run([sys.executable, "-c", "import json\n" + probe], capture_output=True, text=True,
                            env=env, cwd=REPO_ROOT, check=True)
    answer = json.loads(second.stdout)
    assert answer["heavy"] == []
    assert answer["text"] == first.stdout


def test_a_first_triage_hashes_the_file_once(file_hashes: list[int]) -> None:
    # The report slot and the snapshot cache entry both need the file's SHA-256: one hash serves both.
    fresh = triage(str(SAMPLES[0]), CACHED).to_json()
    assert len(file_hashes) == 1
    assert triage(str(SAMPLES[0]), CACHED).to_json() == fresh  # and both entries were written from it
