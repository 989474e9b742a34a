"""The opcode vetting in front of the C unpickler (memlens.snapshot.scan): every real snapshot
and every pickle protocol passes unchanged, at any chunk size; the constructs that can make
the C unpickler hash forever or allocate without bound are refused, with the byte offset."""

from __future__ import annotations

import io
import math
import os
import pickle
import pickletools
import struct
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import memlens
from memlens.errors import MemlensFormatError
from memlens.snapshot import scan
from memlens.snapshot.scan import PickleRefused, VettedStream
from tests.conftest import REAL_SNAPSHOTS_DIR
from tests.hostile_files import get, put, small_int, snapshot, text, tuple_dag

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow


class _Plain(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise AssertionError(f"global {module}.{name}")


def vetted_load(data: bytes) -> Any:
    stream = VettedStream(io.BytesIO(data))
    try:
        return _Plain(stream).load()
    except Exception:
        if stream.refusal is not None:
            raise stream.refusal from None
        raise


def real_snapshots() -> list[Path]:
    return sorted(Path(REAL_SNAPSHOTS_DIR).glob("*.pickle"))


@pytest.mark.parametrize("path", real_snapshots(), ids=lambda p: p.name[:40])
def test_real_snapshots_pass_unchanged(path: Path) -> None:
    data = path.read_bytes()
    assert vetted_load(data) == pickle.loads(data)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_every_protocol_passes_unchanged(protocol: int) -> None:
    raw = snapshot(extra={"floats": [1.5, -0.0, math.inf], "big": 1 << 70, "flags": (True, False, None),
                          "text": "é" * 300, "empty": ()})
    if protocol >= 3:  # older protocols write bytes through a global (_codecs.encode)
        raw["extra"]["bytes"] = b"\x00\x01" * 200
    data = pickle.dumps(raw, protocol=protocol)
    assert vetted_load(data) == raw


values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.integers(-(1 << 1000), 1 << 1000)
    | st.floats(allow_nan=False)
    | st.text(max_size=300),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    | st.tuples(st.integers(-(1 << 31), (1 << 31) - 1), st.integers(0, 9)),
    max_leaves=40,
)


@settings(max_examples=150, deadline=None)
@given(value=values, blob=st.binary(max_size=300), protocol=st.integers(0, pickle.HIGHEST_PROTOCOL),
       chunk=st.integers(1, 300), piece=st.integers(1, 64))
def test_any_chunking_gives_the_same_objects(value: Any, blob: bytes, protocol: int, chunk: int,
                                             piece: int) -> None:
    """Tokens, payloads and tuples cut by buffer and piece boundaries are still read right."""
    if protocol >= 3:  # older protocols write bytes through a global (_codecs.encode)
        value = [value, blob]
    data = pickle.dumps(value, protocol=protocol)
    old = scan.CHUNK, scan.PIECE
    scan.CHUNK, scan.PIECE = chunk, piece
    try:
        assert vetted_load(data) == value
    finally:
        scan.CHUNK, scan.PIECE = old


@pytest.mark.parametrize("value", [
    (1, 2), (1,), (1, 2, 3), (None, True, 0), ((1 << 31) - 1, -(1 << 31)),
    (1 << 40, 0),
], ids=repr)
def test_tuples_of_a_few_numbers_pass(value: tuple[Any, ...]) -> None:
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert vetted_load(pickle.dumps({"segment_pool_id": value}, protocol=protocol)) == {"segment_pool_id": value}


@pytest.mark.parametrize("value", [((1 << 61) - 1, -(1 << 61) + 1), ((1 << 64) - 1, (1 << 64) - 1), (0, (1 << 64) - 1)],
                         ids=repr)
def test_pool_ids_of_64_bit_capture_ids_pass(value: tuple[Any, ...]) -> None:
    """segment_pool_id holds CaptureId_t (uint64): legal up to 2**61 and at 2**64 - 1 ("none"), in
    the binary protocols PyTorch's snapshots are written with."""
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        assert vetted_load(pickle.dumps({"segment_pool_id": value}, protocol=protocol)) == {"segment_pool_id": value}


def test_wide_tuples_are_counted() -> None:
    many = [((1 << 40) + i, i) for i in range(scan.MAX_WIDE_TUPLES + 1)]
    with pytest.raises(PickleRefused, match="tuples of integers beyond 32 bits"):
        vetted_load(pickle.dumps(many, protocol=4))
    assert len(vetted_load(pickle.dumps(many[:1000], protocol=4))) == 1000


@pytest.mark.parametrize("value", [
    ((1, 2), (3, 4)), ("a", 1), ([1], 2), tuple(range(9)), tuple_dag(2), (2.5, 1), (1 << 62, 0),
], ids=["nested", "string", "list", "nine items", "dag", "float", "large int"])
def test_other_tuples_are_refused(value: tuple[Any, ...]) -> None:
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        with pytest.raises(PickleRefused, match="a tuple of anything but a few small integers"):
            vetted_load(pickle.dumps({"x": value}, protocol=protocol))


