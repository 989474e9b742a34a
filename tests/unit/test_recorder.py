"""The recorder on the CPU: storage tracking, steps, files, OOM, sidecar."""

from __future__ import annotations

import itertools
import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from memlens.errors import MemlensUsageError
from memlens.recorder import record
from memlens.recorder.cpu_tracker import StorageTracker, live_tensors
from memlens.recorder.model_inspection import model_stats
from memlens.recorder.stacks import StackCapture, relative_filename_map
from memlens.recorder.writing import _host_tag, remove_stale_files, reservation_path, reserve, write_atomic
from memlens.sidecar.writer import sidecar_path

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow


def fake_clock() -> Any:
    return itertools.count(1_000_000).__next__


def load_raw(path: Path) -> dict[str, Any]:
    with open(path, "rb") as handle:
        return pickle.load(handle)


def trace_of(path: Path) -> list[dict[str, Any]]:
    return load_raw(path)["device_traces"][0]


def actions(trace: list[dict[str, Any]]) -> list[str]:
    return [entry["action"] for entry in trace]


# ------------------------------------------------------------------------- stacks
def _inner(capture: StackCapture) -> list[dict[str, object]]:
    return capture.capture()


def test_stack_is_innermost_first_and_interned() -> None:
    capture = StackCapture()
    stacks = []
    for _ in range(2):
        stacks.append(_inner(capture))
    first, second = stacks
    assert first[0]["name"] == "_inner"
    assert first[1]["name"] == "test_stack_is_innermost_first_and_interned"
    assert set(first[0]) == {"filename", "line", "name"}
    assert first is second  # the same stack is one list object: pickled once


def test_stack_depth_cap_and_filename_map() -> None:
    capture = StackCapture(max_depth=2, filename_map=relative_filename_map({os.path.dirname(__file__): "T"}))
    frames = _inner(capture)
    assert len(frames) == 2
    assert str(frames[0]["filename"]).startswith("T/")


# ------------------------------------------------------------------------- tracking
class FakeSimulator:
    """Records malloc/free calls; addresses count up."""

    def __init__(self) -> None:
        self.record_history = True
        self.calls: list[tuple[str, int, bool]] = []
        self.allocated_bytes = 0
        self._next = 0x1000

    def malloc(self, size: int, stream: int = 0, frames: Any = None) -> int:
        self._next += 1 << 20
        self.calls.append(("malloc", size, self.record_history))
        return self._next

    def free(self, address: int, frames: Any = None) -> None:
        self.calls.append(("free", address, self.record_history))


def tracked(fn: Any) -> tuple[FakeSimulator, Any]:
    from memlens.recorder.cpu_tracker import TrackingMode

    simulator = FakeSimulator()
    tracker = StorageTracker(simulator, StackCapture())  # type: ignore[arg-type]
    tracker.active = True
    with TrackingMode(tracker):
        result = fn()
        tracker.drain()
    tracker.close()
    return simulator, result


def test_views_share_one_storage_and_free_is_reported_once() -> None:
    def body() -> None:
        base = torch.zeros(1024)
        view = base[10:]
        view2 = base.view(32, 32)
        del base, view, view2

    simulator, _ = tracked(body)
    assert [call[0] for call in simulator.calls] == ["malloc", "free"]
    assert simulator.calls[0][1] == 4096


def test_inplace_ops_are_not_new_allocations() -> None:
    def body() -> torch.Tensor:
        x = torch.ones(256)
        x.add_(1).mul_(2)
        return x

    simulator, _ = tracked(body)
    assert [call[0] for call in simulator.calls] == ["malloc"]


def test_backward_gradients_are_tracked() -> None:
    layer = torch.nn.Linear(64, 64)

    def body() -> None:
        layer(torch.randn(8, 64)).sum().backward()

    simulator, _ = tracked(body)
    sizes = [size for kind, size, _ in simulator.calls if kind == "malloc"]
    assert 64 * 64 * 4 in sizes  # weight.grad was born inside backward


