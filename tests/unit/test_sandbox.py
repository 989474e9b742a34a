"""memlens.sandbox: a function run in a child process comes back with its value, its one-line
error, or a stop at the time or memory limit, and never leaves the child running."""

from __future__ import annotations

import time

import pytest

from memlens.errors import MemlensError
from memlens.sandbox import Crashed, Limits, ProcessGroup, Stopped, run_limited
from memlens.units import GiB, parse_bytes

pytestmark = pytest.mark.timeout(300)


def test_the_value_comes_back() -> None:
    assert run_limited(sum, ([1, 2, 3],), limits=Limits(timeout_s=60)) == 6


def test_a_memlens_error_comes_back_as_its_message() -> None:
    with pytest.raises(MemlensError) as raised:
        run_limited(parse_bytes, ("lots",), limits=Limits(timeout_s=60))
    assert "lots" in str(raised.value)


def test_past_the_deadline_the_child_is_stopped() -> None:
    # Had it run to the end, sleep's None would have come back instead.
    with pytest.raises(Stopped, match=r"tool call stopped: took over 0\.5 s"):
        run_limited(time.sleep, (60,), limits=Limits(timeout_s=0.5), what="tool call")


def test_past_the_memory_cap_the_child_is_stopped() -> None:
    with pytest.raises(Stopped, match="needed over"):
        run_limited(bytearray, (8 * GiB,), limits=Limits(timeout_s=60, memory_bytes=2 * GiB))


def test_a_bug_is_a_crash_with_its_traceback() -> None:
    with pytest.raises(Crashed, match="ValueError"):
        run_limited(int, ("not a number",), limits=Limits(timeout_s=60))


def test_a_closed_group_starts_nothing() -> None:
    group = ProcessGroup()
    group.kill_all()
    with pytest.raises(Stopped, match="shutting down"):
        run_limited(sum, ([1],), limits=Limits(timeout_s=60), group=group)
