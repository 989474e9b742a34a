"""``memlens predict`` on a terminal: one line kept current with the steps taken and the time."""

from __future__ import annotations

import io
import time

import pytest
import torch

from memlens.cli import common
from memlens.cli import predict as predict_cli


def test_the_progress_line_counts_optimizer_steps_and_clears_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "STATUS_SECONDS", 0.05)
    stream = io.StringIO()
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with predict_cli.progress_line(stream):
        optimizer.step()
        time.sleep(0.3)
        optimizer.step()
        time.sleep(0.3)
    text = stream.getvalue()
    assert "memlens predict: 1 step, 0 s" in text and "memlens predict: 2 steps" in text
    assert text.endswith("\r\x1b[K")
    optimizer.step()  # the hook is gone: nothing more is counted or drawn
    assert stream.getvalue() == text


def test_no_terminal_no_line() -> None:
    with predict_cli.progress_line(None):
        pass
