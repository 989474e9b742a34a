"""``memlens export --format jsonl|csv``: every event once, fields as in the snapshot, hostile
strings harmless, memory flat whatever the trace's length, files whole or absent."""

from __future__ import annotations

import csv
import io
import json
import os
import pickle
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import memlens
from memlens.analysis import analyze_snapshot
from memlens.analysis.datatypes import CATEGORIES
from memlens.cli.main import cli
from memlens.snapshot.model import MAX_FRAMES_EXAMINED, Action, DeviceTrace, Frame, Snapshot, StackTable
from memlens.stream_export import (
    BLOCK_COLUMNS,
    CONTENT_FACTOR,
    EVENT_COLUMNS,
    FRAME_SEPARATOR,
    atomic_stream,
    csv_text,
    event_labels,
    frame_text_lengths,
    table_content,
    write_table,
)
from tests.conftest import REPO_ROOT, SAMPLE_SNAPSHOTS_DIR, needs_real_snapshots, real_snapshot, real_snapshot_paths
from tests.unit.tracebuilder import MiB, TraceBuilder, frame, training_run

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow

SAMPLES = sorted(SAMPLE_SNAPSHOTS_DIR.glob("*.pickle"))


def export(snapshot: Snapshot, fmt: str, table: str = "events", labels: Any = None) -> bytes:
    sink = io.BytesIO()
    write_table(snapshot, sink, fmt, table, labels)  # type: ignore[arg-type]
    return sink.getvalue()


def read_jsonl(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.decode("utf-8").splitlines()]


def read_csv(data: bytes) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(data.decode("utf-8"), newline="")))


def stack_text(snapshot: Snapshot, stack_id: int) -> str:
    return FRAME_SEPARATOR.join(f"{f.filename}:{f.line}:{f.name}" for f in snapshot.stacks.frames_of(stack_id))


def block_rows(snapshot: Snapshot) -> int:
    return sum(max(1, len(segment.blocks)) for segment in snapshot.segments)


# --------------------------------------------------------------------------- counts


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_cli_writes_one_row_per_event_of_each_sample(path: Path, tmp_path: Path) -> None:
    snapshot = memlens.load(path, cache=False)
    for suffix in ("jsonl", "csv"):
        out = tmp_path / f"events.{suffix}"
        result = CliRunner().invoke(cli, ["export", str(path), "-o", str(out), "--no-cache"])
        assert result.exit_code == 0, result.output
        assert f"wrote {out} ({snapshot.total_events:,} rows of events" in result.output
        rows = read_jsonl(out.read_bytes()) if suffix == "jsonl" else read_csv(out.read_bytes())
        assert len(rows) == snapshot.total_events
    out = tmp_path / "blocks.csv"
    result = CliRunner().invoke(cli, ["export", str(path), "--table", "blocks", "-o", str(out), "--no-cache"])
    assert result.exit_code == 0, result.output
    assert len(read_csv(out.read_bytes())) == block_rows(snapshot)


