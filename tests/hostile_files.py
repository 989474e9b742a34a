"""Hostile and malformed snapshot files, built in code (each a few bytes to a few megabytes).

One builder per attack; ``CORPUS`` maps a name to (attack class, builder). The tests in
``tests/unit/test_hostile_*.py`` run ``memlens triage`` on each, and
``benchmarks/hostile_corpus.py`` writes them all and measures time and peak RSS per file.
Builders return the file's bytes. Where pickle itself cannot write the attack (a tuple used
as a dict key would be hashed while building it), the opcodes are assembled by hand.
"""

from __future__ import annotations

import gzip
import io
import math
import pickle
import pickletools
import struct
from collections.abc import Callable
from typing import Any

PROTO4 = b"\x80\x04"
STOP = b"."


def text(value: str) -> bytes:
    """SHORT_BINUNICODE / BINUNICODE of ``value``."""
    data = value.encode()
    if len(data) < 256:
        return b"\x8c" + bytes([len(data)]) + data
    return b"X" + struct.pack("<I", len(data)) + data


def small_int(value: int) -> bytes:
    return b"K" + bytes([value]) if 0 <= value < 256 else b"J" + struct.pack("<i", value)


def get(index: int) -> bytes:
    return b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)


def entry(action: str = "alloc", addr: int = 0x7000_0000, size: int = 512, **more: Any) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 1, "frames": [], **more}


def snapshot(**more: Any) -> dict[str, Any]:
    """A small well-formed snapshot (one segment, two blocks, a short trace) to mutate."""
    frame = {"filename": "train.py", "line": 10, "name": "forward"}
    frames = [frame, {"filename": "train.py", "line": 20, "name": "main"}]
    base = 0x7000_0000
    raw: dict[str, Any] = {
        "segments": [{
            "device": 0, "address": base, "total_size": 2 << 20, "stream": 0, "segment_type": "large",
            "segment_pool_id": (0, 0), "is_expandable": False, "allocated_size": 1024,
            "active_size": 1024, "requested_size": 1000,
            "blocks": [
                {"address": base, "size": 1024, "requested_size": 1000, "state": "active_allocated",
                 "frames": frames},
                {"address": base + 1024, "size": (2 << 20) - 1024, "requested_size": 0, "state": "inactive",
                 "frames": []},
            ],
        }],
        "device_traces": [[
            entry("segment_alloc", base, 2 << 20, frames=frames),
            entry("alloc", base, 1024, frames=frames),
            entry("alloc", base + 1024, 2048, frames=frames),
            entry("free_requested", base + 1024, 2048, frames=frames),
            entry("free_completed", base + 1024, 2048, frames=frames),
        ]],
        "external_annotations": [{"name": "ProfilerStep#1", "stage": "START", "device": 0, "time_us": 1}],
        "allocator_settings": {"max_split_size": -1, "garbage_collection_threshold": 0.0,
                               "expandable_segments": False, "PYTORCH_CUDA_ALLOC_CONF": ""},
    }
    raw.update(more)
    return raw


def dumps(raw: Any) -> bytes:
    return pickle.dumps(raw, protocol=4)


# --------------------------------------------------------------------------- hash bombs


def tuple_dag(levels: int = 64) -> tuple[Any, ...]:
    """A tuple whose every level holds the level below twice: hashing it takes 2**levels steps."""
    dag: tuple[Any, ...] = (0, 0)
    for _ in range(levels):
        dag = (dag, dag)
    return dag


def _dag_opcodes(levels: int, first_memo: int) -> bytes:
    """Opcodes that push a ``levels``-deep tuple DAG (memo slots from ``first_memo``)."""
    out = small_int(0) + small_int(0) + b"\x86" + put(first_memo)
    for level in range(levels):
        out += get(first_memo + level) * 2 + b"\x86" + put(first_memo + level + 1)
    return out


def put(index: int) -> bytes:
    return b"q" + bytes([index]) if index < 256 else b"r" + struct.pack("<I", index)


def open_snapshot() -> tuple[bytes, int]:
    """A snapshot's opcodes (protocol 2: no frames, explicit memo) without the final STOP, so
    the top dict is still on the stack for more SETITEMs; and the next free memo index."""
    data = pickle.dumps(snapshot(), protocol=2)
    puts = [arg for op, arg, _ in pickletools.genops(data) if op.name in ("BINPUT", "LONG_BINPUT")
            and isinstance(arg, int)]
    return data[:-1], max(puts, default=-1) + 1


