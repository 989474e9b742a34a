"""``memlens predict`` of a script that runs convolutions says, on a line of its own, that cuDNN's
workspaces are not in the prediction (on an H200 they put peak reserved 28% above it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

CNN = textwrap.dedent(
    """
    import torch
    from torch import nn

    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 8, 3)).to("cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(4, 3, 32, 32, device="cuda")).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    """
)
MLP = textwrap.dedent(
    """
    import torch

    model = torch.nn.Linear(64, 64).to("cuda")
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    """
)


def predict(tmp_path: Path, source: str, *options: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(source)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    command = [sys.executable, "-m", "memlens", "predict", "--gpu", "h200", *options, "--", "python", str(script)]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)


def test_convolutions_on_the_gpu_are_said_to_leave_cudnns_workspaces_out(tmp_path: Path) -> None:
    completed = predict(tmp_path, CNN, "--json")
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(completed.stdout)
    assert result["fits"] is True
    [line] = result["not_modelled"]
    # Two steps of two convolutions, each once forward and once backward.
    assert line.startswith("not modelled: cuDNN's convolution workspaces (8 convolution calls")
    assert "2.22 GiB real, 1.59 GiB predicted" in line and "docs/predict.md" in line
    text = predict(tmp_path, CNN)
    assert text.returncode == 0, text.stderr[-3000:]
    assert f"  {line}\n" in text.stdout


def test_a_script_without_convolutions_has_nothing_unmodelled(tmp_path: Path) -> None:
    completed = predict(tmp_path, MLP, "--json")
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert json.loads(completed.stdout)["not_modelled"] == []
    # (The budget's workspace row names cuDNN among the libraries; only the not-modelled line is absent.)
    assert "not modelled:" not in predict(tmp_path, MLP).stdout