@needs_real_snapshots
@pytest.mark.timeout(300)
def test_real_snapshots_export_every_event_and_block() -> None:
    for path in real_snapshot_paths():
        snapshot = memlens.load(path, cache=False)
        events = read_jsonl(export(snapshot, "jsonl"))
        assert len(events) == snapshot.total_events, path.name
        assert len(read_csv(export(snapshot, "csv"))) == snapshot.total_events, path.name
        assert len(read_jsonl(export(snapshot, "jsonl", "blocks"))) == block_rows(snapshot), path.name
        for row in events[:: max(1, len(events) // 200)]:  # a spread of rows, each field checked
            trace = snapshot.devices[row["device"]]
            i = row["event"]
            assert row["action"] == trace.action_of(i).label
            assert (row["address"], row["size"], row["stream"]) == (
                int(trace.address[i]), int(trace.size[i]), int(trace.stream[i]))
            assert row["allocated_bytes"] == int(trace.allocated[i])
            stack_id = int(trace.stack_id[i])
            assert row["frames"] == (stack_text(snapshot, stack_id) if stack_id >= 0 else None)
            assert row["frames_omitted"] == (0 if stack_id >= 0 else None)  # a real stack is never cut
        stacks = read_jsonl(export(snapshot, "jsonl", "stacks"))
        assert [row["stack_id"] for row in stacks] == list(range(len(snapshot.stacks))), path.name
        assert all(row["frames"] == stack_text(snapshot, row["stack_id"]) for row in stacks), path.name


@needs_real_snapshots
@pytest.mark.timeout(120)
def test_cli_exports_a_real_snapshot_with_categories(tmp_path: Path) -> None:
    path = real_snapshot("MAGMA27__assignment2-systems__memory_snapshot.pickle")
    out = tmp_path / "events.jsonl"
    result = CliRunner().invoke(cli, ["export", str(path), "-o", str(out), "--no-cache"])
    assert result.exit_code == 0, result.output
    rows = read_jsonl(out.read_bytes())
    assert len(rows) == memlens.load(path, cache=False).total_events
    assert {r["category"] for r in rows if r["action"] == "alloc"} <= set(CATEGORIES)
    assert any(r["category"] is not None for r in rows)


# --------------------------------------------------------------------------- fields


@pytest.fixture(scope="module")
def leaky_run() -> tuple[Snapshot, Any]:
    snapshot = training_run(4, leak=4 * MiB).snapshot()
    return snapshot, analyze_snapshot(snapshot)


def test_columns_are_stable_and_typed() -> None:
    names = [c.name for c in EVENT_COLUMNS]
    assert names[:6] == ["device", "event", "action", "address", "size", "stream"]
    assert len(set(names)) == len(names) and len({c.name for c in BLOCK_COLUMNS}) == len(BLOCK_COLUMNS)
    assert {c.type for c in (*EVENT_COLUMNS, *BLOCK_COLUMNS)} <= {"int64", "string", "bool"}


def test_jsonl_round_trips_every_field(leaky_run: tuple[Snapshot, Any]) -> None:
    snapshot, analysis = leaky_run
    rows = read_jsonl(export(snapshot, "jsonl", labels=event_labels(analysis)))
    trace = snapshot.devices[0]
    assert [list(r) for r in rows] == [[c.name for c in EVENT_COLUMNS]] * len(trace)
    for i, row in enumerate(rows):
        stack_id = int(trace.stack_id[i])
        expected = {
            "device": 0, "event": i, "action": trace.action_of(i).label, "address": int(trace.address[i]),
            "size": int(trace.size[i]), "stream": int(trace.stream[i]), "time_us": int(trace.time_us[i]),
            "block_size": int(trace.block_size[i]),
            "allocated_bytes": int(trace.allocated[i]), "reserved_bytes": int(trace.reserved[i]),
            "stack_id": stack_id if stack_id >= 0 else None,
            "frames": stack_text(snapshot, stack_id) if stack_id >= 0 else None,
            "user_metadata": trace.metadata_at(i) or None,
        }
        assert {key: row[key] for key in expected} == expected
    steps = analysis.report.devices[0].steps
    assert steps and all(rows[s.start_event]["step"] == s.index for s in steps)
    assert all(r["step"] is None for r in rows[: steps[0].start_event])


def test_categories_on_allocs_and_the_frees_that_end_them(leaky_run: tuple[Snapshot, Any]) -> None:
    snapshot, analysis = leaky_run
    rows = read_jsonl(export(snapshot, "jsonl", labels=event_labels(analysis)))
    made_at: dict[int, str] = {}
    frees = 0
    for row in rows:
        if row["action"] == "alloc":
            assert row["category"] in CATEGORIES
            made_at[row["address"]] = row["category"]
        elif row["action"] == "free_requested":
            assert row["category"] == made_at[row["address"]]  # the category of what it frees
            frees += 1
        else:
            assert row["category"] is None
    assert frees and "activations" in made_at.values()
    # The analysis' own numbers, rebuilt from the rows: bytes live at the peak by category.
    peak = analysis.report.devices[0].peak_allocated_event
    live: dict[int, tuple[str, int]] = {}
    for row in rows[: peak + 1]:
        if row["action"] == "alloc":
            live[row["address"]] = (row["category"], row["block_size"])
        elif row["action"] == "free_requested":
            live.pop(row["address"], None)
    by_category: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
    for category, size in live.values():
        by_category[category] += size
    at_peak = analysis.report.devices[0].categories_at_peak
    ghosts = snapshot.devices[0].baseline_allocated  # live before the history: no alloc row
    assert sum(by_category.values()) + ghosts == sum(at_peak.values())
    assert by_category["activations"] == at_peak["activations"]


def test_csv_holds_the_same_values_as_jsonl(leaky_run: tuple[Snapshot, Any]) -> None:
    snapshot, analysis = leaky_run
    labels = event_labels(analysis)
    as_json = read_jsonl(export(snapshot, "jsonl", labels=labels))
    as_csv = read_csv(export(snapshot, "csv", labels=labels))
    ints = {c.name for c in EVENT_COLUMNS if c.type == "int64"}
    for j, c in zip(as_json, as_csv, strict=True):
        decoded = {k: (None if v == "" else int(v) if k in ints else v) for k, v in c.items()}
        assert decoded == j


def test_blocks_table_matches_the_segments(leaky_run: tuple[Snapshot, Any]) -> None:
    snapshot, _ = leaky_run
    rows = read_jsonl(export(snapshot, "jsonl", "blocks"))
    blocks = [(s, b) for s in snapshot.segments for b in s.blocks]
    assert len(rows) == len(blocks)
    for row, (segment, block) in zip(rows, blocks, strict=True):
        assert (row["segment_address"], row["segment_size"], row["is_expandable"]) == (
            segment.address, segment.total_size, segment.is_expandable)
        assert (row["address"], row["size"], row["requested_size"], row["state"]) == (
            block.address, block.size, block.requested_size, block.state)
    assert read_csv(export(snapshot, "csv", "blocks"))[0]["is_expandable"] == "false"


def test_a_segment_without_blocks_is_one_row_with_null_block_columns() -> None:
    raw = training_run(1).raw()
    raw["segments"].append({"device": 0, "address": 1 << 40, "total_size": 2 * MiB, "stream": 0,
                            "segment_type": "large", "segment_pool_id": (0, 0), "blocks": []})
    rows = read_jsonl(export(memlens.snapshot.parse(raw), "jsonl", "blocks"))
    empty = [r for r in rows if r["segment_address"] == 1 << 40]
    assert len(empty) == 1 and empty[0]["address"] is None and empty[0]["state"] is None


# --------------------------------------------------------------------------- hostile strings

HOSTILE_NAME = 'fn,"quoted"\nsecond line\r\x00\x1b[2J\x9b\u202egnp.exe\u2028\ud800'
HOSTILE_FILE = '=HYPERLINK("http://evil.example"),x.py'


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Snapshot:
    builder = TraceBuilder()
    frames = [frame(HOSTILE_NAME, HOSTILE_FILE, 3), frame("train", "/work/a;b.py", 4)]
    for _ in range(3):
        builder.free(builder.alloc(4096, frames))
    path = tmp_path_factory.mktemp("hostile") / "hostile.pickle"
    path.write_bytes(pickle.dumps(builder.raw(), protocol=4))
    return memlens.load(path, cache=False)  # through the safe loader, as the CLI reads it


def test_jsonl_gives_back_hostile_strings_exactly_and_shows_only_text(hostile: Snapshot) -> None:
    data = export(hostile, "jsonl")
    text = data.decode("utf-8")  # valid UTF-8, lone surrogate included (as an escape)
    assert len(text.splitlines()) == hostile.total_events
    assert not any(ch in text for ch in "\x00\x1b\x9b\r\u202e\u2028")
    expected = f"{HOSTILE_FILE}:3:{HOSTILE_NAME};/work/a;b.py:4:train"
    assert all(row["frames"] == expected for row in read_jsonl(data))


def test_csv_quotes_hostile_strings_one_record_a_line(hostile: Snapshot) -> None:
    data = export(hostile, "csv")
    text = data.decode("utf-8")
    assert text.count("\n") == hostile.total_events + 1  # header + one line per record
    assert not any(ch in text for ch in "\x00\x1b\x9b\r\u202e\u2028")
    rows = list(csv.reader(io.StringIO(text, newline="")))
    assert all(len(row) == len(EVENT_COLUMNS) for row in rows)
    frames_cell = rows[1][[c.name for c in EVENT_COLUMNS].index("frames")]
    assert frames_cell.startswith("'=HYPERLINK(")  # a spreadsheet shows it, never runs it
    assert frames_cell == "'" + f"{HOSTILE_FILE}:3:" + csv_text(HOSTILE_NAME) + ";/work/a;b.py:4:train"
    assert "\\x0asecond line\\x0d\\x00\\x1b[2J\\x9b\\u202e" in frames_cell


def test_csv_text_escapes_and_defuses() -> None:
    assert csv_text("a\nb\u202e\ud800") == "a\\x0ab\\u202e\\ud800"
    assert [csv_text(s)[0] for s in ("=1+1", "+1", "-1", "@SUM(A1)")] == ["'"] * 4
    assert csv_text("<frozen runpy>") == "<frozen runpy>"


# --------------------------------------------------------------------------- memory

class _CountingSink(io.RawIOBase):
    """Where exported bytes go when only their amount matters."""

    def __init__(self) -> None:
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.written += len(data)
        return len(data)


def _long_trace(events: int) -> Snapshot:
    """A trace of ``events`` rows built straight from columns (alloc/free pairs, 200 stacks of 40
    frames), so the test measures the export and not a reader."""
    frames = [Frame(f"/work/project/model/layer_{i}.py", i, f"forward_{i}") for i in range(400)]
    stacks = [tuple((s * 7 + k) % 400 for k in range(40)) for s in range(200)]
    rows = np.arange(events, dtype=np.int64)
    action = np.where(rows % 2 == 0, int(Action.ALLOC), int(Action.FREE_REQUESTED)).astype(np.int8)
    size = ((rows // 2) % 97 + 1) * 512
    allocated = np.where(rows % 2 == 0, size, 0).astype(np.int64)
    trace = DeviceTrace(
        device=0, action=action, address=0x7F00_0000_0000 + (rows // 2) * 4096, size=size, block_size=size,
        stream=np.zeros(events, dtype=np.int64), time_us=1_700_000_000_000_000 + rows,
        stack_id=((rows // 2) % 200).astype(np.int32), device_free=np.zeros(events, dtype=np.int64),
        metadata_id=np.full(events, -1, dtype=np.int32), context_id=np.full(events, -1, dtype=np.int32),
        allocated=allocated, reserved=np.full(events, 1 << 30, dtype=np.int64), has_time=True)
    return Snapshot(source="<long>", devices={0: trace}, segments=[], stacks=StackTable(frames, stacks))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_memory_stays_flat_however_long_the_trace(fmt: str) -> None:
    peaks = {}
    for events in (4_000, 64_000):
        snapshot = _long_trace(events)
        sink = _CountingSink()
        tracemalloc.start()
        try:
            rows = write_table(snapshot, sink, fmt)  # type: ignore[arg-type]
            _, peaks[events] = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert rows == events
        assert sink.written > events * 400  # the output is far larger than what was held
    assert max(peaks.values()) < 4 * MiB, peaks
    assert peaks[64_000] < 1.5 * peaks[4_000] + MiB, peaks  # 16x the rows, not 16x the memory


def _rows_sharing_one_deep_stack(rows: int, depth: int) -> Snapshot:
    """``rows`` trace rows that all share one ``depth``-frame stack (distinct frames)."""
    frames = [Frame(f"/work/project/deep_module_{i}.py", i, f"call_{i}") for i in range(depth)]
    index = np.arange(rows, dtype=np.int64)
    trace = DeviceTrace(
        device=0, action=np.full(rows, int(Action.ALLOC), dtype=np.int8), address=0x7F00_0000_0000 + index * 512,
        size=np.full(rows, 512, dtype=np.int64), block_size=np.full(rows, 512, dtype=np.int64),
        stream=np.zeros(rows, dtype=np.int64), time_us=index,
        stack_id=np.zeros(rows, dtype=np.int32), device_free=np.zeros(rows, dtype=np.int64),
        metadata_id=np.full(rows, -1, dtype=np.int32), context_id=np.full(rows, -1, dtype=np.int32),
        allocated=(index + 1) * 512, reserved=np.full(rows, 1 << 30, dtype=np.int64), has_time=True)
    return Snapshot(source="<deep>", devices={0: trace}, segments=[],
                    stacks=StackTable(frames, [tuple(range(depth))]))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_rows_sharing_a_long_stack_write_a_bounded_amount(fmt: str) -> None:
    """4,000 rows sharing one 20,000-frame stack (its innermost 1,024 frames: 46 KB of text)
    wrote the stack whole on every row: 3.6 GB. The cells are cut to what the table's content
    allows (its rows, the stack's frame references and the frames' text, each counted once)."""
    snapshot = _rows_sharing_one_deep_stack(4_000, 20_000)
    sink = _CountingSink()
    assert write_table(snapshot, sink, fmt) == 4_000  # type: ignore[arg-type]
    content = table_content(snapshot.stacks, 4_000, np.ones(1, dtype=bool), frame_text_lengths(snapshot.stacks))
    assert sink.written < CONTENT_FACTOR * content + 4_000 * 512 < 100 * MiB


def test_cut_cells_are_the_same_on_every_row_and_say_what_they_leave_out() -> None:
    snapshot = _rows_sharing_one_deep_stack(4_000, 20_000)
    rows = read_jsonl(export(snapshot, "jsonl"))
    shown = rows[0]["frames"].count(FRAME_SEPARATOR) + 1
    assert 10 < shown < MAX_FRAMES_EXAMINED and all(r["frames"] == rows[0]["frames"] for r in rows)
    assert rows[0]["frames"] == FRAME_SEPARATOR.join(stack_text(snapshot, 0).split(FRAME_SEPARATOR)[:shown])
    assert all(r["frames_omitted"] == 20_000 - shown for r in rows)
    [stack] = read_jsonl(export(snapshot, "jsonl", "stacks"))  # each stack once, to the examined depth
    assert stack["depth"] == 20_000 and stack["frames_omitted"] == 20_000 - MAX_FRAMES_EXAMINED


def test_a_stack_shared_by_few_rows_is_written_whole() -> None:
    rows = read_jsonl(export(_rows_sharing_one_deep_stack(3, 2_000), "jsonl"))
    assert rows[0]["frames"].count(FRAME_SEPARATOR) + 1 == MAX_FRAMES_EXAMINED
    assert {r["frames_omitted"] for r in rows} == {2_000 - MAX_FRAMES_EXAMINED}


# --------------------------------------------------------------------------- files and streams

SAMPLE = SAMPLE_SNAPSHOTS_DIR / "leak.pickle"


def test_dash_writes_standard_output_the_same_bytes_as_a_file(tmp_path: Path) -> None:
    out = tmp_path / "events.jsonl"
    assert CliRunner().invoke(cli, ["export", str(SAMPLE), "-o", str(out), "--no-cache"]).exit_code == 0
    result = CliRunner().invoke(cli, ["export", str(SAMPLE), "--format", "jsonl", "-o", "-", "--no-cache"])
    assert result.exit_code == 0
    assert result.stdout_bytes == out.read_bytes()
    bare = CliRunner().invoke(cli, ["export", str(SAMPLE), "--format", "csv", "--no-cache"])
    assert bare.stdout_bytes.startswith(b"device,event,action,")


@pytest.mark.parametrize(("args", "message"), [
    (["--format", "html", "-o", "-"], "needs a file"),
    (["--format", "csv", "--device", "7", "-o", "-"], "no device 7"),
    (["-o", "/no/such/folder/e.jsonl"], "no such folder"),
])
def test_export_mistakes_are_one_line(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["export", str(SAMPLE), "--no-cache", *args])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_an_export_that_fails_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "events.jsonl"
    target.write_text("old\n")
    with pytest.raises(RuntimeError), atomic_stream(target) as handle:
        handle.write(b"half an export")
        raise RuntimeError("interrupted")
    assert target.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["events.jsonl"]
    with atomic_stream(target) as handle:
        handle.write(b"new\n")
    assert target.read_text() == "new\n" and os.listdir(tmp_path) == ["events.jsonl"]


@pytest.mark.timeout(120)
def test_a_reader_that_stops_early_ends_the_export_quietly() -> None:
    command = (f"{sys.executable} -m memlens export {SAMPLE} --format jsonl --no-cache | head -n 1; "
               "echo \"status ${PIPESTATUS[0]}\"")
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=REPO_ROOT, timeout=100)
    first, status = done.stdout.splitlines()
    assert json.loads(first)["event"] == 0
    assert status == "status 141" and done.stderr == ""


def test_a_folder_that_cannot_be_written_is_one_line() -> None:
    # /proc takes no new files, whoever asks (root included, as in CI containers).
    result = CliRunner().invoke(cli, ["export", str(SAMPLE), "-o", "/proc/memlens-export.csv", "--no-cache"])
    assert result.exit_code == 2
    assert "cannot write /proc/memlens-export.csv" in result.output and "Traceback" not in result.output


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["jsonl", "html"])
def test_export_to_a_fifo_writes_into_it_and_leaves_it_a_fifo(tmp_path: Path, fmt: str) -> None:
    import stat
    import threading

    fifo = tmp_path / f"out.{fmt}"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    result = CliRunner().invoke(cli, ["export", str(SAMPLE), "-o", str(fifo), "--no-cache"])
    reader.join(60)
    assert result.exit_code == 0, result.output
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # never replaced by a regular file
    assert received and received[0].startswith(b"{" if fmt == "jsonl" else b"<!DOCTYPE")
    assert os.listdir(tmp_path) == [fifo.name]


def test_export_through_a_symlink_writes_its_target_and_keeps_the_link(tmp_path: Path) -> None:
    target = tmp_path / "real" / "events.jsonl"
    target.parent.mkdir()
    target.write_text("old\n")
    link = tmp_path / "events.jsonl"
    link.symlink_to(target)
    result = CliRunner().invoke(cli, ["export", str(SAMPLE), "-o", str(link), "--no-cache"])
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and target.read_text().startswith("{")
    assert sorted(os.listdir(tmp_path)) == ["events.jsonl", "real"] and os.listdir(target.parent) == ["events.jsonl"]


def test_export_into_a_symlink_to_the_snapshot_is_refused(tmp_path: Path) -> None:
    snapshot = tmp_path / "run.pickle"
    snapshot.write_bytes(SAMPLE.read_bytes())
    (tmp_path / "out.jsonl").symlink_to(snapshot)
    result = CliRunner().invoke(cli, ["export", str(snapshot), "-o", str(tmp_path / "out.jsonl"), "--no-cache"])
    assert result.exit_code == 2 and "overwrite the snapshot" in result.output
    assert snapshot.read_bytes() == SAMPLE.read_bytes()


def test_export_to_a_character_device_writes_into_it(tmp_path: Path) -> None:
    import stat

    # As root, a private null device: an export that replaced it must not take the machine's
    # /dev/null with it (which is what replacing did, run as root).
    device = tmp_path / "null"
    if os.geteuid() == 0:
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    else:
        device = Path("/dev/null")  # not ours to replace: the old rename failed with EACCES
    before = os.stat(device)
    result = CliRunner().invoke(cli, ["export", str(SAMPLE), "--format", "csv", "-o", str(device), "--no-cache"])
    assert result.exit_code == 0, result.output
    after = os.stat(device)
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)


def test_export_to_a_socket_is_refused_in_one_line(tmp_path: Path) -> None:
    import socket
    import stat

    path = tmp_path / "out.jsonl"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        result = CliRunner().invoke(cli, ["export", str(SAMPLE), "-o", str(path), "--no-cache"])
    assert result.exit_code == 2 and "not a regular file" in result.output and "Traceback" not in result.output
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