def hash_bomb_as_dict_key() -> bytes:
    """{<64-level tuple DAG>: [], "segments": []} (the C unpickler hashes the key)."""
    return (PROTO4 + b"}" + put(0) + _dag_opcodes(64, first_memo=1) + b"]s"
            + text("segments") + b"]s" + STOP)


def hash_bomb_in_a_trace_entry_key() -> bytes:
    """A trace entry whose extra key is the DAG."""
    head, memo = open_snapshot()
    return head + text("extra") + b"}" + _dag_opcodes(64, first_memo=memo) + small_int(1) + b"ss" + STOP


def hash_bomb_as_action() -> bytes:
    return dumps(snapshot(device_traces=[[entry(action=tuple_dag())]]))  # type: ignore[arg-type]


def hash_bomb_as_user_metadata() -> bytes:
    return dumps(snapshot(device_traces=[[entry(user_metadata=tuple_dag())]]))


def hash_bomb_in_a_frozenset() -> bytes:
    """A frozenset (hashable, so it could be a key): refused whatever it holds."""
    return dumps(snapshot(extra=frozenset({"a", "b"})))


# --------------------------------------------------------------------------- amplification


def shared_segments_and_blocks(count: int = 20_000) -> bytes:
    """20,000 references to one segment whose blocks are 20,000 references to one block."""
    block = {"address": 0x7000_0000, "size": 512, "requested_size": 512, "state": "active_allocated",
             "frames": []}
    segment = {"device": 0, "address": 0x7000_0000, "total_size": 2 << 20, "stream": 0,
               "blocks": [block] * count}
    return dumps({"segments": [segment] * count, "device_traces": []})


def shared_trace_entries(count: int = 2_500_000) -> bytes:
    """One trace entry referred to 2.5 million times (5 MB of memo references)."""
    return dumps(snapshot(device_traces=[[entry()] * count]))


def dup_trace_entries(count: int = 5_000_000) -> bytes:
    """One trace entry DUPed 5 million times into the trace list."""
    one = pickle.dumps(entry(), protocol=2)[2:-1]  # the entry dict's opcodes, without PROTO and STOP
    trace = b"]" + b"(" + one + b"2" * count + b"e"
    return PROTO4 + b"}" + text("segments") + b"]s" + text("device_traces") + b"]" + trace + b"as" + STOP


def shared_annotations(count: int = 1_000_000) -> bytes:
    return dumps(snapshot(external_annotations=[{"name": "a", "stage": "START", "device": 0,
                                                 "time_us": 1}] * count))


# --------------------------------------------------------------------------- deep nesting


def _deep_list_opcodes(depth: int) -> bytes:
    return b"]" * depth + b"a" * (depth - 1)


def deep_unknown_key(depth: int = 100_000) -> bytes:
    head, _ = open_snapshot()
    return head + text("nested") + _deep_list_opcodes(depth) + b"s" + STOP


def deep_allocator_setting(depth: int = 100_000) -> bytes:
    """allocator_settings = {"deep": [[[...]]]} (what the cache stores)."""
    return (PROTO4 + b"}" + text("segments") + b"]s" + text("allocator_settings") + b"}"
            + text("deep") + _deep_list_opcodes(depth) + b"ss" + STOP)


def self_referencing_setting() -> bytes:
    loop: list[Any] = []
    loop.append(loop)
    return dumps(snapshot(allocator_settings={"max_split_size": -1, "loop": loop}))


def deep_frames(depth: int = 100_000) -> bytes:
    """An entry's frames list nested 100,000 deep."""
    head = PROTO4 + b"}" + text("segments") + b"]s" + text("device_traces") + b"]]"
    one = b"}" + text("action") + text("alloc") + b"s" + text("frames") + _deep_list_opcodes(depth) + b"s"
    return head + one + b"aa" + b"s" + STOP


def deep_mark_stack(depth: int = 200_000) -> bytes:
    return PROTO4 + b"(" * depth + STOP


# --------------------------------------------------------------------------- types and numbers


def huge_size_near_2_62() -> bytes:
    """Sizes near 2**62: these used to overflow the curves into "4194304.00 TiB"; legal for a
    size_t, they are read as unknown (0 B, with a note), not refused."""
    big = 1 << 62
    return dumps(snapshot(device_traces=[[entry("alloc", 0x1000, big), entry("alloc", 0x2000, big)]]))


def nan_annotation_time() -> bytes:
    return dumps(snapshot(external_annotations=[{"name": "x", "stage": "START", "device": 0,
                                                 "time_us": math.nan}]))


def list_block_state() -> bytes:
    raw = snapshot()
    raw["segments"][0]["blocks"][0]["state"] = ["active_allocated"]
    return dumps(raw)


