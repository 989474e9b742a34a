"""The uncaught-exception guard of the Hugging Face callback, in real processes.

A ``TrainerCallback`` hears nothing of an exception, so the callback's run is written by
``sys.excepthook`` when an exception ends the program, and at exit when the program ends inside
training without one (SIGTERM: the recorder's handler raises ``SystemExit(143)``, which skips the
excepthook). Both are Python's own machinery at interpreter exit, so they are tested in child
processes, driving ``FrameworkRun`` as the callback does (no framework needed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

SCRIPT = """
import os, signal, sys
import torch
from memlens.integrations._framework import FrameworkRun, UncaughtExceptionGuard

run = FrameworkRun({out!r}, {{"device": "cpu"}})
model = torch.nn.Linear(64, 64)
run.start(rank=0, world_size=1, model=model, optimizers=[torch.optim.SGD(model.parameters(), lr=0.1)])
UncaughtExceptionGuard(run).install()
for step in range(3):
    run.begin_step()
    activations = model(torch.randn(32, 64))
    if step == 1:
        {failure}
    activations.sum().backward()
    run.end_step()
"""


FAILURES = {
    "exception": 'raise RuntimeError("bad batch")',
    "sigterm": "os.kill(os.getpid(), signal.SIGTERM)",
}


@pytest.fixture(scope="module")
def children(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, subprocess.CompletedProcess[str]]]:
    """Both child runs, started together (each spends most of its time importing torch)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    started = {}
    for name, failure in FAILURES.items():
        folder = tmp_path_factory.mktemp(name)
        script = textwrap.dedent(SCRIPT).format(out=str(folder / "runs"), failure=failure)
        process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=env)
        started[name] = (folder, process)
    finished = {}
    for name, (folder, process) in started.items():
        stdout, stderr = process.communicate(timeout=240)
        finished[name] = (folder, subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    return finished


def written(folder: Path) -> tuple[dict[str, object], list[int]]:
    import memlens

    snapshot = folder / "runs" / "snapshot.pickle"
    sidecar = json.loads(snapshot.with_suffix(".memlens.json").read_text())
    return sidecar, [step.index for step in memlens.analyze(snapshot).device().steps]


def test_an_uncaught_exception_is_written_before_its_traceback(children: dict[str, Any]) -> None:
    folder, result = children["exception"]

    assert result.returncode == 1, result.stderr
    assert "RuntimeError: bad batch" in result.stderr, "the traceback is still printed"
    assert result.stderr.index("memlens: wrote") < result.stderr.index("Traceback")
    sidecar, steps = written(folder)
    assert sidecar["reason"] == "exception"
    assert steps == [0, 1]  # step 1 is the one the exception ended


def test_sigterm_inside_training_is_written_at_exit(children: dict[str, Any]) -> None:
    folder, result = children["sigterm"]

    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert "memlens: wrote" in result.stderr
    sidecar, steps = written(folder)
    assert sidecar["reason"] == "terminated"
    assert steps == [0, 1]
