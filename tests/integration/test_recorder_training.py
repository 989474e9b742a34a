"""Real training loops on the CPU under memlens.record: the output loads in memlens and in PyTorch's
own consumer (torch.cuda._memory_viz), and shows what happened (a leak's staircase, checkpointing)."""

from __future__ import annotations

import itertools
import json
import pickle
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import memlens
from memlens.recorder import record
from tests.examples import TRAIN_TINY, load_train_tiny

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


tiny = load_train_tiny()


def step_end_levels(path: Path) -> list[int]:
    """Allocated bytes at the END annotation of each memlens step, from the memlens reader."""
    snapshot = memlens.load(path)
    trace = snapshot.devices[0]
    ends = [a.time_us for a in snapshot.annotations if a.name.startswith("memlens.step#") and a.stage == "END"]
    indices = [int(np.searchsorted(trace.time_us, t, side="right")) - 1 for t in ends]
    return [int(trace.allocated[i]) for i in indices]


def train(out: Path, steps: int = 4, leak: bool = False, batch: int = 4, seq: int = 32, **options: Any) -> Any:
    torch.manual_seed(0)
    model = tiny.TinyLM(d_model=32, n_layers=2)
    model.checkpointing = options.pop("checkpointing", False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    held_out = torch.randint(0, 256, (batch, seq + 1))
    losses = []
    clock = itertools.count(1_700_000_000_000_000).__next__
    with record(out, model=model, optimizer=optimizer, clock=clock, **options) as rec:
        for _ in range(steps):
            with rec.step():
                tiny.train_step(model, optimizer, torch.randint(0, 256, (batch, seq + 1)))
                if leak:
                    logits = model(held_out[:, :-1])
                    losses.append(logits.logsumexp(-1).mean())  # kept with its graph: a leak
    return rec


def test_training_run_loads_in_memlens_and_memory_viz(tmp_path: Path) -> None:
    from torch.cuda import _memory_viz

    rec = train(tmp_path, steps=3, batch=8, seq=160)  # logits over 1 MiB: large-pool segments
    path = rec.paths[-1]
    snapshot = memlens.load(path)
    trace = snapshot.devices[0]
    assert trace.has_time and trace.events > 100
    assert snapshot.sidecar is not None and snapshot.sidecar.optimizer is not None
    assert snapshot.sidecar.optimizer.class_name == "AdamW"
    names = [a.name for a in snapshot.annotations if a.stage == "START"]
    assert [name for name in names if name.startswith("memlens.step#")] == [f"memlens.step#{i}" for i in range(3)]
    # the model's modules as scopes, forward and backward (the embeddings, fed token ids, have
    # no observable backward; see memlens.recorder.module_scopes)
    assert {"memlens.forward#<root>", "memlens.forward#blocks.0", "memlens.backward#blocks.0",
            "memlens.backward#head"} <= set(names)
    assert "memlens.backward#embed" not in names
    # what the recorder knew is in the sidecar, and the analysis uses it
    assert snapshot.sidecar.tensor_roles is not None
    roles = snapshot.sidecar.tensor_roles.records
    assert {"step#0.start", "optimizer.pre", "optimizer.post", "forward", "forward.end"} <= {r.at for r in roles}
    report = memlens.analyze(path)
    device = report.devices[0]
    assert device.categories_at_peak["unknown"] < 0.05 * device.peak_allocated_bytes
    assert snapshot.segments and all(s.total_size % 512 == 0 for s in snapshot.segments)
    assert (trace.allocated <= trace.reserved).all()
    # segment_alloc events, frames and user_metadata like a CUDA snapshot
    with open(path, "rb") as handle:
        raw = pickle.load(handle)
    entries = raw["device_traces"][0]
    assert {"alloc", "free_requested", "free_completed", "segment_alloc"} <= {e["action"] for e in entries}
    alloc_frames = [e["frames"] for e in entries if e["action"] == "alloc"]
    assert all(frames for frames in alloc_frames)
    assert any(f["filename"].endswith("train_tiny.py") for frames in alloc_frames for f in frames)
    # PyTorch's own consumer accepts it (segsum checks the segment accounting identity)
    assert "total_reserved" in _memory_viz.segsum(raw)
    assert "entries" in _memory_viz.trace(raw)
    assert "<html>" in _memory_viz.trace_plot(raw)
    assert "<html>" in _memory_viz.trace_plot(raw, plot_segments=True)


def test_leak_rises_step_over_step_and_healthy_does_not(tmp_path: Path) -> None:
    healthy = step_end_levels(train(tmp_path / "healthy", steps=4).paths[-1])
    leaky = step_end_levels(train(tmp_path / "leak", steps=4, leak=True).paths[-1])
    assert len(healthy) == len(leaky) == 4
    assert len(set(healthy[1:])) == 1  # after the first step (AdamW state appears) it is flat
    growth = np.diff(leaky)
    assert (growth > 0).all() and growth.min() > 64 * 1024  # each step keeps a held-out graph


def test_checkpointing_lowers_the_peak(tmp_path: Path) -> None:
    plain = train(tmp_path / "plain", steps=2, batch=8, seq=64)
    checkpointed = train(tmp_path / "ckpt", steps=2, batch=8, seq=64, checkpointing=True)
    assert checkpointed.peak_bytes[0] < plain.peak_bytes[0]


def test_fake_tensor_mode_sizes_a_model_without_its_memory(tmp_path: Path) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = tiny.TinyLM(d_model=512, n_layers=2)
        optimizer = torch.optim.AdamW(model.parameters())
        with record(tmp_path, model=model, optimizer=optimizer, capacity="80GiB") as rec, rec.step():
            tiny.train_step(model, optimizer, torch.randint(0, 256, (16, 513)))
    parameter_bytes = 4 * sum(p.numel() for p in model.parameters())
    peak_allocated, _ = rec.peak_bytes
    assert peak_allocated > 3 * parameter_bytes  # params + grads + AdamW's two moments, at least
    assert memlens.load(rec.paths[-1]).devices[0].events > 0


def test_cli_records_an_unmodified_script(tmp_path: Path) -> None:
    from memlens.cli.main import cli

    out = tmp_path / "run"
    result = CliRunner().invoke(
        cli,
        ["record", "--out", str(out), "--", "python", str(TRAIN_TINY), "--steps", "3", "--seq", "16"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    assert "trained 3 steps" in result.output
    snapshot = memlens.load(out / "snapshot.pickle")
    starts = [a.name for a in snapshot.annotations if a.stage == "START" and a.name.startswith("memlens.step#")]
    # one step per optimizer.step(); the tail after the last one is not a step
    assert starts == ["memlens.step#0", "memlens.step#1", "memlens.step#2"]
    sidecar = json.loads((out / "snapshot.memlens.json").read_text())
    assert sidecar["reason"] == "exit" and [s["index"] for s in sidecar["steps"]] == [0, 1, 2]
    report = memlens.analyze(snapshot).device()
    assert report.step_source == "memlens" and len(report.steps) == 3
    assert f"wrote {out / 'snapshot.pickle'} (3 steps;" in result.output
    assert sys.argv[0] != str(TRAIN_TINY)  # restored


def test_cli_simulated_oom_exits_nonzero_with_a_snapshot(tmp_path: Path) -> None:
    from memlens.cli.main import cli

    out = tmp_path / "oom"
    result = CliRunner().invoke(
        cli,
        ["record", "--out", str(out), "--capacity", "2MiB", "--", "python", str(TRAIN_TINY), "--steps", "3"],
    )
    assert result.exit_code == 1
    assert "OutOfMemoryError" in result.output
    sidecar = json.loads((out / "snapshot.memlens.json").read_text())
    assert sidecar["reason"] == "oom"
    trace = memlens.load(out / "snapshot.pickle").devices[0]
    assert trace.action[-1] == int(memlens.snapshot.model.Action.OOM)


@pytest.mark.slow
def test_memlens_record_subprocess(tmp_path: Path) -> None:
    out = tmp_path / "sub"
    completed = subprocess.run(
        [sys.executable, "-m", "memlens", "record", "--out", str(out), "--", "python", str(TRAIN_TINY), "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert "memlens: wrote" in completed.stderr
    assert (out / "snapshot.pickle").stat().st_size > 0


# ------------------------------------------------------------- memlens record as a real process
SCRIPT = '''
import os, signal, sys, time
from pathlib import Path

import torch

model = torch.nn.Linear(16, 16)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def step():
    model(torch.randn(8, 16)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


mode = sys.argv[1]
Path(sys.argv[2], f"ran-{os.getpid()}").touch()
for _ in range(3):
    step()
print("started", flush=True)
if mode == "until-signalled":
    while True:
        step()
        time.sleep(0.01)
elif mode == "exit-message":
    sys.exit("the loss is nan")
elif mode == "meet":  # wait until the other run is this far too: both are recording now
    while len(list(Path(sys.argv[2]).glob("ran-*"))) < 2:
        time.sleep(0.05)
    step()
elif mode == "killed-while-writing":  # SIGKILL in the middle of the next periodic dump
    os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
    step()
elif mode == "closes-its-streams":
    kept = [torch.empty(1000 + i, dtype=torch.uint8) for i in range(3)]  # sizes off 512
    step()
    sys.stdout.close()
    sys.stderr.close()
elif mode == "os-exit":
    step()
    os._exit(7)
'''


_STARTED: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _no_run_left_behind() -> Iterator[None]:
    """A test that fails while a ``memlens record`` runs (a timeout) kills it: left behind, a
    training loop waiting for a signal would run on, and slow every later test."""
    yield
    while _STARTED:
        run = _STARTED.pop()
        if run.poll() is None:
            run.kill()
            run.communicate()


def memlens_record(tmp_path: Path, out: Path | str, mode: str, *options: str) -> subprocess.Popen[str]:
    script = tmp_path / "train_script.py"
    if not script.exists():
        script.write_text(SCRIPT)
    (tmp_path / "marks").mkdir(exist_ok=True)
    run = subprocess.Popen(
        [sys.executable, "-m", "memlens", "record", "--out", str(out), *options, "--",
         "python", str(script), mode, str(tmp_path / "marks")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )
    _STARTED.append(run)
    return run


def wait_until_started(process: subprocess.Popen[str]) -> None:
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.strip() == "started", line + (process.stderr.read() if process.stderr else "")


def wrote_line(stderr: str) -> str:
    (line,) = [line for line in stderr.splitlines() if line.startswith("memlens: wrote ")]
    return line


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_recordings_started_at_once_keep_both_snapshots(tmp_path: Path) -> None:
    out = tmp_path / "shared"
    runs = [memlens_record(tmp_path, out, "meet") for _ in range(2)]
    results = [run.communicate(timeout=240) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], results
    written = sorted(wrote_line(stderr).split()[2] for _, stderr in results)
    assert written == [str(out / "snapshot-2.pickle"), str(out / "snapshot.pickle")]
    for path in written:
        assert len(memlens.analyze(memlens.load(path)).device().steps) == 4
    assert sorted(p.name for p in out.iterdir()) == [
        "snapshot-2.memlens.json", "snapshot-2.pickle", "snapshot.memlens.json", "snapshot.pickle"
    ]  # no reservation or temporary file left behind


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["a file", "under a file"])
def test_an_out_that_cannot_be_written_stops_before_the_script(tmp_path: Path, kind: str) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    out = blocker if kind == "a file" else blocker / "runs"
    run = memlens_record(tmp_path, out, "exit-message")
    stdout, stderr = run.communicate(timeout=240)
    assert run.returncode == 2
    assert stderr.splitlines() == [stderr.strip()]
    assert stderr.startswith(f"memlens: error: cannot write snapshots into {out}")
    assert "Traceback" not in stderr and stdout == ""
    assert not list((tmp_path / "marks").iterdir())  # the script never ran


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("signum", "status", "reason"), [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")]
)
def test_a_signal_writes_the_snapshot_then_exits_like_the_signal(
    tmp_path: Path, signum: int, status: int, reason: str
) -> None:
    out = tmp_path / "run"
    run = memlens_record(tmp_path, out, "until-signalled")
    wait_until_started(run)
    run.send_signal(signum)
    _, stderr = run.communicate(timeout=240)
    assert run.returncode == status, stderr
    assert "Aborted!" not in stderr
    assert wrote_line(stderr).startswith(f"memlens: wrote {out / 'snapshot.pickle'} (")
    sidecar = json.loads((out / "snapshot.memlens.json").read_text())
    assert sidecar["reason"] == reason and len(sidecar["steps"]) >= 4
    assert memlens.load(out / "snapshot.pickle").devices[0].events > 0
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sys_exit_with_a_message_prints_it(tmp_path: Path) -> None:
    run = memlens_record(tmp_path, tmp_path / "run", "exit-message")
    _, stderr = run.communicate(timeout=240)
    assert run.returncode == 1
    assert "the loss is nan" in stderr.splitlines()
    assert wrote_line(stderr)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_what_a_kill_9_leaves_is_cleaned_by_the_next_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    killed = memlens_record(tmp_path, out, "killed-while-writing", "--dump-every", "1")
    killed.communicate(timeout=240)
    assert killed.returncode == -signal.SIGKILL
    leftovers = sorted(p.name for p in out.rglob("*"))  # the dump's temporary file is in rolling/
    assert any(name.endswith(".tmp") for name in leftovers) and ".snapshot.pickle.reserved" in leftovers, leftovers
    # the periodic dump before the one it was killed in is whole
    assert memlens.load(out / "snapshot.pickle").devices[0].events > 0
    again = memlens_record(tmp_path, out, "exit-message")
    _, stderr = again.communicate(timeout=240)
    assert wrote_line(stderr).startswith(f"memlens: wrote {out / 'snapshot-2.pickle'} (")
    # the killed run's rolling snapshots (--dump-every) stay beside its name; the stale files are gone
    assert sorted(p.name for p in out.iterdir() if p.name != "rolling") == [
        "snapshot-2.memlens.json", "snapshot-2.pickle", "snapshot.memlens.json", "snapshot.pickle"
    ]
    assert all(not p.name.startswith(".") for p in out.rglob("*"))
    assert any(p.name.startswith("snapshot.step") for p in (out / "rolling").iterdir())


def triage_peaks(path: Path) -> tuple[int, int]:
    completed = subprocess.run([sys.executable, "-m", "memlens", "triage", "--json", str(path)],
                               capture_output=True, text=True, timeout=240, cwd=REPO)  # fmt: skip
    device = json.loads(completed.stdout)["devices"]["0"]
    return device["peak_allocated_bytes"], device["peak_reserved_bytes"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_script_that_closes_its_streams_keeps_its_status_and_the_closing_line_is_triages(tmp_path: Path) -> None:
    """python exits 0 after closing its own stdout and stderr, and so does memlens record; the
    closing line still reaches stderr, with the peaks triage will say of the file (the blocks of
    1000-1002 bytes are where the recorder's own counters and the file's analysis used to differ)."""
    from memlens.units import format_bytes

    out = tmp_path / "run"
    run = memlens_record(tmp_path, out, "closes-its-streams")
    _, stderr = run.communicate(timeout=240)
    assert run.returncode == 0, stderr
    allocated, reserved = triage_peaks(out / "snapshot.pickle")
    assert wrote_line(stderr).endswith(
        f"peak allocated {format_bytes(allocated)}, peak reserved {format_bytes(reserved)})"
    ), stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_os_exit_writes_the_snapshot_first_and_keeps_its_status(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = memlens_record(tmp_path, out, "os-exit")
    _, stderr = run.communicate(timeout=240)
    assert run.returncode == 7, stderr
    assert wrote_line(stderr).startswith(f"memlens: wrote {out / 'snapshot.pickle'} (")
    assert memlens.load(out / "snapshot.pickle").devices[0].events > 0
    assert sorted(p.name for p in out.iterdir()) == ["snapshot.memlens.json", "snapshot.pickle"]  # no reservation
