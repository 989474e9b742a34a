"""Predict a script's GPU memory on the CPU (``memlens predict``): run it unmodified against a
simulated CUDA GPU, write the whole run as ``OUT/predicted.pickle`` with its sidecar, and triage
that file as ``memlens triage`` would, so what predict says of the run is what triage says of
the file (one number per quantity).

``predict`` answers the question; the CLI parses the flags and renders the ``Prediction``.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from memlens.errors import MemlensUsageError
from memlens.recorder.writing import write_sidecar, write_snapshot
from memlens.sidecar.writer import build_sidecar, sidecar_path
from memlens.units import format_bytes

if TYPE_CHECKING:
    from memlens.analysis.report import Report
    from memlens.predict.launcher import LaunchedCommand
    from memlens.predict.session import PredictResult, PredictSession
    from memlens.sidecar import ModelInfo, Sidecar

# How long a signal that landed where it cannot be raised waits before it is sent again
# (StopSignals), and how many times it waits before it is raised wherever it lands (1 s in all; a
# script is back in its own code, or memlens', within microseconds to milliseconds).
SIGNAL_RETRY_SECONDS = 0.005
SIGNAL_RETRIES = 200
# torch's own Python, which the fake tensors' C++ dispatcher calls back into (a dispatch rule's
# lookup, the fake mode's handlers): an exception raised there by a signal handler can meet a C++
# frame that cannot pass it on, and the process aborts ("terminate called after throwing an
# instance of 'pybind11::error_already_set' ... KeyboardInterrupt"), writing nothing.


def _inside_torch(frame: Any) -> bool:
    """Whether the interrupted ``frame`` is torch's own Python (see above)."""
    torch = sys.modules.get("torch")
    torch_file = getattr(torch, "__file__", None)
    if frame is None or not torch_file:
        return False
    return frame.f_code.co_filename.startswith(os.path.dirname(torch_file) + os.sep)


__all__ = ["SIGNAL_WORDS", "PredictOptions", "Prediction", "exit_status", "oom_line", "predict", "split_command"]


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
    from memlens.predict.cudnn import ConvolutionCount
    from memlens.predict.launcher import read_launcher
    from memlens.predict.session import PredictSession, run_in_session

    options = options or PredictOptions()
    launched = read_launcher(command)  # torchrun's command line: its script, as rank 0 of its world
    kind, target, argv = split_command(launched.command)
    # Resolved once, now: the script may chdir, and the prediction belongs where the user said.
    out = Path(os.path.abspath(options.out_dir))
    _check_out_folder(out)  # before the run: a folder that cannot be written is a usage error now
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
        predicted = out / "predicted.pickle"
        write_snapshot(predicted, result.snapshot or {})
        sidecar = predicted_sidecar(session, result)
        if launched.world_size > 1:  # rank 0 of N: what triage and fleet read
            sidecar = msgspec.structs.replace(sidecar, world_size=launched.world_size)
        write_sidecar(sidecar_path(predicted), sidecar)
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


def split_command(command: tuple[str, ...]) -> tuple[str, str, list[str]]:
    """``python train.py A`` -> ("path", "train.py", ["train.py", "A"]); ``python -m pkg A`` ->
    ("module", "pkg", ["pkg", "A"]). The interpreter word is optional."""
    words = list(command)
    if words and os.path.basename(words[0]).startswith("python"):
        words = words[1:]
    if not words:
        raise MemlensUsageError("nothing to run: give the command after --, e.g. -- python train.py")
    if words[0] == "-m":
        if len(words) < 2:
            raise MemlensUsageError("-m needs a module name")
        return "module", words[1], [words[1], *words[2:]]
    if words[0].startswith("-"):
        raise MemlensUsageError(f"unsupported interpreter option {words[0]!r}: give a script or -m module")
    if not Path(words[0]).is_file():
        raise MemlensUsageError(f"no such script: {words[0]}")
    return "path", words[0], words


def run_command(kind: str, target: str, argv: list[str]) -> Any:
    """Run a script or module in this process as ``python`` would (``__main__``, argv, path);
    returns its globals, which keeps a module-level model alive for the budget. This frame and
    every frame outward of it are memlens' own: the stacks end at the script's ``<module>``, as
    ``memlens record``'s do."""
    from memlens.recorder.stacks import hide_frames_outward

    hide_frames_outward(sys._getframe())
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)) if kind == "path" else os.getcwd())
    try:
        if kind == "path":
            return runpy.run_path(target, run_name="__main__")
        return runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        from memlens.predict.session import ProgramExit
        from memlens.recorder import Terminated

        if isinstance(stop, Terminated) or stop.code in (None, 0):
            if isinstance(stop, Terminated):
                raise
            return None
        raise ProgramExit(stop.code) from None
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


# What a shell reports for a process ended by SIGINT / SIGTERM (128 + the signal's number), as
# ``memlens record`` exits.
_SIGNAL_STATUS = {"interrupted": 128 + signal.SIGINT, "terminated": 128 + signal.SIGTERM}
SIGNAL_WORDS = {"interrupted": "interrupted (Ctrl-C)", "terminated": "terminated (SIGTERM)"}


def exit_status(result: Any, pending_signal: int | None = None) -> int:
    """0: the run completed within the capacity. 1: it did not fit (out of memory), or it did not
    get to the end (the script failed, or stopped needing a real value or a missing kernel), so
    no fit can be claimed. 143 / 130: SIGTERM / Ctrl-C stopped it (the prediction up to there is
    written). Usage and input errors exit 2 before anything runs."""
    if result.interrupted:
        return _SIGNAL_STATUS[result.interrupted]
    if pending_signal is not None:
        return 128 + pending_signal
    return 0 if result.fits else 1


