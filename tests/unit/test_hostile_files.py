"""Hostile snapshot files, one test per attack class (issue 11): ``memlens triage`` ends in
one line on stderr and exit 2, or in a correct analysis, never a traceback, a hang or a
MemoryError. Each file runs in a child process under a 2 GiB address-space limit, so a
regression fails the test instead of swapping the machine, and a hang hits the timeout."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hostile_files import ACCEPTED, CORPUS, dumps, entry, snapshot

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow

MEMORY_LIMIT = 2 << 30
OUTPUT_LIMIT = 2 << 30
REPO = Path(__file__).resolve().parents[2]

# What the one line must say for each refused file (a word or two of the problem).
EXPECTED = {
    ("hash bomb", "dict key"): "a tuple of anything but a few small integers",
    ("hash bomb", "entry key"): "a tuple of anything but a few small integers",
    ("hash bomb", "action"): "a tuple of anything but a few small integers",
    ("hash bomb", "user_metadata"): "a tuple of anything but a few small integers",
    ("hash bomb", "frozenset"): "a frozenset",
    ("hash bomb", "colliding ints"): "integers beyond +-2**61",
    # Pairs of 61-bit ints are legal pool ids (CaptureId_t): counted, refused past 10,000 (seconds).
    ("hash bomb", "colliding tuples"): "more than 10,000 tuples of integers beyond 32 bits",
    ("reference amplification", "segments x blocks"): "refers to objects met elsewhere",
    ("reference amplification", "trace entries"): "refers to objects met elsewhere",
    ("reference amplification", "DUP"): "DUP",
    ("reference amplification", "annotations"): "refers to objects met elsewhere",
    ("reference amplification", "gzip"): "inflates to more than",  # 9 KB: refused at 1 MiB inflated
    ("reference amplification", "gzip bomb"): "inflate the stream past",
    ("reference amplification", "gzip bomb strings"): "inflates to more than",
    ("reference amplification", "gzip of tiny events"): "inflates to more than 4,",
    ("deep nesting", "frames"): "a stack frame should be a dict",
    ("deep nesting", "marks"): "not a readable pickle",
    ("types and numbers", "NaN time_us"): "'time_us' should be an integer, found nan",
    ("types and numbers", "list state"): "'state' should be text, found a list",
    ("types and numbers", "device_free 2**80"): "'device_free' is out of range",
    ("types and numbers", "address past 2**64"): "'addr' is out of range at entry 0",
    ("types and numbers", "LONG4"): "LONG4",
    ("types and numbers", "memo index"): "memo index",
    ("many devices", "device_traces"): "40,000 devices",
    ("many devices", "segment devices"): "'device' is out of range",
}


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _limit_memory_and_output() -> None:
    _limit_memory()
    resource.setrlimit(resource.RLIMIT_FSIZE, (OUTPUT_LIMIT, OUTPUT_LIMIT))  # no file may fill the disk


def memlens(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "memlens", *args],
        capture_output=True, text=True, cwd=REPO, preexec_fn=_limit_memory, timeout=50, check=False,
    )


def triage(path: Path) -> subprocess.CompletedProcess[str]:
    return memlens("triage", str(path), "--no-cache")


def check_class(attack: str, tmp_path: Path) -> None:
    for name, build in CORPUS[attack].items():
        path = tmp_path / f"{name.replace(' ', '_').replace('*', '')}.pickle"
        path.write_bytes(build())
        result = triage(path)
        if (attack, name) in ACCEPTED:
            assert result.returncode == 0, (name, result.stderr[-2000:])
            assert "peak allocated" in result.stdout, name
            replay = memlens("whatif", str(path))  # the allocator replay of what was accepted
            assert replay.returncode == 0, (name, replay.stderr[-2000:])
            continue
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2, (name, result.returncode, result.stderr[-2000:])
        assert len(lines) == 1, (name, lines[:5])
        assert lines[0].startswith(f"memlens: error: {path}: "), (name, lines[0])
        assert EXPECTED[(attack, name)] in lines[0], (name, lines[0])


@pytest.mark.timeout(300)
def test_hash_bombs_are_refused_before_anything_is_hashed(tmp_path: Path) -> None:
    check_class("hash bomb", tmp_path)


@pytest.mark.timeout(300)
def test_shared_segments_blocks_and_entries_are_refused_not_multiplied(tmp_path: Path) -> None:
    check_class("reference amplification", tmp_path)


@pytest.mark.timeout(300)
def test_deep_nesting_is_cut_or_refused_without_recursion(tmp_path: Path) -> None:
    check_class("deep nesting", tmp_path)


@pytest.mark.timeout(300)
def test_wrong_types_and_out_of_range_numbers_name_the_field(tmp_path: Path) -> None:
    check_class("types and numbers", tmp_path)


@pytest.mark.timeout(300)
def test_huge_strings_are_cut_and_analysed(tmp_path: Path) -> None:
    check_class("huge strings", tmp_path)


@pytest.mark.timeout(300)
def test_many_steps_and_streams_are_analysed_in_linear_time(tmp_path: Path) -> None:
    check_class("many steps and streams", tmp_path)


@pytest.mark.timeout(300)
def test_rows_sharing_a_deep_stack_cost_the_stack_once(tmp_path: Path) -> None:
    """Release runs and allocations sharing one 100,000-frame stack: triage and whatif (in
    check_class), then diff, the HTML export and the lens commands, each in the subprocess's 50 s."""
    check_class("shared deep stacks", tmp_path)
    releases, allocations = tmp_path / "release_runs.pickle", tmp_path / "allocations.pickle"
    compared = memlens("diff", str(releases), str(allocations))
    assert compared.returncode == 0, compared.stderr[-2000:]
    exported = memlens("export", str(allocations), "-o", str(tmp_path / "report.html"))
    assert exported.returncode == 0, exported.stderr[-2000:]
    for lens in (["group", "--by", "stack"], ["group", "--by", "frame", "--window", "10:90000"], ["stages"],
                 ["lines", "f3.py", "--json"]):  # the lens commands: labels per stack id, not per row
        looked = memlens(lens[0], str(allocations), *lens[1:])
        assert looked.returncode == 0, (lens, looked.stderr[-2000:])
    for suffix in ("jsonl", "csv"):  # each row wrote the whole stack: gigabytes from 6 MB
        out = tmp_path / f"events.{suffix}"
        exported = subprocess.run(
            [sys.executable, "-m", "memlens", "export", str(allocations), "-o", str(out), "--no-analysis"],
            capture_output=True, text=True, cwd=REPO, preexec_fn=_limit_memory_and_output, timeout=120, check=False)
        assert exported.returncode == 0, exported.stderr[-2000:]
        assert out.stat().st_size < 100 * allocations.stat().st_size


