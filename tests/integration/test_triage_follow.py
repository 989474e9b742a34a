"""``memlens triage --follow DIR`` as a real process, against a folder a recording keeps writing into
(a thread of this test runs the CPU recorder with dump_every): each newer complete snapshot is
drawn, the leak is announced once it holds, and Ctrl-C ends it with exit 0 and no traceback."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from memlens.recorder import record

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
SCREEN = re.compile(r"^──── memlens: (?P<name>\S+) ────$", re.MULTILINE)


def write_run(folder: Path, steps: int, pause_s: float) -> None:
    """A loop that keeps 1 MiB a step, recorded with a rolling snapshot every 2 steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kept: list[Any] = []
    with record(folder, dump_every=2, capacity="256MiB", model=model, optimizer=optimizer) as rec:
        for _ in range(steps):
            with rec.step():
                model(torch.randn(8, 32)).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                kept.append(torch.empty(262_144))
            time.sleep(pause_s)


class Lines:
    """A pipe read on a thread, so the test can wait for a line without blocking on the pipe."""

    def __init__(self, stream: Any) -> None:
        self.text = ""
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.text += line

    def wait_for(self, pattern: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if re.search(pattern, self.text, re.MULTILINE):
                return True
            time.sleep(0.05)
        return False

    def join(self) -> None:
        self._thread.join(timeout=30)


def test_follow_draws_each_newer_snapshot_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    follower = subprocess.Popen(
        [sys.executable, "-m", "memlens", "triage", "--follow", str(folder), "--follow-interval", "0.2",
         "--follow-timeout", "200", "--width", "100"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        out, err = Lines(follower.stdout), Lines(follower.stderr)
        assert err.wait_for("waiting for a complete snapshot", 60), err.text
        writer = threading.Thread(target=write_run, args=(folder, 12, 0.5))
        writer.start()
        writer.join(timeout=120)
        assert out.wait_for(r"^──── memlens: snapshot\.pickle ────$", 60), out.text  # the final dump
        assert out.wait_for(r"^Same file in PyTorch's viewer.*\n(memlens: .*\n)+\Z", 30), out.text[-2000:]
        follower.send_signal(signal.SIGINT)
        follower.wait(timeout=30)
        out.join()
        err.join()
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait(timeout=30)
        for pipe in (follower.stdout, follower.stderr):
            if pipe is not None:
                pipe.close()
    assert follower.returncode == 0, err.text
    assert "Traceback" not in err.text and "stopped following" in err.text
    screens = SCREEN.findall(out.text)
    rolled = [name for name in screens if name != "snapshot.pickle"]
    # a rolling snapshot was drawn before the run ended, and a newer one (or the final) after it
    assert len(rolled) >= 2 and screens[-1] == "snapshot.pickle", screens
    steps = [int(re.search(r"step(\d+)", name)[1]) for name in rolled]  # type: ignore[index]
    assert steps == sorted(steps) and len(set(steps)) == len(steps), steps
    assert re.search(r"^memlens: new steps since the last snapshot: \d+", out.text, re.MULTILINE)
    announced = re.findall(
        r"^memlens: new finding: leak began at step \d+, growing 1\.0 MiB/step; at that rate the "
        r"device is full in ~[\d,]+ steps \(~[^)]+\)$",
        out.text,
        re.MULTILINE,
    )
    assert len(announced) == 1, out.text[-3000:]  # once, when it first held


def test_follow_refuses_a_file_and_a_snapshot_beside_it(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from memlens.cli.main import cli

    both = CliRunner().invoke(cli, ["triage", "--follow", str(tmp_path), "x.pickle"])
    assert both.exit_code != 0 and "give no SNAPSHOT" in both.output
    neither = CliRunner().invoke(cli, ["triage"])
    assert neither.exit_code == 2 and "Missing argument 'SNAPSHOT'" in neither.output
    missing = CliRunner().invoke(cli, ["triage", "--follow", str(tmp_path / "nothing"), "--follow-timeout", "0"])
    assert missing.exit_code != 0 and "no such folder to follow" in missing.output
