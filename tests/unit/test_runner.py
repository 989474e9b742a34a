"""memlens.ops.runner: a function run in a child process comes back with its value, its one-line
error, or a stop at the time or memory limit, and never leaves the child running; many calls
(``run_each``) each cost their own item only."""

from __future__ import annotations

import os
import time

import pytest

from memlens.allocator.simulator import SimulatedOOM
from memlens.errors import MemlensError
from memlens.ops.runner import (
    DEATHS_BEFORE_GIVING_UP,
    Crashed,
    Died,
    Limits,
    ProcessGroup,
    Stopped,
    run_each,
    run_limited,
)
from memlens.ops.triage import TriageOptions, analyse
from memlens.units import GiB, parse_bytes
from tests.conftest import SAMPLE_SNAPSHOTS_DIR

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



def _escaping_simulated_oom() -> None:
    raise SimulatedOOM(requested=1 << 30, rounded=1 << 30, device_free=0, allocated=0, reserved=0)


def _bottomless(depth: int = 0) -> int:
    return _bottomless(depth + 1)


def test_a_simulated_oom_escaping_the_child_is_our_bug_not_the_users_mistake() -> None:
    """It used to come back as a ``MemlensError`` (the user's mistake) with the simulator's words."""
    with pytest.raises(Crashed, match="SimulatedOOM") as raised:
        run_limited(_escaping_simulated_oom, limits=Limits(timeout_s=60))
    assert "SimulatedOOM: " in raised.value.last_line


def test_running_out_of_stack_depth_is_the_input_stopping_not_a_crash() -> None:
    """Was a ``Crashed`` with a traceback: the input's depth, not a bug, as the CLI words it."""
    with pytest.raises(Stopped, match=r"analysis stopped: ran out of stack depth on this input \(RecursionError\)"):
        run_limited(_bottomless, limits=Limits(timeout_s=60))


def _die_on_doomed(name: str) -> str:
    if name.endswith("doomed"):
        os._exit(3)  # what an OOM kill or a segfault in native code looks like from outside
    if name == "mistake":
        parse_bytes("lots")
    return name.upper()


def test_run_each_keeps_the_order_and_a_death_costs_its_own_item() -> None:
    names = ["a", "mistake", "doomed", "b"]
    done: list[tuple[int, int]] = []
    outcomes = run_each(_die_on_doomed, [(n,) for n in names], jobs=2, limits=Limits(timeout_s=60),
                        progress=lambda d, t: done.append((d, t)))
    assert [o.value for o in outcomes] == ["A", None, None, "B"]
    assert outcomes[1].error is not None and "lots" in outcomes[1].error and not outcomes[1].ok
    assert outcomes[2].error is not None and outcomes[2].error.startswith("internal error: the analysis process died")
    assert sorted(done) == [(i, 4) for i in range(1, 5)]
    assert all(o.seconds > 0 for o in outcomes)


def test_children_that_die_on_every_item_are_not_started_for_ever() -> None:
    names = [f"{i}.doomed" for i in range(8)]
    outcomes = run_each(_die_on_doomed, [(n,) for n in names], jobs=2, limits=Limits(timeout_s=60))
    errors = [str(o.error) for o in outcomes]
    died = [e for e in errors if "died" in e and not e.startswith("not analysed")]
    given_up = [e for e in errors if e.startswith("not analysed: 3 analysis processes in a row died")]
    assert len(died) + len(given_up) == len(names)
    # The ones already started when the third death came may still run: at most a worker's worth more.
    assert DEATHS_BEFORE_GIVING_UP <= len(died) <= DEATHS_BEFORE_GIVING_UP + 1 and given_up
    assert errors.index(given_up[0]) >= DEATHS_BEFORE_GIVING_UP


def test_a_died_child_is_a_crash_of_its_own_kind() -> None:
    with pytest.raises(Died, match="exit code 3"):
        run_limited(_die_on_doomed, ("doomed",), limits=Limits(timeout_s=60))


def test_the_one_per_file_analysis_runs_in_a_child() -> None:
    leak = str(SAMPLE_SNAPSHOTS_DIR / "leak.pickle")
    analysis = run_limited(analyse, (leak, TriageOptions(cache=False)), limits=Limits(timeout_s=120))
    assert {f.kind for f in analysis.report.findings} >= {"leak"}
    assert analysis.live  # the per-allocation index came back with the report
    with pytest.raises(MemlensError, match="no such file"):
        run_limited(analyse, (leak + ".missing",), limits=Limits(timeout_s=60))
