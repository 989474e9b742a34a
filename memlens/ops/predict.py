"""Predict a script's GPU memory on the CPU (``memlens predict``): run it unmodified against a
simulated CUDA GPU, write the whole run as ``OUT/predicted.pickle`` with its sidecar, and triage
that file as ``memlens triage`` would, so what predict says of the run is what triage says of
the file (one number per quantity).

``predict`` answers the question; the CLI parses the flags and renders the ``Prediction``. The
machinery is ``memlens.predict``'s: the command (``command``), the signals and the exit status
(``signals``), the run written as a recording (``written``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

# What a face words and renders a prediction with: the GPU table's names and the basis of a fit
# verdict, a signal's words, the out-of-memory line.
from memlens.predict.gpus import GPU_NAMES_HELP, FitBasis, fit_basis
from memlens.predict.signals import SIGNAL_WORDS
from memlens.predict.written import oom_line

if TYPE_CHECKING:
    from memlens.analysis.report import Report
    from memlens.predict.launcher import LaunchedCommand
    from memlens.predict.session import PredictResult, PredictSession

__all__ = ["GPU_NAMES_HELP", "SIGNAL_WORDS", "FitBasis", "PredictOptions", "Prediction", "fit_basis", "oom_line",
           "predict"]


class PredictOptions(msgspec.Struct, frozen=True, kw_only=True):
    """The simulated device (a GPU from the table, or its capacity; memory outside PyTorch's
    allocator taken off it), where the run is written, and how the script sees the GPU."""

    gpu: str | None = None
    capacity: int | None = None
    reserve_outside: int = 0
    out_dir: str = "memlens_predict"
    placeholder_values: bool = False
    stacks: bool = True


@dataclass
class Prediction:
    """The run's result, the triage of the written ``predicted.pickle`` (None when the script put
    nothing on the GPU), and the exit status the run earns (see ``exit_status``)."""

    result: PredictResult
    report: Report | None
    exit_status: int
    world_size: int = 1  # the ranks torchrun would start; the prediction is rank 0's
    # What the script did that the emulation cannot size, one line each (cuDNN's workspaces).
    not_modelled: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """What ``memlens predict --json`` prints: the result's JSON and ``not_modelled``."""
        return {**self.result.to_json(), "not_modelled": list(self.not_modelled)}


def predict(command: Sequence[str], options: PredictOptions | None = None,
            on_stopped: Callable[[PredictResult], None] | None = None) -> Prediction:
    """Run ``command`` (``python train.py A`` or ``python -m pkg A``) in this process against the
    simulated GPU. ``on_stopped`` sees the result as soon as the script has stopped, before the
    files are written (to say "interrupted; writing the prediction" or show the script's own
    traceback); signals meanwhile wait until the files are written."""
    from memlens.predict.command import check_out_folder, run_command, split_command
    from memlens.predict.cudnn import ConvolutionCount
    from memlens.predict.launcher import read_launcher
    from memlens.predict.session import PredictSession, run_in_session
    from memlens.predict.signals import StopSignals, exit_status, reopen_closed_streams
    from memlens.predict.written import SNAPSHOT_NAME, write_prediction

    options = options or PredictOptions()
    launched = read_launcher(command)  # torchrun's command line: its script, as rank 0 of its world
    kind, target, argv = split_command(launched.command)
    # Resolved once, now: the script may chdir, and the prediction belongs where the user said.
    out = Path(os.path.abspath(options.out_dir))
    check_out_folder(out)  # before the run: a folder that cannot be written is a usage error now
    session = PredictSession(gpu=options.gpu, capacity=options.capacity, reserve_outside=options.reserve_outside,
                             stacks=options.stacks, placeholder_values=options.placeholder_values)
    convolutions = ConvolutionCount()
    session.op_hooks.append(convolutions)
    with StopSignals() as signals:
        with launched_world(launched, session):
            result = run_in_session(session, lambda: run_command(kind, target, argv), capture_errors=True)
        signals.hold()  # a signal from now on waits until the prediction is written
        reopen_closed_streams()
        if on_stopped is not None:
            on_stopped(result)
        predicted = out / SNAPSHOT_NAME
        write_prediction(predicted, session, result, launched.world_size)
        result.snapshots.append(str(predicted.resolve()))
        result.value = None  # the script's globals: let them go
        report = predicted_report(predicted, result)
    note = convolutions.note()
    return Prediction(result, report, exit_status(result, signals.pending), launched.world_size,
                      [note] if note else [])


def launched_world(launched: LaunchedCommand, session: PredictSession) -> contextlib.AbstractContextManager[None]:
    """What a launcher gives the script it starts: torchrun's rank 0 of its world (its variables,
    a process group whose collectives return at once); a plain command runs as it is."""
    if launched.launcher is None:
        return contextlib.nullcontext()
    from memlens.plan.apply import rank_zero_of

    return rank_zero_of(launched.world_size, session.op_hooks)


def predicted_report(predicted: Path, result: PredictResult) -> Report | None:
    """``memlens triage``'s report of the written ``predicted.pickle``, the budget from the
    parameters found beside it; the result's peaks become the report's, so what predict prints
    is what triage will say of the file (one number per quantity). None when the program put
    nothing on the GPU (there is nothing to analyse)."""
    if not result.used_cuda:
        return None
    from memlens.ops.triage import TriageOptions, triage

    report = triage(str(predicted), TriageOptions())
    device = report.device(0)
    result.peak_allocated_bytes = device.peak_allocated_bytes
    result.peak_reserved_bytes = device.peak_reserved_bytes
    return report