def oom_device_free_2_80() -> bytes:
    return dumps(snapshot(device_traces=[[entry("oom", 0, 1 << 30, device_free=1 << 80)]]))


def address_2_64() -> bytes:
    """The largest uintptr_t: legal, kept bit for bit in the int64 column."""
    return dumps(snapshot(device_traces=[[entry("alloc", (1 << 64) - 1, 512)]]))


def address_past_2_64() -> bytes:
    """One past what a pointer can hold: no file PyTorch wrote."""
    return dumps(snapshot(device_traces=[[entry("alloc", 1 << 64, 512)]]))


def huge_long4_integer() -> bytes:
    return dumps(snapshot(extra=1 << 100_000))


def _long1(value: int) -> bytes:
    encoded = pickle.encode_long(value)
    return b"\x8a" + bytes([len(encoded)]) + encoded


def _dict_under_extra(items: bytes) -> bytes:
    """A snapshot whose key "extra" holds the dict built by ``items`` (key, value opcodes),
    assembled by hand: building such a dict in Python to pickle it would take the quadratic
    time the file is meant to cause."""
    head, _ = open_snapshot()
    return head + text("extra") + b"}(" + items + b"us" + STOP


def colliding_int_keys(count: int = 50_000) -> bytes:
    """Dict keys equal modulo 2**61 - 1: one hash, so building the dict takes count**2 probes."""
    return _dict_under_extra(b"".join(_long1(1 + i * ((1 << 61) - 1)) + b"K\x00" for i in range(count)))


def colliding_tuple_keys(count: int = 50_000) -> bytes:
    """Pairs (a, b) whose tuple hashes are equal: b solved from a through CPython's tuple hash."""
    prime1, prime2, prime5 = 11400714785074694791, 14029467366897019727, 2870177450012600261
    mask = (1 << 64) - 1

    def rounds(acc: int, lane: int) -> int:
        acc = (acc + lane * prime2) & mask
        return (((acc << 31) | (acc >> 33)) & mask) * prime1 & mask

    target = rounds(rounds(prime5, 7), 7)  # the state (7, 7) leaves before the length is added
    unrotated = (target * pow(prime1, -1, 1 << 64)) & mask
    unrotated = ((unrotated >> 31) | (unrotated << 33)) & mask
    items, found, a = [], 0, 1
    while found < count:
        lane = ((unrotated - rounds(prime5, a)) * pow(prime2, -1, 1 << 64)) & mask
        if lane < (1 << 61) - 1:  # an int's hash is the int itself below 2**61 - 1
            items.append(_long1(a) + _long1(lane) + b"\x86" + b"K\x00")
            found += 1
        a += 1
    return _dict_under_extra(b"".join(items))


def huge_memo_index() -> bytes:
    """LONG_BINPUT with index 2**31: the C unpickler would size its memo table to it."""
    return PROTO4 + b"]r" + struct.pack("<I", 1 << 31) + STOP


# --------------------------------------------------------------------------- huge strings


def huge_frame_name(size: int = 10 << 20) -> bytes:
    frames = [{"filename": "x.py", "line": 1, "name": "n" * size}]
    return dumps(snapshot(device_traces=[[entry("alloc", 0x1000, 512, frames=frames)]]))


def huge_frame_in_long_stacks(size: int = 10 << 20, depth: int = 2_000, stacks: int = 50) -> bytes:
    """One 10 MB frame name repeated through 2,000-frame stacks (distinct frame dicts)."""
    name = "n" * size
    entries = []
    for i in range(stacks):
        frames = [{"filename": f"f{i}.py", "line": j, "name": name} for j in range(depth)]
        entries.append(entry("alloc", 0x1000 + 4096 * i, 512, frames=frames))
    return dumps(snapshot(device_traces=[entries]))


# --------------------------------------------------------------------------- many devices


def many_device_traces(count: int = 40_000) -> bytes:
    return dumps({"segments": [], "device_traces": [[entry("alloc", 0x1000 * (d + 1), 512)]
                                                    for d in range(count)]})


def many_segment_devices(count: int = 40_000) -> bytes:
    segments = [{"device": d, "address": 0x1000, "total_size": 2 << 20, "stream": 0, "blocks": []}
                for d in range(count)]
    return dumps({"segments": segments, "device_traces": []})


def devices_at_the_cap(count: int = 1024) -> bytes:
    """As many devices as memlens reads, each with a short trace: must still finish quickly."""
    traces = [[entry("alloc", 0x1000, 512), entry("free_completed", 0x1000, 512)] for _ in range(count)]
    return dumps({"segments": [], "device_traces": traces})