def test_seed_mallocs_without_history_and_skips_duplicates() -> None:
    simulator = FakeSimulator()
    tracker = StorageTracker(simulator, None)  # type: ignore[arg-type]
    weight = torch.zeros(100)
    assert tracker.seed([weight, weight[1:], torch.empty(0)]) == 1
    assert simulator.calls == [("malloc", 400, False)]
    assert simulator.record_history is True
    tracker.close()


def test_tensors_only_garbage_holds_are_not_seeded_as_live(tmp_path: Path) -> None:
    """A tensor kept by an unreachable reference cycle is no memory the program holds: seeded,
    it counted as live when history started and was "freed" inside the first step whenever the
    collector ran (an accelerate test's peak was such garbage, at event 0, in a full test run)."""
    import gc

    gc.collect()
    gc.disable()  # the cycle stays until the recorder collects it
    try:
        cycle: list[Any] = [torch.zeros(64 * 1024)]  # 256 KiB
        cycle.append(cycle)
        del cycle
        with record(tmp_path, device="cpu") as rec, rec.step():
            torch.ones(16)
    finally:
        gc.enable()
    import memlens

    trace = memlens.load(rec.path, cache=False).device(0)
    assert trace.baseline_allocated < 64 * 1024 * 4  # the garbage was collected before the seed
    assert not (trace.action == 2).any() or int(trace.block_size[trace.action == 2].max()) < 64 * 1024 * 4


def test_live_tensors_finds_model_and_optimizer_state_first() -> None:
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    found = live_tensors([model, optimizer])
    ids = [id(t) for t in found]
    assert ids[0] == id(model.weight)
    state = optimizer.state[model.weight]
    assert id(state["exp_avg"]) in ids and id(model.weight.grad) in ids


