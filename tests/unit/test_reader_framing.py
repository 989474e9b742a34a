"""Pickle framing anywhere it is legal, and files cut short, on both engines.

Protocols 4 and 5 let a pickler start a FRAME between any two opcodes: CPython's commits one
once 64 KiB are buffered, wherever that falls, a tuple's items included (memlens' own loader
refused a snapshot ``memlens plan`` had just written so). A file cut short -- a copy still being
written, a partial download -- is told as such, with where reading stopped, at every cut point.
"""

from __future__ import annotations

import gzip
import pickle
import pickletools
import random
import re
from pathlib import Path

import pytest

from memlens.allocator.engine import native_module
from memlens.snapshot import ahead
from tests.conftest import real_snapshot_paths
from tests.hostile_files import dumps, entry, snapshot
from tests.unit.test_native_scan import outcome

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SAMPLES = sorted((REPO / "sample_snapshots").glob("*.pickle"))
ENGINES = [pytest.param(True, id="python"), pytest.param(
    False, id="native", marks=pytest.mark.skipif(ahead._native_scan is None or native_module() is None,
                                                 reason="the native core is not built"))]
_TUPLES = {"TUPLE1", "TUPLE2", "TUPLE3", "TUPLE"}


def reframed(data: bytes, seed: int, largest: int) -> bytes:
    """``data`` (a pickle) re-framed as protocol 4: a frame of 1 to ``largest`` bytes of whole
    opcodes at a time, and a frame boundary before each of the three opcodes ahead of every
    tuple opcode (between a tuple's items, and between its last item and the tuple)."""
    rng = random.Random(seed)
    ops = list(pickletools.genops(data))
    ends = [position for _, _, position in ops[1:]] + [len(data)]
    out = bytearray(b"\x80\x04")
    frame = bytearray()
    target = rng.randint(1, largest)
    for index, ((opcode, _argument, position), end) in enumerate(zip(ops, ends, strict=True)):
        if opcode.name in ("PROTO", "FRAME"):
            continue
        tuple_ahead = any(o.name in _TUPLES for o, _, _ in ops[index:index + 4])
        if frame and (tuple_ahead or len(frame) >= target):
            out += b"\x95" + len(frame).to_bytes(8, "little") + frame
            frame.clear()
            target = rng.randint(1, largest)
        frame += data[position:end]
    out += b"\x95" + len(frame).to_bytes(8, "little") + frame
    return bytes(out)


def test_the_reframing_puts_a_frame_between_a_tuples_items() -> None:
    data = reframed(dumps(snapshot()), seed=0, largest=1 << 20)
    assert pickle.loads(data) == snapshot()
    names = [opcode.name for opcode, _, _ in pickletools.genops(data)]
    pair = names.index("TUPLE2")  # segment_pool_id: (0, 0)
    assert names[pair - 4:pair + 1] == ["BININT1", "FRAME", "BININT1", "FRAME", "TUPLE2"]


@pytest.mark.parametrize("pure_python", ENGINES)
@pytest.mark.parametrize("path", [*SAMPLES, *real_snapshot_paths()], ids=lambda p: p.name)
def test_a_snapshot_framed_at_awkward_places_reads_as_it_was_written(
    path: Path, pure_python: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = path.read_bytes()
    copy = tmp_path / "snapshot.pickle"
    copy.write_bytes(original)
    expected = outcome(copy, pure_python, monkeypatch)
    assert expected[0] != "error"
    # Tiny frames on the samples; frames up to 4 KiB (still one between every tuple's items)
    # on the real files, which are larger.
    copy.write_bytes(reframed(original, seed=len(original), largest=48 if path in SAMPLES else 4096))
    assert outcome(copy, pure_python, monkeypatch) == expected


@pytest.mark.parametrize("pure_python", ENGINES)
def test_a_frame_before_every_opcode_reads_as_one_frame(
    pure_python: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    raw = snapshot(device_traces=[[entry("alloc", 0x7000_0000, 512), entry("free_completed", 0x7000_0000, 512)]])
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(dumps(raw))
    expected = outcome(path, pure_python, monkeypatch)
    path.write_bytes(reframed(dumps(raw), seed=0, largest=1))
    assert outcome(path, pure_python, monkeypatch) == expected


_SMALL = dumps(snapshot(device_traces=[[entry("alloc", 0, 512, user_metadata="m"), entry("oom", 0, 1 << 30)]]))
_ENDS_EARLY = re.compile(r"(?:the file|the pickle inside the gzip) ends early at byte ([0-9,]+) of ([0-9,]+)"
                         r"(?: \(a [0-9,]+-byte string there runs past its end\)| \(its gzip stream stops before its "
                         r"end\))?: it is truncated or was still being written$")


@pytest.mark.parametrize("pure_python", ENGINES)
@pytest.mark.parametrize("protocol", [0, 4])
def test_a_file_cut_at_any_point_says_where_it_ends_early(
    protocol: int, pure_python: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = _SMALL if protocol == 4 else pickle.dumps(pickle.loads(_SMALL), protocol=protocol)
    path = tmp_path / "cut.pickle"
    for cut in range(1, len(data)):
        path.write_bytes(data[:cut])
        answer = outcome(path, pure_python, monkeypatch)
        assert answer[0] == "error", cut
        message = answer[1].split(": ", 1)[1]
        found = _ENDS_EARLY.match(message)
        assert found is not None, (cut, message)
        stopped, size = (int(group.replace(",", "")) for group in found.groups())
        assert size == cut and stopped <= cut, (cut, message)


@pytest.mark.parametrize("pure_python", ENGINES)
def test_a_sample_cut_short_says_where_it_ends_early(
    pure_python: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = SAMPLES[0].read_bytes()
    path = tmp_path / "cut.pickle"
    for cut in random.Random(0).sample(range(1, len(data)), 40):
        path.write_bytes(data[:cut])
        answer = outcome(path, pure_python, monkeypatch)
        found = _ENDS_EARLY.match(answer[1].split(": ", 1)[1])
        assert found is not None and int(found.group(2).replace(",", "")) == cut, (cut, answer)


@pytest.mark.parametrize("pure_python", ENGINES)
def test_a_gzip_cut_short_says_where_it_ends_early(
    pure_python: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = gzip.compress(SAMPLES[0].read_bytes())
    path = tmp_path / "cut.pickle.gz"
    for cut in [3, 10, 11, 100, *random.Random(1).sample(range(12, len(data)), 20), len(data) - 8, len(data) - 1]:
        path.write_bytes(data[:cut])
        answer = outcome(path, pure_python, monkeypatch)
        found = _ENDS_EARLY.match(answer[1].split(": ", 1)[1])
        assert found is not None, (cut, answer)