# --------------------------------------------------------------------------- many steps


def unclosed_step_scopes(count: int = 200_000) -> bytes:
    """200,000 ProfilerStep scopes that START and never END, over as many trace rows: every
    step runs to the end of the trace (the analysis took 150 s at 500,000)."""
    annotations = [{"name": f"ProfilerStep#{i}", "stage": "START", "device": 0, "time_us": i}
                   for i in range(count)]
    trace = [entry("alloc", 0x1000 + 512 * i, 512, time_us=i) for i in range(count)]
    return dumps({"segments": [], "device_traces": [trace], "external_annotations": annotations})


def one_stream_per_allocation(count: int = 150_000) -> bytes:
    """150,000 allocations, each on its own stream: each makes a segment in the what-if replay
    (whose overlap test scanned every segment: hours)."""
    trace = [entry("alloc", 0x1000 + 512 * i, 512, stream=i, time_us=i) for i in range(count)]
    return dumps({"segments": [], "device_traces": [trace]})


def identical_steps(count: int = 100_000) -> bytes:
    """100,000 closed steps that all start and end at the same time."""
    annotations = [{"name": f"ProfilerStep#{i}", "stage": stage, "device": 0, "time_us": 1 if stage == "START" else 9}
                   for i in range(count) for stage in ("START", "END")]
    trace = [entry("alloc", 0x1000 + 512 * i, 512, time_us=1 + i % 9) for i in range(count)]
    return dumps({"segments": [], "device_traces": [trace], "external_annotations": annotations})


# --------------------------------------------------------------------------- compression


def gzip_of_shared_entries() -> bytes:
    return gzip.compress(shared_trace_entries(), compresslevel=9)


def gzip_bomb(inflated: int = 1 << 30) -> bytes:
    """A megabyte of gzip that inflates to a 1 GiB string in the snapshot."""
    payload = b"\x80\x04}" + text("segments") + b"]s" + text("junk") + b"\x8d" + struct.pack("<Q", inflated)
    compressor = gzip.GzipFile  # streamed, so building it needs no gigabyte either
    out = io.BytesIO()
    with compressor(fileobj=out, mode="wb", compresslevel=9) as zipped:
        zipped.write(payload)
        block = b"a" * (1 << 20)
        for _ in range(inflated >> 20):
            zipped.write(block)
        zipped.write(b"s.")
    return out.getvalue()