# ------------------------------------------------------------------------- sessions
def small_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    loss = model(torch.randn(16, 32)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


@pytest.fixture
def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
    return model, torch.optim.AdamW(model.parameters())


def step_annotations(path: Path) -> list[tuple[str, str]]:
    """The step markers (module scopes, memlens.forward#/backward#, are tested on their own)."""
    return [(a["name"], a["stage"]) for a in load_raw(path)["external_annotations"]
            if a["name"].startswith("memlens.step#")]


def test_scoped_steps_write_annotations_metadata_and_sidecar(tmp_path: Path, model_and_optimizer: Any) -> None:
    model, optimizer = model_and_optimizer
    with record(tmp_path, model=model, optimizer=optimizer, clock=fake_clock()) as rec:
        for _ in range(3):
            with rec.step():
                small_step(model, optimizer)
    path = tmp_path / "snapshot.pickle"
    assert rec.paths == [path]
    assert step_annotations(path) == [(f"memlens.step#{i}", stage) for i in range(3) for stage in ("START", "END")]
    raw = load_raw(path)
    assert {a["device"] for a in raw["external_annotations"]} == {0}
    trace = raw["device_traces"][0]
    assert {e["user_metadata"] for e in trace} == {"memlens.step#0", "memlens.step#1", "memlens.step#2"}
    times = [e["time_us"] for e in trace]
    assert times == sorted(times)
    # parameters existed before recording: live blocks with no alloc event (a "ghost")
    allocated_addresses = {e["addr"] for e in trace if e["action"] == "alloc"}
    live = [b for s in raw["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert any(b["address"] not in allocated_addresses for b in live)

    sidecar = json.loads(sidecar_path(path).read_text())
    assert sidecar["backend"] == "cpu" and sidecar["reason"] == "exit"
    assert sidecar["model"]["parameters_total"] == sum(p.numel() for p in model.parameters())
    assert sidecar["model"]["parameter_bytes_by_dtype"] == {"torch.float32": 4 * sidecar["model"]["parameters_total"]}
    assert sidecar["optimizer"]["class"] == "AdamW"
    assert [s["index"] for s in sidecar["steps"]] == [0, 1, 2]
    assert all(s["start_us"] < s["end_us"] for s in sidecar["steps"])
    assert sidecar["rank"] == 0 and sidecar["world_size"] == 1
    assert sidecar["peak_reserved_bytes"] >= sidecar["peak_allocated_bytes"] > 0


def test_mark_step_numbers_steps_from_entering(tmp_path: Path, model_and_optimizer: Any) -> None:
    model, optimizer = model_and_optimizer
    with record(tmp_path, clock=fake_clock()) as rec:
        for _ in range(2):
            small_step(model, optimizer)
            rec.mark_step()
    names = step_annotations(rec.paths[-1])
    assert names[:4] == [
        ("memlens.step#0", "START"),
        ("memlens.step#0", "END"),
        ("memlens.step#1", "START"),
        ("memlens.step#1", "END"),
    ]


def test_the_tail_after_the_last_mark_is_not_a_step(tmp_path: Path, model_and_optimizer: Any) -> None:
    model, optimizer = model_and_optimizer
    with record(tmp_path, clock=fake_clock()) as rec:
        for _ in range(6):
            small_step(model, optimizer)
            rec.mark_step()
        torch.ones(1000).sum()  # the script's tail: evaluation, saving, logging
    assert [s["index"] for s in rec.steps] == list(range(6))
    names = {name for name, _ in step_annotations(rec.paths[-1])}
    assert names == {f"memlens.step#{i}" for i in range(6)}
    assert "memlens.step#6" not in {e["user_metadata"] for e in trace_of(rec.paths[-1])}


def test_optimizer_steps_are_the_steps(tmp_path: Path, model_and_optimizer: Any) -> None:
    model, optimizer = model_and_optimizer
    with record(tmp_path, record_optimizer_steps=True, clock=fake_clock()) as rec:
        for _ in range(6):
            small_step(model, optimizer)
    assert [s["index"] for s in rec.steps] == list(range(6))


def test_an_error_keeps_the_step_it_interrupted(tmp_path: Path, model_and_optimizer: Any) -> None:
    model, optimizer = model_and_optimizer
    with pytest.raises(RuntimeError), record(tmp_path, record_optimizer_steps=True, clock=fake_clock()) as rec:
        for _ in range(2):
            small_step(model, optimizer)
        raise RuntimeError("failed in the third step")
    assert [s["index"] for s in rec.steps] == [0, 1, 2]


def test_the_python_api_says_what_it_wrote(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with record(tmp_path, clock=fake_clock()) as rec, rec.step():
        torch.ones(100)
    assert capsys.readouterr().err == rec.summary_line() + "\n"
    assert rec.summary_line().startswith(f"memlens: wrote {tmp_path / 'snapshot.pickle'} (1 step; peak allocated ")


def test_step_fn_decorator(tmp_path: Path, model_and_optimizer: Any) -> None:
    model, optimizer = model_and_optimizer
    with record(tmp_path, clock=fake_clock()) as rec:
        step = rec.step_fn(lambda: small_step(model, optimizer))
        for _ in range(2):
            step()
    assert [s["index"] for s in rec.steps] == [0, 1]


def test_steps_filter_starts_late_and_stops_after_last(tmp_path: Path, model_and_optimizer: Any) -> None:
    model, optimizer = model_and_optimizer
    with record(tmp_path, steps=range(2, 4), model=model, clock=fake_clock()) as rec:
        for _ in range(6):
            with rec.step():
                small_step(model, optimizer)
    assert [s["index"] for s in rec.steps] == [2, 3]
    sidecar = json.loads(sidecar_path(rec.paths[-1]).read_text())
    assert sidecar["reason"] == "steps_done" and sidecar["steps_selected"] == [2, 3]
    assert len(rec.paths) == 1  # nothing written after the last chosen step
    raw = load_raw(rec.paths[-1])
    trace = raw["device_traces"][0]
    assert {e["user_metadata"] for e in trace} <= {"memlens.step#2", "memlens.step#3", ""}
    # parameters and AdamW state existed before step 2: live blocks with no alloc event
    allocated = {e["addr"] for e in trace if e["action"] == "alloc"}
    ghosts = [
        b["requested_size"]
        for segment in raw["segments"]
        for b in segment["blocks"]
        if b["state"] == "active_allocated" and b["address"] not in allocated
    ]
    parameter_bytes = 4 * sum(p.numel() for p in model.parameters())
    assert sum(ghosts) >= 3 * parameter_bytes


def test_mixing_styles_is_an_error(tmp_path: Path) -> None:
    with record(tmp_path, clock=fake_clock()) as rec:
        rec.mark_step()
        with pytest.raises(MemlensUsageError), rec.step():
            pass


def test_dump_every_writes_periodically(tmp_path: Path, model_and_optimizer: Any) -> None:
    model, optimizer = model_and_optimizer
    with record(tmp_path, dump_every=2, clock=fake_clock()) as rec:
        for _ in range(4):
            with rec.step():
                small_step(model, optimizer)
    reasons = []
    assert len(rec.paths) == 3  # after steps 1 and 3, then on exit
    reasons.append(json.loads(sidecar_path(rec.paths[-1]).read_text())["reason"])
    assert reasons == ["exit"]


def test_exception_dumps_and_reraises(tmp_path: Path, model_and_optimizer: Any) -> None:
    model, optimizer = model_and_optimizer
    with pytest.raises(ValueError), record(tmp_path, clock=fake_clock()) as rec, rec.step():
        small_step(model, optimizer)
        raise ValueError("boom")
    assert json.loads(sidecar_path(rec.paths[-1]).read_text())["reason"] == "exception"


def test_simulated_oom_raises_dumps_and_stops(tmp_path: Path) -> None:
    keep = []
    with pytest.raises(torch.OutOfMemoryError), record(tmp_path, capacity="8MiB", clock=fake_clock()) as rec:
        for _ in range(10):
            with rec.step():
                keep.append(torch.empty(1 << 20))  # 4 MiB each: the third does not fit
    assert rec.oom is not None and rec.oom["requested_bytes"] == 4 << 20
    raw = load_raw(rec.paths[-1])
    assert actions(raw["device_traces"][0])[-1] == "oom"
    sidecar = json.loads(sidecar_path(rec.paths[-1]).read_text())
    assert sidecar["reason"] == "oom" and sidecar["oom"]["requested_bytes"] == 4 << 20
    assert len(rec.paths) == 1  # not written again on the way out
    assert rec.backend.tracker.active is False  # type: ignore[attr-defined]
    # recording is off: further work is not tracked and raises nothing
    keep.append(torch.empty(1 << 22))


def test_max_entries_keeps_the_newest(tmp_path: Path) -> None:
    with record(tmp_path, max_entries=10, clock=fake_clock()) as rec:
        for _ in range(20):
            torch.ones(100)
    trace = trace_of(rec.paths[-1])
    assert len(trace) == 10


def test_out_ending_in_pickle_is_the_file(tmp_path: Path) -> None:
    target = tmp_path / "nested" / "run.pickle"
    with record(target, clock=fake_clock()):
        torch.ones(10)
    assert target.exists() and (tmp_path / "nested" / "run.memlens.json").exists()


def test_bad_options() -> None:
    with pytest.raises(MemlensUsageError):
        record("x", dump_every=0)
    with pytest.raises(MemlensUsageError):
        record("x", device="tpu")
    with pytest.raises(MemlensUsageError):
        record("x", steps=[])
    if not torch.cuda.is_available():
        with pytest.raises(MemlensUsageError):
            record("x", device="cuda")


@pytest.mark.parametrize("name", ["../../escaped", "../x", "a/b", "/tmp/absolute", "..", ".", "", "a\x00b"])
def test_a_name_is_a_file_name_never_a_path(tmp_path: Path, name: str) -> None:
    out = tmp_path / "deep" / "runs"
    with pytest.raises(MemlensUsageError, match="--name"):
        record(out, name=name, clock=fake_clock())
    assert not (tmp_path / "escaped.pickle").exists() and not list(tmp_path.rglob("*.pickle"))


def test_a_plain_name_is_the_stem(tmp_path: Path) -> None:
    with record(tmp_path, name="run-1.b", clock=fake_clock()):
        torch.ones(10)
    assert (tmp_path / "run-1.b.pickle").exists()


# ------------------------------------------------------------------------- files
def test_atomic_write_never_leaves_a_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "snap.pickle"
    write_atomic(target, b"old")

    def crash(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError):
        write_atomic(target, b"new contents")
    monkeypatch.undo()
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["snap.pickle"]


def test_snapshot_uses_protocol_4(tmp_path: Path) -> None:
    with record(tmp_path, clock=fake_clock()) as rec:
        torch.ones(10)
    data = rec.paths[0].read_bytes()
    assert data[:2] == b"\x80\x04"


def test_model_stats_counts_trainable_and_dtypes() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model[0].weight.requires_grad_(False)
    model[1].half()
    stats = model_stats(model)
    assert stats is not None
    assert stats.parameters_total == 16 + 4 + 8
    assert stats.parameters_trainable == 4 + 8
    assert stats.parameter_bytes_by_dtype == {"torch.float16": 16, "torch.float32": 80}
    assert stats.buffer_bytes_total is not None and stats.buffer_bytes_total > 0


# ------------------------------------------------------------------------- CLI helpers
def test_parse_steps_and_split_command(tmp_path: Path) -> None:
    from memlens.cli.record import parse_steps, split_command

    assert parse_steps("2:6") == range(2, 6)
    assert parse_steps("1,3") == {1, 3}
    assert parse_steps(None) is None
    with pytest.raises(MemlensUsageError):
        parse_steps("a:b")
    script = tmp_path / "train.py"
    script.write_text("")
    assert split_command((sys.executable, str(script), "--x", "1")) == ("path", str(script), ["--x", "1"])
    assert split_command(("python", "-m", "pkg.mod", "a")) == ("module", "pkg.mod", ["a"])
    with pytest.raises(MemlensUsageError):
        split_command(("python", str(tmp_path / "missing.py")))
    with pytest.raises(MemlensUsageError):
        split_command(("python", "-c", "print(1)"))


def test_an_earlier_runs_files_are_never_overwritten(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def run_once() -> Path:
        with record(tmp_path / "run") as rec:
            for _ in range(2):
                with rec.step():
                    torch.ones(256, 256).sum()
        return rec.path

    first = run_once()
    first_bytes = first.read_bytes()
    second = run_once()
    assert first.name == "snapshot.pickle" and second.name == "snapshot-2.pickle"
    assert first.read_bytes() == first_bytes  # untouched
    assert sidecar_path(second).exists()
    assert "snapshot.pickle is taken (an earlier or a running recording); keeping it" in capsys.readouterr().err
    assert run_once().name == "snapshot-3.pickle"


# ------------------------------------------------------------------------- names and leftovers
def test_a_reserved_name_is_not_given_twice(tmp_path: Path) -> None:
    target = tmp_path / "snapshot.pickle"
    first = reserve(target)
    assert first is not None and reservation_path(target).exists()
    assert reserve(target) is None  # held: a recording is running under this name
    first.release()
    assert not reservation_path(target).exists()
    again = reserve(target)
    assert again is not None  # released before anything was written: free again
    write_atomic(target, b"done")
    again.release()
    assert reserve(target) is None  # an earlier run's file


def test_concurrent_sessions_in_one_process_get_two_names(tmp_path: Path) -> None:
    with record(tmp_path, clock=fake_clock()) as first, record(tmp_path, clock=fake_clock()) as second:
        assert (first.path.name, second.path.name) == ("snapshot.pickle", "snapshot-2.pickle")
        first.mark_step()
        second.mark_step()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "snapshot-2.memlens.json", "snapshot-2.pickle", "snapshot.memlens.json", "snapshot.pickle"
    ]


def test_stale_temporary_files_and_reservations_are_removed(tmp_path: Path) -> None:
    import subprocess

    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True)
    dead_pid = int(finished.stdout)
    host = _host_tag()
    dead = tmp_path / f".snapshot.pickle.{host}.{dead_pid}.k2j4h5g6.tmp"
    live = tmp_path / f".snapshot.pickle.{host}.{os.getpid()}.a1b2c3d4.tmp"
    elsewhere = tmp_path / f".snapshot.pickle.some-other-host.{dead_pid}.a1b2c3d4.tmp"
    abandoned = reservation_path(tmp_path / "snapshot-3.pickle")
    for path in (dead, live, elsewhere, abandoned):
        path.write_bytes(b"x")
    held = reserve(tmp_path / "snapshot-4.pickle")
    assert held is not None
    assert sorted(remove_stale_files(tmp_path)) == sorted([dead, abandoned])
    assert live.exists() and elsewhere.exists() and reservation_path(tmp_path / "snapshot-4.pickle").exists()
    held.release()


def test_temporary_names_carry_host_and_pid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    real_replace = os.replace

    def spy(source: str, target: Any) -> None:
        seen.append(os.path.basename(source))
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", spy)
    write_atomic(tmp_path / "snapshot.pickle", b"data")
    (name,) = seen
    assert name.startswith(f".snapshot.pickle.{_host_tag()}.{os.getpid()}.") and name.endswith(".tmp")


def test_an_out_that_is_a_file_is_refused_at_start(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(MemlensUsageError, match="it is a file, not a folder"):
        record(blocker, clock=fake_clock()).start()
    with pytest.raises(MemlensUsageError, match="cannot write snapshots into"):
        record(blocker / "runs", clock=fake_clock()).start()


@pytest.mark.timeout(300)
def test_sigterm_under_the_python_api_writes_then_exits_143(tmp_path: Path) -> None:
    import subprocess

    script = (
        "import os, signal, sys, torch, memlens\n"
        "with memlens.record(sys.argv[1]) as rec:\n"
        "    for i in range(5):\n"
        "        with rec.step():\n"
        "            torch.ones(1000).sum()\n"
        "            if i == 2:\n"
        "                os.kill(os.getpid(), signal.SIGTERM)\n"
        "print('not reached')\n"
    )
    completed = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                               timeout=240, check=False)
    assert completed.returncode == 143, completed.stderr
    assert "not reached" not in completed.stdout and "Traceback" not in completed.stderr
    sidecar = json.loads(sidecar_path(tmp_path / "snapshot.pickle").read_text())
    assert sidecar["reason"] == "terminated" and [s["index"] for s in sidecar["steps"]] == [0, 1, 2]


def test_a_signal_during_a_write_waits_for_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import signal

    from memlens.recorder import Terminated

    with pytest.raises(Terminated), record(tmp_path, clock=fake_clock()) as rec:
        real_dumps = pickle.dumps

        def dumps_then_signalled(*args: Any, **kwargs: Any) -> bytes:
            monkeypatch.setattr(pickle, "dumps", real_dumps)
            data = real_dumps(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGTERM)  # arrives in the middle of the dump
            return data

        monkeypatch.setattr(pickle, "dumps", dumps_then_signalled)
        with rec.step():
            torch.ones(10)
        rec.dump("manual")
    # the manual dump was completed (and listed) before the signal ended the session
    assert len(rec.paths) == 2 and rec.paths[0] == rec.paths[1]
    assert json.loads(sidecar_path(rec.paths[-1]).read_text())["reason"] == "terminated"


def test_a_signal_inside_a_finalizer_ends_the_session_at_the_next_step(tmp_path: Path) -> None:
    """Python runs a signal handler at the next bytecode, which can be inside a finalizer (the CPU
    tracker's, as a tensor is freed), where an exception is printed as "ignored" and lost: a Ctrl-C
    must still stop the run, at the next step."""
    import signal
    import weakref

    class Freed:
        pass

    def finalizer() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(3):  # the handler runs here, inside the finalizer
            len("x")

    reached = []
    with pytest.raises(KeyboardInterrupt), record(tmp_path, clock=fake_clock()) as rec:
        with rec.step():
            torch.ones(10)
            freed = Freed()
            weakref.finalize(freed, finalizer)
            del freed  # the finalizer runs; the signal waits
            reached.append("after the finalizer")
        with rec.step():
            reached.append("the next step")
    assert reached == ["after the finalizer"]
    assert json.loads(sidecar_path(rec.paths[-1]).read_text())["reason"] == "interrupted"
