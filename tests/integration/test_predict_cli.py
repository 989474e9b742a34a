"""``memlens predict -- python script.py``: an unmodified script, run in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from memlens.snapshot.reader import load

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch

    assert torch.cuda.is_available()
    device = "cuda"
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = int(sys.argv[1])
    torch.cuda.memory._record_memory_history(max_entries=100000)
    for _ in range(2):
        x = torch.randn(batch, 512, device=device)
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    print("max allocated", torch.cuda.max_memory_allocated())
    torch.cuda.memory._dump_snapshot("step.pickle")
    huge = torch.empty(int(sys.argv[2]), device=device, dtype=torch.uint8)
    print("after huge")
    """
)


def run_predict(tmp_path: Path, *options: str, batch: int = 64, huge: int = 1) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    command = [sys.executable, "-m", "memlens", "predict", *options, "--", "python", str(script), str(batch), str(huge)]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)


def test_json_result_and_snapshots(tmp_path: Path) -> None:
    completed = run_predict(tmp_path, "--json", "--gpu", "l4", "--out", "out")
    assert completed.returncode == 0, completed.stderr[-3000:]
    printed_peak = int(completed.stdout.split("max allocated ")[1].split()[0])
    result = json.loads(completed.stdout[completed.stdout.index("{\n") :])
    assert set(result) >= {"peak_allocated_bytes", "peak_reserved_bytes", "oom", "snapshots"}
    assert result["oom"] is False and "after huge" in completed.stdout
    # The script's own reading of torch.cuda.max_memory_allocated() is the simulator's peak.
    assert printed_peak == result["peak_allocated_bytes"]
    assert result["peak_reserved_bytes"] >= result["peak_allocated_bytes"]
    step, predicted = (tmp_path / "step.pickle").resolve(), (tmp_path / "out" / "predicted.pickle").resolve()
    assert result["snapshots"] == [str(step), str(predicted)]
    assert len(load(step, cache=False).device()) > 0
    parameters = 512 * 2048 + 2048 + 2048 * 512 + 512
    assert result["model"]["parameters_trainable"] == parameters and result["optimizer"]["class"] == "AdamW"
    sidecar = json.loads((tmp_path / "out" / "predicted.memlens.json").read_text())
    assert sidecar["model"]["parameters_trainable"] == parameters
    assert sidecar["device"]["total_memory_bytes"] == result["capacity_bytes"]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    triage_command = [sys.executable, "-m", "memlens", "triage", "--json", str(predicted)]
    triage = subprocess.run(triage_command, env=env, capture_output=True, text=True, timeout=120)
    assert triage.returncode == 0, triage.stderr[-2000:]


def test_oom_names_the_scripts_line(tmp_path: Path) -> None:
    completed = run_predict(tmp_path, "--json", "--capacity", "2GiB", huge=3 << 30)
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(completed.stdout[completed.stdout.index("{\n") :])
    assert result["oom"] is True
    assert result["oom_at"] == f"{tmp_path / 'train.py'}:20"
    assert "after huge" not in completed.stdout


def test_reserve_outside_and_text_output(tmp_path: Path) -> None:
    completed = run_predict(tmp_path, "--gpu", "a10g", "--reserve-outside", "1.5GiB")
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "NVIDIA A10G" in completed.stdout and "reserved outside" in completed.stdout
    assert "fits" in completed.stdout
    assert "budget (formulas) beside the prediction" in completed.stdout
    assert "optimizer_state" in completed.stdout


def test_script_errors_are_shown_and_fail(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("raise ValueError('the script itself is wrong')\n")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    completed = subprocess.run([sys.executable, "-m", "memlens", "predict", "--", "python", str(script)],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert completed.returncode == 1
    assert "the script itself is wrong" in completed.stderr  # Python's traceback
    assert f"the script failed: ValueError: the script itself is wrong (at {script}:1)" in completed.stdout
    assert (tmp_path / "memlens_predict" / "predicted.pickle").is_file()


def test_a_printed_loss_stops_the_run_or_takes_a_placeholder(tmp_path: Path) -> None:
    script = tmp_path / "printing.py"
    script.write_text(
        "import torch\n"
        "x = torch.ones(4, 4, device='cuda', requires_grad=True)\n"
        "loss = (x * 2).sum()\n"
        "print('loss', loss.item())\n"
        "loss.backward()\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    base = [sys.executable, "-m", "memlens", "predict", "--json"]
    stopped = subprocess.run([*base, "--", "python", str(script)], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    result = json.loads(stopped.stdout[stopped.stdout.index("{\n") :])
    assert result["stopped_at"] == f"{script}:4" and "real value" in result["stop_reason"]
    went_on = subprocess.run([*base, "--placeholder-values", "--", "python", str(script)], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    result = json.loads(went_on.stdout[went_on.stdout.index("{\n") :])
    assert result["stopped_at"] is None and result["placeholder_values"] == 1
    assert result["first_placeholder_at"] == f"{script}:4" and "loss nan" in went_on.stdout


def test_a_module_runs_with_dash_m(tmp_path: Path) -> None:
    package = tmp_path / "trainpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(
        "import sys, torch\nx = torch.empty(int(sys.argv[1]), device='cuda', dtype=torch.uint8)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    command = [sys.executable, "-m", "memlens", "predict", "--json", "--", "python", "-m", "trainpkg.train", "3000000"]
    completed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(completed.stdout[completed.stdout.index("{\n") :])
    assert result["peak_allocated_bytes"] == 3_000_320  # 3,000,000 rounded up to a multiple of 512
    assert result["peak_reserved_bytes"] == 20 << 20  # a 1-10 MiB request gets a 20 MiB segment
