"""Recordings made on a real NVIDIA H200 (tests/data/h200/README.md says how): what each block is."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from memlens.analysis import CATEGORIES, analyze_snapshot
from memlens.ops.triage import TriageOptions, triage
from memlens.snapshot.reader import load

H200 = Path(__file__).resolve().parent.parent / "data" / "h200"
MiB = 1 << 20


def test_a_python_stack_recordings_cublas_workspaces_are_workspace_and_its_gradients_are_the_real_ones(
        tmp_path: Path) -> None:
    """`memlens record --device cuda` of a two-Linear AdamW loop: its two 32 MiB cuBLAS workspaces
    (one under F.linear's frame, one from autograd's thread with no frame, which the phase alone
    made a gradient) read workspace, and the gradients at the peak are the model's 4.01 MiB."""
    for name in ("leak_cuda.pickle", "leak_cuda.memlens.json"):
        shutil.copy(H200 / name, tmp_path / name)
    report = triage(str(tmp_path / "leak_cuda.pickle"), TriageOptions(cache=False))
    device = report.devices[0]
    parameters = 512 * 1024 * 4 + 1024 * 4 + 1024 * 512 * 4 + 512 * 4
    assert device.categories_at_peak["workspace"] == 64 * MiB
    assert device.categories_at_peak["gradients"] == parameters
    assert device.categories_at_peak["parameters"] == parameters
    assert device.categories_at_peak["unknown"] < 2 * MiB
    assert device.budget is not None
    gradients = next(row for row in device.budget.rows if row.category == "gradients")
    assert gradients.measured_bytes == gradients.theory_bytes == parameters
    workspace = next(row for row in device.budget.rows if row.category == "workspace")
    assert workspace.measured_bytes == 64 * MiB and "cuBLAS's" in workspace.note and "cuDNN's" in workspace.note


def test_cudnn_convolution_workspaces_are_workspace() -> None:
    """A BatchNorm CNN step with C++ stacks: every block cuDNN's run_conv_plan took (the large
    odd-sized ones, 250.79 MiB the largest) is a workspace, and nothing else is."""
    snapshot = load(str(H200 / "convnet.pickle"), cache=False)
    trace = snapshot.devices[0]
    category_of_event = analyze_snapshot(snapshot).category_of_event(0)
    conv_rows: list[int] = []
    other_rows: list[int] = []
    for row in np.nonzero(category_of_event >= 0)[0].tolist():  # the rows that allocate
        frames = snapshot.stacks.innermost(int(trace.stack_id[row]))
        (conv_rows if any("run_conv_plan" in frame.name for frame in frames) else other_rows).append(row)
    assert max(int(trace.size[row]) for row in conv_rows) == 262_972_560  # 250.79 MiB
    assert {CATEGORIES[category_of_event[row]] for row in conv_rows} == {"workspace"}
    assert "workspace" not in {CATEGORIES[category_of_event[row]] for row in other_rows}
