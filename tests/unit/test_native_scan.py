"""The native snapshot scanner (memlens._scan) against the Python path: the same Snapshot, to the
byte of every column, for every sample and real snapshot (plain and gzipped), for generated
snapshots of every field type, and the same one-line refusal for every hostile file."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import pickle
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memlens
from memlens.errors import MemlensFormatError
from memlens.snapshot import ahead, native_scan
from tests.conftest import real_snapshot_paths
from tests.hostile_files import dumps, entry, get, snapshot, text
from tests.unit.test_hostile_scan import opcode_streams

REPO = Path(__file__).resolve().parents[2]
SAMPLES = sorted((REPO / "sample_snapshots").glob("*.pickle"))

pytestmark = [
    pytest.mark.skipif(
        ahead._native_scan is None,
        reason="memlens._scan is not built (pip install -e . with a C++17 compiler builds it)",
    ),
    pytest.mark.slow,
]


def fingerprint(value: Any) -> Any:
    """Everything a Snapshot holds, as comparable plain values (arrays by dtype, shape and bytes)."""
    if isinstance(value, np.ndarray):
        return ("array", str(value.dtype), value.shape, value.tobytes())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__,
                tuple((f.name, fingerprint(getattr(value, f.name))) for f in dataclasses.fields(value)))
    if isinstance(value, dict):
        return ("dict", tuple((fingerprint(k), fingerprint(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(fingerprint(v) for v in value))
    return (type(value).__name__, value)


def outcome(path: Path | str, pure_python: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The loaded snapshot's fingerprint, or the one-line error, on one path."""
    if pure_python:
        monkeypatch.setenv("MEMLENS_PURE_PYTHON", "1")
    else:
        monkeypatch.delenv("MEMLENS_PURE_PYTHON", raising=False)
    try:
        return fingerprint(memlens.load(path, cache=False))
    except MemlensFormatError as exc:
        return ("error", str(exc))