@pytest.mark.timeout(300)
def test_many_devices_are_refused_or_analysed_in_linear_time(tmp_path: Path) -> None:
    check_class("many devices", tmp_path)


def test_every_corpus_file_has_an_expected_outcome() -> None:
    names = {(attack, name) for attack, files in CORPUS.items() for name in files}
    assert names == set(EXPECTED) | ACCEPTED
    assert not set(EXPECTED) & ACCEPTED


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sidecar", [
    "[" * 100_000 + "]" * 100_000,
    '{"device": {"total_memory_bytes": 1e999}, "model": {"parameters_total": Infinity}}',
    '{"device": {"total_memory_bytes": NaN}, "trainable_parameters": -Infinity}',
    '{"device": {"total_memory_bytes": 1208925819614629174706176}, "model": {"parameters_total": "7e9"}}',
    '{"model": [1, 2], "optimizer": "adam", "steps": {"0": null}, "device": []}',
    '{"device": {"total_memory_bytes": 2048}, "allocator_settings": {"max_split_size": "big"}}',
    '{"x": "' + "y" * 1_000_000 + '"}',
    "not json at all",
], ids=["deep", "inf", "nan", "2**80", "wrong shapes", "small capacity", "huge string", "not json"])
def test_hostile_sidecars_only_lose_extras(tmp_path: Path, sidecar: str) -> None:
    """The recorder's JSON sidecar next to a snapshot is input too: the analysis still runs."""
    path = tmp_path / "run.pickle"
    path.write_bytes(dumps(snapshot()))
    (tmp_path / "run.memlens.json").write_text(sidecar)
    for command in ("triage", "whatif"):
        result = memlens(command, str(path))
        assert result.returncode == 0, (command, result.stderr[-2000:])
        assert "Traceback" not in result.stderr


def test_one_long_name_shared_by_many_frames_costs_a_bounded_text_budget() -> None:
    """100,000 frame dicts cost the file a few bytes each even when they share one 1 MB name;
    kept at 4 KiB each they would cost the model and the cache 400 MB."""
    from memlens.snapshot.reader import MAX_TEXT, SHORT_TEXT, parse

    name = "n" * (1 << 20)
    frames = [{"filename": "f.py", "line": line, "name": name} for line in range(100_000)]
    raw = snapshot(device_traces=[[entry("alloc", 0x1000, 512, frames=frames)]])
    table = parse(raw, text_budget=1 << 20).stacks
    lengths = [len(frame.name) for frame in table.frames if frame.filename == "f.py"]
    assert lengths[0] == MAX_TEXT and lengths[-1] == SHORT_TEXT
    assert sum(lengths) < (1 << 20) + MAX_TEXT + SHORT_TEXT * len(lengths)
