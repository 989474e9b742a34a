"""``memlens predict``'s signals: SIGTERM and Ctrl-C end the script with its ``finally`` blocks run,
even when they land inside a finalizer, where Python would print the exception and drop it."""

from __future__ import annotations

import os
import signal
import time
import weakref

import pytest

from memlens.ops.predict import StopSignals
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
