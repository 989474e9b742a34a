"""The emulated-CUDA tests, each in a process whose autograd engine has not started yet."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import PREDICT_IN_PROCESS_ENV, PREDICT_IN_PROCESS_TESTS, REPO_ROOT

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
def test_emulated_cuda_api_suite_in_a_fresh_process() -> None:
    """The in-process predict tests (tests/unit/test_predict_cuda_api.py, one call of the emulated
    torch.cuda API at a time, and the others of PREDICT_IN_PROCESS_TESTS), in a process of their own."""
    env = dict(os.environ, **{PREDICT_IN_PROCESS_ENV: "1"})
    files = [f"tests/{name}" for name in PREDICT_IN_PROCESS_TESTS]
    command = [sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider", *files]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=880)
    assert result.returncode == 0, result.stdout[-12000:] + result.stderr[-4000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


@pytest.mark.timeout(300)
def test_predict_after_backward_is_one_clear_error(tmp_path: Path) -> None:
    """A process that ran backward() before predict cannot get the emulated GPU: it is told so."""
    script = tmp_path / "late.py"
    script.write_text(textwrap.dedent("""
        import torch
        import memlens
        from memlens.errors import MemlensUsageError
        torch.ones(2, requires_grad=True).sum().backward()
        def step():
            torch.nn.Linear(8, 8).cuda()(torch.randn(2, 8, device="cuda")).sum().backward()
        try:
            memlens.predict(step, capacity="1GiB")
        except MemlensUsageError as exc:
            print("usage error:", exc)
    """))
    result = subprocess.run([sys.executable, str(script)], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=280, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert result.returncode == 0, result.stderr[-4000:]
    assert "usage error: memlens.predict needs a process in which backward() has not run yet" in result.stdout