def gzip_bomb_of_many_strings(inflated: int = 1 << 30) -> bytes:
    """A megabyte of gzip that inflates to a gigabyte of 1 KiB strings, each one small."""
    piece = text("a" * 1024) + b"a"  # a 1 KiB string appended to the list on the stack
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=9) as zipped:
        zipped.write(b"\x80\x04}" + text("segments") + b"]s" + text("junk") + b"]")
        block = piece * ((1 << 20) // len(piece))
        for _ in range(inflated // len(block)):
            zipped.write(block)
        zipped.write(b"s.")
    return out.getvalue()


# --------------------------------------------------------------------------- second round (issue 21)


def deep_frames_list(depth: int = 100_000) -> list[dict[str, Any]]:
    return [{"filename": f"f{j % 97}.py", "line": j, "name": "call"} for j in range(depth)]


def releases_sharing_a_deep_stack(pairs: int = 50_000, depth: int = 100_000) -> bytes:
    """50,000 segment_free / segment_alloc pairs (each a release run) sharing one 100,000-frame
    stack, ending in an OOM so that triage replays the allocator (4 MB; 434 s when every run
    walked the whole stack)."""
    frames = deep_frames_list(depth)
    base, size = 0x7000_0000, 2 << 20
    trace = [entry("segment_alloc", base, size, frames=frames, time_us=0),
             entry("alloc", base, 512, frames=frames, time_us=0)]  # with an alloc, triage replays
    for i in range(pairs):
        trace.append(entry("segment_free", base, size, frames=frames, time_us=2 * i + 1))
        trace.append(entry("segment_alloc", base, size, frames=frames, time_us=2 * i + 2))
    trace.append(entry("oom", 0, 1 << 30, frames=frames, time_us=2 * pairs + 3, device_free=0))
    return dumps({"segments": [], "device_traces": [trace]})


def allocations_sharing_a_deep_stack(count: int = 50_000, depth: int = 100_000) -> bytes:
    """50,000 alloc / free pairs sharing one 100,000-frame stack: what triage, diff, the lenses
    and the exports derive from a stack must be derived once per stack, not once per row."""
    frames = deep_frames_list(depth)
    trace = []
    for i in range(count):
        trace.append(entry("alloc", 0x7000_0000 + 512 * (i % 64), 512, frames=frames, time_us=2 * i))
        trace.append(entry("free_completed", 0x7000_0000 + 512 * (i % 64), 512, frames=frames, time_us=2 * i + 1))
    return dumps({"segments": [], "device_traces": [trace]})


def one_allocation_beyond_80_gib(size: int = 95 << 30) -> bytes:
    """One 95 GiB tensor under expandable_segments, no capacity known: the replay reserved the
    address space of an assumed 80 GiB device and asserted (the dashboard's what-if: HTTP 500)."""
    base = 0x7000_0000_0000
    raw = snapshot(segments=[], device_traces=[[entry("segment_map", base, size + (2 << 20)),
                                                entry("alloc", base, size)]])
    raw["allocator_settings"]["expandable_segments"] = True
    return dumps(raw)


def gzip_of_tiny_events(count: int = 4_360_000) -> bytes:
    """44 KB of gzip holding 4.36 million ``{"action": "alloc"}`` entries (30 MB inflated, under
    the old 64 MiB floor: 1.5 GB RSS and 24 s)."""
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=9) as zipped:
        zipped.write(PROTO4 + b"}" + text("segments") + b"]s" + text("device_traces") + b"]]")
        zipped.write(b"}" + text("action") + put(0) + text("alloc") + put(1) + b"sa")
        block = (b"}" + get(0) + get(1) + b"sa") * 100_000
        for _ in range(count // 100_000):
            zipped.write(block)
        zipped.write(b"as" + STOP)
    return out.getvalue()


# Attack class -> name -> builder. "accept": a correct analysis is the right answer
# (the file is odd but real-shaped); every other file must be refused with one line.
CORPUS: dict[str, dict[str, Callable[[], bytes]]] = {
    "hash bomb": {
        "dict key": hash_bomb_as_dict_key,
        "entry key": hash_bomb_in_a_trace_entry_key,
        "action": hash_bomb_as_action,
        "user_metadata": hash_bomb_as_user_metadata,
        "frozenset": hash_bomb_in_a_frozenset,
        "colliding ints": colliding_int_keys,
        "colliding tuples": colliding_tuple_keys,
    },
    "reference amplification": {
        "segments x blocks": shared_segments_and_blocks,
        "trace entries": shared_trace_entries,
        "DUP": dup_trace_entries,
        "annotations": shared_annotations,
        "gzip": gzip_of_shared_entries,
        "gzip bomb": gzip_bomb,
        "gzip bomb strings": gzip_bomb_of_many_strings,
        "gzip of tiny events": gzip_of_tiny_events,
    },
    "deep nesting": {
        "unknown key": deep_unknown_key,
        "allocator_settings": deep_allocator_setting,
        "self reference": self_referencing_setting,
        "frames": deep_frames,
        "marks": deep_mark_stack,
    },
    "types and numbers": {
        "sizes near 2**62": huge_size_near_2_62,
        "NaN time_us": nan_annotation_time,
        "list state": list_block_state,
        "device_free 2**80": oom_device_free_2_80,
        "address 2**64": address_2_64,
        "address past 2**64": address_past_2_64,
        "LONG4": huge_long4_integer,
        "memo index": huge_memo_index,
        "95 GiB expandable": one_allocation_beyond_80_gib,
    },
    "huge strings": {
        "frame name": huge_frame_name,
        "long stacks": huge_frame_in_long_stacks,
    },
    "many steps and streams": {
        "unclosed scopes": unclosed_step_scopes,
        "identical steps": identical_steps,
        "one stream per allocation": one_stream_per_allocation,
    },
    "shared deep stacks": {
        "release runs": releases_sharing_a_deep_stack,
        "allocations": allocations_sharing_a_deep_stack,
    },
    "many devices": {
        "device_traces": many_device_traces,
        "segment devices": many_segment_devices,
        "at the cap": devices_at_the_cap,
    },
}
# Files whose right answer is an analysis, not a refusal.
ACCEPTED = {
    ("huge strings", "frame name"), ("huge strings", "long stacks"),
    ("deep nesting", "unknown key"), ("deep nesting", "self reference"), ("deep nesting", "allocator_settings"),
    ("many devices", "at the cap"),
    ("types and numbers", "95 GiB expandable"),
    ("shared deep stacks", "release runs"), ("shared deep stacks", "allocations"),
    ("types and numbers", "sizes near 2**62"), ("types and numbers", "address 2**64"),
    ("many steps and streams", "unclosed scopes"), ("many steps and streams", "identical steps"),
    ("many steps and streams", "one stream per allocation"),
}
