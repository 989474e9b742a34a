"""The safe reader: every shape of bad input gives one MemlensFormatError naming the file."""

from __future__ import annotations

import gzip
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import memlens
from memlens.errors import MemlensFormatError
from memlens.snapshot import Action, parse


def frame(name: str, line: int = 1, filename: str = "train.py") -> dict[str, Any]:
    return {"filename": filename, "line": line, "name": name}


def tiny_snapshot() -> dict[str, Any]:
    """Two allocations in a fresh 2 MiB segment; the second is still live at the end."""
    stack = [frame("forward", 10), frame("main", 99)]
    base = 0x7000_0000
    trace = [
        {"action": "segment_alloc", "addr": base, "size": 2 << 20, "stream": 0, "time_us": 1, "frames": stack},
        {"action": "alloc", "addr": base, "size": 1000, "stream": 0, "time_us": 2, "frames": stack},
        {"action": "alloc", "addr": base + 1024, "size": 4096, "stream": 0, "time_us": 3, "frames": stack},
        {"action": "free_requested", "addr": base, "size": 1000, "stream": 0, "time_us": 4, "frames": stack},
        {"action": "free_completed", "addr": base, "size": 1000, "stream": 0, "time_us": 5, "frames": stack},
    ]
    blocks = [
        {"address": base, "size": 1024, "requested_size": 1000, "state": "inactive", "frames": []},
        {"address": base + 1024, "size": 4096, "requested_size": 4096, "state": "active_allocated",
         "frames": stack},
        {"address": base + 5120, "size": (2 << 20) - 5120, "requested_size": 0, "state": "inactive",
         "frames": []},
    ]
    segment = {"device": 0, "address": base, "total_size": 2 << 20, "allocated_size": 4096, "active_size": 4096,
               "requested_size": 4096, "stream": 0, "segment_type": "small", "segment_pool_id": (0, 0),
               "is_expandable": False, "frames": stack, "blocks": blocks}
    return {"segments": [segment], "device_traces": [trace], "allocator_settings": {"expandable_segments": False},
            "external_annotations": [{"name": "ProfilerStep#1", "stage": "START", "device": 0, "time_us": 1}],
            "some_future_key": {"kept": True}}


def write(path: Path, obj: Any) -> Path:
    path.write_bytes(pickle.dumps(obj, protocol=4))
    return path


def test_tiny_snapshot_columns_and_curves(tmp_path: Path) -> None:
    snap = memlens.load(write(tmp_path / "s.pickle", tiny_snapshot()))
    trace = snap.device(0)
    assert [Action(a) for a in trace.action] == [
        Action.SEGMENT_ALLOC, Action.ALLOC, Action.ALLOC, Action.FREE_REQUESTED, Action.FREE_COMPLETED]
    # Block bytes, as memory_allocated counts them (the 1,000-byte request holds a 1,024-byte
    # block), freed at the request; the requested bytes stay in ``size``.
    assert trace.allocated.tolist() == [0, 1024, 5120, 4096, 4096]
    assert trace.block_size.tolist() == [2 << 20, 1024, 4096, 1024, 1024]
    assert trace.size.tolist() == [2 << 20, 1000, 4096, 1000, 1000]
    assert trace.reserved.tolist() == [2 << 20] * 5
    assert trace.baseline_allocated == 0 and trace.baseline_reserved == 0
    assert trace.window_complete
    assert trace.has_time and trace.time_us.tolist() == [1, 2, 3, 4, 5]
    # one distinct stack, stored once, shared by the trace, the block and the segment
    assert len(snap.stacks) == 1 and set(trace.stack_id.tolist()) == {0}
    assert [str(f) for f in snap.stacks.frames_of(0)] == ["forward (train.py:10)", "main (train.py:99)"]
    assert snap.segments[0].allocated_size == 4096 and snap.segments[0].largest_free_block == (2 << 20) - 5120
    assert snap.annotations[0].name == "ProfilerStep#1"
    assert snap.extra == {"some_future_key": {"kept": True}}


def test_window_that_starts_late_gets_a_baseline() -> None:
    raw = tiny_snapshot()
    raw["device_traces"][0] = raw["device_traces"][0][2:]  # the ring buffer dropped the first two
    trace = parse(raw).device(0)
    assert trace.baseline_allocated == 1024  # the first allocation's block was live before the window
    assert trace.baseline_reserved == 2 << 20
    assert trace.allocated.tolist() == [5120, 4096, 4096]
    assert not trace.window_complete


def test_bare_segment_list_from_memory_snapshot() -> None:
    snap = parse(tiny_snapshot()["segments"])
    assert snap.device(0).events == 0
    assert snap.device(0).baseline_allocated == 4096
    assert snap.format_guess == "memory_snapshot() segment list"


