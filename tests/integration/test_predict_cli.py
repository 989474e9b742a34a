"""``memlens predict -- python script.py``: an unmodified script, run in a fresh process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from memlens.snapshot.reader import load
from memlens.units import format_bytes

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
    # --json: stdout is the JSON alone; the script's own prints went to stderr.
    printed_peak = int(completed.stderr.split("max allocated ")[1].split()[0])
    result = json.loads(completed.stdout)
    assert set(result) >= {"peak_allocated_bytes", "peak_reserved_bytes", "oom", "snapshots"}
    assert result["oom"] is False and "after huge" in completed.stderr
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


def test_oom_names_the_scripts_line_and_does_not_fit(tmp_path: Path) -> None:
    completed = run_predict(tmp_path, "--json", "--capacity", "2GiB", huge=3 << 30)
    assert completed.returncode == 1, completed.stderr[-3000:]  # does not fit: a CI job can ask
    result = json.loads(completed.stdout[completed.stdout.index("{\n") :])
    assert result["oom"] is True and result["fits"] is False
    assert result["oom_at"] == f"{tmp_path / 'train.py'}:20"
    assert result["oom_op"] == "aten.empty.memory_format" and result["oom_in_backward"] is False
    assert "after huge" not in completed.stdout


def test_reserve_outside_and_text_output(tmp_path: Path) -> None:
    completed = run_predict(tmp_path, "--gpu", "a10g", "--reserve-outside", "1.5GiB")
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "NVIDIA A10G" in completed.stdout and "reserved outside" in completed.stdout
    assert "fits" in completed.stdout
    assert "Budget  theory next to what was measured at the peak" in completed.stdout
    assert "optimizer_state" in completed.stdout


def test_script_errors_are_shown_and_fail(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("raise ValueError('the script itself is wrong')\n")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    completed = subprocess.run([sys.executable, "-m", "memlens", "predict", "--", "python", str(script)],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert completed.returncode == 1
    assert "the script itself is wrong" in completed.stderr  # Python's traceback
    # It failed before anything reached the GPU, and says so (issue 36), with the error and its line.
    failure = f"ValueError: the script itself is wrong (at {script}:1)"
    assert f"the script failed before it put anything on the GPU: {failure}" in completed.stdout
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
    assert result["first_placeholder_at"] == f"{script}:4" and "loss nan" in went_on.stderr


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


def predict_script(
    tmp_path: Path, source: str, *options: str, name: str = "script.py"
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / name
    script.write_text(textwrap.dedent(source))
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    command = [sys.executable, "-m", "memlens", "predict", *options, "--", "python", str(script)]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)


def json_result(completed: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(completed.stdout[completed.stdout.index("{\n") :])
    return loaded


def triage_json(path: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    command = [sys.executable, "-m", "memlens", "triage", "--json", str(path)]
    triage = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert triage.returncode in (0, 1), triage.stderr[-2000:]
    loaded: dict[str, Any] = json.loads(triage.stdout)
    return loaded


BACKWARD_OOM = """
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first = torch.nn.Linear(1024, 1024)
            self.second = torch.nn.Linear(1024, 1024)

        def forward(self, x):
            hidden = torch.nn.functional.gelu(self.first(x))
            return self.second(hidden)

    model = Block().cuda()
    x = torch.randn(BATCH, 1024, device="cuda")
    loss = LOSS
    loss.backward()
    print("backward done")