def test_a_shared_tuple_of_numbers_used_as_key_is_refused_by_reference() -> None:
    """Memo references in a tuple are refused even when they point at numbers-only tuples."""
    data = (b"\x80\x04}" + put(0) + small_int(1) + small_int(2) + b"\x86" + put(1)
            + get(1) + get(1) + b"\x86" + b"Ns.")
    with pytest.raises(PickleRefused, match="at byte 16"):
        vetted_load(data)


@pytest.mark.parametrize(("data", "problem"), [
    (pickle.dumps({"x": {1, 2}}, protocol=4), "a set"),
    (pickle.dumps({"x": frozenset({1})}, protocol=4), "a frozenset"),
    (b"\x80\x04]" + text("a") + b"2a.", "DUP"),
    (pickle.dumps(1 << 4000, protocol=4), "LONG4"),
    (b"\x80\x02]r" + struct.pack("<I", 1 << 30) + b".", "memo index"),
    (b"(lp99999999\n.", "memo index"),
    (b"\x80\x04\xff.", "0xff"),
])
def test_dangerous_opcodes_are_refused_with_the_offset(data: bytes, problem: str) -> None:
    with pytest.raises(PickleRefused, match=problem) as info:
        vetted_load(data)
    assert "at byte" in str(info.value)


def test_a_few_large_integers_pass_but_not_thousands() -> None:
    """Ints equal modulo 2**61 - 1 share a hash: as dict keys they take quadratic time."""
    few = [1 + i * ((1 << 61) - 1) for i in range(1, scan.MAX_LARGE_INTS + 1)]  # all beyond 2**61
    for protocol in (0, 2, 4):
        assert vetted_load(pickle.dumps(few, protocol=protocol)) == few
    many = [*few, -(1 << 70)]
    for protocol in (0, 2, 4):
        with pytest.raises(PickleRefused, match="integers beyond"):
            vetted_load(pickle.dumps(many, protocol=protocol))


def test_bytes_after_stop_are_never_read() -> None:
    assert vetted_load(pickle.dumps([1], protocol=4) + b"2" * 100) == [1]


class _System:
    def __reduce__(self) -> Any:
        return (os.system, ("true",))


@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_a_global_is_named_even_when_its_arguments_are_refused(tmp_path: Path, protocol: int) -> None:
    """The arguments tuple of a REDUCE holds a string (refused), but the message names the global."""
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps(snapshot(extra=_System()), protocol=protocol))
    with pytest.raises(MemlensFormatError, match=r"names the global (posix|os)\.system"):
        memlens.load(path, cache=False)


# --------------------------------------------------------------------------- vetting in a child process


@pytest.fixture
def always_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Vet every plain file in a child process, whatever its size and the CPU count (on the
    Python path: the native scanner reads a file it accepts without vetting processes)."""
    monkeypatch.setenv("MEMLENS_PURE_PYTHON", "1")
    monkeypatch.setattr(scan, "parallel_vetting_pays", lambda size: True)


@pytest.mark.parametrize("path", real_snapshots()[:4], ids=lambda p: p.name[:40])
def test_a_child_process_vets_to_the_same_snapshot(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMLENS_PURE_PYTHON", "1")  # the Python path's vetting, in process and piped
    in_process = memlens.load(path, cache=False)
    monkeypatch.setattr(scan, "parallel_vetting_pays", lambda size: True)
    fractions: list[float] = []
    piped = memlens.load(path, cache=False, progress=lambda stage, fraction: fractions.append(fraction))
    for device in in_process.devices:
        for column in ("action", "address", "size", "time_us", "stack_id", "allocated", "reserved"):
            assert (getattr(piped.device(device), column) == getattr(in_process.device(device), column)).all()
    assert len(piped.segments) == len(in_process.segments)
    assert fractions[-1] == 1.0 and fractions == sorted(fractions)


@pytest.mark.usefixtures("always_parallel")
@pytest.mark.parametrize(("build", "problem"), [
    (lambda: pickle.dumps(snapshot(extra=_System()), protocol=4), r"names the global (posix|os)\.system"),
    (lambda: pickle.dumps(snapshot(extra={"x": tuple_dag(3)}), protocol=4), "a tuple of anything but"),
    (lambda: b"\x80\x04]" + text("a") + b"2a.", "DUP"),
    (lambda: pickle.dumps(snapshot(), protocol=4)[:300], "ends early"),
])
def test_a_child_process_refuses_as_the_in_process_vetting_does(tmp_path: Path, build: Any, problem: str) -> None:
    path = tmp_path / "hostile.pickle"
    path.write_bytes(build())
    with pytest.raises(MemlensFormatError, match=problem):
        memlens.load(path, cache=False)


@pytest.mark.usefixtures("always_parallel")
def test_a_child_that_cannot_start_leaves_vetting_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scan, "_CHILD", "import sys; sys.exit(3)")
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(snapshot(), protocol=4))
    assert memlens.load(path, cache=False).device(0).events == 5


@pytest.mark.usefixtures("always_parallel")
def test_a_child_that_dies_midway_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = pickle.dumps(snapshot(), protocol=4)
    first = data[:40]
    monkeypatch.setattr(scan, "_CHILD", (
        "import struct, sys; out = sys.stdout.buffer; "
        f"out.write(struct.pack('<cQ', b'D', {len(first)}) + {first!r}); out.flush(); sys.exit(5)"))
    path = tmp_path / "s.pickle"
    path.write_bytes(data)
    with pytest.raises(MemlensFormatError, match=r"the vetting process stopped \(exit code 5\)"):
        memlens.load(path, cache=False)


# --------------------------------------------------------------------------- random opcode streams


def _argument(opcode: pickletools.OpcodeInfo, draw: st.DrawFn) -> bytes:
    """Bytes for ``opcode``'s argument: well-formed or not, lengths small or absurd."""
    kind = opcode.arg.n if opcode.arg is not None else 0
    if kind > 0:
        return draw(st.binary(min_size=kind, max_size=kind))
    if kind == pickletools.UP_TO_NEWLINE:
        return draw(st.sampled_from([b"0", b"-5", b"x", b"9" * 30, b"'a'", b"os", b"1.5", b"\x1b[2J"])) + b"\n"
    width = {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: 4,
             pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8}.get(kind)
    if width is None:
        return b""
    length = draw(st.sampled_from([0, 1, 3, 200, (1 << (8 * width - 1)) - 1]))
    return length.to_bytes(width, "little") + draw(st.binary(max_size=min(length, 16)))


