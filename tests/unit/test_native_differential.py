"""The native and Python engines give the same answer, byte for byte, on every input either accepts.

The differential run: real snapshots with their traces mutated (rows retyped, moved, resized,
dropped, repeated; segments freed and opened where none was), and generated traces, each through
``memlens triage --json`` and ``memlens whatif --json`` once per engine (one child process per
engine for all the files), the outputs and exit codes compared. Below it, the cases the
differential run found, each small enough to read: a block-size pass, the replay's recorded
segments, a segment at 2**63.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from memlens.allocator import whatif
from memlens.allocator.engine import native_module
from memlens.allocator.settings import AllocatorSettings
from memlens.snapshot.blocks import block_sizes
from memlens.snapshot.engine import native_kernels
from memlens.snapshot.model import Action, Block, Segment
from memlens.snapshot.reader import parse, read_raw
from tests.conftest import REAL_SNAPSHOTS_MISSING, real_snapshot_paths
from tests.hostile_files import entry

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20
BASE = 0x7000_0000
needs_native = pytest.mark.skipif(native_module() is None,
                                  reason="the native core is not built (or MEMLENS_PURE_PYTHON)")

# The rows a trace may hold, and how many rows of a real trace a mutated copy keeps (a window of
# the trace: the runs stay short, and a window is what a ring buffer of the recording keeps).
ACTIONS = ["alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom", "snapshot"]
WINDOW_ROWS = 1500
MUTATIONS_PER_FILE = 3
GENERATED_TRACES = 120

_RUN_ALL = """
import json, sys
from click.testing import CliRunner
from memlens.cli.main import cli
runner = CliRunner()
out = {}
for path in sys.argv[1:]:
    for command in (["triage", "--json", "--no-cache"], ["whatif", "--json"]):
        result = runner.invoke(cli, [*command, path])
        out[command[0] + " " + path] = [result.exit_code, result.stdout, result.stderr]