def test_torch_2_0_blocks_with_history_get_addresses() -> None:
    raw = tiny_snapshot()
    for block in raw["segments"][0]["blocks"]:
        del block["address"]
        block["history"] = [{"addr": 0, "real_size": block["size"], "frames": [frame("old", 3)]}]
        del block["frames"]
    snap = parse(raw)
    assert [b.address for b in snap.segments[0].blocks] == [0x7000_0000, 0x7000_0000 + 1024, 0x7000_0000 + 5120]
    assert snap.format_guess == "2.0"
    assert snap.stacks.frames_of(snap.segments[0].blocks[1].stack_id)[0].name == "old"


def test_oom_entry_keeps_device_free_and_pending_free_counts_as_allocated() -> None:
    raw = tiny_snapshot()
    raw["device_traces"][0].append({"action": "oom", "device_free": 12345, "size": 1 << 30, "stream": 0,
                                    "time_us": 6})
    raw["segments"][0]["blocks"][1]["state"] = "active_awaiting_free"  # the docstring's spelling
    trace = parse(raw).device(0)
    assert trace.action_of(5) == Action.OOM and int(trace.device_free[5]) == 12345
    assert trace.final_allocated == 4096


def test_several_devices_and_expandable_segments() -> None:
    raw = tiny_snapshot()
    second = dict(raw["segments"][0], device=1, is_expandable=True)
    raw["segments"].append(second)
    raw["device_traces"].append([
        {"action": "segment_map", "addr": 0x7000_0000, "size": 2 << 20, "stream": 0, "time_us": 1},
        {"action": "alloc", "addr": 0x7000_0000 + 1024, "size": 4096, "stream": 0, "time_us": 2},
        {"action": "segment_unmap", "addr": 0x7000_0000 + (4 << 20), "size": 2 << 20, "stream": 0, "time_us": 3},
    ])
    snap = parse(raw)
    assert snap.device_ids == [0, 1]
    assert snap.device(1).reserved.tolist() == [4 << 20, 4 << 20, 2 << 20]
    assert snap.device(1).baseline_reserved == 2 << 20


def test_gzip_snapshot_loads(tmp_path: Path) -> None:
    path = tmp_path / "s.pickle.gz"
    with gzip.open(path, "wb") as handle:
        pickle.dump(tiny_snapshot(), handle, protocol=4)
    assert memlens.load(path).device(0).events == 5


@pytest.mark.timeout(120)
def test_a_gzip_is_read_with_the_limits_of_its_inflated_content(tmp_path: Path) -> None:
    """Limits that scale with the file's size use what the gzip inflates to: the same snapshot,
    plain or gzipped, keeps the same texts (the text budget was twice the compressed size)."""
    import random

    rnd = random.Random(7)
    frames = []
    for i in range(5_000):  # 20 MB of names, each a 400-character piece ten times: gzip ~10x
        piece = "".join(rnd.choice("abcdefghij") for _ in range(400))
        frames.append({"filename": f"f{i}.py", "line": i, "name": piece * 10 + str(i)})
    raw = {"segments": [], "device_traces": [[
        {"action": "alloc", "addr": 4096 * (i + 1), "size": 512, "stream": 0, "frames": [frame]}
        for i, frame in enumerate(frames)]]}
    plain, zipped = tmp_path / "s.pickle", tmp_path / "s.pickle.gz"
    plain.write_bytes(pickle.dumps(raw, protocol=4))
    zipped.write_bytes(gzip.compress(plain.read_bytes()))
    assert 2 * zipped.stat().st_size < 16 << 20 < 20 << 20 < 2 * plain.stat().st_size
    names = [len(f.name) for f in memlens.load(plain, cache=False).stacks.frames]
    assert names == [4000 + len(str(i)) for i in range(5_000)]  # none cut
    assert [len(f.name) for f in memlens.load(zipped, cache=False).stacks.frames] == names


class _WritesAFile:
    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.target}",))


class _Evals:
    def __reduce__(self) -> Any:
        import builtins

        return (builtins.eval, ("1+1",))


def test_hostile_pickle_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    raw = tiny_snapshot()
    raw["segments"][0]["blocks"][0]["frames"] = [_WritesAFile(str(marker))]  # hidden deep inside
    path = write(tmp_path / "evil.pickle", raw)
    with pytest.raises(MemlensFormatError) as info:
        memlens.load(path)
    assert not marker.exists()
    assert str(path) in str(info.value) and ("posix.system" in str(info.value) or "os.system" in str(info.value))