@st.composite
def opcode_streams(draw: st.DrawFn) -> bytes:
    opcodes = draw(st.lists(st.sampled_from(pickletools.opcodes), min_size=1, max_size=30))
    body = b"".join(op.code.encode("latin-1") + _argument(op, draw) for op in opcodes)
    return b"\x80\x04" + body + draw(st.sampled_from([b".", b""]))


@settings(max_examples=300, deadline=None)
@given(data=opcode_streams())
def test_random_opcode_streams_give_one_line_or_a_snapshot(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "random.pickle"
        path.write_bytes(data)
        try:
            memlens.load(path, cache=False)
        except MemlensFormatError as exc:
            assert "\n" not in str(exc) and str(exc).isprintable()


_PREFIX = b"\x80\x04}(" + text("segments") + b"]" + text("device_traces") + b"]" + text("x")
# Every length-prefixed opcode: its byte and the width of its length.
_LENGTH_PREFIXED = {
    "BYTEARRAY8": (b"\x96", 8), "BINBYTES8": (b"\x8e", 8), "BINUNICODE8": (b"\x8d", 8), "BINBYTES": (b"B", 4),
    "BINUNICODE": (b"X", 4), "BINSTRING": (b"T", 4), "SHORT_BINBYTES": (b"C", 1), "SHORT_BINUNICODE": (b"\x8c", 1),
    "SHORT_BINSTRING": (b"U", 1),
}


@pytest.mark.parametrize("pure_python", [True, False], ids=["python", "native"])
@pytest.mark.parametrize("name", sorted(_LENGTH_PREFIXED))
def test_a_declared_length_past_the_end_is_refused_before_anything_is_allocated(
    name: str, pure_python: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 60-byte file declaring a 1 GiB string: the unpickler allocates what BYTEARRAY8 or
    BINBYTES8 declare before it reads, so the opcode must never reach it."""
    import tracemalloc

    opcode, width = _LENGTH_PREFIXED[name]
    declared = min(1 << 30, (1 << (8 * width)) - 1)
    data = _PREFIX + opcode + declared.to_bytes(width, "little") + b"abc" + b"u."
    path = tmp_path / "declared.pickle"
    path.write_bytes(data)
    if pure_python:
        monkeypatch.setenv("MEMLENS_PURE_PYTHON", "1")
    else:
        monkeypatch.delenv("MEMLENS_PURE_PYTHON", raising=False)
    warm = tmp_path / "warm.pickle"  # the imports a load makes, made outside the trace
    warm.write_bytes(pickle.dumps(snapshot(), protocol=4))
    memlens.load(warm, cache=False)
    tracemalloc.start()
    try:
        with pytest.raises(MemlensFormatError) as refused:
            memlens.load(path, cache=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak:,} bytes allocated before the refusal"
    message = str(refused.value)
    assert "\n" not in message
    assert f"ends early at byte {len(_PREFIX):,} of {len(data):,}" in message
    assert f"a {declared:,}-byte string there runs past its end" in message