print(json.dumps(out))
"""


def _run_all(paths: list[str], pure_python: bool, cache_home: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "MEMLENS_PURE_PYTHON"}
    env["XDG_CACHE_HOME"] = str(cache_home)  # nothing cached by one engine is read by the other
    if pure_python:
        env["MEMLENS_PURE_PYTHON"] = "1"
    result = subprocess.run([sys.executable, "-c", _RUN_ALL, *paths], capture_output=True, text=True, cwd=REPO,
                            env=env, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def mutated_trace(entries: list[dict[str, Any]], rng: random.Random) -> list[dict[str, Any]]:
    """A window of ``entries`` with a few rows changed the ways a damaged or odd file changes them."""
    start = rng.randrange(max(len(entries) - WINDOW_ROWS, 0) + 1)
    rows = [dict(row) for row in entries[start:start + WINDOW_ROWS]]
    if not rows:
        return [entry("alloc", BASE, 512)]
    addresses = [row.get("addr", 0) for row in rows]
    sizes = [row.get("size", 0) for row in rows]
    for _ in range(rng.randint(1, 8)):
        at = rng.randrange(len(rows))
        change = rng.choice(["action", "address", "size", "drop", "repeat", "segment_free", "segment_alloc"])
        if change == "action":
            rows[at]["action"] = rng.choice(ACTIONS)
        elif change == "address":
            rows[at]["addr"] = rng.choice(addresses) + rng.choice([0, 512, 1 << 20, -(1 << 20)])
        elif change == "size":
            rows[at]["size"] = rng.choice([*sizes, 512, 2 * MiB, 20 * MiB + 512, 1000])
        elif change == "drop" and len(rows) > 1:
            del rows[at]
        elif change == "repeat":
            rows.insert(rng.randrange(len(rows) + 1), dict(rows[at]))
        else:  # a segment row at an address the trace uses, of a size it uses
            rows.insert(at, {**rows[at], "action": change, "addr": rng.choice(addresses),
                             "size": rng.choice([2 * MiB, 20 * MiB, *sizes])})
    return rows


def generated_trace(rng: random.Random) -> dict[str, Any]:
    """A few rows of every kind over a few addresses, with a dump that holds a segment or none."""
    trace = [entry(rng.choice(ACTIONS[:5]), BASE + rng.choice([0, 1, 2, 4, 8, 20]) * MiB // 2,
                   rng.choice([512, 1000, MiB // 2, MiB, 2 * MiB, 10 * MiB, 20 * MiB]), time_us=1000 + k)
             for k in range(rng.randint(1, 8))]
    segments = []
    if rng.random() < 0.6:
        total = rng.choice([2, 4, 20, 40]) * MiB
        used = rng.choice([0, 512, MiB, 2 * MiB]) if total > 2 * MiB else 0
        blocks = [{"address": BASE, "size": used, "requested_size": used, "state": "active_allocated"}] if used else []
        blocks.append({"address": BASE + used, "size": total - used, "requested_size": 0, "state": "inactive"})
        segments.append({"device": 0, "address": BASE, "total_size": total, "stream": 0, "segment_type": "large",
                         "segment_pool_id": (0, 0), "blocks": blocks})
    return {"segments": segments, "device_traces": [trace]}


def _both_engines_agree(paths: list[str], folder: Path) -> None:
    native = _run_all(paths, pure_python=False, cache_home=folder / "native-cache")
    python = _run_all(paths, pure_python=True, cache_home=folder / "python-cache")
    differ = sorted(key for key in native if native[key] != python[key])
    assert not differ, f"{len(differ)} of {len(native)} runs differ between the engines, first: {differ[0]}"
    assert any(code == 0 for code, _, _ in native.values())  # most are analysed, not refused


@needs_native
def test_mutated_real_snapshots_get_one_answer_from_both_engines(tmp_path: Path) -> None:
    real = real_snapshot_paths()
    if not real:
        pytest.skip(REAL_SNAPSHOTS_MISSING)
    paths: list[str] = []
    for path in real:
        raw = read_raw(path)
        for copy in range(MUTATIONS_PER_FILE):
            rng = random.Random(f"{path.name}/{copy}")
            mutated = dict(raw)
            mutated["device_traces"] = [mutated_trace(trace, rng) if isinstance(trace, list) else trace
                                        for trace in raw.get("device_traces") or []]
            target = tmp_path / f"{path.stem}.{copy}.pickle"
            target.write_bytes(pickle.dumps(mutated, protocol=4))
            paths.append(str(target))
    _both_engines_agree(paths, tmp_path)


@needs_native
def test_generated_traces_get_one_answer_from_both_engines(tmp_path: Path) -> None:
    paths = []
    for index in range(GENERATED_TRACES):
        target = tmp_path / f"generated.{index}.pickle"
        target.write_bytes(pickle.dumps(generated_trace(random.Random(index)), protocol=4))
        paths.append(str(target))
    _both_engines_agree(paths, tmp_path)


# ------------------------------------------------------------------ what the differential run found

_ALLOC, _FREE_REQUESTED, _FREE_COMPLETED = int(Action.ALLOC), int(Action.FREE_REQUESTED), int(Action.FREE_COMPLETED)
_SEGMENT_ALLOC, _SEGMENT_FREE = int(Action.SEGMENT_ALLOC), int(Action.SEGMENT_FREE)


def _segment(address: int, total: int, *live: int) -> Segment:
    """A segment of the dump, with a 2 MiB block allocated at each of ``live``."""
    blocks = [Block(at, 2 * MiB, 2 * MiB, "active_allocated") for at in live]
    return Segment(device=0, address=address, total_size=total, stream=0, segment_type="large", pool_id=(0, 0),
                   is_expandable=False, blocks=blocks)


@pytest.mark.parametrize(("rows", "segments"), [
    # A 10 MiB alloc, then a free of a 3 MiB block from before the window that the alloc lands inside:
    # the block keeps its 3 MiB (the fast pass gave it the 3.5 MiB to the segment's end).
    pytest.param([(_ALLOC, BASE + 2 * MiB, 10 * MiB + 1000), (_FREE_REQUESTED, BASE + MiB // 2, 3 * MiB + 1000)],
                 [(BASE, 4 * MiB)], id="an alloc inside a block from before the window"),
    # A segment opened inside the one the dump holds (they overlap): the block takes the nearer one.
    pytest.param([(_SEGMENT_ALLOC, BASE + MiB, 3 * MiB), (_ALLOC, BASE + 2 * MiB, MiB + 512)],
                 [(BASE, 40 * MiB)], id="overlapping segments"),
    # A block from before the window reaching past the next block's start: never extended over it.
    pytest.param([(_FREE_COMPLETED, BASE + MiB // 2, 20 * MiB + 1000),
                  (_FREE_COMPLETED, BASE + 2 * MiB, 20 * MiB + 1000),
                  (_FREE_COMPLETED, BASE + 3 * MiB // 2, 2 * MiB)],
                 [(BASE, 4 * MiB)], id="a block over the next one's start"),
    # A large free at an address whose first row was a small one: not a block from before the window
    # (both passes agreed here before; a guard for the fast pass's seeding of what was occupied).
    pytest.param([(_FREE_COMPLETED, BASE + 3 * MiB // 2, MiB // 2), (_FREE_REQUESTED, BASE + MiB, 2 * MiB + 1000),
                  (_FREE_REQUESTED, BASE + 3 * MiB // 2, 2 * MiB + 512)],
                 [(BASE, 4 * MiB)], id="a large free where a small block was"),
    # A segment opened twice at one address: the second opening replaces the first from its row on.
    pytest.param([(_SEGMENT_ALLOC, BASE + MiB // 2, MiB + 512), (_SEGMENT_ALLOC, BASE + MiB // 2, 20 * MiB + 1000),
                  (_FREE_REQUESTED, BASE + 3 * MiB, 3 * MiB // 2 + 512), (_ALLOC, BASE + MiB // 2, 20 * MiB + 512),
                  (_SEGMENT_ALLOC, BASE + MiB // 2, 20 * MiB + 512)],
                 [(BASE, 4 * MiB)], id="a segment opened twice"),
    # A block from before the window over blocks live at the dump that no row touches.
    pytest.param([(_FREE_REQUESTED, BASE, 3 * MiB + 1000)], [(BASE, 4 * MiB, BASE + MiB)],
                 id="a block from before the window over live blocks"),
    # The cases below are histories no allocator writes, which now go to the row-by-row pass.
    # A 3 MiB block given the segment's last 1 MiB, freed as a 512 B one (a small free does not
    # vacate a large block), then a 2 MiB alloc in that tail: the block ends where it starts
    # (the fast pass took the small free as the block's end and kept the 4 MiB).
    pytest.param([(_SEGMENT_ALLOC, BASE, 4 * MiB), (_ALLOC, BASE, 3 * MiB + 1000), (_FREE_COMPLETED, BASE, 512),
                  (_ALLOC, BASE + 7 * MiB // 2, 2 * MiB)],
                 [], id="a large block freed at a small size"),
    # The same from the random search: a 2 MiB block freed as 1 MiB, a block from before the window
    # after it, a 1.5 MiB alloc at its tail.
    pytest.param([(_ALLOC, BASE, 2 * MiB), (_FREE_REQUESTED, BASE, MiB),
                  (_FREE_REQUESTED, BASE + 3 * MiB, 7 * MiB // 2 + 1000), (_ALLOC, BASE + 2 * MiB, 3 * MiB // 2 + 512)],
                 [(BASE, 4 * MiB)], id="a block freed at a smaller size, found at random"),
    # Allocated twice at one address with no release between: the second alloc takes the address
    # over, and a later alloc in the first block's tail ends the second block, not the first.
    pytest.param([(_SEGMENT_ALLOC, BASE, 4 * MiB), (_ALLOC, BASE, 3 * MiB + 1000), (_ALLOC, BASE, 2 * MiB),
                  (_ALLOC, BASE + 7 * MiB // 2, 2 * MiB)],
                 [], id="an address allocated twice"),
    # A block from before the window (freed, but only free_completed releases where the trace has
    # one) allocated again, then an alloc in its tail: the block from before keeps its tail.
    pytest.param([(_FREE_REQUESTED, BASE + 2 * MiB, 3 * MiB + 1000), (_FREE_COMPLETED, BASE + 7 * MiB // 2, MiB),
                  (_ALLOC, BASE + 2 * MiB, 3 * MiB + 1000), (_ALLOC, BASE + 3 * MiB, 3 * MiB // 2 + 512),
                  (_SEGMENT_FREE, BASE + 2 * MiB, 7 * MiB // 2 + 1000)],
                 [], id="a block from before the window allocated again, found at random"),
    pytest.param([(_FREE_REQUESTED, BASE + 2 * MiB, MiB + 512), (_SEGMENT_FREE, BASE, 7 * MiB // 2 + 1000),
                  (_ALLOC, BASE + 2 * MiB, 3 * MiB // 2 + 512), (_ALLOC, BASE + 7 * MiB // 2, 2 * MiB),
                  (_FREE_COMPLETED, BASE + 7 * MiB // 2, 3 * MiB // 2 + 512)],
                 [], id="a block from before the window allocated again and freed at another size"),
])
def test_the_fast_block_size_pass_measures_as_the_row_by_row_one(
    rows: list[tuple[int, int, int]], segments: list[tuple[int, ...]],
) -> None:
    action = np.array([r[0] for r in rows], dtype=np.int8)
    address = np.array([r[1] for r in rows], dtype=np.int64)
    size = np.array([r[2] for r in rows], dtype=np.int64)
    known = [_segment(*segment) for segment in segments]
    fast = block_sizes(action, address, size, known, AllocatorSettings(), native=False)
    row_by_row = block_sizes(action, address, size, known, AllocatorSettings(), sweep=True)
    assert fast.tolist() == row_by_row.tolist()
    if native_kernels() is not None:
        assert block_sizes(action, address, size, known, AllocatorSettings()).tolist() == row_by_row.tolist()


# A random search over short histories, bounded: 3,000 traces of 6 to 10 rows on nine addresses half
# a MiB apart, sizes about the 1 MiB line between the pools and a 4 MiB segment's tails. The old
# fast pass differed from the row-by-row one on 2 of these (seed 33), a few seconds' run.
RANDOM_TRACES = 3000
_RANDOM_ACTIONS = [_ALLOC, _FREE_REQUESTED, _FREE_COMPLETED, _SEGMENT_ALLOC, _SEGMENT_FREE]
_RANDOM_SIZES = [512, MiB, 3 * MiB // 2 + 512, 2 * MiB, 3 * MiB + 1000, 7 * MiB // 2 + 1000]


def random_block_trace(rng: random.Random) -> tuple[list[tuple[int, int, int]], list[Segment]]:
    """6 to 10 (action, address, size) rows, allocs the likeliest, and a dump of one free 4 MiB segment or none."""
    rows = [(rng.choices(_RANDOM_ACTIONS, weights=[4, 2, 2, 1, 1])[0], BASE + rng.randrange(9) * MiB // 2,
             rng.choice(_RANDOM_SIZES)) for _ in range(rng.randint(6, 10))]
    segments = [] if rng.random() < 0.5 else [_segment(BASE, 4 * MiB)]
    return rows, segments


def test_random_short_histories_get_one_block_size_from_every_pass() -> None:
    rng = random.Random(33)
    differ = []
    for _ in range(RANDOM_TRACES):
        rows, segments = random_block_trace(rng)
        action = np.array([r[0] for r in rows], dtype=np.int8)
        address = np.array([r[1] for r in rows], dtype=np.int64)
        size = np.array([r[2] for r in rows], dtype=np.int64)
        row_by_row = block_sizes(action, address, size, segments, AllocatorSettings(), sweep=True).tolist()
        answers = [block_sizes(action, address, size, segments, AllocatorSettings(), native=False).tolist()]
        if native_kernels() is not None:
            answers.append(block_sizes(action, address, size, segments, AllocatorSettings()).tolist())
        if any(answer != row_by_row for answer in answers):
            differ.append(rows)
    assert not differ, f"{len(differ)} of {RANDOM_TRACES} traces differ between the passes, first: {differ[0]}"


def _whatif_both_ways(raw: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    answers = []
    for pure_python in (False, True):
        if pure_python:
            monkeypatch.setenv("MEMLENS_PURE_PYTHON", "1")
        else:
            monkeypatch.delenv("MEMLENS_PURE_PYTHON", raising=False)
        native_module.cache_clear()
        native_kernels.cache_clear()
        try:
            result = whatif(parse(raw))
            answers.append(json.dumps(result.to_json(), sort_keys=True))
        finally:
            native_module.cache_clear()
            native_kernels.cache_clear()
    return answers[0], answers[1]


@needs_native
def test_an_alloc_past_a_segment_opened_inside_another_is_in_no_known_segment_on_both_engines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The native replay remembered the segment found for each 2 MiB of address, and answered the
    dump's 4 MiB segment for an address past the small one opened inside it (Python: none)."""
    trace = [entry("segment_alloc", BASE + MiB // 2, 1000), entry("free_completed", BASE + 4 * MiB, 10 * MiB),
             entry("alloc", BASE, 10 * MiB), entry("alloc", BASE + MiB, 1000),
             entry("free_completed", BASE + 10 * MiB, 2 * MiB)]
    blocks = [{"address": BASE, "size": 512, "requested_size": 512, "state": "active_allocated"},
              {"address": BASE + 512, "size": 4 * MiB - 512, "requested_size": 0, "state": "inactive"}]
    raw = {"segments": [{"device": 0, "address": BASE, "total_size": 4 * MiB, "stream": 0, "blocks": blocks}],
           "device_traces": [trace]}
    native, python = _whatif_both_ways(raw, monkeypatch)
    assert json.loads(python)["simulated"]["allocs_in_known_segment"] == 1
    assert native == python


@needs_native
def test_a_segment_freed_at_2_63_gets_one_answer_from_both_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Python simulator raised KeyError: 9223372036854775808 (a block's key wrapped the
    address, read as -2**63) where the native one left the segment out of what it models."""
    raw = {"segments": [], "device_traces": [[entry("alloc", BASE, 512), entry("segment_free", 1 << 63, 2 * MiB),
                                              entry("free_completed", BASE, 512)]]}
    native, python = _whatif_both_ways(raw, monkeypatch)
    assert native == python
    assert "lies outside the address space the allocator model covers" in python
