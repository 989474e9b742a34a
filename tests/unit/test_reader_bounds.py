"""Every numeric field at every boundary its PyTorch C++ type allows (issue 20, section 1).

A value PyTorch's types can hold loads: a meaningful one as written (addresses and streams past
2**63 - 1 bit for bit in the int64 columns), a meaningless one (a frame line of 2**64 - 1, a
block of 2**60 bytes, a time before the epoch) as unknown, with a note on the device. Only a
value no such type holds is refused, in one line naming the field.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import memlens
from memlens.errors import MemlensFormatError
from memlens.snapshot import Snapshot
from tests.unit.test_reader import tiny_snapshot

PLAUSIBLE_BYTES = 1 << 44  # memlens.snapshot.validate.PLAUSIBLE_BYTES: more than any GPU holds
INT64_MIN, INT64_MAX, UINT64_MAX = -(1 << 63), (1 << 63) - 1, (1 << 64) - 1
INT8_MIN, INT8_MAX = -128, 127
BIT64 = 1 << 64


def as_int64(value: int) -> int:
    return value - BIT64 if value > INT64_MAX else value


# field name -> where it lives in tiny_snapshot()
def _set(path: tuple[Any, ...]) -> Callable[[dict[str, Any], int], None]:
    def setter(raw: dict[str, Any], value: int) -> None:
        node: Any = raw
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return setter


SEGMENT = ("segments", 0)
BLOCK = (*SEGMENT, "blocks", 1)
ENTRY = ("device_traces", 0, 2)  # the live allocation
OOM_ROW = ("device_traces", 0, 5)  # an oom row _with appends for it
FRAME = (*ENTRY, "frames", 0)
ANNOTATION = ("external_annotations", 0)


def _load(tmp_path: Path, raw: dict[str, Any], name: str) -> Snapshot:
    path = tmp_path / f"{name}.pickle"
    path.write_bytes(pickle.dumps(raw, protocol=4))
    return memlens.load(path, cache=False)


def _with(field: tuple[Any, ...], value: int) -> dict[str, Any]:
    raw = copy.deepcopy(tiny_snapshot())
    raw["device_traces"][0][2]["frames"] = [dict(f) for f in raw["device_traces"][0][2]["frames"]]
    if field[:3] == OOM_ROW:
        raw["device_traces"][0].append({"action": "oom", "addr": 0, "size": 1 << 30, "stream": 0, "time_us": 6,
                                        "device_free": 0, "frames": []})
    _set(field)(raw, value)
    return raw


def _notes(snapshot: Snapshot) -> str:
    return " | ".join(note for trace in snapshot.devices.values() for note in trace.curve_warnings)


# (field, value, check of the loaded snapshot): every value here is one PyTorch's type can hold.
LOADS: list[tuple[str, tuple[Any, ...], int, Callable[[Snapshot], bool]]] = [
    # Frame lines: uint64 in today's builds (-1 when CPython has none), C int in 2.0.
    ("frame line max", (*FRAME, "line"), UINT64_MAX, lambda s: s.device(0).stack_id[2] >= 0
        and s.stacks.frames_of(int(s.device(0).stack_id[2]))[0].line == 0),
    ("frame line -1", (*FRAME, "line"), -1, lambda s: s.stacks.frames_of(int(s.device(0).stack_id[2]))[0].line == 0),
    ("frame line int64 min", (*FRAME, "line"), INT64_MIN,
     lambda s: s.stacks.frames_of(int(s.device(0).stack_id[2]))[0].line == 0),
    ("frame line 2**31-1", (*FRAME, "line"), (1 << 31) - 1,
     lambda s: s.stacks.frames_of(int(s.device(0).stack_id[2]))[0].line == (1 << 31) - 1),
    ("frame line 0", (*FRAME, "line"), 0, lambda s: s.stacks.frames_of(int(s.device(0).stack_id[2]))[0].line == 0),
    # Trace addresses are size_t / uintptr_t: kept bit for bit.
    ("addr max", (*ENTRY, "addr"), UINT64_MAX, lambda s: int(s.device(0).address[2]) == as_int64(UINT64_MAX)),
    ("addr 2**63", (*ENTRY, "addr"), 1 << 63, lambda s: int(s.device(0).address[2]) == as_int64(1 << 63)),
    ("addr int64 max", (*ENTRY, "addr"), INT64_MAX, lambda s: int(s.device(0).address[2]) == INT64_MAX),
    ("addr 0", (*ENTRY, "addr"), 0, lambda s: int(s.device(0).address[2]) == 0),
    ("addr int64 min", (*ENTRY, "addr"), INT64_MIN, lambda s: int(s.device(0).address[2]) == INT64_MIN),
    # Streams are cudaStream_t pointers (int64 in older builds, uint64 in newer).
    ("stream max", (*ENTRY, "stream"), UINT64_MAX, lambda s: int(s.device(0).stream[2]) == -1),
    ("stream int64 min", (*ENTRY, "stream"), INT64_MIN, lambda s: int(s.device(0).stream[2]) == INT64_MIN),
    ("segment stream max", (*SEGMENT, "stream"), UINT64_MAX, lambda s: s.segments[0].stream == -1),
    ("segment stream int64 min", (*SEGMENT, "stream"), INT64_MIN, lambda s: s.segments[0].stream == INT64_MIN),
    # Sizes are size_t: past PLAUSIBLE_BYTES they are no allocation a GPU served (unknown, 0 B).
    ("size max", (*ENTRY, "size"), UINT64_MAX,
     lambda s: int(s.device(0).size[2]) == 0 and "counted as 0 B" in _notes(s)),
    ("size 2**63", (*ENTRY, "size"), 1 << 63, lambda s: int(s.device(0).size[2]) == 0 and "0 B" in _notes(s)),
    ("size int64 max", (*ENTRY, "size"), INT64_MAX, lambda s: int(s.device(0).size[2]) == 0),
    ("size 8 TiB", (*ENTRY, "size"), PLAUSIBLE_BYTES // 2,
     # plausible as a size (not read as unknown), but the row's block at the dump is 4 KiB
     lambda s: int(s.device(0).size[2]) == 4096 and "counted as 0 B" not in _notes(s)
     and "larger than the block" in _notes(s)),
    # The row's block is live at the dump: the state gives it (4 KiB), and a request past its
    # block cannot be true (it read "16.00 TiB requested in the 5.00 KiB of blocks").
    ("size 16 TiB, in a 4 KiB block", (*ENTRY, "size"), PLAUSIBLE_BYTES,
     lambda s: int(s.device(0).size[2]) == 4096 == int(s.device(0).block_size[2])
     and "larger than the block that held them" in _notes(s)),
    ("size 0", (*ENTRY, "size"), 0, lambda s: int(s.device(0).size[2]) == 0),
    ("block size max", (*BLOCK, "size"), UINT64_MAX,
     lambda s: s.segments[0].blocks[1].size == 0 and "counted as 0 B" in _notes(s)),
    ("block requested max", (*BLOCK, "requested_size"), UINT64_MAX,
     lambda s: s.segments[0].blocks[1].requested_size == 0),
    ("segment total max", (*SEGMENT, "total_size"), UINT64_MAX,
     lambda s: s.segments[0].total_size == 0 and "counted as 0 B" in _notes(s)),
    ("segment total 0", (*SEGMENT, "total_size"), 0, lambda s: s.segments[0].total_size == 0),
    # Segment and block addresses: uintptr_t (and int64 from PyTorch's C++ pickler).
    ("segment address max", (*SEGMENT, "address"), UINT64_MAX,
     lambda s: s.segments[0].address == as_int64(UINT64_MAX)),
    ("segment address int64 min", (*SEGMENT, "address"), INT64_MIN, lambda s: s.segments[0].address == INT64_MIN),
    ("block address max", (*BLOCK, "address"), UINT64_MAX,
     lambda s: s.segments[0].blocks[1].address == as_int64(UINT64_MAX)),
    # time_us is approx_time_t (int64): outside the epoch's range the trace's clock is unknown.
    ("time max", (*ENTRY, "time_us"), INT64_MAX,
     lambda s: not s.device(0).has_time and not s.device(0).time_us.any() and "times" in _notes(s)),
    ("time min", (*ENTRY, "time_us"), INT64_MIN, lambda s: not s.device(0).has_time),
    ("time 0", (*ENTRY, "time_us"), 0, lambda s: s.device(0).has_time),
    # Devices: c10::DeviceIndex (int8; int64 in older SegmentInfo). Negative: no device.
    ("segment device int8 max", (*SEGMENT, "device"), INT8_MAX, lambda s: s.segments[0].device == INT8_MAX),
    ("segment device -1", (*SEGMENT, "device"), -1, lambda s: not s.segments and "name no device" in _notes(s)),
    ("segment device int8 min", (*SEGMENT, "device"), INT8_MIN, lambda s: not s.segments),
    ("segment device int64 min", (*SEGMENT, "device"), INT64_MIN, lambda s: not s.segments),
    ("annotation device -1", (*ANNOTATION, "device"), -1, lambda s: s.annotations[0].device == -1),
    ("annotation device int64 max", (*ANNOTATION, "device"), INT64_MAX, lambda s: len(s.annotations) == 1),
    ("annotation time int64 min", (*ANNOTATION, "time_us"), INT64_MIN,
     lambda s: s.annotations[0].time_us == INT64_MIN),
    ("annotation time int64 max", (*ANNOTATION, "time_us"), INT64_MAX,
     lambda s: s.annotations[0].time_us == INT64_MAX),
    # max_split_size is a size_t (SIZE_MAX when unset) or -1.
    ("max_split_size max", ("allocator_settings", "max_split_size"), UINT64_MAX, lambda s: True),
    ("max_split_size -1", ("allocator_settings", "max_split_size"), -1, lambda s: True),
    # roundup_power2_divisions maps size_t to size_t: past 2**16 divisions it is unknown.
    ("divisions max", ("allocator_settings", "roundup_power2_divisions"), {"1": UINT64_MAX},  # type: ignore[list-item]
     lambda s: "roundup_power2_divisions" not in s.allocator_settings and "past 2**16" in _notes(s)),
    ("divisions key 2**63", ("allocator_settings", "roundup_power2_divisions"), {str(1 << 63): 4},  # type: ignore[list-item]
     lambda s: s.allocator_settings["roundup_power2_divisions"] == {str(1 << 63): 4}),  # PyTorch's keys: powers of 2
    ("divisions 2**16", ("allocator_settings", "roundup_power2_divisions"), {"1": 1 << 16},  # type: ignore[list-item]
     lambda s: s.allocator_settings["roundup_power2_divisions"] == {"1": 1 << 16}),
    # device_free (an OOM row's free bytes) is a size_t.
    ("device_free max", (*OOM_ROW, "device_free"), UINT64_MAX,
     lambda s: int(s.device(0).device_free[5]) == 0 and "counted as 0 B" in _notes(s)),
    ("device_free 16 TiB", (*OOM_ROW, "device_free"), PLAUSIBLE_BYTES,
     lambda s: int(s.device(0).device_free[5]) == PLAUSIBLE_BYTES),
    ("oom size max", (*OOM_ROW, "size"), UINT64_MAX, lambda s: int(s.device(0).size[5]) == 0),
    # An OOM row's size is what was asked for: torch.empty(2**50) asks for 1 PiB, and says so.
    ("oom size 1 PiB", (*OOM_ROW, "size"), 1 << 50,
     lambda s: int(s.device(0).size[5]) == 1 << 50 and "counted as 0 B" not in _notes(s)),
    # segment_pool_id is a pair of CaptureId_t (uint64): the opcode vetting takes them within
    # +-2**61 and at 2**64 - 1 (counted: MAX_WIDE_TUPLES), beyond are tuples a hash bomb is made of.
    ("pool id 2**31-1", (*SEGMENT, "segment_pool_id"), (0, (1 << 31) - 1),  # type: ignore[list-item]
     lambda s: s.segments[0].pool_id == (0, (1 << 31) - 1)),
    ("pool id 2**61-1", (*SEGMENT, "segment_pool_id"), ((1 << 61) - 1, 1),  # type: ignore[list-item]
     lambda s: s.segments[0].pool_id == ((1 << 61) - 1, 1)),
    ("pool id max", (*SEGMENT, "segment_pool_id"), (UINT64_MAX, UINT64_MAX),  # type: ignore[list-item]
     lambda s: s.segments[0].pool_id == (UINT64_MAX, UINT64_MAX)),
]

# Values no PyTorch type for the field can hold.
REFUSED: list[tuple[str, tuple[Any, ...], int, str]] = [
    ("frame line 2**64", (*FRAME, "line"), BIT64, "'line' is out of range"),
    ("frame line below int64", (*FRAME, "line"), INT64_MIN - 1, "'line' is out of range"),
    ("addr 2**64", (*ENTRY, "addr"), BIT64, "'addr' is out of range"),
    ("addr below int64", (*ENTRY, "addr"), INT64_MIN - 1, "'addr' is out of range"),
    ("stream 2**64", (*ENTRY, "stream"), BIT64, "'stream' is out of range"),
    ("size 2**64", (*ENTRY, "size"), BIT64, "'size' is out of range"),
    ("size -1", (*ENTRY, "size"), -1, "negative size"),
    ("block size 2**64", (*BLOCK, "size"), BIT64, "'size' is out of range"),
    ("block size -1", (*BLOCK, "size"), -1, "'size' is negative"),
    ("segment total 2**64", (*SEGMENT, "total_size"), BIT64, "'total_size' is out of range"),
    ("segment address 2**64", (*SEGMENT, "address"), BIT64, "'address' is out of range"),
    ("segment stream 2**64", (*SEGMENT, "stream"), BIT64, "'stream' is out of range"),
    ("time 2**63", (*ENTRY, "time_us"), 1 << 63, "'time_us' is out of range"),
    ("annotation time 2**63", (*ANNOTATION, "time_us"), 1 << 63, "'time_us' is out of range"),
    ("segment device past int64", (*SEGMENT, "device"), 1 << 63, "'device' is out of range"),
    ("segment device past the cap", (*SEGMENT, "device"), 1024, "'device' is out of range"),
    ("max_split_size 2**64", ("allocator_settings", "max_split_size"), BIT64, "'max_split_size' is out of range"),
    ("device_free 2**64", (*OOM_ROW, "device_free"), BIT64, "'device_free' is out of range"),
    ("divisions 2**64", ("allocator_settings", "roundup_power2_divisions"), {"1": BIT64},  # type: ignore[list-item]
     "'roundup_power2_divisions' should map sizes to counts"),
]


@pytest.mark.parametrize(("name", "field", "value", "check"), LOADS, ids=[case[0] for case in LOADS])
def test_every_value_pytorchs_types_hold_loads(
    tmp_path: Path, name: str, field: tuple[Any, ...], value: int, check: Callable[[Snapshot], bool],
) -> None:
    snapshot = _load(tmp_path, _with(field, value), name.replace(" ", "_").replace("*", ""))
    assert check(snapshot), (name, _notes(snapshot))
    memlens.analyze(snapshot)  # the analysis runs on what was read


@pytest.mark.parametrize(("name", "field", "value", "message"), REFUSED, ids=[case[0] for case in REFUSED])
def test_values_no_pytorch_type_holds_are_refused_naming_the_field(
    tmp_path: Path, name: str, field: tuple[Any, ...], value: int, message: str,
) -> None:
    with pytest.raises(MemlensFormatError, match=message.replace("*", r"\*")):
        _load(tmp_path, _with(field, value), name.replace(" ", "_").replace("*", ""))


def test_python_313_frames_without_a_line_load_in_any_number(tmp_path: Path) -> None:
    """PyTorch under Python 3.13 writes line 2**64 - 1 for frames CPython has no line for; a
    real file has thousands of such frame dicts (the opcode vetting counts large integers)."""
    raw = tiny_snapshot()
    base = 0x7100_0000
    raw["device_traces"][0].extend(
        {"action": "alloc", "addr": base + 512 * i, "size": 512, "stream": 0, "time_us": 10 + i,
         "frames": [{"filename": f"model_{i}.py", "line": UINT64_MAX, "name": "forward"},
                    {"filename": "train.py", "line": 7, "name": "main"}]}
        for i in range(20_000))
    snapshot = _load(tmp_path, raw, "py313")
    frames = [f for f in snapshot.stacks.frames if f.filename.startswith("model_")]
    assert len(frames) == 20_000 and {f.line for f in frames} == {0}
    assert str(frames[0]) == "forward (model_0.py)"  # no ":0" or ":18446744073709551615"


def test_the_cache_round_trips_values_past_int64(tmp_path: Path) -> None:
    raw = _with((*SEGMENT, "address"), UINT64_MAX - (4 << 20))
    raw["segments"][0]["blocks"][1]["address"] = UINT64_MAX - (2 << 20)
    raw["device_traces"][0][2]["addr"] = UINT64_MAX - (2 << 20)
    raw["device_traces"][0][2]["stream"] = UINT64_MAX
    path = tmp_path / "high.pickle"
    path.write_bytes(pickle.dumps(raw, protocol=4))
    first = memlens.load(path, cache=True)
    second = memlens.load(path, cache=True)
    assert second.from_cache
    assert second.segments[0].address == first.segments[0].address == as_int64(UINT64_MAX - (4 << 20))
    assert second.segments[0].blocks[1].address == first.segments[0].blocks[1].address
    assert int(second.device(0).stream[2]) == -1