"""


@pytest.mark.parametrize(
    ("batch", "loss", "capacity", "forward_line"),
    [
        (1024, "model(x).pow(2).mean()", "46MiB", 16),  # pow's gradient, in the script's body
        (4096, "model(x).sum()", "96MiB", 12),  # the second Linear's, inside Block.forward
    ],
)
def test_an_oom_in_backward_is_the_same_result_as_in_forward(
    tmp_path: Path, batch: int, loss: str, capacity: str, forward_line: int
) -> None:
    """The backward pass runs on autograd's device thread: its OOM used to escape as an internal
    error. It is an OUT OF MEMORY result naming the op, the line that called backward, and the
    forward line whose gradient was being computed."""
    script = tmp_path / "script.py"
    source = BACKWARD_OOM.replace("BATCH", str(batch)).replace("LOSS", loss)
    completed = predict_script(tmp_path, source, "--json", "--capacity", capacity)
    assert completed.returncode == 1, completed.stderr[-3000:]
    assert "internal error" not in completed.stderr and "terminate called" not in completed.stderr
    assert "backward done" not in completed.stdout
    result = json_result(completed)
    assert result["oom"] is True and result["oom_in_backward"] is True
    assert result["oom_at"] == f"{script}:17"  # loss.backward()
    assert result["oom_forward_at"] == f"{script}:{forward_line}"
    assert result["oom_op"].startswith("aten.") and result["oom_requested_bytes"] > 0
    assert (tmp_path / "memlens_predict" / "predicted.pickle").is_file()
    text = predict_script(tmp_path, source, "--capacity", capacity)
    assert text.returncode == 1
    assert (f"OUT OF MEMORY in the backward pass called at {script}:17: {result['oom_op']} asked for "
            in text.stdout) and f"computing the gradient of {script}:{forward_line}" in text.stdout


def test_gpu_names_people_type_and_the_help_lists_them(tmp_path: Path) -> None:
    for typed, name in (("H100", "NVIDIA H100 80GB HBM3"), ("a100", "NVIDIA A100-SXM4-80GB")):
        completed = predict_script(tmp_path, "import torch\nx = torch.empty(10, device='cuda')\n", "--json",
                                   "--gpu", typed)  # fmt: skip
        assert completed.returncode == 0, completed.stderr[-2000:]
        assert json_result(completed)["gpu"] == name
    refused = predict_script(tmp_path, "print('never runs')\n", "--gpu", "b200")
    assert refused.returncode == 2 and "never runs" not in refused.stdout
    assert refused.stderr.strip().splitlines() == [refused.stderr.strip()] and "unknown GPU 'b200'" in refused.stderr
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), COLUMNS="200")
    shown = subprocess.run([sys.executable, "-m", "memlens", "predict", "--help"], env=env,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    help_text = " ".join(shown.stdout.split())
    assert "h100-80gb" in help_text and "H100 = h100-80gb" in help_text and "Exit status" in help_text


def test_a_script_that_puts_nothing_on_the_gpu_says_so(tmp_path: Path) -> None:
    source = "import torch\nmodel = torch.nn.Linear(8, 8)\nprint(model(torch.randn(2, 8)).shape)\n"
    completed = predict_script(tmp_path, source)
    # Nothing on the GPU answers nothing about it: no "fits", and not the status of a fit.
    assert completed.returncode == 1, completed.stderr[-2000:]
    assert "no fit to claim: nothing was put on the GPU" in completed.stdout
    assert "peak allocated" not in completed.stdout and "fits" not in completed.stdout
    result = json_result(predict_script(tmp_path, source, "--json"))
    assert result["used_cuda"] is False and result["fits"] is False


@pytest.mark.parametrize(
    ("source", "failure"),
    [
        ("import argparse\nparser = argparse.ArgumentParser()\nparser.add_argument('--lr', type=float, required=True)\n"
         "parser.parse_args()\n", "the script exited with status 2"),
        ("import torch\nimport a_module_that_is_not_installed\n",
         "ModuleNotFoundError: No module named 'a_module_that_is_not_installed'"),
    ],
    ids=["argparse", "import"],
)  # fmt: skip
def test_a_script_that_fails_before_the_gpu_is_told_what_failed(tmp_path: Path, source: str, failure: str) -> None:
    completed = predict_script(tmp_path, source)
    assert completed.returncode == 1
    assert f"the script failed before it put anything on the GPU: {failure}" in completed.stdout
    assert "nothing was put on the GPU" not in completed.stdout


TRAINED = """
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 2048)).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    kept = [torch.empty(1000 + i, dtype=torch.uint8, device="cuda") for i in range(3)]  # sizes off 512
    for _ in range(2):
        loss = model(torch.randn(256, 2048, device="cuda")).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