def natively_read(data: bytes, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.delenv("MEMLENS_PURE_PYTHON", raising=False)
    raw, _reason = native_scan.scan(data)
    return raw is not None and any(isinstance(t, native_scan.NativeTrace) for t in raw.get("device_traces") or [])


@pytest.mark.parametrize("path", [*SAMPLES, *real_snapshot_paths()], ids=lambda p: p.name)
def test_samples_and_real_snapshots_read_natively_to_the_same_snapshot(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = path.read_bytes()
    monkeypatch.delenv("MEMLENS_PURE_PYTHON", raising=False)
    raw, reason = native_scan.scan(data)
    assert raw is not None, f"the scanner declined a file PyTorch wrote ({reason})"
    traces = raw.get("device_traces") or [] if isinstance(raw, dict) else []
    assert all(isinstance(t, native_scan.NativeTrace) for t in traces if t), "a trace went the Python way"
    expected = outcome(path, True, monkeypatch)
    assert outcome(path, False, monkeypatch) == expected
    zipped = tmp_path / (path.name + ".gz")
    zipped.write_bytes(gzip.compress(data, compresslevel=1))
    assert outcome(zipped, False, monkeypatch) == outcome(zipped, True, monkeypatch)


def test_pure_python_turns_the_scanner_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMLENS_PURE_PYTHON", "1")
    assert native_scan.scanner() is None
    assert native_scan.scan(SAMPLES[0].read_bytes()) == (None, "the native scanner is off")


def _write(tmp_path: Path, data: bytes, name: str = "case.pickle") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


# Files the scanner must decline (the Python path's answer stands), and files it reads itself.
SHARED_ENTRY = entry("alloc", 0x7000_0000, 512)
DECLINED = {
    "protocol 0": pickle.dumps(snapshot(), protocol=0),
    "bool addr": dumps(snapshot(device_traces=[[entry("alloc", True, 512)]])),
    "float size": dumps(snapshot(device_traces=[[entry("alloc", 0, 512.0)]])),
    "negative size": dumps(snapshot(device_traces=[[entry("alloc", 0, -1)]])),
    "time past int64": dumps(snapshot(device_traces=[[entry("alloc", 0, 512, time_us=1 << 63)]])),
    "addr past 2**64": dumps(snapshot(device_traces=[[entry("alloc", 1 << 64, 512)]])),
    "no action": dumps(snapshot(device_traces=[[{"addr": 0, "size": 1}]])),
    "frames text": dumps(snapshot(device_traces=[[entry("alloc", 0, 512, frames="main")]])),
    "metadata int": dumps(snapshot(device_traces=[[entry("alloc", 0, 512, user_metadata=3)]])),
    "oom free negative": dumps(snapshot(device_traces=[[entry("oom", 0, 512, device_free=-5)]])),
    "global": pickle.dumps({"segments": [], "device_traces": [], "x": os.getcwd}, protocol=4),
    "truncated": dumps(snapshot())[:-40],
    # The action column is a byte a row: a list of more distinct actions goes the Python way.
    "300 distinct actions": dumps(snapshot(device_traces=[[entry(f"action {k}", 512 * k, 512) for k in range(300)]])),
}
SHARED_TRACES: list[Any] = [[entry("alloc", 0, 512)]]
SELF_HOLDING: dict[str, Any] = snapshot()
SELF_HOLDING["itself"] = SELF_HOLDING
DECLINED.update({
    # Another key reaches the traces: they go the Python way, so that key's copy holds the entries.
    "traces under another key too": dumps(snapshot(device_traces=SHARED_TRACES, copy=SHARED_TRACES)),
    "root holds itself": dumps(SELF_HOLDING),
})
READ = {
    "shared entry": dumps(snapshot(device_traces=[[SHARED_ENTRY, SHARED_ENTRY]])),  # that device: Python
    "uint64 stream and addr": dumps(snapshot(device_traces=[[entry("alloc", (1 << 64) - 512, 512,
                                                                   stream=(1 << 64) - 1)]])),
    "metadata and context": dumps(snapshot(device_traces=[[
        entry("alloc", 0, 512, user_metadata="step 1", compile_context="N/A"),
        entry("alloc", 512, 512, user_metadata="", compile_context="region"),
        entry("free_completed", 512, 512, user_metadata=None),
        entry("oom", 0, 1 << 30, device_free=1 << 20)]])),
    "no time": dumps(snapshot(device_traces=[[{"action": "alloc", "addr": 0, "size": 512, "stream": 0}]])),
    "bytes after stop": dumps(snapshot()) + b"\x00garbage",
    "bare list": dumps(snapshot()["segments"]),
    "two devices, one empty": dumps(snapshot(device_traces=[[entry("alloc", 0, 512)], []])),
    "long frame text": dumps(snapshot(device_traces=[[entry("alloc", 0, 512, frames=[
        {"filename": "x" * 5000, "line": (1 << 64) - 1, "name": "n" * 300}])]])),
}


# The scanner reads each plain trace entry into its list's columns as it is appended and drops the
# entry's dict (the arena never holds a million of them): a file that needs such a dict whole after
# all must be declined, never read with the entry missing.
_ROWS = [entry("alloc", 512 * k, 512) for k in range(3)]
_NOT_PLAIN_LAST = [*_ROWS, entry("alloc", 0, 512.0)]
_SHARED_LATE = [*_ROWS]
_LIST_TWICE = [entry("alloc", 0, 512), entry("free_requested", 0, 512)]
DROPPED_NEEDED = {
    # An entry met again through the memo after its row was read (a later key holds it).
    "entry met again": dumps(snapshot(device_traces=[_SHARED_LATE], later=_SHARED_LATE[1])),
    # ... after its container was reused by the dicts read since (a row's dict is reused at once).
    "entry met again after its container was reused": dumps({
        "device_traces": [_SHARED_LATE], "segments": [{"address": 0, "blocks": [{"size": k}]} for k in range(5)],
        "later": _SHARED_LATE[0]}),
    # The last entry is not plain: the rows before it are needed as dicts (the Python way).
    "last entry not plain": dumps(snapshot(device_traces=[_NOT_PLAIN_LAST])),
    # Entries that look like a trace's under another key: converted as dicts, so declined.
    "entries under another key": dumps({**snapshot(), "history": [*_ROWS]}),
    # The same entries list for two devices.
    "one list for two devices": dumps(snapshot(device_traces=[_LIST_TWICE, _LIST_TWICE])),
    # An entry whose frames are a list of entries.
    "frames of entries": dumps(snapshot(device_traces=[[entry("alloc", 0, 512, frames=[*_ROWS])]])),
}
# Lists of entries built each way the opcodes allow: APPENDS (above), APPEND one by one, LIST.
_APPEND_BY_ONE = dumps(snapshot(device_traces=[[_ROWS[0]]]))
READ_AS_ROWS = {
    "protocol 1 (BINPUT, BINUNICODE)": pickle.dumps({"segments": [], "device_traces": [[*_ROWS]]}, protocol=1),
    "protocol 2": pickle.dumps(snapshot(device_traces=[[*_ROWS], [entry("oom", 0, 1 << 30, device_free=5)]]),
                               protocol=2),
    "one entry (APPEND)": _APPEND_BY_ONE,
    "first entry not plain": dumps(snapshot(device_traces=[[entry("alloc", 0, -1), *_ROWS]])),
    "second entry not plain": dumps(snapshot(device_traces=[[_ROWS[0], entry("alloc", 0, -1), *_ROWS[1:]]])),
}


def _scanned_both_ways(data: bytes, tmp_path: Path) -> tuple[Any, Any]:
    """The scan of ``data`` in memory, and of the same bytes in a file read through a window of 7
    bytes (every opcode straddles a refill), each as ``fingerprint``s."""
    path = _write(tmp_path, data, "windowed.pickle")
    with path.open("rb") as handle:
        windowed = native_scan.scan_file(handle.fileno(), len(data), chunk=7)
    return fingerprint(native_scan.scan(data)), fingerprint(windowed)


WINDOWED_CASES = {**{f"declined: {k}": v for k, v in DECLINED.items()}, **{f"read: {k}": v for k, v in READ.items()},
                  **{f"dropped: {k}": v for k, v in DROPPED_NEEDED.items()},
                  **{f"rows: {k}": v for k, v in READ_AS_ROWS.items()}}


@pytest.mark.parametrize("name", sorted(WINDOWED_CASES))
def test_a_file_read_through_a_small_window_scans_as_in_memory(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MEMLENS_PURE_PYTHON", raising=False)
    in_memory, windowed = _scanned_both_ways(WINDOWED_CASES[name], tmp_path)
    assert windowed == in_memory


@pytest.mark.parametrize("path", [*SAMPLES, *real_snapshot_paths()], ids=lambda p: p.name)
def test_samples_and_real_snapshots_read_through_a_small_window_scan_as_in_memory(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MEMLENS_PURE_PYTHON", raising=False)
    data = path.read_bytes()
    in_memory, windowed = _scanned_both_ways(data, tmp_path)
    assert windowed == in_memory
    raw, _reason = native_scan.scan(data)
    assert raw is not None


def test_a_file_cut_short_after_it_was_opened_gets_the_python_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scanner reads the file as it is while it reads (a megabyte at a time), not a copy taken
    when it was opened: one that shrank since (rewritten in place) is declined, and the Python
    path says what it now holds."""
    from memlens.files import open_regular

    data = dumps(snapshot(device_traces=[[entry("alloc", 512 * k, 512) for k in range(2000)]]))
    answers = []
    for pure_python in (False, True):
        path = _write(tmp_path, data, f"cut-{pure_python}.pickle")
        opened = open_regular(path)
        try:
            os.truncate(path, len(data) // 2)
            raw, reason = native_scan.scan_file(opened.fd, opened.size)
            assert raw is None and reason == "truncated"
            if pure_python:
                monkeypatch.setenv("MEMLENS_PURE_PYTHON", "1")
            else:
                monkeypatch.delenv("MEMLENS_PURE_PYTHON", raising=False)
            with pytest.raises(MemlensFormatError) as refused:
                memlens.load(opened, cache=False)
            answers.append(str(refused.value).replace(path.name, "FILE"))
        finally:
            opened.close()
    assert answers[0] == answers[1]


def test_columns_that_hold_one_value_cost_one_element(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream, OOM free bytes or metadata that never change over a trace are one element, read-only
    (``model.constant_column``); a column whose value changes once is written out whole."""
    monkeypatch.delenv("MEMLENS_PURE_PYTHON", raising=False)
    rows = [entry("alloc", 512 * k, 512, stream=7, time_us=1_700_000_000_000_000 + k) for k in range(100)]
    raw, _reason = native_scan.scan(dumps(snapshot(device_traces=[rows])))
    trace = raw["device_traces"][0]
    assert trace.stream.strides == (0,) and not trace.stream.flags.writeable and len(trace.stream) == 100
    assert trace.stream.tolist() == [7] * 100 and trace.device_free.strides == (0,)
    assert trace.time_us.strides == (8,) and trace.action_local.dtype == np.uint8
    rows[-1] = entry("alloc", 0, 512, stream=8)
    raw, _reason = native_scan.scan(dumps(snapshot(device_traces=[rows])))
    assert raw["device_traces"][0].stream.tolist() == [7] * 99 + [8]


@pytest.mark.parametrize("name", sorted(DROPPED_NEEDED))
def test_an_entry_needed_whole_after_its_row_is_declined(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = DROPPED_NEEDED[name]
    monkeypatch.delenv("MEMLENS_PURE_PYTHON", raising=False)
    raw, reason = native_scan.scan(data)
    assert raw is None and reason
    path = _write(tmp_path, data)
    assert outcome(path, False, monkeypatch) == outcome(path, True, monkeypatch)


@pytest.mark.parametrize("name", sorted(READ_AS_ROWS))
def test_entry_lists_built_every_way_read_the_same(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = READ_AS_ROWS[name]
    monkeypatch.delenv("MEMLENS_PURE_PYTHON", raising=False)
    raw, reason = native_scan.scan(data)
    assert raw is not None, reason
    path = _write(tmp_path, data)
    assert outcome(path, False, monkeypatch) == outcome(path, True, monkeypatch)


def test_the_first_entry_is_kept_whole_for_the_format_guess(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEMLENS_PURE_PYTHON", raising=False)
    first = entry("alloc", 0, 512, user_metadata="m", extra_key=[1, 2])
    raw, _reason = native_scan.scan(dumps(snapshot(device_traces=[[first, *_ROWS]])))
    trace = raw["device_traces"][0]
    assert isinstance(trace, native_scan.NativeTrace) and len(trace) == 4
    assert trace.first_entry == first


@pytest.mark.parametrize("name", sorted(DECLINED))
def test_what_the_scanner_declines_gets_the_python_answer(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = DECLINED[name]
    assert not natively_read(data, monkeypatch)
    path = _write(tmp_path, data)
    assert outcome(path, False, monkeypatch) == outcome(path, True, monkeypatch)


@pytest.mark.parametrize("name", sorted(READ))
def test_what_the_scanner_reads_is_what_python_reads(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = _write(tmp_path, READ[name])
    assert outcome(path, False, monkeypatch) == outcome(path, True, monkeypatch)


_INTS = st.one_of(st.integers(-(1 << 64), 1 << 65), st.sampled_from([0, 1, 512, (1 << 63) - 1, (1 << 64) - 1]))
_FIELD_VALUES = st.one_of(_INTS, st.none(), st.booleans(), st.floats(allow_nan=False), st.text(max_size=8))
_FRAME = st.fixed_dictionaries({"filename": st.text(max_size=5), "line": _INTS, "name": st.text(max_size=5)})
_ENTRY = st.fixed_dictionaries(
    {"action": st.sampled_from(["alloc", "free_requested", "free_completed", "segment_alloc", "oom", "other"])},
    optional={
        "addr": _INTS, "size": st.one_of(st.integers(0, 1 << 20), _FIELD_VALUES), "stream": _INTS,
        "time_us": st.one_of(st.integers(1, 1 << 40), _FIELD_VALUES), "device_free": _FIELD_VALUES,
        "frames": st.one_of(st.none(), st.lists(_FRAME, max_size=3)),
        "user_metadata": st.one_of(st.none(), st.sampled_from(["", "N/A", "a", "b"]), _FIELD_VALUES),
        "compile_context": st.one_of(st.none(), st.sampled_from(["N/A", "c"])),
        "extra": _FIELD_VALUES,
    },
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(traces=st.lists(st.lists(_ENTRY, max_size=6), max_size=3), protocol=st.integers(2, 5),
       share_frames=st.booleans())
def test_generated_traces_read_the_same_on_both_paths(
    traces: list[list[dict[str, Any]]], protocol: int, share_frames: bool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if share_frames:  # one frames list shared by every entry that has frames, as PyTorch's memo does
        shared = next((e["frames"] for t in traces for e in t if e.get("frames")), None)
        for trace in traces:
            for item in trace:
                if item.get("frames") and shared is not None:
                    item["frames"] = shared
    path = _write(tmp_path, pickle.dumps(snapshot(device_traces=traces), protocol=protocol))
    assert outcome(path, False, monkeypatch) == outcome(path, True, monkeypatch)


# ------------------------------------------------------------------ the hostile corpus, both paths

MEMORY_LIMIT = 2 << 30
_LOAD_ALL = """
import hashlib, json, sys
import memlens
from memlens.errors import MemlensError
from tests.unit.test_native_scan import fingerprint
out = {}
for path in sys.argv[1:]:
    try:
        out[path] = "loaded " + hashlib.sha256(repr(fingerprint(memlens.load(path, cache=False))).encode()).hexdigest()
    except MemlensError as exc:
        out[path] = "refused " + str(exc)
    except MemoryError:
        out[path] = "MemoryError"
print(json.dumps(out))
"""


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _load_all(paths: list[str], pure_python: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MEMLENS_PURE_PYTHON"}
    if pure_python:
        env["MEMLENS_PURE_PYTHON"] = "1"
    result = subprocess.run([sys.executable, "-c", _LOAD_ALL, *paths], capture_output=True, text=True, cwd=REPO,
                            env=env, preexec_fn=_limit_memory, timeout=900, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_every_hostile_file_gets_the_same_answer_on_both_paths(tmp_path: Path) -> None:
    from tests.hostile_files import CORPUS

    paths = []
    for attack, builds in CORPUS.items():
        for name, build in builds.items():
            safe = hashlib.sha1(f"{attack}/{name}".encode()).hexdigest()[:12]
            paths.append(str(_write(tmp_path, build(), f"{safe}.pickle")))
    native, python = _load_all(paths, False), _load_all(paths, True)
    assert native == python


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(opcode_streams(), st.binary(max_size=64).map(lambda b: b"\x80\x04" + b)))
def test_random_opcode_streams_read_the_same_on_both_paths(data: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random opcodes through the scanner and its conversion to Python objects (the part the
    libFuzzer harness does not reach): no crash, and the Python path's answer."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "random.pickle"
        path.write_bytes(data)
        assert outcome(path, False, monkeypatch) == outcome(path, True, monkeypatch)


_BASE = dumps(snapshot(device_traces=[[entry("alloc", 0, 512, user_metadata="m"), entry("oom", 0, 1 << 30)]]))


def test_a_frame_shorter_than_its_opcodes_gets_the_python_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by the mutation test below: a FRAME claiming 524 bytes of a 746-byte pickle. Reading a
    file, CPython's unpickler drops the frame's rest at its end (pickle.loads of the bytes would
    not): the scanner must decline such a stream, not read it as pickle.loads does."""
    data = bytearray(_BASE)
    assert data[2] == 0x95  # FRAME, then its 8-byte length
    data[3] = 12  # the length's low byte: 0x2df becomes 0x20c, ending the frame inside an opcode
    assert not natively_read(bytes(data), monkeypatch)
    path = _write(tmp_path, bytes(data))
    assert outcome(path, False, monkeypatch) == outcome(path, True, monkeypatch)


def test_a_stop_inside_a_frame_gets_the_python_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by mutating snapshots: a STOP with its frame running on past it. The Python path hands
    the unpickler nothing after STOP, so the frame cannot be read whole: "truncated" there, where
    pickle.loads (and the scanner, before) returned the value on the stack."""
    body = dumps(snapshot())[11:-1] + b"."  # the frame's opcodes, STOP included
    data = b"\x80\x04\x95" + (len(body) + 2).to_bytes(8, "little") + body + b"N."
    assert not natively_read(data, monkeypatch)
    path = _write(tmp_path, data)
    assert outcome(path, True, monkeypatch) == outcome(path, False, monkeypatch)
    assert "ends early" in outcome(path, True, monkeypatch)[1]


@st.composite
def mutated_snapshots(draw: st.DrawFn) -> bytes:
    """A small valid snapshot with a few bytes changed, inserted or cut: most still unpickle."""
    data = bytearray(_BASE)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data) - 1))
        kind = draw(st.sampled_from(["flip", "insert", "cut"]))
        if kind == "flip":
            data[at] = draw(st.integers(0, 255))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        else:
            del data[at:at + draw(st.integers(1, 8))]
    return bytes(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=mutated_snapshots())
def test_mutated_snapshots_read_the_same_on_both_paths(data: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "mutated.pickle"
        path.write_bytes(data)
        assert outcome(path, False, monkeypatch) == outcome(path, True, monkeypatch)


def _text(value: str) -> bytes:
    data = value.encode()
    return b"X" + len(data).to_bytes(4, "little") + data  # BINUNICODE


def _frame(name: str) -> bytes:
    return (b"}(" + _text("filename") + _text("train.py") + _text("line") + b"K\x07" + _text("name") + _text(name)
            + b"u")


def _row(address: int, frames: bytes) -> bytes:
    return (b"}(" + _text("action") + _text("alloc") + _text("addr") + b"J" + address.to_bytes(4, "little")
            + _text("size") + b"J\x00\x02\x00\x00" + _text("stream") + b"K\x00" + _text("frames") + frames + b"u")


def test_frames_lists_of_the_same_objects_share_a_stack_as_they_end_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scanner hands the reader one frames list per content (PyTorch writes one per entry),
    compared once the file is read: a list that grows after its entry was read (through the memo)
    is not merged with the lists it equalled then."""
    data = b"".join([
        b"\x80\x02}q\x00(", _text("segments"), b"]", _text("device_traces"), b"](]q\x01(",
        _row(0, b"]q\x02" + _frame("forward") + b"q\x03a"),  # frames [forward] (grows below)
        _row(512, b"]q\x04h\x03a"),  # [forward]: another list of the same frame dict
        _row(1024, b"]q\x05h\x03a"),  # and another
        b"ee", b"u",
        b"h\x02", _frame("backward"), b"a0",  # the first list grows: [forward, backward]
        b".",
    ])
    assert natively_read(data, monkeypatch)
    raw, _reason = native_scan.scan(data)
    assert len(raw["device_traces"][0].frames) == 2  # three lists, two contents
    path = _write(tmp_path, data)
    assert outcome(path, False, monkeypatch) == outcome(path, True, monkeypatch)
    snapshot = memlens.load(path, cache=False)
    trace = snapshot.devices[0]
    assert [len(snapshot.stacks.stacks[s]) for s in trace.stack_id.tolist()] == [2, 1, 1]


def test_a_memoised_nan_used_twice_as_a_key_is_one_key_on_both_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A float is an object: the memo hands back the same one, and a dict finds a NaN key by
    identity, so CPython keeps one key here; the scanner made a new float per use (two keys)."""
    nan = b"G\x7f\xf8\x00\x00\x00\x00\x00\x00"  # BINFLOAT, big-endian NaN
    # {"segments": [], "device_traces": [], "x": {nan: 1, <memo 7: the same nan>: 2}}
    data = (b"\x80\x04}\x94(" + _text("segments") + b"\x94]\x94" + _text("device_traces") + b"\x94]\x94" +
            _text("x") + b"\x94}\x94(" + nan + b"\x94K\x01h\x07K\x02uu.")
    assert len(pickle.loads(data)["x"]) == 1
    raw, _reason = native_scan.scan(data)
    assert raw is not None and len(raw["x"]) == 1
    nans = list(raw["x"])
    assert len(nans) == 1 and nans[0] != nans[0]
    path = _write(tmp_path, data)
    assert outcome(path, False, monkeypatch) == outcome(path, True, monkeypatch)


def test_floats_written_twice_stay_two_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two BINFLOAT opcodes of one NaN are two objects to CPython (two keys): not merged either."""
    nan = b"G\x7f\xf8\x00\x00\x00\x00\x00\x00"
    data = (b"\x80\x04}(" + _text("segments") + b"]" + _text("device_traces") + b"]" + _text("x") + b"}(" +
            nan + b"K\x01" + nan + b"K\x02uu.")
    assert len(pickle.loads(data)["x"]) == 2
    monkeypatch.delenv("MEMLENS_PURE_PYTHON", raising=False)
    raw, _reason = native_scan.scan(data)
    assert raw is not None and len(raw["x"]) == 2


# ------------------------------------------------------------------ trace entries met again

_REPEATED = "one trace entry at two places"


def _entries_met_again(count: int, again: bytes = b"", second_device: bytes = b"", x: bytes = b"N") -> bytes:
    """A trace of ``count`` entries, each its own dict memoised at 3 + its index (the first one's
    strings at 0, 1, 2), then the opcodes ``again`` appending to it; a second device's trace of
    ``second_device`` if given; ``x`` (opcodes of one value) under an unknown key after them."""
    fields = text("action") + b"\x94" + text("alloc") + b"\x94" + text("addr") + b"\x94"  # MEMOIZE: 0, 1, 2
    again_fields = get(0) + get(1) + get(2)
    rows = b"".join(b"}(" + (fields if k == 0 else again_fields) + b"J" + (0x7000_0000 + 512 * k).to_bytes(4, "little")
                    + text("size") + b"M\x00\x02u\x94a" for k in range(count))
    traces = b"]" + rows + again + b"a" + (b"]" + second_device + b"a" if second_device else b"")
    return (b"\x80\x04}(" + text("segments") + b"]" + text("device_traces") + b"]" + traces + text("x") + x
            + b"u.")


_GET_ROW = b"j\x08\x00\x00\x00"  # the sixth entry (a row whose dict the scanner dropped)
_GET_FIRST = b"j\x03\x00\x00\x00"  # the first entry (the one the scanner keeps whole)


@pytest.mark.parametrize(("case", "refused"), [
    (dict(again=_GET_ROW + b"a"), True),
    (dict(again=_GET_FIRST + b"a"), True),
    (dict(second_device=_GET_ROW + b"a"), True),  # in another device's trace
    (dict(x=_GET_ROW), False),  # under an unknown key: no trace holds it twice
    (dict(again=_GET_ROW + b"0"), False),  # met again and popped: held nowhere
], ids=["a row again", "the first entry again", "in another device", "under a key", "popped"])
def test_a_trace_entry_met_again_is_refused_in_one_line_on_both_engines(
    case: dict[str, bytes], refused: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PyTorch writes every event as a dict of its own; a file that names one again through the
    memo made the Python path build a dict per reference (2 GB for a 9 MB gzip), where the scanner
    declined: both refuse it, the scanner without building them."""
    data = _entries_met_again(10, **case)
    raw = pickle.loads(data)
    assert len(raw["device_traces"][0]) == 10 + refused * ("again" in case)
    path = _write(tmp_path, data)
    native, python = outcome(path, False, monkeypatch), outcome(path, True, monkeypatch)
    assert native == python
    assert (native[0] == "error" and _REPEATED in native[1]) is refused, native[:2]
    assert not refused or "\n" not in native[1]


def test_a_gzip_of_entries_met_again_is_refused_with_memory_bounded_by_the_columns(tmp_path: Path) -> None:
    """A million rows and one reference again (2 MB of gzip): refused by the scanner within a few
    tens of megabytes, where the Python path builds the million dicts before its check refuses it."""
    from memlens.snapshot.reader import REPEATED_ENTRY

    data = _entries_met_again(1_000_000, _GET_ROW + b"a")
    assert native_scan.scan(data) == (None, REPEATED_ENTRY)  # the scanner's own answer: no Python path after it
    path = tmp_path / "again.pickle.gz"
    path.write_bytes(gzip.compress(data, compresslevel=6))
    # The peak is the child's own VmHWM (its address space's high-water mark since exec), not
    # ru_maxrss, which Linux carries over from the parent across fork and exec: beside a test
    # process grown to 1.2 GB both engines read 1.2 GB.
    code = ("import sys, memlens\n"
            "try:\n    memlens.load(sys.argv[1], cache=False)\n"
            "except memlens.MemlensError as exc:\n    print(str(exc).replace(chr(10), ' '))\n"
            "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')))\n")

    def peak(target: Path, pure_python: bool) -> tuple[int, str]:
        env = {k: v for k, v in os.environ.items() if k != "MEMLENS_PURE_PYTHON"}
        if pure_python:
            env["MEMLENS_PURE_PYTHON"] = "1"
        result = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, env=env,
                                cwd=REPO, timeout=300, check=True)
        *message, kib = result.stdout.splitlines()
        return int(kib) << 10, " ".join(message)

    (native, native_says), (python, python_says) = peak(path, False), peak(path, True)
    assert native_says == python_says and _REPEATED in native_says
    assert python - native > 32 << 20, (native, python)  # the million dicts, which the scanner never makes
