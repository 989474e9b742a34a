"""The ``memlens`` program's head start: the snapshot of a ``triage`` or ``whatif`` is hashed or
scanned on another thread before click and the command's modules are imported, and the command
takes what was begun instead of starting over -- with the same answer as without it."""

from __future__ import annotations

import gc
import gzip
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from memlens import cache_folder
from memlens.cli import head_start
from memlens.cli.launch import main as launch_main
from memlens.cli.main import cli
from memlens.files import OpenedFile, open_regular
from memlens.snapshot import ahead, native_scan
from tests.conftest import SAMPLE_SNAPSHOTS_DIR

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow

SAMPLE = SAMPLE_SNAPSHOTS_DIR / "leak.pickle"


@pytest.fixture(autouse=True)
def _nothing_left_started(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.setenv(cache_folder.CACHE_DIR_ENV, str(tmp_path / "cache"))
    yield
    for opened in head_start._started.values():  # a test that started and never took: let it end
        ahead.wait(opened)
        hashed = cache_folder.hash_started(opened)
        if hashed is not None:
            hashed.result()
        opened.close()
    head_start._started.clear()


def started_file(token: str) -> OpenedFile | None:
    return head_start._started.get(token)


def test_a_cached_triage_has_its_file_hashed_before_the_imports(
    monkeypatch: pytest.MonkeyPatch, file_hashes: list[int],
) -> None:
    monkeypatch.setattr(cache_folder, "CACHE_MIN_BYTES", 0)  # every file is cached, as a large one is
    head_start.start(["--debug", "triage", "--width", "90", str(SAMPLE)])
    opened = started_file(str(SAMPLE))
    assert opened is not None and cache_folder.hash_started(opened) is not None
    assert len(file_hashes) == 1
    with head_start.snapshot_source(str(SAMPLE)) as source:
        assert source is opened  # taken, once
        assert started_file(str(SAMPLE)) is None
    assert opened.fd == -1  # closed when the block ended, its hash done


def test_an_uncached_file_is_scanned_ahead_and_the_reader_takes_the_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    if native_scan.scanner() is None:
        pytest.skip("the native scanner is not built")
    taken: list[object] = []
    real_take = ahead.take_scan

    def counted(opened: OpenedFile) -> ahead.Begun[Any] | None:
        begun = real_take(opened)
        taken.append(begun)
        return begun

    monkeypatch.setattr(ahead, "take_scan", counted)
    head_start.start(["triage", str(SAMPLE), "--no-cache"])
    opened = started_file(str(SAMPLE))
    assert opened is not None and cache_folder.hash_started(opened) is None
    from memlens.ops.triage import TriageOptions, triage

    with head_start.snapshot_source(str(SAMPLE)) as source:
        report = triage(source, TriageOptions(cache=False))
    assert len(taken) == 1 and taken[0] is not None  # the reader read the scan begun ahead
    assert report.to_json() == triage(str(SAMPLE), TriageOptions(cache=False)).to_json()


@pytest.mark.parametrize("args", [
    ["fleet", str(SAMPLE)],  # not a command that reads one file
    ["triage"],  # no file
    ["triage", "no/such/file.pickle"],
    ["triage", str(SAMPLE_SNAPSHOTS_DIR)],  # a folder
    ["triage", str(SAMPLE), str(SAMPLE_SNAPSHOTS_DIR / "healthy.pickle")],  # which one? none
    ["--help"],
    [],
])
def test_nothing_starts_when_the_command_line_is_not_one_snapshot_of_triage_or_whatif(args: list[str]) -> None:
    head_start.start(args)
    assert head_start._started == {}


def test_a_file_that_is_no_snapshot_is_left_alone(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text('{"hidden_size": 64}')
    head_start.start(["triage", "--config", str(config), str(SAMPLE), "--no-cache"])
    assert list(head_start._started) == [str(SAMPLE)]  # the JSON is not a candidate


def test_a_fifo_named_on_the_command_line_never_blocks_the_start(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.pickle"
    os.mkfifo(fifo)
    head_start.start(["triage", str(fifo)])  # opened without blocking, refused: not a regular file
    assert head_start._started == {}


def test_a_gzip_is_hashed_ahead_but_never_scanned_ahead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    packed = tmp_path / "leak.pickle.gz"
    packed.write_bytes(gzip.compress(SAMPLE.read_bytes()))
    head_start.start(["triage", str(packed), "--no-cache"])  # the reader inflates a gzip first
    assert head_start._started == {}
    monkeypatch.setattr(cache_folder, "CACHE_MIN_BYTES", 0)
    head_start.start(["whatif", str(packed), "--expandable-segments"])
    opened = started_file(str(packed))
    assert opened is not None and cache_folder.hash_started(opened) is not None


def test_the_scan_begun_ahead_reads_what_the_reader_would(tmp_path: Path) -> None:
    if native_scan.scanner() is None:
        pytest.skip("the native scanner is not built")
    with open_regular(SAMPLE) as opened:
        assert ahead.start_scan(opened) and ahead.start_scan(opened)  # once: the second finds it running
        begun = ahead.take_scan(opened)
        assert begun is not None and ahead.take_scan(opened) is None
        early, _ = native_scan.scanned(begun)
        direct, _ = native_scan.scan_file(opened.fd, opened.size)
    assert early is not None and direct is not None
    assert early["segments"] == direct["segments"]
    assert [len(t) for t in early["device_traces"]] == [len(t) for t in direct["device_traces"]]
    truncated = tmp_path / "truncated.pickle"
    shutil.copyfile(SAMPLE, truncated)
    with open_regular(truncated) as opened:
        os.truncate(truncated, opened.size // 2)  # shorter than at open: declined, as the direct scan does
        assert ahead.start_scan(opened)
        begun = ahead.take_scan(opened)
        assert begun is not None
        assert native_scan.scanned(begun) == native_scan.scan_file(opened.fd, opened.size)


def test_no_scan_ahead_on_the_python_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMLENS_PURE_PYTHON", "1")
    with open_regular(SAMPLE) as opened:
        assert not ahead.start_scan(opened)


@pytest.mark.parametrize("command", [
    ["triage", str(SAMPLE), "--width", "100", "--no-color", "--no-cache"],
    ["triage", str(SAMPLE), "--json", "--cache"],
    ["whatif", str(SAMPLE), "--expandable-segments", "--json"],
])
def test_the_program_answers_as_the_command_group_does(
    command: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(cache_folder, "CACHE_MIN_BYTES", 0)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")  # the program sets it (restored after the test)
    expected = CliRunner().invoke(cli, command)
    assert expected.exit_code == 0, expected.output
    try:
        with pytest.raises(SystemExit) as exited:
            launch_main(command)
    finally:
        gc.unfreeze()  # the program freezes what is left for its exit; a test process goes on
    assert exited.value.code == 0
    assert capsys.readouterr().out == expected.output
    assert head_start._started == {}  # the command took the file it named


@pytest.mark.parametrize(("command", "one_blas_thread"), [
    (["triage", "--help"], True),
    (["whatif", "--help"], True),
    (["record", "--help"], False),  # the user's script inherits the environment: left as it is
    (["predict", "--help"], False),
    (["plan", "--help"], False),
])
def test_numpy_gets_one_blas_thread_unless_the_users_code_runs(
    command: list[str], one_blas_thread: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")  # recorded: what the program sets is undone after
    monkeypatch.delenv("OPENBLAS_NUM_THREADS")
    try:
        with pytest.raises(SystemExit):
            launch_main(command)
    finally:
        gc.unfreeze()
    capsys.readouterr()
    assert (os.environ.get("OPENBLAS_NUM_THREADS") == "1") is one_blas_thread


def test_a_stopped_scan_declines_at_its_next_read() -> None:
    """A scan nobody will take is stopped (``ahead.wait``): its next read finds the file's end and
    it declines as for a truncated file, so no thread is left in the scanner at the exit."""
    module = ahead.scanner()
    if module is None:
        pytest.skip("the native scanner is not built")
    with open_regular(SAMPLE) as opened:
        stop = module.StopFlag()
        stop.set()
        ok, reason = module.scan_file(opened.fd, opened.size, ahead.SCAN_CHUNK, stop)
        assert not ok and "truncated" in reason
        assert module.scan_file(opened.fd, opened.size, ahead.SCAN_CHUNK, module.StopFlag())[0]  # not set: read
        assert ahead.start_scan(opened)
        ahead.wait(opened)  # stopped and waited for; nothing left to take
        assert ahead.take_scan(opened) is None


def test_a_usage_error_after_a_scan_began_ends_in_one_line(tmp_path: Path) -> None:
    """The program stops what it began for a command that fails before reading its file: click's
    usage error, exit 2, and no abort from a thread left in the scanner as the interpreter shuts
    down (``terminate called without an active exception``, exit -6, before)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "memlens", "triage", str(SAMPLE), "--no-cache", "--top", "0"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert "--top" in done.stderr and "terminate" not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(("command", "code"), [
    (["whatif", str(SAMPLE), "--expandable-segments", "--json"], 0),
    (["triage", str(SAMPLE), "--json", "--no-cache"], 0),
    (["whatif", str(SAMPLE), "--capacity", "0"], 2),  # a usage error: one line, status 2
    (["triage", "/no/such/snapshot.pickle"], 2),
])
def test_the_quick_exit_keeps_the_output_and_the_status(command: list[str], code: int) -> None:
    # triage and whatif end with os._exit once their output is flushed: every byte printed is
    # still there, and the status is the command's.
    expected = CliRunner().invoke(cli, command)
    assert expected.exit_code == code
    ran = subprocess.run([sys.executable, "-m", "memlens", *command], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "MEMLENS_CACHE_DIR": "/nonexistent/memlens-cache"})
    assert ran.returncode == code, ran.stderr
    if code == 0:
        assert ran.stdout == expected.output
    else:
        assert ran.stderr.strip() and "Traceback" not in ran.stderr