"""


def test_the_closing_figures_are_triages_and_the_roles_are_the_recorders(tmp_path: Path) -> None:
    """What predict prints is what triage says of predicted.pickle (one number per quantity), and
    the model and optimizer are known as the recorder knows them: parameters measured, under 5%
    unknown at the peak, the budget table in triage's form (no "(GiB)" over MiB values)."""
    completed = predict_script(tmp_path, TRAINED, "--json")
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json_result(completed)
    triage = triage_json(tmp_path / "memlens_predict" / "predicted.pickle")
    device = triage["devices"]["0"]
    assert (result["peak_allocated_bytes"], result["peak_reserved_bytes"]) == (
        device["peak_allocated_bytes"], device["peak_reserved_bytes"])  # fmt: skip
    parameter_bytes = 4 * (2048 * 4096 + 4096 + 4096 * 2048 + 2048)
    at_peak = device["categories_at_peak"]
    assert at_peak["parameters"] == parameter_bytes
    assert at_peak["unknown"] < 0.05 * device["peak_allocated_bytes"], at_peak
    sidecar = json.loads((tmp_path / "memlens_predict" / "predicted.memlens.json").read_text())
    assert sidecar["tensor_roles"]["records"]
    text = predict_script(tmp_path, TRAINED)
    assert f"peak allocated  {format_bytes(device['peak_allocated_bytes'])}" in text.stdout
    assert f"peak reserved   {format_bytes(device['peak_reserved_bytes'])}" in text.stdout
    assert "(GiB)" not in text.stdout and "Budget" in text.stdout
    parameters_row = next(line for line in text.stdout.splitlines() if line.startswith("parameters"))
    size = format_bytes(parameter_bytes).split()
    assert parameters_row.split()[1:5] == [*size, *size]  # theory and measured


LOOPING = """
    import pathlib, sys, time
    import torch

    model = torch.nn.Linear(256, 256).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(100000):
        model(torch.randn(8, 256, device="cuda")).sum().backward()
        optimizer.step()
        if step == 2:
            pathlib.Path(sys.argv[0]).with_name("started").write_text("yes")
        time.sleep(0.01)
"""


@pytest.mark.parametrize(("signum", "status", "reason"),
                         [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")])  # fmt: skip
def test_a_signal_writes_the_prediction_then_exits_like_the_signal(
    tmp_path: Path, signum: int, status: int, reason: str
) -> None:
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent(LOOPING))
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    command = [sys.executable, "-m", "memlens", "predict", "--json", "--", "python", str(script)]
    run = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 200
        while not (tmp_path / "started").exists():
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            time.sleep(0.1)
        run.send_signal(signum)
        stdout, stderr = run.communicate(timeout=120)
    finally:
        if run.poll() is None:  # a failed test leaves no endless loop behind it
            run.kill()
            run.communicate()
    assert run.returncode == status, stderr[-3000:]
    assert "Aborted!" not in stderr and "Traceback" not in stderr
    result = json.loads(stdout[stdout.index("{\n") :])
    assert result["interrupted"] == reason and result["fits"] is False
    assert result["stopped_at"].startswith(f"{script}:")
    predicted = tmp_path / "memlens_predict" / "predicted.pickle"
    assert load(predicted, cache=False).devices[0].events > 0
    assert json.loads((tmp_path / "memlens_predict" / "predicted.memlens.json").read_text())["reason"] == reason


def test_a_script_that_closes_its_streams_still_gets_its_prediction(tmp_path: Path) -> None:
    source = "import sys, torch\nx = torch.empty(10, device='cuda')\nsys.stdout.close()\nsys.stderr.close()\n"
    completed = predict_script(tmp_path, source)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "fits: the run completed within capacity" in completed.stdout


def test_sys_exit_with_a_failure_is_a_result_too(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    completed = predict_script(tmp_path, "import sys, torch\nx = torch.empty(10, device='cuda')\nsys.exit(3)\n")
    assert completed.returncode == 1 and "Traceback" not in completed.stderr
    assert f"the script failed: the script exited with status 3 (at {script}:3)" in completed.stdout
    assert (tmp_path / "memlens_predict" / "predicted.pickle").is_file()


def test_json_is_all_of_stdout_and_the_scripts_prints_go_to_stderr(tmp_path: Path) -> None:
    """As ``plan --json``: ``memlens predict --json ... | jq`` works, whatever the script prints,
    from Python, from a subprocess writing to file descriptor 1, or straight to that descriptor."""
    source = ("import os, subprocess, sys, torch\nprint('from print')\nx = torch.empty(10, device='cuda')\n"
              "subprocess.run([sys.executable, '-c', 'print(\"from a child\")'], check=True)\n"
              "os.write(1, b'from fd 1\\n')\n")
    completed = predict_script(tmp_path, source, "--json")
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert json.loads(completed.stdout)["fits"] is True
    for printed in ("from print", "from a child", "from fd 1"):
        assert printed in completed.stderr and printed not in completed.stdout
