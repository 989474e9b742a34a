"""optimizer.step on a real Adam loop recorded on the CPU: the state made in ``_init_group`` is
reported whole (two moments and a step counter per parameter), the window stops where
``zero_grad`` begins, and the spike adds up to the byte."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import memlens
from memlens.analysis import Finding

WIDTH = 1024  # two 1024x1024 layers: 8.4 MB of parameters, 16.8 MB of Adam state


def record_adam(out: Path, zero_grad_after_step: bool) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    inputs = torch.randn(4, WIDTH)
    with memlens.record(out, device="cpu") as rec:
        for _ in range(3):
            with rec.step():
                if not zero_grad_after_step:
                    optimizer.zero_grad()
                model(inputs).square().mean().backward()
                optimizer.step()
                if zero_grad_after_step:  # frees the gradients right after the step's last row
                    optimizer.zero_grad()
    return out / "snapshot.pickle"


def spike_of(path: Path) -> tuple[Finding, int, list[int]]:
    """The spike, the first step's index, and the rows made under ``zero_grad``."""
    snapshot = memlens.load(path, cache=False)
    report = memlens.analyze(snapshot)
    (spike,) = [f for f in report.findings if f.kind == "optimizer_spike"]
    trace = snapshot.device(0)
    zero_grad_rows = [
        row for row, sid in enumerate(trace.stack_id.tolist())
        if any(frame.name == "zero_grad" for frame in snapshot.stacks.frames_of(sid))
    ]
    return spike, report.device().steps[0].index, zero_grad_rows


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero_grad_after_step", [True, False], ids=["zero_grad_after", "zero_grad_before"])
def test_adam_state_is_whole_and_the_spike_adds_up(tmp_path: Path, zero_grad_after_step: bool) -> None:
    parameter_sizes = [WIDTH * WIDTH, WIDTH] * 2  # two layers' weight and bias, float32
    def block(nbytes: int) -> int:  # the 512-byte block memory_allocated counts
        return max(512, -(-nbytes // 512) * 512)

    # exp_avg, exp_avg_sq and a 0-d step for each parameter, in their blocks
    state_bytes = sum(2 * block(4 * n) + block(4) for n in parameter_sizes)
    spike, first_step, zero_grad_rows = spike_of(record_adam(tmp_path / "run", zero_grad_after_step))
    assert zero_grad_rows  # set_to_none frees the gradients under zero_grad's frame
    assert not [row for row in zero_grad_rows if spike.start_event <= row < spike.end_event]
    e = spike.evidence
    assert e["window_source"] == "frames"
    assert e["state_kept_after_window_bytes"] == state_bytes
    assert e["new_state_bytes"] == state_bytes  # _init_group makes it all before the update's temporaries
    assert e["released_bytes"] == 0 and e["state_replaced_bytes"] == 0  # the gradients are not state
    assert e["spike_bytes"] == int(e["new_state_bytes"]) + int(e["transient_bytes"]) - int(e["released_bytes"])
    assert spike.step == first_step  # the first step makes the state
