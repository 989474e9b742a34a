"""``memlens predict`` says what its "fits" was decided against, and refuses a reserve bigger than
the board in the user's units."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

SCRIPT = "import torch\nx = torch.empty(1 << 20, device='cuda')\n(x * 2).sum()\n"


def predict(tmp_path: Path, *options: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "train.py").write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    command = [sys.executable, "-m", "memlens", "predict", "--out", str(tmp_path / "out"), *options,
               "--", "python", str(tmp_path / "train.py")]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280, check=False)


def test_capacity_without_a_gpu_names_the_board_it_behaves_as(tmp_path: Path) -> None:
    completed = predict(tmp_path, "--capacity", "24GB", "--reserve-outside", "512MiB")
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = completed.stdout
    assert "fit decided against --capacity 22.35 GiB - 512.00 MiB --reserve-outside = 21.85 GiB" in out
    assert "--capacity without --gpu keeps the a100-80gb's behaviour: compute capability 8.0" in out
    assert "counted only in --reserve-outside: the CUDA context" in out


def test_a_board_shows_torchs_figure_for_it(tmp_path: Path) -> None:
    completed = predict(tmp_path, "--gpu", "T4")
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "fit decided against 14.56 GiB (the t4 as torch reports it, published)" in completed.stdout
    assert "board behaviour (t4): compute capability 7.5" in completed.stdout


def test_a_reserve_bigger_than_the_board_is_one_line_in_the_users_units(tmp_path: Path) -> None:
    completed = predict(tmp_path, "--gpu", "a100", "--reserve-outside", "100GiB")
    assert completed.returncode == 2
    assert completed.stderr.strip() == ("memlens: error: --reserve-outside 100.00 GiB is more than the "
                                        "NVIDIA A100-SXM4-80GB's 79.14 GiB: it would leave PyTorch's allocator nothing")
