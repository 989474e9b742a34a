"""ops.follow: the newest complete snapshot of a folder, and what changed since the last look
(new steps, findings that appeared, ranks, a leak's rate and time to full)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from memlens.analysis.datatypes import Evidence, Finding, Step, amount, fact
from memlens.errors import MemlensUsageError
from memlens.ops.follow import Follower, FollowUpdate, announce, scan_folder

pytestmark = pytest.mark.timeout(180)

MiB = 2**20


def touch(path: Path, data: bytes = b"x", mtime_ns: int | None = None) -> Path:
    path.write_bytes(data)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))
    return path


def test_scan_lists_complete_snapshots_newest_last_once_each(tmp_path: Path) -> None:
    rolling = tmp_path / "rolling"  # where the recorder writes them
    rolling.mkdir()
    touch(rolling / "snapshot.step000002.pickle", mtime_ns=2_000)
    touch(rolling / "snapshot.step000004.pickle", mtime_ns=4_000)
    os.link(rolling / "snapshot.step000004.pickle", tmp_path / "snapshot.pickle")  # the recorder's link
    touch(tmp_path / "rank1.step000003.pickle", mtime_ns=3_000)  # any writer's, in the folder itself
    touch(rolling / ".snapshot.step000006.pickle.host.123.abcd.tmp")  # being written
    touch(tmp_path / ".snapshot.pickle.reserved")
    touch(rolling / "snapshot.step000004.memlens.json")
    state = scan_folder(tmp_path)
    assert [(s.path.name, s.series, s.step) for s in state.snapshots] == [
        ("snapshot.step000002.pickle", "snapshot", 2),
        ("rank1.step000003.pickle", "rank1", 3),
        ("snapshot.step000004.pickle", "snapshot", 4),
    ]
    assert state.series == ["rank1", "snapshot"]
    assert scan_folder(tmp_path).generation == state.generation
    touch(rolling / "snapshot.step000006.pickle", mtime_ns=6_000)
    moved = scan_folder(tmp_path)
    assert moved.generation != state.generation and moved.newest is not None
    assert moved.newest.step == 6
    with pytest.raises(MemlensUsageError, match="no such folder"):
        scan_folder(tmp_path / "missing")


def leak_finding(**evidence: int) -> Finding:
    items = [amount("bytes_per_step", evidence.pop("bytes_per_step"))]
    items += [fact(name, value, "count", "moment") for name, value in evidence.items()]
    return Finding(
        kind="leak",
        device=0,
        severity="high",
        bytes=0,
        start_event=0,
        end_event=1,
        start_us=None,
        end_us=None,
        step=40,
        top_stacks=[],
        evidence=Evidence(items),
        summary="",
        recommendation="",
        estimated_saving_bytes=None,
    )


class FakeDevice:
    def __init__(self, capacity: int | None, steps: list[Step] | None = None) -> None:
        self.capacity_bytes = capacity
        self.peak_allocated_bytes = 1024 * MiB
        self.steps = steps or []


def test_a_leak_is_announced_with_its_rate_and_time_to_full() -> None:
    finding = leak_finding(
        bytes_per_step=12 * MiB,
        first_step=40,
        last_step=50,
        first_step_end_us=0,
        last_step_end_us=8_000_000,
        steps_until_full=310,
    )
    said = announce(finding, FakeDevice(capacity=80 * 1024 * MiB))  # type: ignore[arg-type]
    assert (
        said.text
        == "leak began at step 40, growing 12.0 MiB/step; at that rate the device is full in ~310 steps (~4 min)"
    )
    assert (said.seconds_per_step, said.seconds_until_full) == (0.8, 248.0)
    # no capacity: no time to full, said so; no times in the evidence: the steps' own
    steps = [
        Step(index=i, start_event=i, end_event=i + 1, start_us=i * 2_000_000, end_us=(i + 1) * 2_000_000)
        for i in range(4)
    ]
    unknown = announce(leak_finding(bytes_per_step=MiB), FakeDevice(capacity=None, steps=steps))  # type: ignore[arg-type]
    assert unknown.seconds_per_step == 2.0 and unknown.steps_until_full is None
    assert unknown.text.endswith("the device's capacity is not known (--capacity), so not when it is full")
    # the capacity known, no count from the finder: the same rule (headroom over the rate)
    counted = announce(leak_finding(bytes_per_step=MiB), FakeDevice(capacity=2048 * MiB, steps=steps))  # type: ignore[arg-type]
    assert counted.steps_until_full == 1024 and counted.text.endswith("~1,024 steps (~34 min)")


def test_following_a_recording_sees_new_steps_then_the_leak_once(tmp_path: Path) -> None:
    """The CPU recorder writes a rolling snapshot every 2 steps of a loop that keeps 1 MiB a step;
    the follower, asked after every step, answers only for new snapshots."""
    from memlens.recorder import record

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kept: list[Any] = []
    follower = Follower(tmp_path)
    updates: list[FollowUpdate | None] = []
    with record(tmp_path, dump_every=2, capacity="256MiB", model=model, optimizer=optimizer) as rec:
        for _ in range(10):
            with rec.step():
                model(torch.randn(8, 32)).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                kept.append(torch.empty(262_144))  # 1 MiB a step, never let go
            updates.append(follower.poll())
    shown = [u for u in updates if u is not None]
    assert [u.snapshot.step for u in shown] == [1, 3, 5, 7, 9]
    assert updates[0] is None and updates[2] is None  # between dumps: nothing new
    assert shown[0].first and shown[0].new_steps == [0, 1]
    assert [u.new_steps for u in shown[1:]] == [[2, 3], [4, 5], [6, 7], [8, 9]]
    announced = [a for u in shown for a in u.announcements]
    assert len(announced) == 1, announced  # once, when it first holds
    (leak,) = announced
    assert leak.bytes_per_step == MiB and leak.steps_until_full is not None and leak.seconds_per_step
    assert re.fullmatch(
        r"leak began at step \d+, growing 1\.0 MiB/step; at that rate the device is full in "
        r"~[\d,]+ steps \(~.+\)",
        leak.text,
    ), leak.text
    assert any(line == f"new finding: {leak.text}" for u in shown for line in u.lines())
    assert shown[-1].lines()[0] == f"following {tmp_path}: snapshot.step000009.pickle (step 9); writing here: snapshot"
    assert follower.poll() is not None  # the final dump: a new file under the run's own name
    assert follower.poll() is None


def test_ranks_appear_as_they_come(tmp_path: Path) -> None:
    from memlens.recorder import record

    follower = Follower(tmp_path)
    updates = []
    for name in ("rank0", "rank1"):
        with record(tmp_path, name=name, dump_every=1) as rec, rec.step():
            torch.ones(1000).sum()
        updates.append(follower.poll())
    update = updates[-1]
    assert updates[0] is not None and update is not None
    assert update.new_series == ["rank1"]
    assert "new in the folder: rank1" in update.lines()