@pytest.mark.parametrize("payload", [_Evals(), np.zeros(3)], ids=["builtins.eval", "numpy-array"])
def test_any_global_is_refused(tmp_path: Path, payload: Any) -> None:
    path = write(tmp_path / "g.pickle", {"segments": [], "device_traces": [], "x": payload})
    with pytest.raises(MemlensFormatError, match="refused to load: the pickle names the global"):
        memlens.load(path)


def test_torch_objects_are_refused(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    path = write(tmp_path / "t.pickle", {"segments": [], "device_traces": [], "t": torch.zeros(2)})
    with pytest.raises(MemlensFormatError, match="torch"):
        memlens.load(path)


def bad_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    good = pickle.dumps(tiny_snapshot(), protocol=4)
    cases: dict[str, tuple[bytes | Any, str]] = {
        "empty": (b"", "empty"),
        "truncated": (good[: len(good) // 2], "truncated"),
        "text": (b"hello, this is not a pickle\n", "not a pickle"),
        "list_of_ints": ([1, 2, 3], "segment 0 should be a dict"),
        "no_segments": ({"device_traces": []}, "no 'segments' key"),
        "scalar": (42, "holds a int"),
        "negative_size": ({"segments": [dict(tiny_snapshot()["segments"][0], total_size=-5)]}, "negative"),
        "negative_trace_size": ({"segments": [], "device_traces": [[
            {"action": "alloc", "addr": 1, "size": -1, "stream": 0}]]}, "negative size"),
        "string_size": ({"segments": [], "device_traces": [[
            {"action": "alloc", "addr": 1, "size": "big", "stream": 0}]]}, "'size' should be integers"),
        "trace_not_list": ({"segments": [], "device_traces": {"0": []}}, "'device_traces' should be a list"),
        "entry_not_dict": ({"segments": [], "device_traces": [[1, 2]]}, "should hold dicts"),
        "no_action": ({"segments": [], "device_traces": [[{"addr": 1}]]}, "no 'action'"),
        "bad_state": ({"segments": [dict(tiny_snapshot()["segments"][0],
                                         blocks=[{"address": 0, "size": 512, "state": "zombie"}])]},
                      "unknown block state"),
        "bad_frame": ({"segments": [], "device_traces": [[
            {"action": "alloc", "addr": 1, "size": 1, "stream": 0, "frames": ["not a dict"]}]]},
            "stack frame should be a dict"),
    }
    out = {}
    for name, (content, message) in cases.items():
        path = tmp_path / f"{name}.pickle"
        path.write_bytes(content if isinstance(content, bytes) else pickle.dumps(content, protocol=4))
        out[name] = (path, message)
    return out


def test_bad_files_each_give_one_clear_error(tmp_path: Path) -> None:
    for name, (path, message) in bad_files(tmp_path).items():
        with pytest.raises(MemlensFormatError) as info:
            memlens.load(path)
        assert str(path) in str(info.value), name
        assert message in str(info.value), (name, str(info.value))


def test_missing_path_directory_and_zip(tmp_path: Path) -> None:
    with pytest.raises(MemlensFormatError, match="no such file"):
        memlens.load(tmp_path / "nope.pickle")
    with pytest.raises(MemlensFormatError):
        memlens.load(tmp_path)
    archive = tmp_path / "model.pt"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("data.pkl", b"x")
    with pytest.raises(MemlensFormatError, match="zip archive"):
        memlens.load(archive)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cache", [False, True])
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path, cache: bool) -> None:
    fifo = tmp_path / "run.pickle"
    os.mkfifo(fifo)
    with pytest.raises(MemlensFormatError, match="not a regular file"):
        memlens.load(fifo, cache=cache)


@pytest.mark.timeout(60)
def test_a_fifo_as_the_sidecar_is_skipped_without_waiting(tmp_path: Path) -> None:
    path = write(tmp_path / "run.pickle", tiny_snapshot())
    os.mkfifo(tmp_path / "run.memlens.json")
    loaded = memlens.load(path)
    assert loaded.sidecar is None and "not a regular file" in str(loaded.sidecar_problem)


@pytest.mark.timeout(60)
def test_sniffing_a_folder_of_files_skips_a_fifo_without_waiting(tmp_path: Path) -> None:
    from memlens.snapshot.formats import sniff

    os.mkfifo(tmp_path / "pipe.pickle")
    assert not sniff(tmp_path / "pipe.pickle")
    assert sniff(write(tmp_path / "run.pickle", tiny_snapshot()))


def test_an_opened_file_is_read_through_its_descriptor(tmp_path: Path) -> None:
    """What is analysed is the file that was opened and checked, whatever the path names later."""
    from memlens.files import open_regular

    path = write(tmp_path / "run.pickle", tiny_snapshot())
    (tmp_path / "run.memlens.json").write_text('{"rank": 3}')
    with open_regular(path) as opened:
        os.rename(path, tmp_path / "moved.pickle")
        (tmp_path / "run.pickle").write_bytes(b"not a pickle")
        loaded = memlens.load(opened, cache=True)
    assert loaded.source == str(path) and loaded.sidecar is not None and loaded.sidecar.rank == 3
    assert len(loaded.devices[0].action) == len(memlens.load(tmp_path / "moved.pickle").devices[0].action)


def test_sidecar_is_read_when_present(tmp_path: Path) -> None:
    path = write(tmp_path / "run.pickle", tiny_snapshot())
    (tmp_path / "run.memlens.json").write_text('{"rank": 3}')
    loaded = memlens.load(path)
    assert loaded.sidecar is not None and loaded.sidecar.rank == 3 and loaded.sidecar_problem is None
    (tmp_path / "run.memlens.json").write_text("{broken")
    loaded = memlens.load(path)
    assert loaded.sidecar is None
    assert "run.memlens.json: not a memlens sidecar (invalid JSON" in str(loaded.sidecar_problem)


def test_pending_free_is_not_allocated_but_reported_apart() -> None:
    """A free waiting on another stream: out of memory_allocated at the request, pending until done."""
    frames: list[dict[str, Any]] = []
    trace = [
        {"action": "alloc", "addr": 0x1000, "size": 4096, "stream": 0, "frames": frames},
        {"action": "alloc", "addr": 0x2000, "size": 1024, "stream": 0, "frames": frames},
        {"action": "free_requested", "addr": 0x1000, "size": 4096, "stream": 0, "frames": frames},
        {"action": "free_requested", "addr": 0x2000, "size": 1024, "stream": 0, "frames": frames},
        {"action": "free_completed", "addr": 0x2000, "size": 1024, "stream": 0, "frames": frames},
    ]
    blocks = [
        {"address": 0x1000, "size": 4096, "requested_size": 4096, "state": "active_pending_free", "frames": []},
        {"address": 0x2000, "size": 2 << 20, "requested_size": 0, "state": "inactive", "frames": []},
    ]
    segment = {"device": 0, "address": 0x1000, "total_size": (2 << 20) + 4096, "stream": 0,
               "segment_type": "large", "blocks": blocks}
    snap = parse({"segments": [segment], "device_traces": [trace]})
    curve = snap.device(0)
    assert curve.allocated.tolist() == [4096, 5120, 1024, 0, 0]
    assert curve.baseline_allocated == 0
    assert curve.pending_free_final == 4096 and curve.pending_free_peak == 5120


def test_blocks_read_inline_only_when_plain_and_the_same_either_way() -> None:
    """``_parse_segment`` reads a plain block inline (``_plain_block``) and anything else through
    the checker: the edge values go the checker's way, and both ways give the same Block."""
    from memlens.snapshot.reader import _plain_block
    from memlens.snapshot.validate import INT64_MAX, PLAUSIBLE_BYTES

    plain = {"address": 4096, "size": 512, "requested_size": 500, "state": "active_allocated", "frames": []}
    assert _plain_block(plain, 0) == (4096, 512, 500, "active_allocated", [])
    assert _plain_block({"size": 512}, 8192) == (8192, 512, 512, "inactive", None)  # 2.0: tiles the segment
    for odd in ({"size": True}, {"size": 512.0}, {"size": -1}, {"size": PLAUSIBLE_BYTES + 1},
                {"size": 512, "requested_size": None}, {"size": 512, "state": "active_awaiting_free"},
                {"size": 512, "state": ["inactive"]}, {"size": 512, "address": INT64_MAX + 1},
                {"size": 512, "address": -4096}, {"size": 512, "address": "0x1000"}):
        assert _plain_block(odd, 0) is None, odd
    # The odd ones the checker reads (not refuses) come out as the checker has them.
    blocks = [plain, {"size": 512, "state": "active_awaiting_free", "address": INT64_MAX + 1},
              {"size": PLAUSIBLE_BYTES + 1, "address": 8192, "state": "inactive"}]
    snap = parse({"segments": [{"address": 4096, "total_size": 1 << 20, "blocks": blocks}], "device_traces": []})
    got = [(b.address, b.size, b.requested_size, b.state) for b in snap.segments[0].blocks]
    assert got == [(4096, 512, 500, "active_allocated"), (-(1 << 63), 512, 512, "active_pending_free"),
                   (8192, 0, 0, "inactive")]