def reopen_closed_streams() -> None:
    """The script may have closed ``sys.stdout``/``sys.stderr`` (python then still exits 0):
    the prediction is written to file descriptors 1 and 2, which closing the objects leaves open."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        if stream is not None and not getattr(stream, "closed", False):
            continue
        try:
            replacement = open(os.dup(fd), "w", encoding="utf-8", errors="replace")  # noqa: SIM115
        except OSError:  # the descriptor itself is gone: nothing can be shown there
            replacement = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115
        setattr(sys, name, replacement)


def _check_out_folder(out: Path) -> None:
    try:
        if out.exists() and not out.is_dir():
            raise MemlensUsageError(f"--out {out}: it is a file, not a folder")
        out.mkdir(parents=True, exist_ok=True)
        if not os.access(out, os.W_OK | os.X_OK):
            raise MemlensUsageError(f"--out {out}: the folder cannot be written to")
    except OSError as exc:
        raise MemlensUsageError(f"--out {out}: {exc.strerror or exc}") from None


class StopSignals:
    """While predicting, SIGTERM raises ``Terminated`` and Ctrl-C ``KeyboardInterrupt`` in the
    script (its ``finally`` blocks run; the prediction up to there is a result); once ``hold``
    is called, a signal waits until the files are written and sets the exit status (``pending``).
    Only over the default handlers, in the main thread, as ``memlens record`` does."""

    def __init__(self) -> None:
        self.pending: int | None = None
        self._held = False
        self._retries = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            defaults = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}
            for signum, default in defaults.items():
                if signal.getsignal(signum) is default:
                    self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def hold(self) -> None:
        self._held = True

    def _on_signal(self, signum: int, frame: Any) -> None:
        from memlens.recorder import Terminated
        from memlens.recorder.session import inside_finalizer

        if self._held:
            self.pending = self.pending or signum
            return
        if inside_finalizer(frame) or (_inside_torch(frame) and self._retries < SIGNAL_RETRIES):
            # Python runs the handler at the next bytecode, which can be inside a finalizer (the
            # simulated device's, as a tensor is freed): raised there, the exception is printed as
            # "ignored" and lost, and the script would run on. Or inside torch's Python called from
            # C++, where it can abort the process. The script has no step the signal could wait
            # for, so it is sent again in a moment, once that frame has returned.
            self._retries += 1
            again = threading.Timer(SIGNAL_RETRY_SECONDS, os.kill, (os.getpid(), signum))
            again.daemon = True
            again.start()
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum)

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()


def predicted_sidecar(session: PredictSession, result: PredictResult) -> Sidecar:
    """The recorder's sidecar for ``predicted.pickle``: device, peaks, OOM, the steps (one per
    optimizer.step(), as ``memlens record`` marks them), the model (as the recorder's
    ``ModelInspector`` saw it, else the parameters alive at the end) and optimizer, the tensors'
    roles (``tensor_roles``) and who holds a leak (``leak_holders``), all as the recorder writes
    them, so ``triage`` says of a prediction what it says of a recording of the same script."""
    oom = None
    if result.oom:
        oom = {"requested_bytes": result.oom_requested_bytes, "device_free_bytes": session.simulator.device_free_bytes}
    reason = result.interrupted or ("oom" if result.oom else "exception" if result.error else "exit")
    return build_sidecar(
        backend="cpu",
        reason=reason,
        device={
            "type": "cuda",
            "index": 0,
            "name": f"{session.gpu.name} (memlens predict, simulated)",
            "total_memory_bytes": session.capacity,
            "simulated": True,
            "compute_capability": ".".join(str(part) for part in session.gpu.capability),
        },
        allocator_settings=session.settings.to_snapshot_dict(),
        rank=0,
        world_size=1,
        local_rank=0,
        steps=[dict(step) for step in session.steps.steps],
        steps_selected=None,
        peak_allocated_bytes=result.peak_allocated_bytes,
        peak_reserved_bytes=result.peak_reserved_bytes,
        oom=oom,
        model=inspected if (inspected := _inspected_model(session)) is not None else result.model,
        optimizer=result.optimizer,
        recorder={"stacks": session.tracker.stacks is not None, "max_entries": None,
                  "max_stack_depth": None, "dump_every": None, "predict": True},
        tensor_roles=session.roles.to_sidecar(),
        leak_holders=session.leak_holders,
    )  # fmt: skip


def _inspected_model(session: PredictSession) -> ModelInfo | None:
    inspector = session.model_inspector
    return inspector.stats if inspector is not None else None


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


def oom_line(result: Any) -> str:
    """``OUT OF MEMORY at train.py:12: aten.mm.default asked for 64.00 MiB``; in the backward
    pass, the line that called backward and the forward line whose gradient was computed."""
    request = ""
    if result.oom_op or result.oom_requested_bytes is not None:
        asked = f" asked for {format_bytes(result.oom_requested_bytes)}" if result.oom_requested_bytes else ""
        request = f": {result.oom_op or 'an allocation'}{asked}"
    if result.oom_in_backward:
        gradient = f" of {result.oom_forward_at}" if result.oom_forward_at else " (forward line not known)"
        return (
            f"OUT OF MEMORY in the backward pass called at {result.oom_at or '?'}{request}, "
            f"computing the gradient{gradient}"
        )
    return f"OUT OF MEMORY at {result.oom_at or 'an allocation outside your code'}{request}"
