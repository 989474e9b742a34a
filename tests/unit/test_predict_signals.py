"""``memlens predict``'s signals: SIGTERM and Ctrl-C end the script with its ``finally`` blocks run,
even when they land inside a finalizer, where Python would print the exception and drop it."""

from __future__ import annotations

import os
import signal
import time
import weakref

import pytest

from memlens.predict.signals import StopSignals
from memlens.recorder import Terminated


class Freed:
    pass


def run_until_stopped(seconds: float = 10.0) -> list[str]:
    """What a script does after one of its tensors is freed: it goes on, unless stopped."""
    reached: list[str] = []
    freed = Freed()

    def finalizer() -> None:  # the simulated device's, as a tensor is freed
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(3):  # the handler runs here, inside the finalizer
            len("x")

    weakref.finalize(freed, finalizer)
    del freed
    reached.append("after the finalizer")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:  # a training loop that would run on for ever
        time.sleep(0.001)
    reached.append("ran on")
    return reached


def test_a_signal_inside_a_finalizer_still_stops_the_script() -> None:
    with StopSignals(), pytest.raises(Terminated):
        run_until_stopped()


def test_a_signal_outside_a_finalizer_stops_it_at_once() -> None:
    started = time.monotonic()
    with StopSignals(), pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(10)
    assert time.monotonic() - started < 5


def test_a_held_signal_waits_and_sets_the_status() -> None:
    with StopSignals() as signals:
        signals.hold()  # the script has stopped: the prediction is being written
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
    assert signals.pending == signal.SIGTERM


def test_a_signal_inside_torchs_own_python_waits_until_the_script_is_back() -> None:
    """torch's Python that the fake tensors' C++ dispatcher calls back into (a dispatch rule's
    lookup) cannot always pass an exception on: raised there, the process aborted with
    "terminate called after throwing an instance of 'pybind11::error_already_set'". The signal is
    sent again until it lands in the script's own code."""
    import torch

    torch_frame = type("Frame", (), {})()
    torch_frame.f_code = torch.nn.Linear.forward.__code__  # torch's own file
    torch_frame.f_back = None
    signals = StopSignals()
    with signals, pytest.raises(Terminated):
        signals._on_signal(signal.SIGTERM, torch_frame)  # put off, sent again in 5 ms
        time.sleep(10)  # the script's own code: raised here
    assert signals._retries == 1
